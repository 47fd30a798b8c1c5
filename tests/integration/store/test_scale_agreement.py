"""bench/scale.py's two engines give the same answers, and the right ones, on the same snapshot.

A store of about 300 K route rows is written through the real writer (bench/scale.py's `write_run`:
bench/store.py's synthetic records, `DeltaExporter`, Delta commits) and compacted, as the
benchmark does before querying. DuckDB (the project's `Store`) and PySpark in local mode (the
Parquet files of the versions the Store pinned, read from the Delta log) answer the heatmap, drift
and token-lookup queries; their full answers are compared, and both are compared with answers a
brute-force loop computes here from the raw Parquet rows (pyarrow, the snapshot's files found by
replaying the Delta log's JSON commits): on the 300 K-row store, and on a tiny one with uneven
windows and buckets and a lookup limit reached in the middle of a step. The benchmark itself then
runs end to end on a tiny size.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import sys
import time
from collections import defaultdict
from urllib.parse import unquote

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.support.fixtures.s3 import require_module
from tests.support.paths import REPO
from tests.support.realparts import require_program

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.fixture(scope="module")
def scale():
    """bench/scale.py, loaded by path (registered: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("bench_scale", os.path.join(REPO, "bench", "scale.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "bench_scale", module)
        spec.loader.exec_module(module)
        yield module


@pytest.fixture(scope="module")
def spark(scale, tmp_path_factory):
    require_program("java", "/usr/bin/java", package="default-jre-headless")
    require_module("pyspark", package="pyspark")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPARK_LOCAL_IP", "127.0.0.1")
        session = scale.start_spark(str(tmp_path_factory.mktemp("spark")), memory="1g")
        try:
            yield session
        finally:
            session.stop()


# -- the brute force: the raw Parquet rows of the snapshot, in plain Python -------------------------------

def live_files(table_root: str) -> list[str]:
    """The table's live data files: its Delta log's JSON commits replayed in order (adds less removes)."""
    live: set[str] = set()
    for commit in sorted(glob.glob(os.path.join(table_root, "_delta_log", "*.json"))):
        with open(commit) as f:
            for line in f:
                action = json.loads(line)
                if "add" in action:
                    live.add(action["add"]["path"])
                elif "remove" in action:
                    live.discard(action["remove"]["path"])
    return sorted(os.path.join(table_root, unquote(path)) for path in live)


def raw_rows(table_root: str, run_id: str) -> list[dict]:
    rows = []
    for path in live_files(table_root):
        if f"run_id={run_id}" in path.split(os.sep):
            rows += pq.read_table(path).to_pylist()
    return rows


def f32(x: float) -> float:
    return float(np.float32(x))


def brute_heatmap(layer_steps: list[dict], layer: int, bucket: int) -> list[tuple]:
    load: dict[tuple[int, int], int] = defaultdict(int)
    for row in layer_steps:
        if row["layer"] == layer:
            for expert, n in enumerate(row["expert_load"]):
                load[(row["step"] // bucket * bucket, expert)] += n
    return [(b, e, n) for (b, e), n in sorted(load.items())]


def brute_heatmap_from_routes(routes: list[dict], layer: int, bucket: int, experts: int,
                              buckets: list[int]) -> list[tuple]:
    """The same heatmap from the route rows: kept slots per expert and bucket."""
    load = {(b, e): 0 for b in buckets for e in range(experts)}
    for row in routes:
        if row["layer"] == layer:
            for expert, kept in zip(row["expert_ids"], row["kept"]):
                if kept:
                    load[(row["step"] // bucket * bucket, expert)] += 1
    return [(b, e, n) for (b, e), n in sorted(load.items())]


def brute_drift(layer_steps: list[dict], window: int) -> list[tuple]:
    def vector(rows: list[dict]) -> tuple[int, ...]:
        return tuple(int(x) for x in np.sum([r["expert_load"] for r in rows], axis=0))

    groups: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for row in layer_steps:
        groups[(row["layer"], row["step"] // window)].append(row)
    first = min(w for _, w in groups) * window
    out = []
    for (layer, w), rows in sorted(groups.items()):
        base = [r for r in layer_steps if r["layer"] == layer and first <= r["step"] < first + window]
        last = max(r["step_end"] if r["step_end"] is not None else r["step"] for r in rows)
        out.append((layer, w * window, (w + 1) * window, last, len({r["step"] for r in rows}),
                    sum(r["tokens"] for r in rows), vector(rows), vector(base), sum(r["tokens"] for r in base)))
    return out


def brute_lookup(routes: list[dict], layer: int, expert: int, limit: int) -> list[tuple]:
    out = []
    for row in sorted((r for r in routes if r["layer"] == layer), key=lambda r: (r["step"], r["rank"], r["token"])):
        if expert in row["expert_ids"]:
            slot = row["expert_ids"].index(expert)
            out.append((row["step"], row["rank"], row["token"], row["sequence"], row["position"], row["token_id"],
                        slot, f32(row["gate_weights"][slot]), row["kept"][slot], tuple(sorted(row["tags"]))))
            if len(out) == limit:
                break
    return out


# -- the stores -----------------------------------------------------------------------------------------------

class Case:
    """A written (and maybe compacted) store, its Store open, and both engines' answers."""

    def __init__(self, scale, spark, root, shape, rows: float, plan=None, compacted: bool = True):
        from moescope.store import Store
        from moescope.store.compact import compact
        from moescope.store.location import open_location

        self.root = str(root)
        self.location = open_location(self.root)
        self.written = scale.write_run(self.location, shape, rows, progress=False)
        if compacted:
            compact(self.location, run_id=scale.RUN_ID, retention_hours=0.0)
        self.shape = shape
        self.plan = plan or scale.Plan.of(shape, self.written.steps)
        self.store = Store(self.location)
        started = time.perf_counter()
        self.duckdb = {name: q() for name, q in scale.duckdb_queries(self.store, self.plan).items()}
        self.duckdb_s = time.perf_counter() - started
        self.files = scale.snapshot_files(self.location, {t: self.store.versions[t] for t in scale.TABLES})
        started = time.perf_counter()
        self.spark = {name: q() for name, q in scale.spark_queries(spark, self.files, self.plan).items()}
        self.spark_s = time.perf_counter() - started

    def brute(self, scale) -> dict[str, list[tuple]]:
        layer_steps = raw_rows(os.path.join(self.root, "layer_steps"), scale.RUN_ID)
        routes = raw_rows(os.path.join(self.root, "routes"), scale.RUN_ID)
        assert len(routes) == self.written.rows
        plan = self.plan
        heatmap = brute_heatmap(layer_steps, plan.layer, plan.bucket_steps)
        buckets = sorted({b for b, _, _ in heatmap})
        # the loads the heatmap sums are the route rows' kept slots, counted again from routes
        assert heatmap == brute_heatmap_from_routes(routes, plan.layer, plan.bucket_steps, self.shape.experts, buckets)
        return {"heatmap": heatmap, "drift": brute_drift(layer_steps, plan.window_steps),
                "token lookup": brute_lookup(routes, plan.layer, plan.expert, plan.limit)}


@pytest.fixture(scope="module")
def agreement(scale, spark, tmp_path_factory):
    """About 300 K route rows (146 steps x 4 layers x 512 tokens, 16 experts, top-2), compacted."""
    case = Case(scale, spark, tmp_path_factory.mktemp("scale") / "store",
                scale.Shape(layers=4, experts=16, top_k=2, tokens=512), 3e5)
    yield case
    case.store.close()


@pytest.fixture(scope="module")
def tiny(scale, spark, tmp_path_factory):
    """45 steps x 3 layers x 64 tokens, 8 experts: buckets of 4 and windows of 7 steps (the last ones
    partial), and a lookup limit of 151 that the expert reaches within a step; not compacted."""
    shape = scale.Shape(layers=3, experts=8, top_k=2, tokens=64)
    case = Case(scale, spark, tmp_path_factory.mktemp("scale") / "tiny", shape, 45 * 3 * 64,
                plan=scale.Plan(layer=1, expert=5, bucket_steps=4, window_steps=7, limit=151), compacted=False)
    yield case
    case.store.close()


# -- the tests --------------------------------------------------------------------------------------------

def test_the_store_is_written_whole_and_spark_reads_the_snapshot_duckdb_pinned(agreement, scale):
    assert agreement.written.rows == 146 * 4 * 512 >= 250_000
    for table in scale.TABLES:
        pinned = sorted(info.path for info in agreement.store.files[table] if info.run_id == scale.RUN_ID)
        root, paths = agreement.files[table]
        assert [os.path.realpath(p) for p in paths] == [os.path.realpath(p) for p in pinned]
        assert sorted(os.path.realpath(p) for p in live_files(root)) == sorted(os.path.realpath(p) for p in paths)
    # compacted: one route file holds every row, its footer says
    (routes,) = agreement.files["routes"][1]
    assert pq.ParquetFile(routes).metadata.num_rows == agreement.written.rows


@pytest.mark.parametrize("query", ["heatmap", "drift", "token lookup"])
def test_duckdb_and_spark_give_the_same_full_answer(agreement, scale, query):
    duck, spark = agreement.duckdb[query], agreement.spark[query]
    # 146 steps: 1-step buckets, 7-step windows
    assert len(duck) == {"heatmap": 146 * 16, "drift": 4 * 21, "token lookup": 1000}[query]
    assert scale.differences(duck, spark, scale.COLUMNS[query]) is None
    assert duck == spark


def test_both_engines_match_the_brute_force_over_raw_rows(agreement, tiny, scale):
    for case, who in ((agreement, "300 K rows"), (tiny, "tiny")):
        brute = case.brute(scale)
        for query, want in brute.items():
            assert want, f"{who}: the brute force found no {query} rows"
            assert case.duckdb[query] == want, f"{who} {query}: DuckDB " + str(
                scale.differences(case.duckdb[query], want, scale.COLUMNS[query]))
            assert case.spark[query] == want, f"{who} {query}: Spark " + str(
                scale.differences(case.spark[query], want, scale.COLUMNS[query]))
    # the tiny case's shape is what it claims: partial last window and bucket, a limit cut inside a step
    tiny_brute = tiny.brute(scale)
    assert tiny_brute["drift"][-1][2] > 45 and tiny_brute["heatmap"][-1][0] == 44
    lookup = tiny_brute["token lookup"]
    assert len(lookup) == 151
    last_step = lookup[-1][0]
    routed_in_last_step = sum(1 for r in raw_rows(os.path.join(tiny.root, "routes"), scale.RUN_ID)
                              if r["layer"] == 1 and r["step"] == last_step and 5 in r["expert_ids"])
    assert sum(1 for r in lookup if r[0] == last_step) < routed_in_last_step


def test_a_difference_is_found_and_named(agreement, scale):
    answer = agreement.spark["token lookup"]
    changed = list(answer)
    row = list(changed[500])
    row[7] = f32(row[7] + 1e-3)
    changed[500] = tuple(row)
    problem = scale.differences(answer, changed, scale.COLUMNS["token lookup"])
    assert problem is not None and "row 500" in problem and "gate_weight" in problem
    assert "rows against" in scale.differences(answer, answer[:-1], scale.COLUMNS["token lookup"])


def test_the_benchmark_runs_end_to_end_and_removes_its_stores(scale, tmp_path, capsys):
    root = tmp_path / "bench"
    results = scale.main(["--rows", "4e4,1.2e5", "--engines", "duckdb,spark", "--repeats", "1", "--layers", "2",
                          "--tokens", "256", "--experts", "8", "--root", str(root), "--no-progress",
                          "--spark-memory", "1g", "--json", str(tmp_path / "figures.json")])
    assert [r.rows for r in results] == [78 * 2 * 256, 234 * 2 * 256]
    for r in results:
        assert r.agreed is True and r.written.files >= 1 and r.compacted_files == 1
        assert 0 < r.compacted_bytes / r.rows < 64
        assert set(r.queries_ms) == {"duckdb", "spark"} and all(
            len(times) == 1 and times[0] > 0 for engine in r.queries_ms.values() for times in engine.values())
        # CPU per run: DuckDB's threads in this process, Spark's JVM; a query over files takes some
        assert all(len(cpu) == 1 and cpu[0] > 0 for engine in r.queries_cpu_ms.values() for cpu in engine.values())
    out = capsys.readouterr().out
    assert "growth vs" in out and "spark token lookup p50 ms" in out and "answers agree" in out
    assert len(json.loads((tmp_path / "figures.json").read_text())) == 2
    assert not [p for p in root.iterdir() if p.name.startswith("store-")], "the stores are removed"


def test_bad_sizes_and_engines_are_refused_with_what_to_give(scale, capsys):
    for argv, says in ((["--rows", "lots"], "numbers separated by commas"),
                       (["--engines", "duckdb,presto"], "duckdb and/or spark")):
        with pytest.raises(SystemExit):
            scale.main(argv)
        assert says in capsys.readouterr().err
