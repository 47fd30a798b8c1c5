"""Traffic and tokens per rank counted where the data is (`Store.route_groups`: DuckDB counts a layer's
routes rows per window, home key and routing, a page of steps at a time) against a plain loop over the
raw `routes` Parquet rows, token by token, on a three-rank run read in pages of 100 rows (two steps)
with windows of 5 steps, so windows straddle pages and pages straddle windows."""

from __future__ import annotations

import numpy as np
import pytest

from moescope.analyses.placement import rank_tokens
from moescope.analyses.traffic import Wire, traffic_report
from moescope.core.records import TokenSample
from moescope.metrics.placement import Placement
from moescope.metrics.traffic import LIMIT_RULES
from moescope.store import Store
from moescope.store import queries as store_queries
from moescope.store.location import open_location
from moescope.store.writer import ParquetExporter
from tests.support.deltafiles import read_table
from tests.support.store_records import make_record, run_info

LAYERS, EXPERTS, TOP_K, STEPS, RANKS, WINDOW = 2, 6, 3, 12, 3, 5
LAYOUT = [[0, 1, 5], [2, 3, 5], [0, 4, 5]]  # expert 5 on every rank, expert 0 on ranks 0 and 2
NODES = [0, 0, 1]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("groups") / "store")
    for rank in range(RANKS):
        rng = np.random.default_rng(10 + rank)
        exporter = ParquetExporter(root, run_info("g", LAYERS, EXPERTS, TOP_K, rank=rank, world_size=RANKS))
        exporter.export([make_record("g", step, rng, LAYERS, EXPERTS, TOP_K, skew=2.0) for step in range(STEPS)])
        exporter.shutdown()
    return root


@pytest.fixture()
def small_pages(monkeypatch):
    monkeypatch.setattr(store_queries, "GROUP_PAGE_ROWS", 100)  # 48 rows a step: pages of two steps


@pytest.fixture(scope="module")
def rows(root) -> list[dict]:
    return read_table(open_location(root), "routes").to_pylist()


def serving(home: int, expert: int) -> int:
    """The copy serving a token of `home` (the replica rule, written out again)."""
    copies = sorted(r for r, experts in enumerate(LAYOUT) if expert in experts)
    if home in copies:
        return home
    near = [r for r in copies if NODES[r] == NODES[home]]
    far = [r for r in copies if NODES[r] != NODES[home]]
    return near[0] if near else far[home % len(far)]


def home_of(row: dict, rule: str) -> int:
    return {"recorded": row["rank"], "sequence": (row["sequence"] or 0) % RANKS, "token": row["token"] % RANKS}[rule]


@pytest.mark.parametrize("rule", ["recorded", "sequence", "token"])
@pytest.mark.parametrize("mode", ["normal", "low-latency"])
@pytest.mark.parametrize("window", [None, WINDOW])
def test_traffic_counted_by_group_is_the_token_by_token_count(root, rows, small_pages, rule, mode, window):
    with Store(root) as store:
        report = traffic_report(store, "g", Placement(RANKS, {}, default=tuple(tuple(r) for r in LAYOUT)),
                                Wire(np.array(NODES), rule, 10, mode=mode), window).layers
    expected: dict = {}
    for row in rows:
        key = (row["layer"], None if window is None else row["step"] // window * window)
        f = expected.setdefault(key, dict(tokens=0, remote=0, nodes=0, hist=np.zeros(RANKS, int),
                                          matrix=np.zeros((RANKS, RANKS), int), steps=set(), sends=0))
        home = home_of(row, rule)
        dests = [serving(home, e) for e, kept in zip(row["expert_ids"], row["kept"]) if kept and 0 <= e < EXPERTS]
        reached = set(dests)
        f["tokens"] += 1
        f["steps"].add(row["step"])
        f["remote"] += len(reached - {home})
        f["nodes"] += len({NODES[d] for d in reached} - {NODES[home]})
        f["hist"][len(reached - {home})] += 1
        for d in (dests if mode == "low-latency" else reached):
            f["matrix"][home, d] += 1
        f["sends"] += sum(d != home for d in (dests if mode == "low-latency" else reached))
    assert len(report) == len(expected) == LAYERS * (1 if window is None else -(-STEPS // WINDOW))
    for row in report.itertuples():
        f = expected[(row.layer, None if window is None else int(row.window_start))]
        assert row.tokens == f["tokens"] and row.forwards == len(f["steps"])
        assert row.remote_ranks_mean == pytest.approx(f["remote"] / f["tokens"], rel=1e-12)
        assert row.remote_nodes_mean == pytest.approx(f["nodes"] / f["tokens"], rel=1e-12)
        np.testing.assert_array_equal(row.remote_ranks_histogram, f["hist"])
        np.testing.assert_array_equal(row.rank_matrix, f["matrix"])
        assert row.gpu_sends == f["sends"]
        assert row.dispatch_bytes_per_forward == pytest.approx(f["sends"] * 10 * 2 / len(f["steps"]), rel=1e-12)


def copy_of(dispatch: str, row: dict, slot: int, expert: int) -> dict[int, float]:
    """{rank: probability} of the copy serving a slot, by each engine's rule written out again."""
    copies = [r for r, experts in enumerate(LAYOUT) if expert in experts]
    if dispatch == "vllm":  # copy (token * k + slot) mod copies
        return {copies[(row["token"] * TOP_K + slot) % len(copies)]: 1.0}
    if dispatch == "sglang-static":  # the copy on the recorded (= expert-parallel) rank, else one alike
        return {row["rank"]: 1.0} if row["rank"] in copies else {r: 1 / len(copies) for r in copies}
    return {r: 1 / len(copies) for r in copies}  # a copy drawn alike per slot


@pytest.mark.parametrize("dispatch", ["even", "vllm", "sglang-static"])
@pytest.mark.parametrize("window", [None, WINDOW])
def test_tokens_per_rank_counted_by_group_are_the_token_by_token_count(root, rows, small_pages, dispatch, window):
    placement = Placement(RANKS, {}, default=tuple(tuple(r) for r in LAYOUT))
    with Store(root) as store:
        found = rank_tokens(store, "g", placement, {layer: EXPERTS for layer in range(LAYERS)}, dispatch, window)
    expected: dict = {}
    for row in rows:
        key = (row["layer"], None if window is None else row["step"] // window * window)
        tokens, slots = expected.setdefault(key, (np.zeros(RANKS), np.zeros(RANKS)))
        missed = np.ones(RANKS)
        for slot, (expert, kept) in enumerate(zip(row["expert_ids"], row["kept"])):
            if not kept:
                continue
            for rank, p in copy_of(dispatch, row, slot, expert).items():
                slots[rank] += p
                missed[rank] *= 1 - p
        tokens += 1 - missed
    assert {(layer, start) for layer, windows in found.items() for start in windows} == set(expected)
    for (layer, start), (tokens, slots) in expected.items():
        np.testing.assert_allclose(found[layer][start][0], tokens, rtol=1e-9)
        np.testing.assert_allclose(found[layer][start][1], slots, rtol=1e-9)


def test_route_groups_count_every_row_once_in_pages_of_whole_steps(root, rows):
    with Store(root) as store:
        pages = list(store.route_groups("g", 1, WINDOW, token_modulo=4, page_rows=100))
    assert [p.steps.tolist() for p in pages] == [[s, s + 1] for s in range(0, STEPS, 2)]
    counted: dict = {}
    for page in pages:
        for i in range(len(page.count)):
            key = (int(page.window[i]), int(page.routes.token[i]),
                   tuple(int(e) for e in page.routes.expert_ids[i]), tuple(bool(k) for k in page.routes.kept[i]))
            counted[key] = counted.get(key, 0) + int(page.count[i])
    expected: dict = {}
    for row in (r for r in rows if r["layer"] == 1):
        key = (row["step"] // WINDOW, row["token"] % 4, tuple(row["expert_ids"]), tuple(row["kept"]))
        expected[key] = expected.get(key, 0) + 1
    assert counted == expected
    assert max(expected.values()) > 1  # groups do stand for several rows here


# vLLM's and TensorRT-LLM's copy, numbered where the rows are (`SlotCopies`): 13 ranks holding experts with
# 1, 2, 3, 5, 7, 11 and 13 copies (their least common multiple, 30030, past any token period), 1500 tokens
# of top-3 a step and rank (flat positions past 4096; 1024-slot blocks with a token across each boundary),
# two recording ranks, drops, read a step a page with windows of two steps
COPIES = (1, 2, 3, 5, 7, 11, 13, 1)
WIDE = [[e for e, n in enumerate(COPIES) if r < n] for r in range(13)]  # expert e on ranks 0..copies-1
WIDE_STEPS, WIDE_TOKENS, WIDE_RANKS, WIDE_K = 3, 1500, 2, 3


@pytest.fixture(scope="module")
def wide_root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("wide") / "store")
    for rank in range(WIDE_RANKS):
        rng = np.random.default_rng(40 + rank)
        exporter = ParquetExporter(root, run_info("w", 1, len(COPIES), WIDE_K, rank=rank, world_size=WIDE_RANKS))
        exporter.export([make_record("w", step, rng, 1, len(COPIES), WIDE_K, tokens=WIDE_TOKENS, skew=1.0)
                         for step in range(WIDE_STEPS)])
        exporter.shutdown()
    return root


def engine_copy(dispatch: str, rows: list[dict]) -> dict:
    """{(step, rank, token, slot): copy index} by each engine's rule written out again as loops over the rows
    in recording order: vLLM, position mod copies; TensorRT-LLM (moeComputeRouteKernel), per 1024-slot
    block of a forward and rank, (block + the expert's earlier kept slots in the block + EP rank with
    attention DP) mod copies."""
    out, seen = {}, {}
    for row in sorted(rows, key=lambda r: (r["step"], r["rank"], r["token"])):
        k = len(row["expert_ids"])
        for j, (e, kept) in enumerate(zip(row["expert_ids"], row["kept"])):
            if not kept:
                continue
            position = row["token"] * k + j
            if dispatch == "vllm":
                out[(row["step"], row["rank"], row["token"], j)] = position % COPIES[e]
                continue
            block = position // 1024
            nth = seen.get((row["step"], row["rank"], block, e), 0)
            if COPIES[e] > 1:
                seen[(row["step"], row["rank"], block, e)] = nth + 1
            offset = row["rank"] % len(WIDE) if dispatch == "trtllm" else 0
            out[(row["step"], row["rank"], row["token"], j)] = (block + nth + offset) % COPIES[e]
    return out


@pytest.mark.parametrize("dispatch", ["vllm", "trtllm", "trtllm-tp"])
@pytest.mark.parametrize("window", [None, 2])
def test_engine_copies_counted_in_the_store_are_the_engines_loops(wide_root, monkeypatch, dispatch, window):
    monkeypatch.setattr(store_queries, "GROUP_PAGE_ROWS", 1600)  # a step a page
    placement = Placement(len(WIDE), {}, default=tuple(tuple(r) for r in WIDE))
    with Store(wide_root) as store:
        found = rank_tokens(store, "w", placement, {0: len(COPIES)}, dispatch, window)
    rows = read_table(open_location(wide_root), "routes").to_pylist()
    copy = engine_copy(dispatch, rows)
    copy_ranks = {e: [r for r, experts in enumerate(WIDE) if e in experts] for e in range(len(COPIES))}
    assert [len(copy_ranks[e]) for e in range(len(COPIES))] == list(COPIES)
    expected: dict = {}
    for row in rows:
        key = None if window is None else row["step"] // window * window
        tokens, slots = expected.setdefault(key, (np.zeros(len(WIDE)), np.zeros(len(WIDE))))
        reached = set()
        for j, (e, kept) in enumerate(zip(row["expert_ids"], row["kept"])):
            if kept:
                rank = copy_ranks[e][copy[(row["step"], row["rank"], row["token"], j)]]
                slots[rank] += 1
                reached.add(rank)
        for rank in reached:
            tokens[rank] += 1
    assert set(found[0]) == set(expected)
    for key, (tokens, slots) in expected.items():
        np.testing.assert_array_equal(found[0][key][0], tokens)
        np.testing.assert_array_equal(found[0][key][1], slots)
    if dispatch != "vllm":  # blocks do hold an expert's slots more often than it has copies
        assert max(n for n in copy.values()) == max(COPIES) - 1


# node-limited routing, counted with the groups where it changes nothing and row by row where it may: 6 ranks
# in 3 nodes of 2, 12 experts (expert e on rank e // 2, and expert 0 also on rank 5, so homes on node 2 take
# that copy), top-3, two recording ranks; router logits stored for every other token (one of them NaN), as
# integers 0-2 so that node scores tie; gate weights in quarters so that the kept-weights rule ties too
LIM_EXPERTS, LIM_K, LIM_STEPS, LIM_TOKENS = 12, 3, 6, 40
LIM_LAYOUT = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11, 0]]
LIM_NODES = [0, 0, 1, 1, 2, 2]


@pytest.fixture(scope="module")
def limited_root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("limited") / "store")
    for rank in range(2):
        rng = np.random.default_rng(70 + rank)
        records = []
        for step in range(LIM_STEPS):
            record = make_record("n", step, rng, 1, LIM_EXPERTS, LIM_K, tokens=LIM_TOKENS, skew=0.5)
            layer = record.layers[0]
            layer.routes.gate_weights[:] = rng.integers(1, 4, layer.routes.gate_weights.shape) / 4
            sampled = np.arange(0, LIM_TOKENS, 2, dtype=np.int32)
            logits = rng.integers(0, 3, (len(sampled), LIM_EXPERTS)).astype(np.float32)
            logits[3, 5] = np.nan  # a token whose logits are incomplete: the kept-weights rule
            layer.router_logits = TokenSample(sampled, None, logits, np.zeros(len(sampled), dtype=np.int32))
            records.append(record)
        exporter = ParquetExporter(root, run_info("n", 1, LIM_EXPERTS, LIM_K, rank=rank, world_size=2))
        exporter.export(records)
        exporter.shutdown()
    return root


def lim_serving(home: int, expert: int) -> int:
    copies = [r for r, experts in enumerate(LIM_LAYOUT) if expert in experts]
    if home in copies:
        return home
    near = [r for r in copies if LIM_NODES[r] == LIM_NODES[home]]
    far = [r for r in copies if LIM_NODES[r] != LIM_NODES[home]]
    return near[0] if near else far[home % len(far)]


def limited_choice(home: int, ids: list, kept: list, weights: list, logits, max_nodes: int):
    """(rule, changed, moved weight, experts under the limit) of one token, written as loops: DeepSeek-V3's
    rule on softmax(logits) (node score: the sum of its best two experts' scores, the M best nodes kept,
    ties to the lower node; dropped experts replaced by the best unchosen experts of the kept nodes, ties to
    the lower id), or without complete logits the kept-weights rule (node score: its best k // M kept
    weights; the M best of the nodes the token reaches)."""
    slots = [(e, w) for e, w, k in zip(ids, weights, kept) if k]
    node_of = {e: LIM_NODES[lim_serving(home, e)] for e in range(LIM_EXPERTS)}
    total = sum(w for _, w in slots)
    if logits is not None and not any(np.isnan(logits)):
        x = np.exp(np.asarray(logits, dtype=np.float64) - max(logits))
        score = x / x.sum()
        node_score = {n: sum(sorted((score[e] for e in range(LIM_EXPERTS) if node_of[e] == n), reverse=True)[:2])
                      for n in set(node_of.values())}
        allowed = sorted(node_score, key=lambda n: (-node_score[n], n))[:max_nodes]
        dropped = [e for e, _ in slots if node_of[e] not in allowed]
        chosen = {e for e, _ in slots}
        spare = sorted((e for e in range(LIM_EXPERTS) if node_of[e] in allowed and e not in chosen),
                       key=lambda e: (-score[e], e))
        after = [e for e, _ in slots if node_of[e] in allowed] + spare[:len(dropped)]
        moved = sum(w for e, w in slots if e in dropped) / total if total else 0.0
        return "scores", bool(dropped), moved, after
    nodes = {node_of[e] for e, _ in slots}
    node_score = {n: sum(sorted((w for e, w in slots if node_of[e] == n), reverse=True)[:max(1, LIM_K // max_nodes)])
                  for n in nodes}
    allowed = sorted(node_score, key=lambda n: (-node_score[n], n))[:max_nodes]
    moved = sum(w for e, w in slots if node_of[e] not in allowed) / total if len(nodes) > max_nodes else 0.0
    return "kept", len(nodes) > max_nodes, moved, [e for e, _ in slots if node_of[e] in allowed]


@pytest.mark.parametrize("rule", ["recorded", "token"])
@pytest.mark.parametrize("max_nodes", [1, 2, 3])
def test_node_limited_counted_by_group_and_row_is_the_token_by_token_rule(limited_root, monkeypatch, rule,
                                                                         max_nodes):
    monkeypatch.setattr(store_queries, "GROUP_PAGE_ROWS", 100)  # 80 rows a step: pages of one step
    placement = Placement(6, {}, default=tuple(tuple(r) for r in LIM_LAYOUT))
    with Store(limited_root) as store:
        report = traffic_report(store, "n", placement, Wire(np.array(LIM_NODES), rule, max_nodes=max_nodes), 4).layers
    location = open_location(limited_root)
    logits = {(r["step"], r["rank"], r["token"]): r["logits"]
              for r in read_table(location, "router_logits").to_pylist()}
    expected: dict = {}
    for row in read_table(location, "routes").to_pylist():
        home = row["rank"] if rule == "recorded" else row["token"] % 6
        f = expected.setdefault(row["step"] // 4 * 4, dict(tokens=0, changed=0, moved=0.0, rules=set(), remote=0,
                                                             matrix=np.zeros((6, 6), int), hist=np.zeros(6, int)))
        found = limited_choice(home, row["expert_ids"], row["kept"], row["gate_weights"],
                               logits.get((row["step"], row["rank"], row["token"])), max_nodes)
        which, changed, moved, after = found
        reached = {lim_serving(home, e) for e in after}
        f["tokens"] += 1
        f["changed"] += changed
        f["moved"] += moved
        f["rules"].add(LIMIT_RULES[which])
        f["remote"] += len({LIM_NODES[r] for r in reached} - {LIM_NODES[home]})
        f["hist"][len(reached - {home})] += 1
        for r in reached:
            f["matrix"][home, r] += 1
    assert sorted(report.window_start) == sorted(expected)
    for row in report.itertuples():
        f = expected[int(row.window_start)]
        assert row.tokens == f["tokens"]
        assert row.limited_changed_share == pytest.approx(f["changed"] / f["tokens"], rel=1e-12)
        assert row.limited_moved_weight == pytest.approx(f["moved"] / f["tokens"], rel=1e-9)
        assert row.limited_rule == " + ".join(sorted(f["rules"]))
        assert row.limited_remote_nodes_mean == pytest.approx(f["remote"] / f["tokens"], rel=1e-12)
        np.testing.assert_array_equal(row.limited_rank_matrix, f["matrix"])
        np.testing.assert_array_equal(row.limited_remote_ranks_histogram, f["hist"])
    if max_nodes < 3:
        assert all(f["changed"] for f in expected.values())
