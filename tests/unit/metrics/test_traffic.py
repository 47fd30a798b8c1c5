"""moescope.metrics.traffic against plain loops: each token's sends under a placement with redundant
slots and uneven nodes, the perfect placement's floor against an enumeration of every placement,
DeepSeek-V3's node-limited routing, and the co-selection placement on planted expert groups."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moescope.metrics import traffic as wire

# 3 ranks in nodes of 2 and 1; 6 experts; expert 5 on every rank, expert 0 on ranks 0 and 2
PER_RANK = [[0, 1, 5], [2, 3, 5], [0, 4, 5]]
NODES = [0, 0, 1]


def layout_of(per_rank: list[list[int]], nodes: list[int], experts: int) -> wire.WireLayout:
    return wire.WireLayout(np.array([r for r, es in enumerate(per_rank) for _ in es]),
                           np.array([e for es in per_rank for e in es]), np.array(nodes), experts)


def serving_rank(per_rank, nodes, home: int, expert: int) -> int:
    """The replica rule, as the docs state it, one expert at a time."""
    copies = sorted(r for r, es in enumerate(per_rank) if expert in es)
    if home in copies:
        return home
    near = [r for r in copies if nodes[r] == nodes[home]]
    if near:
        return near[0]
    far = [r for r in copies if nodes[r] != nodes[home]]
    return far[home % len(far)]


def oracle(per_rank, nodes, homes, ids, kept, experts):
    ranks = len(per_rank)
    matrix = np.zeros((ranks, ranks), dtype=np.int64)
    remote_ranks, remote_nodes, distinct = [], [], []
    for home, row, keep in zip(homes, ids, kept):
        dests = {serving_rank(per_rank, nodes, int(home), int(e)) for e, k in zip(row, keep) if k and 0 <= e < experts}
        for d in dests:
            matrix[home, d] += 1
        remote_ranks.append(len(dests - {home}))
        remote_nodes.append(len({nodes[d] for d in dests} - {nodes[home]}))
        distinct.append(len({int(e) for e, k in zip(row, keep) if k and 0 <= e < experts}))
    return matrix, np.array(remote_ranks), np.array(remote_nodes), np.array(distinct)


def random_routes(rng, n: int, experts: int, k: int):
    ids = np.stack([rng.choice(experts + 1, size=k, replace=False) for _ in range(n)])  # expert 6: a zero expert
    kept = rng.random((n, k)) > 0.15
    weights = rng.random((n, k)).astype(np.float32)
    return ids, kept, weights


def test_fanout_and_matrix_match_a_loop_with_redundant_slots_and_uneven_nodes():
    rng = np.random.default_rng(0)
    layout = layout_of(PER_RANK, NODES, 6)
    ids, kept, _ = random_routes(rng, 400, 6, 3)
    homes = rng.integers(0, 3, 400)
    fan = wire.token_fanout(layout, homes, ids, kept)
    matrix, remote_ranks, remote_nodes, distinct = oracle(PER_RANK, NODES, homes, ids, kept, 6)
    np.testing.assert_array_equal(fan.remote_ranks, remote_ranks)
    np.testing.assert_array_equal(fan.remote_nodes, remote_nodes)
    np.testing.assert_array_equal(fan.experts, distinct)
    tally = wire.TrafficTally.for_layout(layout)
    tally.add(layout, homes[:150], _part(fan, slice(0, 150)), np.zeros(150, dtype=np.int64))
    tally.add(layout, homes[150:], _part(fan, slice(150, None)), np.ones(250, dtype=np.int64))
    figures = tally.figures(hidden_size=7168, dispatch_bytes=1, combine_bytes=2)
    np.testing.assert_array_equal(figures["rank_matrix"], matrix)
    sends = matrix - np.diag(np.diag(matrix))
    node_matrix = np.zeros((2, 2), dtype=np.int64)
    for h, r in itertools.product(range(3), range(3)):
        node_matrix[NODES[h], NODES[r]] += matrix[h, r]
    np.testing.assert_array_equal(figures["node_matrix"], node_matrix)
    assert figures["gpu_sends"] == sends.sum() == remote_ranks.sum()
    assert figures["rdma_sends"] == remote_nodes.sum()
    assert figures["remote_ranks_mean"] == pytest.approx(remote_ranks.mean())
    assert figures["remote_nodes_mean"] == pytest.approx(remote_nodes.mean())
    assert figures["intra_node_share"] == pytest.approx((sends[0, 1] + sends[1, 0]) / sends.sum())
    h, r = figures["busiest_link"]
    assert sends[h, r] == sends.max() == figures["busiest_link_tokens"]
    node_sends = node_matrix - np.diag(np.diag(node_matrix))
    a, b = figures["busiest_node_link"]
    assert node_sends[a, b] == node_sends.max() == figures["busiest_node_link_tokens"] and a != b
    assert figures["forwards"] == 2
    assert figures["dispatch_bytes_per_forward"] == pytest.approx(sends.sum() * 7168 * 1 / 2)
    assert figures["combine_bytes_per_forward"] == pytest.approx(sends.sum() * 7168 * 2 / 2)
    assert figures["rdma_dispatch_bytes_per_forward"] == pytest.approx(remote_nodes.sum() * 7168 / 2)
    np.testing.assert_array_equal(figures["remote_ranks_histogram"], np.bincount(remote_ranks, minlength=3))
    np.testing.assert_array_equal(figures["remote_nodes_histogram"], np.bincount(remote_nodes, minlength=2))


def _part(fan: wire.TokenFanout, pick) -> wire.TokenFanout:
    return wire.TokenFanout(fan.dest[pick], fan.reached[pick], fan.remote_ranks[pick], fan.remote_nodes[pick],
                            fan.experts[pick])


def test_the_remote_copy_is_spread_by_home_rank():
    # expert 0 on ranks 2 and 3 (node 1); homes 0 and 1 (node 0) go to different copies
    per_rank = [[1], [2], [0, 3], [0, 4]]
    layout = layout_of(per_rank, [0, 0, 1, 1], 5)
    fan = wire.token_fanout(layout, np.array([0, 1, 3]), np.array([[0], [0], [0]]), np.ones((3, 1), bool))
    assert fan.dest[:, 0].tolist() == [2, 3, 3]
    assert fan.remote_ranks.tolist() == [1, 1, 0]
    # expert 0 on ranks 1 and 2 of home 0's node: the lowest of them
    layout = layout_of([[1], [0], [0, 2]], [0, 0, 0], 3)
    fan = wire.token_fanout(layout, np.array([0, 1]), np.array([[0], [0]]), np.ones((2, 1), bool))
    assert fan.dest[:, 0].tolist() == [1, 1]


def best_expected_remote(capacities: list[int], nodes: list[int], experts: int, chosen: set[int]):
    """The least mean remote ranks and nodes over homes (uniform over ranks) of one token choosing
    `chosen`, over every placement of `experts` experts (one slot each) into ranks of these capacities."""
    ranks = len(capacities)
    best_ranks = best_nodes = float("inf")
    for assignment in itertools.product(range(ranks), repeat=experts):
        if any(assignment.count(r) > c for r, c in enumerate(capacities)):
            continue
        reached = {assignment[e] for e in chosen}
        rr = np.mean([len(reached - {h}) for h in range(ranks)])
        rn = np.mean([len({nodes[r] for r in reached} - {nodes[h]}) for h in range(ranks)])
        best_ranks, best_nodes = min(best_ranks, rr), min(best_nodes, rn)
    return best_ranks, best_nodes


@pytest.mark.parametrize("capacities,nodes", [([2, 1, 1], [0, 0, 1]), ([2, 2, 1, 1], [0, 1, 1, 1])])
def test_the_floor_is_the_best_placement_found_by_enumeration(capacities, nodes):
    experts = sum(capacities)
    per_rank, e = [], 0
    for c in capacities:
        per_rank.append(list(range(e, e + c)))
        e += c
    layout = layout_of(per_rank, nodes, experts)
    for k in range(0, 4):
        floor_ranks, floor_nodes = wire.floor_remote(layout, np.array([k]))
        best_ranks, best_nodes = best_expected_remote(capacities, nodes, experts, set(range(k)))
        assert floor_ranks[0] == pytest.approx(best_ranks), k
        assert floor_nodes[0] == pytest.approx(best_nodes), k


def node_limited_oracle(per_rank, nodes, homes, ids, kept, weights, experts, m):
    changed, moved, remote_after = [], [], []
    k = ids.shape[1]
    per_node = max(1, k // m)
    for home, row, keep, w in zip(homes, ids, kept, weights):
        slots = [(float(wt), nodes[serving_rank(per_rank, nodes, int(home), int(e))])
                 for e, kp, wt in zip(row, keep, w) if kp and 0 <= e < experts]
        score: dict[int, float] = {}
        for node in {n for _, n in slots}:
            score[node] = sum(sorted((wt for wt, n in slots if n == node), reverse=True)[:per_node])
        ordered = sorted(score, key=lambda n: (-score[n], n))
        allowed = set(ordered[:m])
        total = sum(wt for wt, _ in slots)
        changed.append(len(score) > m)
        moved.append(sum(wt for wt, n in slots if n not in allowed) / total if total else 0.0)
        remote_after.append(len(allowed - {nodes[home]}) if len(score) > m else len(set(score) - {nodes[home]}))
    return np.array(changed), np.array(moved), np.array(remote_after)


@pytest.mark.parametrize("max_nodes", [1, 2, 3])
def test_node_limited_routing_matches_a_loop(max_nodes):
    rng = np.random.default_rng(1)
    per_rank = [[0, 1], [2, 3], [4, 5], [6, 7, 0], [1, 7]]
    nodes = [0, 1, 2, 3, 3]
    layout = layout_of(per_rank, nodes, 8)
    ids, kept, weights = random_routes(rng, 500, 8, 6)  # k / M = 6, 3, 2 experts score a node
    homes = rng.integers(0, 5, 500)
    fan = wire.token_fanout(layout, homes, ids, kept)
    got = wire.node_limited(layout, fan, homes, ids, weights, max_nodes)
    changed, moved, remote_after = node_limited_oracle(per_rank, nodes, homes, ids, kept, weights, 8, max_nodes)
    np.testing.assert_array_equal(got.changed, changed)
    np.testing.assert_allclose(got.moved_weight, moved, rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(got.remote_nodes, remote_after)
    assert 0 < changed.mean() < 1  # the case exercises both outcomes


def test_home_rules():
    recorded, sequence, token = np.array([0, 1, 1]), np.array([0, 1, 5]), np.array([0, 1, 2])
    assert wire.home_ranks("recorded", 2, recorded, sequence, token).tolist() == [0, 1, 1]
    assert wire.home_ranks("sequence", 4, recorded, sequence, token).tolist() == [0, 1, 1]
    assert wire.home_ranks("token", 2, recorded, sequence, token).tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="--home token"):
        wire.home_ranks("recorded", 1, recorded, sequence, token)
    with pytest.raises(ValueError, match="choose one of"):
        wire.home_ranks("nearest", 2, recorded, sequence, token)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="outside 0..3"):
        layout_of([[0, 4]], [0], 4)
    with pytest.raises(ValueError, match="numbered 0..N-1"):
        layout_of([[0], [1]], [0, 2], 2)
    layout = layout_of([[0], [1]], [0, 0], 3)
    with pytest.raises(ValueError, match="expert 2 has no slot"):
        wire.token_fanout(layout, np.array([0]), np.array([[2]]), np.array([[True]]))


def test_coselection_layout_co_locates_planted_groups_and_cuts_sends():
    # experts {0, 2, 4, 6} are always chosen together, and so are {1, 3, 5, 7}: the contiguous
    # layout splits each group over all 4 ranks, the co-selection placement puts each on one node
    rng = np.random.default_rng(2)
    groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
    ids = np.array([rng.choice(groups[rng.integers(2)], size=2, replace=False) for _ in range(600)])
    cosel = np.zeros((8, 8), dtype=np.int64)
    for row in ids:
        cosel[np.ix_(row, row)] += 1
    load = np.bincount(ids.ravel(), minlength=8)
    nodes = np.array([0, 0, 1, 1])
    per_rank = wire.coselection_layout(cosel, load, np.array([2, 2, 2, 2]), nodes)
    assert sorted(e for r in per_rank for e in r) == list(range(8))
    assert all(len(r) == 2 for r in per_rank)
    node_sets = [set(per_rank[0] + per_rank[1]), set(per_rank[2] + per_rank[3])]
    assert sorted(map(sorted, node_sets)) == groups
    homes = rng.integers(0, 4, 600)
    kept = np.ones(ids.shape, bool)
    contiguous = layout_of([[0, 1], [2, 3], [4, 5], [6, 7]], nodes.tolist(), 8)
    colocated = layout_of(per_rank, nodes.tolist(), 8)
    before = oracle([[0, 1], [2, 3], [4, 5], [6, 7]], nodes.tolist(), homes, ids, kept, 8)[2].mean()
    after = oracle(per_rank, nodes.tolist(), homes, ids, kept, 8)[2].mean()
    assert wire.token_fanout(colocated, homes, ids, kept).remote_nodes.mean() == pytest.approx(after)
    assert wire.token_fanout(contiguous, homes, ids, kept).remote_nodes.mean() == pytest.approx(before)
    # co-located: one node, home on it half the time (0.5); contiguous: 1/3 of pairs on one node (5/6)
    assert after == pytest.approx(0.5, abs=0.06) and before == pytest.approx(5 / 6, abs=0.06)
    with pytest.raises(ValueError, match="do not fit"):
        wire.coselection_layout(cosel, load, np.array([1, 1, 1, 1]), nodes)


def test_a_node_scores_by_its_best_k_over_m_experts_only():
    # k = 5, M = 2: a node scores by its best 2 experts. Node 0 holds three weak ones (0.2 of its best
    # two, 0.3 of all three), node 1 one at 0.25, node 2 one at 0.22: nodes 1 and 2 are kept
    layout = layout_of([[0, 1, 2], [3], [4]], [0, 1, 2], 5)
    ids, kept = np.array([[0, 1, 2, 3, 4]]), np.ones((1, 5), bool)
    weights = np.array([[0.1, 0.1, 0.1, 0.25, 0.22]])
    home = np.array([1])
    got = wire.node_limited(layout, wire.token_fanout(layout, home, ids, kept), home, ids, weights, 2)
    assert got.changed.tolist() == [True]
    assert got.moved_weight[0] == pytest.approx(0.3 / 0.77)
    assert got.remote_nodes.tolist() == [1]  # nodes 1 (home) and 2


def scores_rule_oracle(per_rank, nodes, homes, ids, kept, weights, scores, experts, m):
    """DeepSeek-V3's rule one token at a time: a node scores its best two experts (fewer where it
    holds fewer), the m best nodes stay (ties: lower node), the recorded experts on them stay and the
    best-scoring others on them (ties: lower id) replace the rest."""
    out_ids, changed, moved, remote = [], [], [], []
    for home, row, keep, w, s in zip(homes, ids, kept, weights, scores):
        node_of = {e: nodes[serving_rank(per_rank, nodes, int(home), e)] for e in range(experts)}
        node_score = {n: sum(sorted((s[e] for e in range(experts) if node_of[e] == n), reverse=True)[:2])
                      for n in set(node_of.values())}
        allowed = set(sorted(node_score, key=lambda n: (-node_score[n], n))[:m])
        slots = [(int(e), float(wt)) for e, kp, wt in zip(row, keep, w) if kp and 0 <= e < experts]
        chosen = {e for e, _ in slots}
        others = sorted((e for e in range(experts) if node_of[e] in allowed and e not in chosen),
                        key=lambda e: (-s[e], e))
        stay = [e for e, _ in slots if node_of[e] in allowed]
        new = stay + others[:len(slots) - len(stay)]
        total = sum(wt for _, wt in slots)
        out_ids.append(sorted(new))
        changed.append(len(stay) < len(slots))
        moved.append(sum(wt for e, wt in slots if node_of[e] not in allowed) / total if total else 0.0)
        remote.append(len({nodes[serving_rank(per_rank, nodes, int(home), e)] for e in new} - {nodes[home]}))
    return out_ids, np.array(changed), np.array(moved), np.array(remote)


@pytest.mark.parametrize("max_nodes", [1, 2, 3])
def test_node_limited_on_the_router_scores_matches_a_loop(max_nodes):
    """Redundant copies (an expert's node is its serving copy's), a node of one expert's slot on a
    rank of its own, kept nodes too small to refill every dropped slot (max_nodes 1), capacity drops
    and zero experts."""
    rng = np.random.default_rng(4)
    per_rank = [[0, 1], [2, 3], [4, 5], [6, 7, 0], [1, 7]]
    nodes = [0, 1, 2, 3, 3]
    layout = layout_of(per_rank, nodes, 8)
    ids, kept, weights = random_routes(rng, 400, 8, 4)
    scores = rng.random((400, 8))
    homes = rng.integers(0, 5, 400)
    fan = wire.token_fanout(layout, homes, ids, kept)
    got = wire.node_limited_on_scores(layout, fan, homes, ids, weights, scores, max_nodes)
    new, changed, moved, remote = scores_rule_oracle(per_rank, nodes, homes, ids, kept, weights, scores, 8, max_nodes)
    assert [sorted(int(e) for e in row if e >= 0) for row in got.expert_ids] == new
    np.testing.assert_array_equal(got.changed, changed)
    np.testing.assert_allclose(got.moved_weight, moved, rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(got.remote_nodes, remote)
    assert 0 < changed.mean() < 1 and got.rule == wire.LIMIT_RULES["scores"]
