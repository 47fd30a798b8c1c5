"""Every typed query checked against a brute-force computation over the records that were written."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moescope.store import EmptyStoreError, QueryError, Selection, Store
from moescope.store.compact import compact
from moescope.store.exporter import DeltaExporter
from tests.support.store_records import make_record, run_info

LAYERS, EXPERTS, STEPS = 3, 6, 12


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    records = {"a": [], "b": []}
    for run_id, ranks, skew in (("a", (0, 1), 0.0), ("b", (0,), 2.0)):
        for rank in ranks:
            rng = np.random.default_rng(10 * rank + len(run_id))
            exporter = DeltaExporter(root, run_info(run_id, LAYERS, EXPERTS, rank=rank, world_size=len(ranks),
                                                      tags={"model": run_id}), max_rows=40)
            for step in range(STEPS):
                record = make_record(run_id, step, rng, LAYERS, EXPERTS,
                                     tags={"split": "train" if step % 3 else "eval"}, skew=skew)
                exporter.export([record])
                records[run_id].append((rank, record))
            exporter.shutdown()
    compact(root, run_id="b")  # one run compacted, one not: both must answer alike
    return root, records


def _rows(records, run_id, layer=None, lo=None, hi=None, tags=None):
    for rank, record in records[run_id]:
        if lo is not None and record.step < lo or hi is not None and record.step >= hi:
            continue
        if tags and any(record.tags.get(k) != v for k, v in tags.items()):
            continue
        for ls in record.layers:
            if layer is None or ls.layer == layer:
                yield rank, record, ls


def test_runs_and_tags(written):
    root, records = written
    store = Store(root)
    runs = store.runs().set_index("run_id")
    assert list(runs.index) == ["a", "b"]
    assert runs.loc["a", "world_size"] == 2 and runs.loc["a", "ranks"] == 2
    assert runs.loc["a", "tags"] == {"model": "a"}
    assert runs.loc["a", "steps"] == STEPS
    assert runs.loc["a", "tokens"] == sum(r.tokens for _, r in records["a"])
    values = store.tag_values("a").set_index("value")
    assert values.loc["eval", "steps"] == len({r.step for _, r in records["a"] if r.tags["split"] == "eval"})
    assert store.latest_run() == "b"


def test_load_matrix_by_bucket(written):
    root, records = written
    store = Store(root)
    got = store.load_matrix("a", layer=1, bucket_steps=4, step_from=2, step_to=11)
    want: dict[tuple[int, int], int] = {}
    for _, record, ls in _rows(records, "a", 1, 2, 11):
        for expert, load in enumerate(ls.expert_load):
            key = (record.step // 4 * 4, expert)
            want[key] = want.get(key, 0) + int(load)
    assert {(r.step_bucket, r.expert): r.load for r in got.itertuples()} == want


def test_expert_share_with_tags(written):
    root, records = written
    store = Store(root)
    got = store.expert_share("b", tags={"split": "train"})
    for layer in range(LAYERS):
        load = sum(ls.expert_load for _, _, ls in _rows(records, "b", layer, tags={"split": "train"}))
        rows = got[got.layer == layer].sort_values("expert")
        np.testing.assert_array_equal(rows.load.to_numpy(), load)
        np.testing.assert_allclose(rows.share.to_numpy(), load / load.sum())


def test_coselection_sum(written):
    root, records = written
    got = Store(root).coselection("a", 2, step_from=3)
    want = sum(ls.coselection for _, _, ls in _rows(records, "a", 2, 3))
    np.testing.assert_array_equal(got, want)
    assert Store(root).coselection("a", 2, step_from=100).shape == (0, 0)


def test_load_windows_and_drift(written):
    root, records = written
    store = Store(root)
    windows = store.load_windows("a", 5)
    for row in windows.itertuples():
        lo, hi = row.window_start, row.window_end
        picked = list(_rows(records, "a", row.layer, lo, hi))
        np.testing.assert_array_equal(row.expert_load, sum(ls.expert_load for _, _, ls in picked))
        assert row.tokens == sum(ls.tokens for _, _, ls in picked)
        assert row.steps == len({r.step for _, r, _ in picked})
    assert len(windows) == LAYERS * 3
    drift = store.drift_windows("b", 4, baseline_run="a")
    assert len(drift) == LAYERS * 3  # steps 0-3, 4-7, 8-11 of each layer
    for row in drift.itertuples():
        baseline = sum(ls.expert_load for _, _, ls in _rows(records, "a", row.layer))
        np.testing.assert_array_equal(row.baseline_load, baseline)
    own = store.drift_windows("b", 4)
    first = sum(ls.expert_load for _, _, ls in _rows(records, "b", 0, 0, 4))
    assert len(own[own.layer == 0]) == 3
    for row in own[own.layer == 0].itertuples():
        np.testing.assert_array_equal(row.baseline_load, first)


def test_expert_routes_match_raw_rows(written):
    root, records = written
    got = Store(root).expert_routes("a", 1, 4, step_from=2, step_to=6, tags={"split": "train"}, limit=10_000)
    want = []
    for rank, record, ls in _rows(records, "a", 1, 2, 6, {"split": "train"}):
        r = ls.routes
        for token in range(len(r.expert_ids)):
            hits = np.flatnonzero(r.expert_ids[token] == 4)
            if len(hits):
                s = int(hits[0])
                want.append((record.step, rank, token, int(r.token_ids[token]), s,
                             float(r.gate_weights[token, s]), bool(r.kept[token, s])))
    rows = [(r.step, r.rank, r.token, r.token_id, r.slot, float(np.float32(r.gate_weight)), bool(r.kept))
            for r in got.itertuples()]
    assert len(want) > 0 and rows == sorted(want)
    assert [dict(t) for t in got.tags] == [{"split": "train"}] * len(want)
    assert len(Store(root).expert_routes("a", 1, 4, limit=3)) == 3


def test_tag_breakdown(written):
    root, records = written
    got = Store(root).tag_breakdown("a", "split")
    assert len(got) == LAYERS * 2  # every layer under each of the two tag values
    for row in got.itertuples():
        picked = list(_rows(records, "a", row.layer, tags={"split": row.tag_value}))
        tokens = sum(ls.tokens for _, _, ls in picked)
        assert row.tokens == tokens
        entropy = sum(ls.router_entropy_mean * ls.tokens for _, _, ls in picked) / tokens
        assert row.router_entropy_mean == pytest.approx(entropy)
        load = sum(ls.expert_load for _, _, ls in picked)
        p = load[load > 0] / load.sum()
        assert row.load_entropy == pytest.approx(-(p * np.log(p)).sum())
        steps = {(rank, r.step): r for rank, r in records["a"] if r.tags["split"] == row.tag_value}
        frac = sum(r.active_param_fraction * r.tokens for r in steps.values()) / sum(r.tokens for r in steps.values())
        assert row.active_param_fraction == pytest.approx(frac)
    assert set(got.tag_value) == {"train", "eval"}


def test_compare_runs_and_tags(written):
    root, records = written
    store = Store(root)
    got = store.compare_runs("a", "b")
    for layer in range(LAYERS):
        la = sum(ls.expert_load for _, _, ls in _rows(records, "a", layer))
        lb = sum(ls.expert_load for _, _, ls in _rows(records, "b", layer))
        rows = got[got.layer == layer].sort_values("expert")
        np.testing.assert_allclose(rows.delta.to_numpy(), lb / lb.sum() - la / la.sum())
    tags = store.compare_tags("a", "split", "train", "eval")
    le = sum(ls.expert_load for _, _, ls in _rows(records, "a", 0, tags={"split": "eval"}))
    np.testing.assert_array_equal(tags[tags.layer == 0].sort_values("expert").load_b.to_numpy(), le)
    summary = store.compare_summary(Selection("a"), Selection("b", step_from=6)).set_index("side")
    assert summary.loc["b", "steps"] == STEPS - 6
    assert summary.loc["a", "dropped_tokens"] == sum(ls.dropped_tokens for _, _, ls in _rows(records, "a"))


def test_values_are_parameters_not_sql(written):
    root, _ = written
    store = Store(root)
    assert store.load_matrix("a' OR '1'='1", 0).empty
    assert store.expert_routes("a", 0, 1, tags={"split') OR true --": "x"}).empty
    with pytest.raises(QueryError):
        store.sql("SELECT nope FROM runs")


def test_empty_and_missing_store(tmp_path):
    with pytest.raises(EmptyStoreError, match="no data yet"):
        Store(tmp_path / "missing")
    store = Store(tmp_path)
    assert not store.has_data
    assert store.runs().empty and store.load_matrix("x", 0).empty and store.expert_routes("x", 0, 0).empty
    with pytest.raises(EmptyStoreError, match="no data yet"):
        store.latest_run()


def test_expert_routes_limit_takes_the_first_rows(written):
    root, _ = written
    full = Store(root).expert_routes("b", 0, 2, limit=10_000)
    for limit in (1, 7, 40):
        got = Store(root).expert_routes("b", 0, 2, limit=limit)
        assert got[["step", "rank", "token"]].values.tolist() == full[["step", "rank", "token"]].values.tolist()[:limit]


def _raw_route_rows(root, run_id: str, layer: int, lo: int, hi: int, tags: dict[str, str]) -> list[tuple]:
    """Routes rows read straight from the run's Parquet part files (no DuckDB), filtered by a loop."""
    import glob
    import os

    import pyarrow.parquet as pq

    rows = []
    for path in glob.glob(os.path.join(str(root), "routes", f"run_id={run_id}", "part-*.parquet")):
        for row in pq.read_table(path).to_pylist():
            if row["layer"] != layer or not lo <= row["step"] < hi or any(dict(row["tags"]).get(k) != v
                                                                          for k, v in tags.items()):
                continue
            rows.append((row["step"], row["rank"], row["token"], tuple(row["expert_ids"]), tuple(row["kept"])))
    return sorted(rows)


def test_routes_in_order_match_the_raw_parquet_rows(written):
    root, records = written
    store = Store(root)
    tags = {"split": "train"}
    want = _raw_route_rows(root, "a", 2, 1, 11, tags)
    assert want and len({(r[0], r[1]) for r in want}) > 4  # several steps of both ranks
    for page_rows in (1, 17, 10_000):
        pages = list(store.routes_in_order("a", 2, step_from=1, step_to=11, tags=tags, page_rows=page_rows))
        got = [(int(s), int(r), int(t), tuple(int(e) for e in ids), tuple(bool(k) for k in kept))
               for page in pages for s, r, t, ids, kept in zip(page.step, page.rank, page.token, page.expert_ids,
                                                              page.kept)]
        assert got == want  # recording order: step, then rank, then token
        steps_per_page = [set(page.step.tolist()) for page in pages]
        assert all(a.isdisjoint(b) for a, b in itertools.combinations(steps_per_page, 2))  # a step is never split
        if page_rows == 1:
            assert len(pages) == len({r[0] for r in want})
    # The compacted run answers alike, checked against the records that were written.
    got_b = [(int(s), int(t), ids.tolist(), kept.tolist()) for page in store.routes_in_order("b", 0, page_rows=50)
             for s, t, ids, kept in zip(page.step, page.token, page.expert_ids, page.kept)]
    want_b = [(record.step, token, ls.routes.expert_ids[token].tolist(), ls.routes.kept[token].tolist())
              for _, record, ls in _rows(records, "b", 0) for token in range(len(ls.routes.expert_ids))]
    assert got_b == want_b
    assert list(store.routes_in_order("nope", 0)) == []
    with pytest.raises(ValueError, match="page_rows"):
        next(store.routes_in_order("a", 0, page_rows=0))
