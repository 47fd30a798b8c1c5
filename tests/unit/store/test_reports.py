"""The queries behind the views (store/reports.py), checked against loops over the Parquet rows
read without DuckDB, on a store the probe recorded on a real tiny Mixtral."""

from __future__ import annotations

import glob
import itertools
import os
from collections import Counter, defaultdict

import numpy as np
import pyarrow.parquet as pq
import pytest

from moescope.metrics import signals
from moescope.store.schema import SCHEMAS
from moescope.store.store import Store
from tests.support.recording import record_alerts, record_store


def rows(root: str, table: str, run_id: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(root, table, f"run_id={run_id}", "part-*.parquet")))
    out = []
    for path in files:
        for row in pq.read_table(path).to_pylist():
            row["tags"] = dict(row["tags"]) if row.get("tags") is not None else {}
            out.append(row)
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("reports") / "store")
    runs = record_store(root)
    return {"root": root, "runs": runs, "transitions": record_alerts(root)}


@pytest.fixture(scope="module")
def store(recorded) -> Store:
    return Store(recorded["root"])


@pytest.fixture(scope="module")
def run_id(recorded) -> str:
    return recorded["runs"][0]


def test_layer_expert_load_equals_count_of_kept_routes(store, recorded, run_id):
    # Two independent sources: the probe's per-step reductions (via DuckDB) and the per-token
    # routes (read with pyarrow and counted in a loop).
    counted = Counter()
    for row in rows(recorded["root"], "routes", run_id):
        for expert, kept in zip(row["expert_ids"], row["kept"]):
            if kept:
                counted[(row["layer"], expert)] += 1
    got = store.expert_share(run_id)
    assert {(int(r.layer), int(r.expert)): int(r.load) for r in got.itertuples() if r.load} == dict(counted)


def test_tag_filter_and_load_matrix_match_a_loop(store, recorded, run_id):
    steps = rows(recorded["root"], "layer_steps", run_id)
    code = [r for r in steps if r["tags"]["domain"] == "code" and r["layer"] == 1]
    matrix = store.load_heatmap(run_id, 1, {"domain": "code"}, max_buckets=5)
    width = int(np.ceil((max(r["step"] for r in steps) + 1) / 5))
    expected = defaultdict(int)
    for r in code:
        for expert, load in enumerate(r["expert_load"]):
            expected[((r["step"] // width) * width, expert)] += load
    assert {(int(r.step_start), int(r.expert)): int(r.load) for r in matrix.itertuples()} == dict(expected)
    assert matrix.step_start.nunique() <= 5


def test_step_totals_and_active_fraction_by_tag(store, recorded, run_id):
    steps = rows(recorded["root"], "steps", run_id)
    totals = store.step_totals(run_id, {"domain": "math"})
    chosen = [r for r in steps if r["tags"]["domain"] == "math"]
    assert totals["steps"] == len(chosen)
    assert totals["tokens"] == sum(r["tokens"] for r in chosen)
    weighted = sum(r["active_param_fraction"] * r["tokens"] for r in chosen) / sum(r["tokens"] for r in chosen)
    assert totals["active_fraction"] == pytest.approx(weighted, rel=1e-12)
    assert totals["active_min"] == pytest.approx(min(r["active_param_fraction"] for r in chosen))
    # Active fraction = (shared params + top-k experts' params) / all params: check it from the layers.
    layers = rows(recorded["root"], "layers", run_id)
    run = rows(recorded["root"], "runs", run_id)[0]
    shared = run["total_params"] - run["routed_expert_params"]
    per_token = sum(info["top_k"] * info["params_per_expert"] for info in layers)
    assert totals["active_fraction"] == pytest.approx((shared + per_token) / run["total_params"], rel=1e-9)
    by_tag = store.active_fraction_by_tag(run_id, "domain")
    assert sorted(by_tag.value) == ["code", "math", "prose"]
    assert by_tag.steps.sum() == len(steps)
    for value in ("code", "math", "prose"):  # each tag's row is its own token-weighted mean
        tagged = [r for r in steps if r["tags"]["domain"] == value]
        weighted = sum(r["active_param_fraction"] * r["tokens"] for r in tagged) / sum(r["tokens"] for r in tagged)
        assert by_tag[by_tag.value == value].active_fraction.iloc[0] == pytest.approx(weighted, rel=1e-12)


def test_coselection_matches_pairs_of_routes(store, recorded, run_id):
    pairs = np.zeros((8, 8), dtype=np.int64)
    for row in rows(recorded["root"], "routes", run_id):
        if row["layer"] != 0:
            continue
        chosen = sorted(set(row["expert_ids"]))
        for i in chosen:
            pairs[i, i] += 1
        for i, j in itertools.permutations(chosen, 2):
            pairs[i, j] += 1
    assert np.array_equal(store.coselection(run_id, 0), pairs)


def test_expert_tokens_lists_exactly_the_routed_tokens_with_context(store, recorded, run_id):
    routes = rows(recorded["root"], "routes", run_id)
    wanted = {(r["step"], r["token"]) for r in routes
              if r["layer"] == 1 and 4 in r["expert_ids"] and 3 <= r["step"] <= 7}
    got = store.expert_tokens(run_id, 1, 4, (3, 7), limit=500, context=2)
    assert {(int(r.step), int(r.token)) for r in got.itertuples()} == wanted
    by_position = {(r["step"], r["sequence"], r["position"]): r["token_id"] for r in routes if r["layer"] == 1}
    for r in got.itertuples():
        expected = [by_position[(r.step, r.sequence, p)] for p in range(r.position - 2, r.position + 3)
                    if (r.step, r.sequence, p) in by_position]
        assert list(r.context_ids) == expected
        assert r.token_id == by_position[(r.step, r.sequence, r.position)]
    limited = store.expert_tokens(run_id, 1, 4, None, limit=7)
    assert len(limited) == 7


def test_user_text_never_becomes_sql(store, run_id):
    hostile = "code') OR 1=1; DROP VIEW steps; --"
    assert store.step_totals(run_id, {"domain": hostile})["steps"] == 0
    assert store.step_totals(hostile)["steps"] == 0
    assert store.active_fraction_by_tag(run_id, hostile).empty
    assert store.expert_tag_load(run_id, hostile).empty
    assert store.step_totals(run_id)["steps"] > 0  # the view is still there


def test_drift_windows_against_baseline(store, recorded, run_id):
    steps = rows(recorded["root"], "layer_steps", run_id)
    div = signals.divergence_over_time(store.drift_from_first_steps(run_id, 6, None, 8))
    layer0 = sorted((r for r in steps if r["layer"] == 0), key=lambda r: r["step"])
    reference = np.sum([r["expert_load"] for r in layer0[:8]], axis=0)
    first = np.sum([r["expert_load"] for r in layer0 if r["step"] < 6], axis=0)
    row = div[(div.layer == 0) & (div.window_start == 0)].iloc[0]
    assert row.kl == pytest.approx(signals.kl_divergence(first, reference))
    assert row.js == pytest.approx(signals.js_divergence(first, reference))
    assert len(div[div.layer == 0]) == int(np.ceil(len(layer0) / 6))
    # Against the other run's first 8 steps.
    other = recorded["runs"][1]
    other0 = sorted((r for r in rows(recorded["root"], "layer_steps", other) if r["layer"] == 0),
                    key=lambda r: r["step"])
    versus = signals.divergence_over_time(store.drift_from_first_steps(run_id, 6, other, 8))
    row = versus[(versus.layer == 0) & (versus.window_start == 0)].iloc[0]
    assert row.kl == pytest.approx(signals.kl_divergence(first, np.sum([r["expert_load"] for r in other0[:8]], axis=0)))


def test_optional_tables(store, recorded, run_id):
    with pytest.raises(ValueError, match="no table"):
        store.table_rows("not_a_table", run_id)
    with pytest.raises(ValueError, match="no column"):
        store.table_rows("alerts", run_id, "at; DROP VIEW steps")
    assert store.table_rows("trust_gate_requests", run_id).empty  # in the schema, nothing written
    assert store.table_rows("expert_health", run_id).empty  # in the schema, nothing written
    alerts = store.table_rows("alerts", run_id, "ts")
    assert len(alerts) == len(rows(recorded["root"], "alerts", run_id)) > 0
    assert alerts.ts.is_monotonic_increasing
    assert list(alerts.columns) == SCHEMAS["alerts"].names  # no view guesses a column name
    latest = store.table_rows("alerts", run_id, "ts", limit=3)
    assert len(latest) == 3 and latest.ts.tolist() == alerts.ts.tolist()[-3:]


def test_router_input_sample_is_fixed_and_has_context(store, recorded, run_id):
    a = store.router_input_sample(run_id, 0, size=50)
    b = store.router_input_sample(run_id, 0, size=50)
    assert len(a) == 50 and a[["step", "token"]].equals(b[["step", "token"]])
    inputs = {(r["step"], r["token"]): r for r in rows(recorded["root"], "router_inputs", run_id) if r["layer"] == 0}
    for r in a.itertuples():
        assert r.top1_expert == inputs[(r.step, r.token)]["top1_expert"]
        assert r.token_id in list(r.context_ids)


@pytest.mark.parametrize("buckets", [3, 5, 7])
@pytest.mark.parametrize("lengths", [(16, 11, 5), (13, 7, 9, 2)])
def test_active_fraction_by_position_at_sizes_that_do_not_divide(tmp_path, buckets, lengths):
    """Buckets of width ceil(P / buckets) over positions 0..P-1, P the longest row: with P = 16 or 13
    and 3, 5 or 7 buckets no width divides evenly, so an off-by-one in the width (ceil(max / buckets))
    moves the boundaries and drops the last position; checked against a loop over the raw rows."""
    import dataclasses as dc

    from moescope.store.exporter import DeltaExporter
    from tests.support.deltafiles import snapshot_rows
    from tests.support.store_records import make_record, run_info

    rng = np.random.default_rng(len(lengths) * 10 + buckets)
    tokens = sum(lengths)
    sequence = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)]).astype(np.int32)
    position = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    root = tmp_path / "store"
    exporter = DeltaExporter(root, run_info("r"))
    for step in range(4):
        record = make_record("r", step, rng, tokens=tokens)
        record.layers = [dc.replace(ls, routes=dc.replace(ls.routes, sequence=sequence, position=position))
                         for ls in record.layers]
        exporter.export([record])
    exporter.shutdown()

    routes = snapshot_rows(root, "routes").to_pylist()
    layers = {row["layer"]: row for row in snapshot_rows(root, "layers").to_pylist()}
    run = snapshot_rows(root, "runs").to_pylist()[0]
    used: dict[tuple, float] = defaultdict(float)
    where: dict[tuple, int] = {}
    for row in routes:
        key = (row["step"], row["rank"], row["token"])
        info = layers[row["layer"]]
        used[key] += sum(1 for e, k in zip(row["expert_ids"], row["kept"]) if k and e < info["num_experts"]) \
            * info["params_per_expert"]
        where[key] = row["position"]
    longest = max(where.values()) + 1
    width = -(-longest // buckets)
    want: dict[int, list[float]] = defaultdict(list)
    for key, p in where.items():
        want[p // width].append((run["total_params"] - run["routed_expert_params"] + used[key]) / run["total_params"])

    got = Store(root).active_fraction_by_position("r", buckets)
    assert got.tokens.sum() == len(where)  # every (step, rank, token) with routes, once
    assert list(got.bucket) == sorted(want)
    for row in got.itertuples():
        assert row.position_start == row.bucket * width
        assert row.tokens == len(want[row.bucket])
        assert row.active_fraction == pytest.approx(float(np.mean(want[row.bucket])), rel=1e-12)
    assert got.position_end.iloc[-1] >= longest  # the last bucket reaches the longest position


def _stepped_store(root, first: int, span: int) -> None:
    """A run whose recorded steps cover first .. first + span - 1: single forwards, then one window
    of three forwards at the end (so `step_end`, not `step`, marks the last step), tokens varying."""
    import dataclasses as dc

    from moescope.store.exporter import DeltaExporter
    from tests.support.store_records import make_record, run_info

    rng = np.random.default_rng(span)
    exporter = DeltaExporter(root, run_info("r"))
    last = first + span - 1
    step = first
    while step <= last:
        forwards = 3 if last - step == 2 else 1
        record = make_record("r", step, rng, tokens=8 * (1 + step % 3))
        exporter.export([dc.replace(record, forwards=forwards, step_end=step + forwards - 1)])
        step += forwards
    exporter.shutdown()


# (buckets or window steps, steps the run spans): span - 1 is a multiple of the buckets, so a width of
# ceil((span - 1) / buckets) (the off-by-one) differs from the right ceil(span / buckets) and makes
# one bucket too many; nothing divides evenly.
UNEVEN = [(3, 16), (5, 16), (7, 15), (4, 13)]


@pytest.mark.parametrize("buckets,span", UNEVEN)
def test_step_buckets_at_sizes_that_do_not_divide(tmp_path, buckets, span):
    """active_fraction_buckets and layer_buckets: at most `buckets` buckets of width
    ceil(span / buckets) from the first step, tokens and token-weighted figures equal to a loop over
    the raw rows, the last bucket ending at the run's last step."""
    from tests.support.deltafiles import snapshot_rows

    first = 2
    root = tmp_path / "store"
    _stepped_store(root, first, span)
    width = -(-span // buckets)
    last = first + span - 1

    steps = snapshot_rows(root, "steps").to_pylist()
    want: dict[int, list[dict]] = defaultdict(list)
    for row in steps:
        want[(row["step"] - first) // width].append(row)
    got = Store(root).active_fraction_buckets("r", max_buckets=buckets)
    assert len(got) <= buckets and list(got.step_start) == [first + i * width for i in sorted(want)]
    assert got.tokens.sum() == sum(row["tokens"] for row in steps)
    for row in got.itertuples():
        members = want[(row.step_start - first) // width]
        tokens = sum(m["tokens"] for m in members)
        assert row.tokens == tokens
        assert row.step_end == max(m["step_end"] for m in members)
        assert row.active_fraction == pytest.approx(
            sum(m["tokens"] * m["active_param_fraction"] for m in members) / tokens, rel=1e-12)
    assert got.step_end.iloc[-1] == last

    layer_rows = snapshot_rows(root, "layer_steps").to_pylist()
    per_layer: dict[tuple, list[dict]] = defaultdict(list)
    for row in layer_rows:
        per_layer[(row["layer"], (row["step"] - first) // width)].append(row)
    got = Store(root).layer_buckets("r", max_buckets=buckets)
    assert sorted(zip(got.layer, (got.step_start - first) // width)) == sorted(per_layer)
    assert all(got.groupby("layer").size() <= buckets)
    for row in got.itertuples():
        members = per_layer[(row.layer, (row.step_start - first) // width)]
        tokens = sum(m["tokens"] for m in members)
        assert row.tokens == tokens
        assert row.dropped_tokens == sum(m["dropped_tokens"] for m in members)
        assert row.router_entropy == pytest.approx(
            sum(m["tokens"] * m["router_entropy_mean"] for m in members) / tokens, rel=1e-12)


@pytest.mark.parametrize("window,span", UNEVEN)
def test_load_and_drift_windows_at_sizes_that_do_not_divide(tmp_path, window, span):
    """load_windows (and drift_windows over it): windows aligned to multiples of `window`, the final
    one partial; each window's expert load, tokens and last step equal a loop over the raw rows."""
    from tests.support.deltafiles import snapshot_rows

    first = 2
    root = tmp_path / "store"
    _stepped_store(root, first, span)
    layer_rows = snapshot_rows(root, "layer_steps").to_pylist()
    want: dict[tuple, list[dict]] = defaultdict(list)
    for row in layer_rows:
        want[(row["layer"], row["step"] // window)].append(row)

    store = Store(root)
    got = store.load_windows("r", window)
    assert sorted(zip(got.layer, got.window_start // window)) == sorted(want)
    for row in got.itertuples():
        assert row.window_start % window == 0 and row.window_end == row.window_start + window
        members = want[(row.layer, row.window_start // window)]
        assert row.tokens == sum(m["tokens"] for m in members)
        assert row.last_step == max(m["step_end"] for m in members)
        assert row.steps == sum(m["forwards"] for m in members)
        assert list(row.expert_load) == list(np.sum([m["expert_load"] for m in members], axis=0))
    assert got.last_step.max() == first + span - 1

    drift = store.drift_windows("r", window)
    first_window = min(w for _, w in want)
    for row in drift.itertuples():
        base = want[(row.layer, first_window)]
        assert list(row.baseline_load) == list(np.sum([m["expert_load"] for m in base], axis=0))
        assert row.baseline_tokens == sum(m["tokens"] for m in base)
