"""Scale benchmark: the store at 50 M, 200 M and 1 B route rows, queried by DuckDB and by PySpark.

    python bench/scale.py                                  # 50e6,200e6,1e9 route rows; DuckDB and PySpark
    python bench/scale.py --rows 50e6 --engines duckdb     # one size, DuckDB alone
    python bench/scale.py --rows 2e6,8e6 --repeats 3       # a quick look at how the figures grow
    python bench/scale.py --rows 1e6 --root /tmp/scale --keep --json /tmp/scale.json

Each size, in increasing order (a stop leaves the smaller sizes' figures printed), gets a fresh
local store and:

1. write: bench/store.py's synthetic but complete `StepRecord`s (its `_record`: routes, and loads
   that are the bincount of the routes), generated off the clock, written through the real writer
   (`ParquetExporter`: Arrow, Parquet with page checksums, one Delta commit per 256 K-row part),
   pinned to one core as bench/store.py pins it. The write rate is route rows per second of the
   exporter's wall time (bench/store.py's figure) and per second of the whole loop, records
   generated included; a progress bar follows the rows.
2. compaction, as an operator runs it before querying a long run (`moescope compact`, as
   bench/store.py does): the run's 256 K-row parts merged into large files sorted by (layer, step).
   Bytes per route row and files are given before and after.
3. DuckDB: a fresh `Store` (its open: the snapshot, and every file's footer and page checksums
   checked once), then the heatmap (`load_matrix`, one layer, 100 buckets), drift
   (`drift_windows`, all layers, 20 windows) and token lookup (`expert_routes`, one expert of one
   layer, the first 1000 tokens), each timed `--repeats` times after one warm-up.
4. PySpark in local mode (`local[2]`): the Parquet files of the table versions the `Store` pinned,
   read from each table's Delta log by deltalake (no Delta connector jar is needed: the file list is
   what a connector computes from `_delta_log/`), and the same three queries in Spark's DataFrame
   API. Every answer is compared in full with DuckDB's (an error names the first difference), then
   timed like DuckDB's.

The heatmap and drift queries read `layer_steps` (a row per layer, step and rank: 8 x 30 517 rows
at 1 B route rows of the default shape), not `routes`; the token lookup reads `routes`, bounded to
the steps it needs by the layer's recorded loads. The table at the end gives each figure per size
and its growth beside the growth in rows. The load average (`os.getloadavg()`) is printed beside
each phase: the figures move with it on a shared machine. Every store is removed after its size's
figures are taken (`--keep` keeps them).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any
from urllib.parse import unquote

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ("duckdb", "spark")


def _bench_store() -> ModuleType:
    """bench/store.py, whose writer path and timing helpers this benchmark reuses (loaded by path:
    `store` is also the store package's folder)."""
    module = sys.modules.get("bench_store")
    if module is None:
        spec = importlib.util.spec_from_file_location("bench_store", os.path.join(REPO, "bench", "store.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["bench_store"] = module
    return module


bs = _bench_store()
RUN_ID: str = bs.RUN_ID
TABLES = ("layer_steps", "routes")  # what the three queries read


@dataclass(frozen=True)
class Shape:
    """The synthetic run's shape (bench/store.py's defaults)."""

    layers: int = 8
    experts: int = 64
    top_k: int = 2
    tokens: int = 4096  # per step and layer

    def steps(self, rows: float) -> int:
        return max(1, int(rows) // (self.layers * self.tokens))


@dataclass(frozen=True)
class Plan:
    """The three queries' arguments, as bench/store.py asks them of a run of `steps` steps."""

    layer: int
    expert: int
    bucket_steps: int
    window_steps: int
    limit: int = 1000

    @classmethod
    def of(cls, shape: Shape, steps: int) -> Plan:
        return cls(layer=shape.layers // 2, expert=7 % shape.experts, bucket_steps=max(1, steps // 100),
                   window_steps=max(1, steps // 20))


@dataclass
class Written:
    rows: int
    steps: int
    exporter_s: float  # wall time inside the exporter
    loop_s: float  # wall time of the whole loop, records generated included
    cpu_s: float  # this process's CPU time inside the exporter
    files: int
    bytes: int


# -- writing ---------------------------------------------------------------------------------------

def write_run(loc: Any, shape: Shape, rows: float, progress: bool = True, seed: int = 0) -> Written:
    """Write `rows` route rows (rounded down to whole steps) of one run through `ParquetExporter`,
    pinned to one core; the exporter's time and the loop's are measured apart."""
    from tqdm import tqdm

    from moescope.core.records import LayerInfo, RunInfo
    from moescope.store.writer import ParquetExporter

    steps = shape.steps(rows)
    per_step = shape.layers * shape.tokens
    rng = np.random.default_rng(seed)
    skews = rng.dirichlet(np.ones(shape.experts) * 0.5, size=shape.layers)
    run = RunInfo(run_id=RUN_ID, started_at=dt.datetime.now(dt.timezone.utc), model_class="Bench",
                  total_params=10**8, routed_expert_params=9 * 10**7, tags={"bench": "scale"},
                  layers=tuple(LayerInfo(i, f"layers.{i}", "bench", shape.experts, shape.top_k, 10**6)
                               for i in range(shape.layers)))
    cores = os.sched_getaffinity(0)
    pinned = bs._pin_process({min(cores)})
    busy = cpu = 0.0
    started_loop = time.perf_counter()
    try:
        exporter = ParquetExporter(loc, run, max_rows=bs.DEFAULT_MAX_ROWS, max_age_s=1e9)  # flushes by size
        with tqdm(total=steps * per_step, unit="row", unit_scale=True, desc="write", disable=not progress,
                  mininterval=2.0, file=sys.stderr) as bar:
            for step in range(steps):
                record = bs._record(RUN_ID, step, shape.layers, shape.experts, shape.top_k, shape.tokens, skews,
                                    rng, {"split": "train" if step % 10 else "eval"})  # off the clock
                started, cpu_started = time.perf_counter(), time.process_time()
                exporter.export([record])
                if step == steps - 1:
                    exporter.shutdown()
                busy += time.perf_counter() - started
                cpu += time.process_time() - cpu_started
                bar.update(per_step)
    finally:
        bs._unpin_process(pinned, cores)
    loop_s = time.perf_counter() - started_loop
    files, size, written = bs._route_files(loc)
    if written != steps * per_step:
        raise RuntimeError(f"{written} route rows in the snapshot, {steps * per_step} written")
    return Written(rows=written, steps=steps, exporter_s=busy, loop_s=loop_s, cpu_s=cpu, files=files, bytes=size)


# -- the snapshot, as a Delta connector finds it ------------------------------------------------------

def snapshot_files(loc: Any, versions: dict[str, int | None]) -> dict[str, tuple[str, list[str]]]:
    """Per table: (table root, local paths of the live data files of the run) at `versions[table]`,
    read from the table's Delta log by deltalake (the add actions, selected by their partition value)."""
    import pyarrow as pa
    from deltalake import DeltaTable

    out = {}
    for table, version in versions.items():
        root = loc.join(table)
        delta_table = DeltaTable(root, version=version)
        adds = pa.table(delta_table.get_add_actions(flatten=True))
        paths = [os.path.join(root, unquote(path)) for path, run in zip(adds.column("path").to_pylist(),
                                                                        adds.column("partition.run_id").to_pylist())
                 if run == RUN_ID]
        out[table] = (root, sorted(paths))
    return out


# -- the answers, as comparable rows -------------------------------------------------------------------

Rows = list[tuple]


def _cell(value: Any) -> Any:
    """One value in a comparable form: numbers as Python numbers (floats as the float32 they were
    written as), lists as tuples, maps as sorted (key, value) tuples."""
    if value is None:
        return None
    if isinstance(value, dict):
        return tuple(sorted(value.items()))
    if isinstance(value, (list, tuple, np.ndarray)):
        return tuple(_cell(v) for v in value)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(np.float32(value))
    return value


HEATMAP_COLUMNS = ("step_bucket", "expert", "load")
DRIFT_COLUMNS = ("layer", "window_start", "window_end", "last_step", "steps", "tokens", "expert_load",
                 "baseline_load", "baseline_tokens")
LOOKUP_COLUMNS = ("step", "rank", "token", "sequence", "position", "token_id", "slot", "gate_weight", "kept", "tags")
COLUMNS = {"heatmap": HEATMAP_COLUMNS, "drift": DRIFT_COLUMNS, "token lookup": LOOKUP_COLUMNS}


def frame_rows(frame: Any, columns: tuple[str, ...]) -> Rows:
    """A pandas frame's `columns`, row by row, in the frame's order, as comparable tuples."""
    return [tuple(_cell(v) for v in row) for row in zip(*(frame[c].tolist() for c in columns))]


def differences(a: Rows, b: Rows, columns: tuple[str, ...]) -> str | None:
    """None when the answers are the same, else what first differs."""
    if len(a) != len(b):
        return f"{len(a)} rows against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            cells = [f"{c}: {u!r} != {v!r}" for c, u, v in zip(columns, x, y) if u != v]
            return f"row {i} differs: " + "; ".join(cells)
    return None


# -- DuckDB: the Store's queries ---------------------------------------------------------------------------

def duckdb_queries(store: Any, plan: Plan) -> dict[str, Callable[[], Rows]]:
    """The three queries through the project's `Store` (DuckDB), each returning its full answer."""
    return {
        "heatmap": lambda: frame_rows(store.load_matrix(RUN_ID, plan.layer, bucket_steps=plan.bucket_steps),
                                      HEATMAP_COLUMNS),
        "drift": lambda: frame_rows(store.drift_windows(RUN_ID, plan.window_steps), DRIFT_COLUMNS),
        "token lookup": lambda: frame_rows(store.expert_routes(RUN_ID, plan.layer, plan.expert, limit=plan.limit),
                                           LOOKUP_COLUMNS),
    }


# -- PySpark: the same definitions in Spark's API ---------------------------------------------------------

def start_spark(scratch: str, memory: str = "3g") -> Any:
    """A local-mode SparkSession on 2 cores, its scratch in `scratch`, quiet."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2]").appName("moescope-scale")
               .config("spark.driver.memory", memory).config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false").config("spark.sql.shuffle.partitions", "4")
               .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
               .config("spark.local.dir", scratch).config("spark.sql.warehouse.dir", os.path.join(scratch, "wh"))
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    return session


def spark_queries(spark: Any, files: dict[str, tuple[str, list[str]]], plan: Plan) -> dict[str, Callable[[], Rows]]:
    """The three queries in Spark's DataFrame API over one snapshot's files, each returning its full
    answer; the definitions are the Store's (store/queries.py), written again here."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    def read(table: str) -> Any:
        root, paths = files[table]
        # basePath: run_id comes back from the partition folders, as a Delta connector adds it from the log
        return spark.read.option("basePath", root).parquet(*paths).where(F.col("run_id") == RUN_ID)

    def bucket(column: str, size: int) -> Any:
        return F.floor(F.col(column) / F.lit(size)).cast("long")

    def vector(load: str = "load") -> Any:
        """An aggregate: the group's loads as a list ordered by expert."""
        return F.transform(F.sort_array(F.collect_list(F.struct("expert", load))), lambda s: s[load])

    def heatmap() -> Rows:
        b = plan.bucket_steps
        frame = (read("layer_steps").where(F.col("layer") == plan.layer)
                 .select((bucket("step", b) * b).alias("step_bucket"), F.posexplode("expert_load").alias("expert", "v"))
                 .groupBy("step_bucket", "expert").agg(F.sum("v").alias("load")).orderBy("step_bucket", "expert"))
        return [tuple(_cell(r[c]) for c in HEATMAP_COLUMNS) for r in frame.collect()]

    def drift() -> Rows:
        w = plan.window_steps
        steps = read("layer_steps")
        loads = (steps.select("layer", bucket("step", w).alias("w"), F.posexplode("expert_load").alias("expert", "v"))
                 .groupBy("layer", "w", "expert").agg(F.sum("v").alias("load"))
                 .groupBy("layer", "w").agg(vector().alias("expert_load")))
        counts = steps.groupBy("layer", bucket("step", w).alias("w")).agg(
            F.round(F.sum(F.coalesce("forwards", F.lit(1))) / F.countDistinct("rank")).cast("long").alias("steps"),
            F.sum("tokens").alias("tokens"), F.max(F.coalesce("step_end", "step")).alias("last_step"))
        windows = loads.join(counts, ["layer", "w"]).select(
            "layer", (F.col("w") * w).alias("window_start"), ((F.col("w") + 1) * w).alias("window_end"),
            "last_step", "steps", "tokens", "expert_load").cache()
        try:
            first = windows.agg(F.min("window_start")).first()[0]
            if first is None:
                return []
            base = steps.where((F.col("step") >= first) & (F.col("step") < first + w))
            base_loads = (base.select("layer", F.posexplode("expert_load").alias("expert", "v"))
                          .groupBy("layer", "expert").agg(F.sum("v").alias("load"))
                          .groupBy("layer").agg(vector().alias("baseline_load")))
            base_tokens = base.groupBy("layer").agg(F.sum("tokens").alias("baseline_tokens"))
            frame = (windows.join(base_loads.join(base_tokens, "layer"), "layer", "inner")
                     .orderBy("layer", "window_start"))
            return [tuple(_cell(r[c]) for c in DRIFT_COLUMNS) for r in frame.collect()]
        finally:
            windows.unpersist()

    def token_lookup() -> Rows:
        e = plan.expert
        # as the Store does: the layer's recorded loads give the step by which the expert had `limit`
        # tokens, and routes are read only up to there
        per_step = (read("layer_steps").where(F.col("layer") == plan.layer).groupBy("step")
                    .agg(F.sum(F.element_at("expert_load", e + 1)).alias("n")))
        reached = per_step.withColumn("reached", F.sum("n").over(Window.orderBy("step")))
        bound = reached.where(F.col("reached") >= plan.limit).orderBy("step").select("step").first()
        routes = read("routes").where(F.col("layer") == plan.layer)
        if bound is not None:
            routes = routes.where(F.col("step") < bound[0] + 1)
        at = F.array_position("expert_ids", e).cast("int")
        frame = (routes.where(at > 0).orderBy("step", "rank", "token").limit(plan.limit).select(
            "step", "rank", "token", "sequence", "position", "token_id", (at - 1).alias("slot"),
            F.element_at("gate_weights", at).alias("gate_weight"), F.element_at("kept", at).alias("kept"), "tags"))
        return [tuple(_cell(r[c]) for c in LOOKUP_COLUMNS) for r in frame.collect()]

    return {"heatmap": heatmap, "drift": drift, "token lookup": token_lookup}


# -- one size -----------------------------------------------------------------------------------------

@dataclass
class SizeFigures:
    rows: int
    written: Written
    compact_s: float = 0.0
    compacted_files: int = 0
    compacted_bytes: int = 0
    open_s: float = 0.0
    queries_ms: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # engine -> query -> times
    # CPU ms each timed run took, all of the engine's threads (Spark: its JVM): less moved by the load
    queries_cpu_ms: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    answer_rows: dict[str, int] = field(default_factory=dict)
    agreed: bool | None = None
    load: dict[str, tuple[float, ...]] = field(default_factory=dict)  # phase -> load average after it


def _load() -> tuple[float, ...]:
    return tuple(round(x, 2) for x in os.getloadavg())


def _jvm_cpu_s(spark: Any) -> float:
    """CPU seconds the Spark session's JVM (a child process of this one) has used so far."""
    pid = spark.sparkContext._gateway.proc.pid
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _timed(fn: Callable[[], Any], repeats: int, cpu: Callable[[], float]) -> tuple[list[float], list[float]]:
    """Wall and CPU milliseconds of each of `repeats` timed runs after one warm-up (as bench/store.py times)."""
    fn()  # the first run warms the footer cache, as a dashboard's would be
    wall_ms, cpu_ms = [], []
    for _ in range(repeats):
        started, cpu_started = time.perf_counter(), cpu()
        fn()
        wall_ms.append((time.perf_counter() - started) * 1000)
        cpu_ms.append((cpu() - cpu_started) * 1000)
    return wall_ms, cpu_ms


def bench_size(root: str, shape: Shape, rows: float, args: argparse.Namespace, spark: Any) -> SizeFigures:
    """Write, compact and query one store of `rows` route rows in `root` (a fresh folder)."""
    from moescope.store import Store
    from moescope.store.compact import compact
    from moescope.store.location import open_location

    loc = open_location(root)
    steps = shape.steps(rows)
    print(f"\n== {steps * shape.layers * shape.tokens:,} route rows ({steps} steps) in {root} "
          f"(load {'/'.join(map(str, _load()))})", flush=True)
    written = write_run(loc, shape, rows, progress=not args.no_progress)
    figures = SizeFigures(rows=written.rows, written=written)
    figures.load["write"] = _load()
    print(f"write: {written.rows / written.exporter_s / 1e6:.2f} M route rows/s in the exporter on one core, "
          f"{written.rows / written.loop_s / 1e6:.2f} M/s with the records generated, "
          f"{written.rows / written.cpu_s / 1e6:.2f} M per CPU-s; {written.files} route files, "
          f"{written.bytes / written.rows:.2f} bytes/route row, {written.loop_s:.0f} s "
          f"(load {'/'.join(map(str, figures.load['write']))})", flush=True)

    started = time.perf_counter()
    compact(loc, run_id=RUN_ID, retention_hours=0.0)
    figures.compact_s = time.perf_counter() - started
    figures.compacted_files, figures.compacted_bytes, after = bs._route_files(loc)
    if after != written.rows:
        raise RuntimeError(f"{after} route rows after compaction, {written.rows} before")
    figures.load["compact"] = _load()
    print(f"compaction: {figures.compact_s:.1f} s, {written.files} -> {figures.compacted_files} route files, "
          f"{figures.compacted_bytes / written.rows:.2f} bytes/route row "
          f"({figures.compacted_bytes / 1e9:.2f} GB) (load {'/'.join(map(str, figures.load['compact']))})",
          flush=True)

    plan = Plan.of(shape, steps)
    started = time.perf_counter()
    store = Store(loc)
    store.check_files()  # a reader checks a table's files when a query first reads it: all of them here, timed apart
    figures.open_s = time.perf_counter() - started
    print(f"duckdb: Store opened and every file checked in {figures.open_s:.1f} s (the logs, every file's footer "
          f"and page checksums)", flush=True)
    try:
        engines: dict[str, dict[str, Callable[[], Rows]]] = {}
        if "duckdb" in args.engines:
            engines["duckdb"] = duckdb_queries(store, plan)
        if "spark" in args.engines:
            # the versions DuckDB read, their file lists from the Delta log: the same snapshot
            files = snapshot_files(loc, {t: store.versions[t] for t in TABLES})
            for table in TABLES:
                pinned = sorted(os.path.realpath(info.path) for info in store.files[table] if info.run_id == RUN_ID)
                if pinned != sorted(os.path.realpath(p) for p in files[table][1]):
                    raise RuntimeError(f"{table}: the Delta log's files at v{store.versions[table]} are not the "
                                       f"Store's")
            engines["spark"] = spark_queries(spark, files, plan)
        answers: dict[str, dict[str, Rows]] = {}
        for engine, queries in engines.items():
            answers[engine] = {}
            figures.queries_ms[engine] = {}
            figures.queries_cpu_ms[engine] = {}
            cpu = time.process_time if engine == "duckdb" else (lambda: _jvm_cpu_s(spark) + time.process_time())
            for name, query in queries.items():
                answers[engine][name] = query()
                times, cpu_ms = _timed(query, args.repeats, cpu)
                figures.queries_ms[engine][name] = times
                figures.queries_cpu_ms[engine][name] = cpu_ms
                figures.answer_rows[name] = len(answers[engine][name])
                print(f"{engine:<7} {name:<13} p50 {bs._spread(times, '{:.1f}')} ms "
                      f"({len(answers[engine][name])} rows; CPU {statistics.median(cpu_ms):.0f} ms)", flush=True)
            figures.load[engine] = _load()
        if len(answers) == 2:
            for name, columns in COLUMNS.items():
                problem = differences(answers["duckdb"][name], answers["spark"][name], columns)
                if problem:
                    raise RuntimeError(f"{name}: DuckDB and Spark answer differently: {problem}")
            figures.agreed = True
            print("duckdb and spark give the same full answer to each query", flush=True)
    finally:
        store.close()
    return figures


# -- the table ----------------------------------------------------------------------------------------

def _table(results: list[SizeFigures]) -> str:
    head = [f"{r.rows / 1e9:.2f} B" if r.rows >= 1e9 else f"{r.rows / 1e6:,.0f} M" if r.rows >= 1e6
            else f"{r.rows / 1e3:,.0f} K" for r in results]
    lines = []

    def row(name: str, values: list[float | None], fmt: str, grow: bool = True) -> None:
        cells = [fmt.format(v) if v is not None else "-" for v in values]
        ratios = ""
        if grow and values[0] and len(values) > 1:
            ratios = "  " + ", ".join(f"{v / values[0]:.2f}x" if v is not None else "-" for v in values[1:])
        lines.append(f"{name:<34}" + "".join(f"{c:>14}" for c in cells) + ratios)

    lines.append(f"{'route rows':<34}" + "".join(f"{h:>14}" for h in head)
                 + (f"  growth vs {head[0]}" if len(results) > 1 else ""))
    row("rows", [float(r.rows) for r in results], "{:,.0f}")
    row("route files written", [float(r.written.files) for r in results], "{:,.0f}")
    row("route files compacted", [float(r.compacted_files) for r in results], "{:,.0f}")
    row("bytes/route row written", [r.written.bytes / r.rows for r in results], "{:.2f}")
    row("bytes/route row compacted", [r.compacted_bytes / r.rows for r in results], "{:.2f}")
    row("write M rows/s (exporter)", [r.rows / r.written.exporter_s / 1e6 for r in results], "{:.2f}")
    row("write M rows/s (with generation)", [r.rows / r.written.loop_s / 1e6 for r in results], "{:.2f}")
    row("write s", [r.written.loop_s for r in results], "{:.0f}")
    row("compaction s", [r.compact_s for r in results], "{:.1f}")
    row("Store open + every file checked s", [r.open_s for r in results], "{:.2f}")
    for engine in ENGINES:
        for name in COLUMNS:
            values = [statistics.median(r.queries_ms[engine][name]) if engine in r.queries_ms else None
                      for r in results]
            if any(v is not None for v in values):
                row(f"{engine} {name} p50 ms", values, "{:.1f}")
                row(f"{engine} {name} CPU ms", [statistics.median(r.queries_cpu_ms[engine][name])
                                                if engine in r.queries_cpu_ms else None for r in results], "{:.0f}")
    lines.append(f"{'answers agree (duckdb = spark)':<34}"
                 + "".join(f"{('yes' if r.agreed else '-' if r.agreed is None else 'NO'):>14}" for r in results))
    lines.append(f"{'load average after queries':<34}"
                 + "".join(f"{'/'.join(f'{x:.0f}' for x in list(r.load.values())[-1]):>14}" for r in results))
    return "\n".join(lines)


def _sizes(text: str) -> list[float]:
    try:
        sizes = sorted(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rows takes numbers separated by commas (50e6,200e6,1e9), not {text!r}")
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"--rows needs at least one size of 1 row or more, not {text!r}")
    return sizes


def _engines(text: str) -> list[str]:
    engines = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        raise argparse.ArgumentTypeError(f"--engines takes {' and/or '.join(ENGINES)} separated by commas, "
                                         f"not {text!r}")
    return engines


def main(argv: list[str] | None = None) -> list[SizeFigures]:
    """Run the benchmark; returns each size's figures (those reached)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=_sizes, default=_sizes("50e6,200e6,1e9"),
                        help="route rows per store, comma-separated, run smallest first (default 50e6,200e6,1e9)")
    parser.add_argument("--engines", type=_engines, default=list(ENGINES),
                        help="duckdb, spark or both, comma-separated (default duckdb,spark)")
    parser.add_argument("--root", help="folder to write the stores in (default: a temporary folder)")
    parser.add_argument("--layers", type=int, default=Shape.layers)
    parser.add_argument("--experts", type=int, default=Shape.experts)
    parser.add_argument("--top-k", type=int, default=Shape.top_k)
    parser.add_argument("--tokens", type=int, default=Shape.tokens, help="tokens per step and layer")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per query after one warm-up (default 7)")
    parser.add_argument("--spark-memory", default="3g", help="the Spark driver's memory (default 3g)")
    parser.add_argument("--keep", action="store_true", help="keep the stores written")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.repeats < 1 or min(args.layers, args.experts, args.top_k, args.tokens) < 1:
        parser.error("--repeats, --layers, --experts, --top-k and --tokens must be at least 1")
    if args.top_k > args.experts:
        parser.error(f"--top-k ({args.top_k}) cannot exceed --experts ({args.experts})")
    shape = Shape(args.layers, args.experts, args.top_k, args.tokens)
    root = args.root or tempfile.mkdtemp(prefix="moescope-scale-")
    os.makedirs(root, exist_ok=True)
    print(f"scale benchmark: {', '.join(f'{r:,.0f}' for r in args.rows)} route rows; {shape.layers} layers x "
          f"{shape.tokens} tokens per step, {shape.experts} experts, top-{shape.top_k}; engines "
          f"{', '.join(args.engines)}; {os.cpu_count()} CPUs; free disk {shutil.disk_usage(root).free / 1e9:.0f} GB; "
          f"load {'/'.join(map(str, _load()))}", flush=True)

    spark = None
    results: list[SizeFigures] = []
    try:
        if "spark" in args.engines:
            spark = start_spark(os.path.join(root, "spark-scratch"), args.spark_memory)
        for i, rows in enumerate(args.rows):
            folder = os.path.join(root, f"store-{i}-{int(rows)}")
            shutil.rmtree(folder, ignore_errors=True)
            try:
                results.append(bench_size(folder, shape, rows, args, spark))
            finally:
                if not args.keep:
                    shutil.rmtree(folder, ignore_errors=True)
            print("\n" + _table(results), flush=True)
            if args.json:
                _write_json(args.json, results)
    finally:
        if spark is not None:
            spark.stop()
        if not args.keep:
            shutil.rmtree(os.path.join(root, "spark-scratch"), ignore_errors=True)
            if not args.root:
                shutil.rmtree(root, ignore_errors=True)
    return results


def _write_json(path: str, results: list[SizeFigures]) -> None:
    import dataclasses
    import json

    with open(path, "w") as f:
        json.dump([dataclasses.asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main()
