"""Fitted placements: DeepSeek's EPLB against the published algorithm re-derived in the tests
(tests/support/eplb_reference.py), map for map over a grid of shapes and by hand where each pack holds
one item, and the seeds' load-aware mapping on the seeds' own
shape of loads (four hot experts, mid ones, cold ones)."""

from __future__ import annotations

import numpy as np
import pytest

from moescope.metrics.eplb import eplb, load_aware
from moescope.metrics.placement import PlacementError
from tests.support.eplb_reference import reference_eplb


def _shapes():
    """Every shape the published code accepts over a grid, the one-item-per-pack ones included."""
    for experts in (4, 6, 8, 12, 16, 32):
        for ranks in (1, 2, 3, 4, 8, 16):
            for nodes in (1, 2, 4):
                for groups in (1, 2, 4, 8):
                    for redundant in (0, 2, 4, 8, 16):
                        hierarchical = groups % nodes == 0
                        if (experts + redundant) % ranks or (hierarchical and (ranks % nodes or experts % groups)):
                            continue
                        yield experts, ranks, nodes, groups, redundant


def test_eplb_lays_out_deepseeks_map_slot_for_slot():
    shapes = list(_shapes())
    one_per_pack = [s for s in shapes if s[0] + s[4] == s[1] or (s[3] == s[2] > 1)]
    assert len(shapes) > 500 and len(one_per_pack) > 100
    wrong = []
    for n, (experts, ranks, nodes, groups, redundant) in enumerate(shapes):
        rng = np.random.default_rng(n)
        loads = [rng.gamma(0.7, 100.0, size=(2, experts))]  # skewed, no ties
        if experts + redundant <= 16:  # ties, where the engine's sort keeps the order too
            loads.append(rng.integers(0, 4, size=(2, experts)).astype(float))
        for load in loads:
            placement = eplb(load, ranks, nodes, groups, redundant, layer_ids=[3, 4])
            for row, layer in enumerate([3, 4]):
                expected = reference_eplb(load[row], ranks, nodes, groups, redundant)
                if [list(r) for r in placement.rank_experts(layer, experts)] != expected:
                    wrong.append((experts, ranks, nodes, groups, redundant, load[row].tolist()))
    assert not wrong, f"{len(wrong)} of the maps differ, the first: {wrong[0]}"


def test_one_item_per_pack_keeps_the_items_in_place():
    # one slot per GPU: expert r on rank r, whatever the loads (the heaviest is not moved to rank 0)
    rising = np.arange(1.0, 9.0)[None, :]
    assert [list(r) for r in eplb(rising, ranks=8).rank_experts(0, 8)] == [[e] for e in range(8)]
    # as many groups as nodes: group g on node g; within the node, copies packed by load
    load = np.array([[1.0, 2, 3, 4, 50, 60, 70, 80]])
    assert [list(r) for r in eplb(load, ranks=4, nodes=2, groups=2).rank_experts(0, 8)] == \
        [[3, 0], [2, 1], [7, 4], [6, 5]]
    # one slot per GPU with copies: slot i on rank i, the experts once each and then the copies in the
    # order replicate_experts chose them: expert 1 (8), expert 1 again (8/2 ties expert 3's 4: the lower
    # index), expert 3 (4 > 8/3), expert 1 (8/3 > 4/2)
    load = np.array([[1.0, 8, 2, 4]])
    assert [list(r) for r in eplb(load, ranks=8, redundant=4).rank_experts(0, 4)] == \
        [[0], [1], [2], [3], [1], [1], [3], [1]]


def test_loads_are_float32_as_in_the_engine():
    # 2**24 + 1 is 2**24 in float32: a tie, which the lower index wins
    load = np.array([[1.0, 2.0 ** 24, 2.0 ** 24 + 1, 0]])
    assert [list(r) for r in eplb(load, ranks=2).rank_experts(0, 4)] == [[1, 0], [2, 3]]


def test_the_global_policy_asks_nothing_of_the_nodes():
    # 1 group over 3 nodes: DeepSeek's global policy, which runs on 4 ranks though 3 nodes do not divide them
    placement = eplb(np.arange(8.0)[None, :], ranks=4, nodes=3)
    assert "global" in placement.source
    assert [list(r) for r in placement.rank_experts(0, 8)] == reference_eplb(np.arange(8.0), 4, 3, 1, 0)


def test_eplb_evens_out_a_skewed_layer_better_than_the_default_layout():
    load = np.array([900.0, 800, 50, 40, 30, 20, 10, 5])  # the two hot experts side by side on rank 0
    placement = eplb(load[None, :], ranks=4, redundant=4)
    per_rank = [sum(load[e] / list(np.concatenate(placement.rank_experts(0, 8))).count(e) for e in r)
                for r in placement.rank_experts(0, 8)]
    contiguous = [load[0:2].sum(), load[2:4].sum(), load[4:6].sum(), load[6:8].sum()]
    assert max(per_rank) / np.mean(per_rank) < 1.3 < max(contiguous) / np.mean(contiguous)


@pytest.mark.parametrize("kwargs, message", [
    (dict(ranks=3, redundant=0), "do not split evenly over 3 ranks"),
    (dict(ranks=4, nodes=3, groups=3), "do not split evenly over 3 nodes"),
    (dict(ranks=4, groups=3), "do not split into 3 equal groups"),
])
def test_eplb_refuses_shapes_it_cannot_place(kwargs, message):
    with pytest.raises(PlacementError, match=message):
        eplb(np.ones((1, 8)), **kwargs)


def test_load_aware_is_the_seeds_rule():
    # four hot experts (each over half a card's fair load), four mid ones, six cold ones, seven cards
    load = np.array([40.0, 38, 36, 34, 12, 11, 10, 9, 2, 2, 1, 1, 1, 1])
    fair = load.sum() / 7
    assert (load[:4] >= fair / 2).all() and ((load[4:8] >= fair / 4) & (load[4:8] < fair / 2)).all()
    assert (load[8:] < fair / 4).all()
    placement = load_aware(load[None, :], ranks=7)
    cards = [sorted(r) for r in placement.rank_experts(0, 14)]
    assert cards == [[0], [1], [2], [3], [4, 7], [5, 6], [8, 9, 10, 11, 12, 13]]


def test_load_aware_puts_what_does_not_fit_on_the_lightest_card():
    load = np.array([10.0, 9, 8, 1])  # three hot experts, two cards
    cards = load_aware(load[None, :], ranks=2).rank_experts(0, 4)
    # the two hottest alone first; expert 2 onto the lighter card (9 -> 17), expert 3 then onto the other (10)
    assert [list(card) for card in cards] == [[0, 3], [1, 2]]
