"""Distributed engines read the store's Delta tables and give the Store's answers.

A run of at least 5 M route rows (tests/support/engines_data.py) is written through the store's own
writer twice: to a local folder and to moto's S3 server. Then:

- Dask distributed (a LocalCluster with 2 worker processes) reads the S3 store: the file list of one
  Delta snapshot (deltalake's add actions, selected by their `run_id` partition value), the files
  themselves through s3fs, credentials from the environment as a fleet's processes get them;
- PySpark in local mode reads the local store: the same kind of file list, `basePath` at the table
  root so `run_id` comes back from the partition folders.

Each computes, in its own API, the definitions the Store documents (docs/measuring.md "What the numbers mean",
`store/queries.py`, `store/reports.py`): per-layer expert load (kept slots per layer and expert, from
`routes`), tokens and dropped tokens per layer (tokens whose every slot was dropped, from `routes`),
token-weighted router entropy per layer and overall (from `layer_steps`), the token-weighted
active-parameter fraction (from `steps`) and the drop rate (dropped tokens / layer-tokens). Each is
compared with the Store's typed queries (`layer_totals`, `expert_share`, `step_totals`, through
`alerts.signals` as `moescope summary` shows them), with the other engine, and with the answers numpy
computed from the generated arrays before anything was written. Then a compaction runs in another
process while the engine queries snapshots taken before, during and after its commit: every answer is
the same.

No connector jar is needed (none can be downloaded here): a snapshot's file list is what the Delta
connectors of Spark and Trino compute themselves from `_delta_log/`.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tests.support.engines_data import (
    EXPERTS,
    LAYERS,
    OTHER_RUN,
    ROUTE_ROWS,
    RUN,
    Answers,
    WrittenRun,
    assert_same,
    write_run,
)
from tests.support.fixtures.s3 import require_module
from tests.support.paths import REPO
from tests.support.realparts import require_program

pytestmark = [pytest.mark.slow, pytest.mark.integration]

TIMES: dict[str, float] = {}  # measured seconds, printed at the end of the module (pytest -s)


@pytest.fixture(scope="module", autouse=True)
def _report_times():
    yield
    if TIMES:
        print("\nengine test timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in TIMES.items()))


# -- the stores --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3_credentials(s3_server):
    """The server's credentials in os.environ for the module: Dask's workers inherit them, as a fleet's
    processes take theirs from the environment."""
    from tests.support.s3server import CLEARED_ENV

    with pytest.MonkeyPatch.context() as mp:
        for key in CLEARED_ENV:
            mp.delenv(key, raising=False)
        for key, value in s3_server.environment().items():
            mp.setenv(key, value)
        yield s3_server


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> tuple[object, WrittenRun]:
    from moescope.store.location import open_location

    location = open_location(tmp_path_factory.mktemp("engines") / "store")
    written = write_run(location)
    TIMES["local write (generate + write)"] = written.generate_s + written.write_s
    return location, written


@pytest.fixture(scope="module")
def s3_run(s3_credentials) -> tuple[object, WrittenRun]:
    prefix = s3_credentials.fresh_prefix("engines")
    location = s3_credentials.location(prefix)
    try:
        written = write_run(location)
        TIMES["s3 write (generate + write)"] = written.generate_s + written.write_s
        yield location, written
    finally:
        if s3_credentials.running:
            s3_credentials.delete_prefix(prefix + "/")


# -- a snapshot's files, as a Delta connector finds them ---------------------------------------------

def snapshot_files(location, table: str, run_id: str = RUN, version: int | None = None) -> tuple[int, str, list[str]]:
    """(version, table root URI, URIs of the live data files of `run_id`) of one Delta snapshot of
    `table`: deltalake's add actions, selected by their partition value (what the log says, not what
    the folder names say)."""
    from deltalake import DeltaTable

    table_uri = location.table_uri(table)
    delta_table = DeltaTable(table_uri, version=version, storage_options=location.storage_options or None)
    adds = pa.table(delta_table.get_add_actions(flatten=True))
    root = delta_table.table_uri.rstrip("/")
    files = [f"{root}/{unquote(path)}" for path, run in zip(adds.column("path").to_pylist(),
                                                           adds.column("partition.run_id").to_pylist())
             if run == run_id]
    return delta_table.version(), root, files


# -- the Store's answers ------------------------------------------------------------------------------

def store_answers(location) -> Answers:
    """The answers as moescope gives them: Store's typed queries, aggregated by alerts.signals (as
    `moescope summary` and the dashboard show them)."""
    from moescope.metrics import signals
    from moescope.store import Store

    with Store(location) as store:
        totals = store.layer_totals(RUN)
        share = store.expert_share(RUN)
        active = store.step_totals(RUN)["active_fraction"]
    layers = signals.layer_figures_of(totals.itertuples())
    run = signals.run_figures(layers)
    loads = np.zeros((LAYERS, EXPERTS), dtype=np.int64)
    loads[share.layer.to_numpy(), share.expert.to_numpy()] = share.load.to_numpy()
    return Answers(loads=loads, layer_tokens=np.array([f.tokens for f in layers]),
                   layer_dropped=np.array([f.dropped_tokens for f in layers]),
                   layer_entropy=np.array([f.entropy.nats for f in layers]), entropy=run.entropy.nats,
                   active_fraction=float(active), drop_rate=run.dropped_token_rate)


def _answers(loads: dict[tuple[int, int], int], per_layer: dict[int, tuple[int, int]],
             entropy: dict[int, tuple[float, float]], active: tuple[float, float]) -> Answers:
    """Answers from an engine's aggregates: loads[(layer, expert)] = slots, per_layer[layer] = (tokens,
    dropped tokens), entropy[layer] = (sum of entropy x tokens, tokens where entropy was recorded),
    active = (sum of fraction x tokens, tokens where the fraction was recorded)."""
    grid = np.zeros((LAYERS, EXPERTS), dtype=np.int64)
    for (layer, expert), n in loads.items():
        grid[int(layer), int(expert)] = int(n)
    layers = sorted(per_layer)
    tokens = np.array([per_layer[layer][0] for layer in layers], dtype=np.int64)
    dropped = np.array([per_layer[layer][1] for layer in layers], dtype=np.int64)
    weighted = np.array([entropy[layer][0] for layer in layers])
    weights = np.array([entropy[layer][1] for layer in layers], dtype=np.float64)
    return Answers(loads=grid, layer_tokens=tokens, layer_dropped=dropped, layer_entropy=weighted / weights,
                   entropy=float(weighted.sum() / weights.sum()), active_fraction=active[0] / active[1],
                   drop_rate=float(dropped.sum() / tokens.sum()))


# -- Dask distributed, from S3 through s3fs -----------------------------------------------------------

def no_slot_kept(kept):
    """Per routes row (a partition's `kept` lists): True where no slot was kept (the token was dropped)."""
    import pandas as pd

    lists = pa.array(kept)
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks()
    flat = lists.flatten().to_numpy(zero_copy_only=False)
    rows = pc.list_parent_indices(lists).to_numpy()
    kept_slots = np.bincount(rows[flat], minlength=len(lists))
    return pd.Series(kept_slots == 0, index=kept.index, name="dropped")


@pytest.fixture(scope="module")
def dask_client(s3_credentials):
    require_module("distributed", package="distributed")
    require_module("s3fs", package="s3fs")
    from distributed import Client, LocalCluster

    started = time.perf_counter()
    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=":0",
                      memory_limit="3GiB") as cluster, Client(cluster) as client:
        TIMES["dask cluster start"] = time.perf_counter() - started
        yield client


def dask_answers(client, location, fsspec_options: dict, version: dict[str, int] | None = None) -> Answers:
    """The answers computed by Dask on the cluster, reading one snapshot per table (the latest, or
    `version[table]`)."""
    import dask.dataframe as dd

    def read(table: str, columns: list[str]):
        _, _, files = snapshot_files(location, table, version=(version or {}).get(table))
        return dd.read_parquet(files, columns=columns, storage_options=fsspec_options, dtype_backend="pyarrow")

    routes = read("routes", ["layer", "expert_ids", "kept"])
    slots = routes.explode(["expert_ids", "kept"])
    loads = slots[slots.kept].groupby(["layer", "expert_ids"]).size()
    routes = routes.assign(dropped=routes.kept.map_partitions(no_slot_kept, meta=("dropped", "bool")))
    per_layer = routes.groupby("layer").dropped.agg(["count", "sum"])
    layer_steps = read("layer_steps", ["layer", "tokens", "router_entropy_mean"])
    recorded = layer_steps.router_entropy_mean.notnull()
    entropy = layer_steps.assign(weighted=layer_steps.router_entropy_mean * layer_steps.tokens,
                                 weight=layer_steps.tokens.where(recorded, 0)
                                 ).groupby("layer")[["weighted", "weight"]].sum()
    steps = read("steps", ["tokens", "active_param_fraction"])
    recorded = steps.active_param_fraction.notnull()
    active_sum = (steps.active_param_fraction * steps.tokens).sum()
    active_weight = steps.tokens.where(recorded, 0).sum()
    loads, per_layer, entropy, active_sum, active_weight = client.gather(client.compute(
        [loads, per_layer, entropy, active_sum, active_weight]))
    return _answers(loads.to_dict(), {int(k): (int(v["count"]), int(v["sum"])) for k, v in per_layer.iterrows()},
                    {int(k): (float(v.weighted), float(v.weight)) for k, v in entropy.iterrows()},
                    (float(active_sum), float(active_weight)))


# -- PySpark local mode, from the local folder ---------------------------------------------------------

@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    require_program("java", "/usr/bin/java", package="default-jre-headless")  # as the `java` fixture
    require_module("pyspark", package="pyspark")
    from pyspark.sql import SparkSession

    scratch = tmp_path_factory.mktemp("spark")
    started = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPARK_LOCAL_IP", "127.0.0.1")
        session = (SparkSession.builder.master("local[2]").appName("moescope-engines")
                   .config("spark.driver.memory", "2g").config("spark.ui.enabled", "false")
                   .config("spark.ui.showConsoleProgress", "false").config("spark.sql.shuffle.partitions", "4")
                   .config("spark.local.dir", str(scratch)).config("spark.sql.warehouse.dir", str(scratch / "wh"))
                   .getOrCreate())
        session.sparkContext.setLogLevel("ERROR")
        TIMES["spark session start"] = time.perf_counter() - started
        try:
            yield session
        finally:
            session.stop()


def spark_answers(spark, location, version: dict[str, int] | None = None) -> Answers:
    """The answers computed by Spark, reading one snapshot per table (the latest, or `version[table]`)."""
    from pyspark.sql import functions as F

    def read(table: str):
        _, root, files = snapshot_files(location, table, version=(version or {}).get(table))
        # basePath: run_id comes back from the partition folders, as the Delta connector adds it from the log
        return spark.read.option("basePath", root).parquet(*files).where(F.col("run_id") == RUN)

    routes = read("routes")
    loads = (routes.select("layer", F.explode(F.arrays_zip("expert_ids", "kept")).alias("slot"))
             .where(F.col("slot.kept")).groupBy("layer", F.col("slot.expert_ids").alias("expert")).count().collect())
    per_layer = routes.groupBy("layer").agg(
        F.count(F.lit(1)).alias("tokens"),
        F.sum(F.when(F.exists("kept", lambda k: k), 0).otherwise(1)).alias("dropped")).collect()
    entropy = read("layer_steps").groupBy("layer").agg(
        F.sum(F.col("router_entropy_mean") * F.col("tokens")).alias("weighted"),
        F.sum(F.when(F.col("router_entropy_mean").isNotNull(), F.col("tokens"))).alias("weight")).collect()
    active = read("steps").agg(
        F.sum(F.col("active_param_fraction") * F.col("tokens")).alias("weighted"),
        F.sum(F.when(F.col("active_param_fraction").isNotNull(), F.col("tokens"))).alias("weight")).collect()[0]
    return _answers({(r.layer, r.expert): r["count"] for r in loads},
                    {r.layer: (r.tokens, r.dropped) for r in per_layer},
                    {r.layer: (r.weighted, r.weight) for r in entropy}, (active.weighted, active.weight))


# -- the tests ---------------------------------------------------------------------------------------------

def test_the_run_has_5m_route_rows_in_a_few_large_committed_parts(local_run, s3_run):
    for location, written in (local_run, s3_run):
        assert written.route_rows >= ROUTE_ROWS
        _, _, files = snapshot_files(location, "routes")
        _, _, other = snapshot_files(location, "routes", run_id=OTHER_RUN)
        assert 4 <= len(files) <= 16 and other, "a few large route parts per rank, and the other run's"
        # every route row is in the snapshot's files, once: their footers, read through the storage
        filesystem = location.filesystem()
        rows = 0
        for uri in files:
            path = uri.removeprefix("file://") if location.is_local else uri.removeprefix("s3://")
            with filesystem.open_input_file(path) as f:
                rows += pq.ParquetFile(f).metadata.num_rows
        assert rows == written.route_rows


@pytest.fixture(scope="module")
def store_local(local_run) -> Answers:
    started = time.perf_counter()
    answers = store_answers(local_run[0])
    TIMES["Store queries (local)"] = time.perf_counter() - started
    return answers


@pytest.fixture(scope="module")
def store_s3(s3_run) -> Answers:
    started = time.perf_counter()
    answers = store_answers(s3_run[0])
    TIMES["Store queries (s3)"] = time.perf_counter() - started
    return answers


def test_the_store_gives_the_generated_answers(local_run, s3_run, store_local, store_s3):
    # the reference the engines are held to is right: numpy over the generated arrays says the same
    assert_same(store_local, local_run[1].truth, "Store (local folder)")
    assert_same(store_s3, s3_run[1].truth, "Store (S3)")


@pytest.fixture(scope="module")
def dask_s3(dask_client, s3_run, s3_credentials) -> Answers:
    started = time.perf_counter()
    answers = dask_answers(dask_client, s3_run[0], s3_credentials.s3fs_options())
    TIMES["dask queries (s3)"] = time.perf_counter() - started
    return answers


@pytest.fixture(scope="module")
def spark_local(spark, local_run) -> Answers:
    started = time.perf_counter()
    answers = spark_answers(spark, local_run[0])
    TIMES["spark queries (local)"] = time.perf_counter() - started
    return answers


def test_dask_reads_the_s3_snapshot_with_the_stores_answers(dask_s3, store_s3, s3_run):
    assert_same(dask_s3, store_s3, "Dask (S3) vs the Store")
    assert_same(dask_s3, s3_run[1].truth, "Dask (S3) vs the generated run")


def test_spark_reads_the_local_snapshot_with_the_stores_answers(spark_local, store_local, local_run):
    assert_same(spark_local, store_local, "Spark (local) vs the Store")
    assert_same(spark_local, local_run[1].truth, "Spark (local) vs the generated run")


def test_the_engines_agree_with_each_other(dask_s3, spark_local):
    assert_same(dask_s3, spark_local, "Dask (S3) vs Spark (local)")


# -- while a compaction commits ----------------------------------------------------------------------------

class Compaction:
    """`moescope compact STORE --run RUN` in its own process (credentials from the environment, as
    every process of a fleet gets them), its output in a file, its end time stamped by a thread."""

    def __init__(self, location, scratch):
        options = [f"--storage-option={k}={v}" for k, v in (location.storage_options or {}).items()]
        self.output = open(scratch / "compact.log", "w+")
        self.started = time.perf_counter()
        self.ended: float | None = None
        self.proc = subprocess.Popen([sys.executable, "-m", "moescope.cli", "compact", location.url, "--run", RUN,
                                      *options], cwd=REPO, stdout=self.output, stderr=subprocess.STDOUT, text=True)
        self._waiter = threading.Thread(target=self._wait, daemon=True)
        self._waiter.start()

    def _wait(self) -> None:
        self.proc.wait()
        self.ended = time.perf_counter()

    def finish(self, timeout_s: float = 300) -> str:
        """Wait for the compaction (killing it after `timeout_s`); returns its output."""
        try:
            self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=30)
            self._waiter.join(timeout=30)
            self.output.seek(0)
            text = self.output.read()
            self.output.close()
        return text


def query_during_compaction(location, answer, want: Answers, who: str, scratch) -> None:
    """Pin a snapshot of each table, start a compaction of the run in another process, query while
    it runs (the pinned snapshot first, then the latest), then query the pinned snapshot again (its
    files replaced by the commit, not yet vacuumed) and the latest: every answer is `want`, and the
    compaction did merge the run's route files."""
    tables = ("routes", "layer_steps", "steps")
    before = {t: snapshot_files(location, t)[0] for t in tables}
    files_before = len(snapshot_files(location, "routes")[2])
    compaction = Compaction(location, scratch)
    during = []  # routes version each query read while the compaction ran
    try:
        version = before
        while compaction.ended is None:
            assert_same(answer(version), want, f"{who} on routes v{version['routes']} during the compaction")
            during.append(version["routes"])
            version = {t: snapshot_files(location, t)[0] for t in tables}  # the latest, pinned for the next query
    finally:
        output = compaction.finish()
    assert compaction.proc.returncode == 0, f"moescope compact failed: {output}"
    TIMES[f"{who}: compaction"] = compaction.ended - compaction.started
    after, _, files_after = snapshot_files(location, "routes")
    assert after > before["routes"] and len(files_after) < files_before, \
        f"the compaction merged nothing: {files_before} -> {len(files_after)} route files ({output.strip()})"
    assert during[0] == before["routes"], "the first query ran on the pinned snapshot, while the compaction ran"
    started = time.perf_counter()
    assert_same(answer(before), want, f"{who} on the snapshot pinned before the compaction, read after its commit")
    assert_same(answer(None), want, f"{who} on routes v{after}, after the compaction")
    TIMES[f"{who}: queries while it ran"] = len(during)
    TIMES[f"{who}: a query after it"] = (time.perf_counter() - started) / 2


def test_dask_answers_while_a_compaction_commits(dask_client, s3_run, s3_credentials, store_s3, tmp_path):
    location = s3_run[0]
    fsspec_options = s3_credentials.s3fs_options()
    query_during_compaction(location, lambda version: dask_answers(dask_client, location, fsspec_options, version),
                            store_s3, "dask (s3)", tmp_path)


def test_spark_answers_while_a_compaction_commits(spark, local_run, store_local, tmp_path):
    location = local_run[0]
    query_during_compaction(location, lambda version: spark_answers(spark, location, version), store_local,
                            "spark (local)", tmp_path)
