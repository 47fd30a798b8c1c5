"""Traffic and tokens per rank counted where the data is (`Store.route_groups`: DuckDB counts a layer's
routes rows per window, home key and routing, a page of steps at a time) against a plain loop over the
raw `routes` Parquet rows, token by token, on a three-rank run read in pages of 100 rows (two steps)
with windows of 5 steps, so windows straddle pages and pages straddle windows."""

from __future__ import annotations

import numpy as np
import pytest

from moescope.analyses.placement import rank_tokens
from moescope.analyses.traffic import Wire, traffic_report
from moescope.metrics.placement import Placement
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
