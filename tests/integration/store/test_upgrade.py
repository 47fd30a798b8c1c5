"""A store of the previous release (Parquet folders, compaction footers, no Delta log), built here with
pyarrow exactly as that release's writer and compaction wrote it (git show 53d5a2d:store/writer.py and
store/compact.py): refused by every reader and writer without a byte changed, then converted in place by
`moescope store upgrade` into Delta tables whose every query answers as a brute-force read of the old
files did (the old readers' rule: footers that read, pages that pass their checksums, less the files a
good merged file replaces); an upgrade interrupted before or after its commit finishes when run again."""

from __future__ import annotations

import collections
import datetime as dt
import hashlib
import json
import os
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moescope.store import LegacyStoreError, Store
from moescope.store import upgrade as upgrading
from moescope.store.compact import SORT_KEYS, compact, prune
from moescope.store.exporter import DeltaExporter
from moescope.store.location import open_location
from moescope.store.naming import parquet_options
from moescope.store.schema import SCHEMAS, probe_stats_table, run_tables, step_tables
from moescope.store.upgrade import upgrade
from tests.support.deltafiles import parts, read_part
from tests.support.store_records import make_record, run_info

TABLES = ("runs", "layers", "steps", "layer_steps", "routes", "probe_stats", "run_ends")


class OldWriter:
    """The previous release's file writer: run_id inside the file and in the folder, a temporary name
    renamed into place, part-<rank>-<pid>-<seq>-<ns>.parquet, 128 Ki-row row groups, page checksums."""

    def __init__(self, root: Path):
        self.root = root
        self.seq = 0
        self.files: dict[str, list[Path]] = collections.defaultdict(list)  # "table/run" -> files, in order

    def write(self, table: str, run_id: str, data: pa.Table, rank: int = 0, name: str | None = None,
              metadata: dict[bytes, bytes] | None = None) -> Path:
        if "host" in data.column_names:  # the previous release's schema had no host column
            data = data.drop_columns(["host"])
        self.seq += 1
        ns = (1700000000 * 10**9 + self.seq) % 10**12
        name = name or f"part-{rank:05d}-{4242 + rank}-{self.seq:06d}-{ns:012d}.parquet"
        folder = self.root / table / f"run_id={run_id}"
        folder.mkdir(parents=True, exist_ok=True)
        if metadata:
            data = data.replace_schema_metadata({**(data.schema.metadata or {}), **metadata})
        tmp = folder / f".tmp-{name}.inprogress"
        pq.write_table(data, tmp, row_group_size=128 * 1024, **parquet_options(data.column_names))
        os.replace(tmp, folder / name)
        self.files[f"{table}/{run_id}"].append(folder / name)
        return folder / name

    def compact(self, table: str, run_id: str, sources: list[Path]) -> Path:
        """The previous release's merge: sorted rows of `sources` in one part-compacted-<ns>-<uuid> file
        whose footer names them (`moescope.replaces`), 256 Ki-row row groups, page checksums."""
        data = pa.concat_tables([pq.read_table(p) for p in sources])
        keys = [k.strip() for k in SORT_KEYS[table].split(",")]
        data = data.sort_by([(k, "ascending") for k in keys])
        name = f"part-compacted-{1700000000 * 10**9 + self.seq}-{uuid.uuid4().hex[:8]}.parquet"
        replaces = {b"moescope.replaces": json.dumps(sorted(p.name for p in sources)).encode()}
        folder = self.root / table / f"run_id={run_id}"
        merged = data.replace_schema_metadata({**(data.schema.metadata or {}), **replaces})
        pq.write_table(merged, folder / name, row_group_size=256 * 1024, **parquet_options(merged.column_names))
        return folder / name


def _flip_a_page_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little") + 8
    data[(len(data) - footer) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def build_old_store(root: Path) -> dict:
    """Two runs of the previous release with everything its folders could hold; returns what was done."""
    writer = OldWriter(root)
    rng = np.random.default_rng(0)
    for run_id, ranks in (("a", (0, 1)), ("b", (0,))):
        for rank in ranks:
            run = run_info(run_id, rank=rank, world_size=len(ranks))
            for table, rows in run_tables(run).items():  # runs, then layers
                writer.write(table, run_id, rows, rank)
            for flush in range(4):  # a flush every 2 steps: one file per table
                records = [make_record(run_id, 2 * flush + i, rng, tags={"split": "eval" if flush % 2 else "train"})
                           for i in range(2)]
                for table in ("steps", "layer_steps", "routes"):
                    writer.write(table, run_id, pa.concat_tables([step_tables(r, rank)[table] for r in records]),
                                 rank)
            written = collections.Counter({"steps": 8, "layer_steps": 24, "routes": 8 * 48})
            writer.write("probe_stats", run_id, probe_stats_table(run_id, rank, 4242 + rank, dt.datetime(
                2024, 1, 1, tzinfo=dt.timezone.utc), written, {("routes", "queue_full"): 7}, {}), rank)
            writer.write("run_ends", run_id, pa.Table.from_pylist([dict(
                run_id=run_id, rank=rank, pid=4242 + rank, ended_at=dt.datetime(2024, 1, 1, 1, tzinfo=dt.timezone.utc),
                last_step=7)], schema=SCHEMAS["run_ends"]), rank)
    # run a: a compaction that published its merged file and deleted half its sources (a crash mid-deletion)
    sources = writer.files["routes/a"][:4]
    writer.compact("routes", "a", sources)
    for path in sources[:2]:
        path.unlink()
    # run b: a merged file damaged after it was written (its sources, still there, are what readers read)
    bad_merge = writer.compact("routes", "b", writer.files["routes/b"][:3])
    _flip_a_page_bit(bad_merge)
    # run b: a file whose footer was cut short; a file naming a file outside its folder
    truncated = writer.files["layer_steps/b"][1]
    truncated.write_bytes(truncated.read_bytes()[:-100])
    hostile = writer.write("steps", "b", pa.table({"run_id": ["b"], "step": pa.array([99], pa.int64())}),
                           name="part-compacted-1-hostile.parquet",
                           metadata={b"moescope.replaces": json.dumps(["../../../precious.parquet"]).encode()})
    (root.parent / "precious.parquet").write_text("not the store's")
    # writes in flight, the previous quarantine, compaction locks, a prune's trash
    (root / "routes" / "run_id=a" / ".tmp-part-00000-1-000099-000000000099.parquet.inprogress").write_bytes(b"PAR1")
    old_bad = root / "_quarantine" / "steps" / "run_id=a" / "part-00000-1-000001-000000000001.parquet"
    old_bad.parent.mkdir(parents=True)
    old_bad.write_bytes(b"garbage")
    (old_bad.parent / (old_bad.name + ".reason.json")).write_text(json.dumps({"reason": "unreadable footer"}))
    (root / "_locks").mkdir()
    (root / "_locks" / "compact-routes-a.lock").write_text("")
    (root / "_trash" / "0123" / "steps").mkdir(parents=True)
    return {"bad_merge": bad_merge, "bad_merge_rows": pq.read_metadata(bad_merge).num_rows, "truncated": truncated,
            "hostile": hostile}


def old_reader(root: Path) -> dict[str, pa.Table]:
    """What the previous release's readers read, by brute force: per run folder, every part-*.parquet
    whose footer reads (with a `moescope.replaces` naming only files of its folder) and whose pages pass
    their checksums, less the files such a good file replaces."""
    out = {}
    for table in TABLES:
        pieces = []
        for folder in sorted((root / table).glob("run_id=*")):
            good = {}
            for path in sorted(folder.glob("part-*.parquet")):
                try:
                    meta = pq.read_metadata(path)
                    names = json.loads((meta.metadata or {}).get(b"moescope.replaces", b"[]"))
                    assert all("/" not in n for n in names)
                    data = pq.ParquetFile(path, page_checksum_verification=True).read()
                except Exception:
                    continue
                good[path.name] = (data, names)
            replaced = {n for _, names in good.values() for n in names}
            pieces += [data for name, (data, _) in good.items() if name not in replaced]
        out[table] = pa.concat_tables(pieces, promote_options="permissive")
    return out


def _cell(value):
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, dict):
        return tuple(sorted(value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_cell(v) for v in value)
    if value is None or (not isinstance(value, (str, bytes)) and pd.isna(value)):
        return None
    if isinstance(value, pd.Timestamp):
        return value.to_pydatetime()
    if hasattr(value, "item"):
        return value.item()
    return value


def rows(frame: pd.DataFrame, columns: list[str]) -> collections.Counter:
    return collections.Counter(tuple(_cell(row[c]) for c in columns) for row in frame[columns].to_dict("records"))


def _all(store: Store, table: str) -> pd.DataFrame:
    """A table's rows; probe_stats without the upgrade's own count of rows in bad files (checked apart)."""
    where = " WHERE reason IS DISTINCT FROM 'quarantined'" if table == "probe_stats" else ""
    return store.sql(f"SELECT * FROM {table}{where}")


def files_on_disk(root: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def old_store(tmp_path) -> tuple[Path, dict]:
    root = tmp_path / "store"
    return root, build_old_store(root)


def test_nothing_is_rewritten_without_the_command(old_store):
    root, _ = old_store
    before = files_on_disk(root)
    for attempt in (lambda: Store(root), lambda: compact(root), lambda: prune(root, 0),
                    lambda: DeltaExporter(root, run_info("c"))):
        with pytest.raises(LegacyStoreError, match=f"moescope store upgrade {root}"):
            attempt()
    assert files_on_disk(root) == before
    assert not list(root.rglob("_delta_log"))


def test_upgrade_answers_every_query_as_the_previous_readers_did(old_store):
    root, made = old_store
    want = old_reader(root)
    report = upgrade(root)

    store = Store(root)
    for table in TABLES:
        columns = [c for c in want[table].column_names if c != "host"]
        assert rows(_all(store, table), columns) == rows(want[table].to_pandas(), columns), table
    # the merged file of run a counts once (its sources left out), run b's damaged merge not at all
    routes = store.sql("SELECT run_id, count(*) AS n, count(DISTINCT (rank, step, layer, token)) AS d "
                       "FROM routes GROUP BY run_id ORDER BY run_id")
    assert routes.values.tolist() == [["a", 2 * 8 * 48, 2 * 8 * 48], ["b", 8 * 48, 8 * 48]]
    layer_rows = store.sql("SELECT run_id, layer, sum(tokens) AS t FROM layer_steps GROUP BY ALL ORDER BY ALL")
    brute = want["layer_steps"].group_by(["run_id", "layer"]).aggregate([("tokens", "sum")]).to_pandas()
    assert sorted(map(tuple, layer_rows.values.tolist())) == sorted(
        (r.run_id, r.layer, r.tokens_sum) for r in brute.itertuples())
    stats = store.probe_stats("b")
    quarantined = stats[stats.reason == "quarantined"]
    assert quarantined[["table_name", "dropped_rows"]].values.tolist() == [["routes", made["bad_merge_rows"]]]
    assert int(stats[stats.reason == "queue_full"].dropped_rows.sum()) == 7

    # every table is a Delta table of files without run_id inside; nothing of the old layout is left
    location = open_location(root)
    for table in TABLES:
        for part in parts(location, table):
            assert part.path.endswith("-delta.parquet") or "/part-quarantine-" in part.path  # the count
            assert "run_id" not in pq.read_schema(root / table / part.path).names
            read_part(location, table, part)  # page checksums verified
    live = {str(root / table / p.path) for table in TABLES for p in parts(location, table)}
    assert not [p for p in root.rglob("*.parquet") if "_delta_log" not in str(p) and "_quarantine" not in str(p)
                and "_previous-release" not in str(p) and str(p) not in live]
    assert not list(root.rglob(".tmp-*")) and not (root / "_locks").exists() and not (root / "_trash").exists()
    assert (root.parent / "precious.parquet").read_text() == "not the store's"
    moved = {q.original_path: q.reason for q in store.quarantined()}
    assert set(moved) == {str(made["bad_merge"]), str(made["truncated"]), str(made["hostile"])}
    assert moved[str(made["truncated"])].startswith("unreadable footer")
    assert moved[str(made["bad_merge"])].startswith("damaged data")
    assert (root / "_previous-release" / "quarantine" / "steps" / "run_id=a").is_dir()  # as it was
    assert {t.table for t in report.tables} == set(TABLES)
    assert not upgrade(root).upgraded  # a second run has nothing to do


@pytest.mark.parametrize("crash", ["before the commit", "after the commit"])
def test_an_upgrade_interrupted_finishes_when_run_again(old_store, monkeypatch, crash):
    root, _ = old_store
    want = old_reader(root)
    real_commit, real_delete = upgrading.delta.commit, upgrading._delete

    class Crash(Exception):
        pass

    def no_commit(*args, **kwargs):
        raise Crash("killed before the commit")

    if crash == "before the commit":
        monkeypatch.setattr(upgrading.delta, "commit", no_commit)
    else:
        monkeypatch.setattr(upgrading, "_delete", lambda *a: (_ for _ in ()).throw(Crash("killed mid-deletion")))
        monkeypatch.setattr(upgrading.delta, "commit", real_commit)
    with pytest.raises(Crash):
        upgrade(root)
    monkeypatch.setattr(upgrading.delta, "commit", real_commit)
    monkeypatch.setattr(upgrading, "_delete", real_delete)
    upgrade(root)
    store = Store(root)
    for table in TABLES:
        columns = [c for c in want[table].column_names if c != "host"]
        assert rows(_all(store, table), columns) == rows(want[table].to_pandas(), columns), table
    assert not (root / "_upgrade").exists()


@pytest.mark.integration
def test_spark_reads_the_upgraded_tables_as_the_previous_readers_did(old_store, java, tmp_path, monkeypatch):
    """Spark reads the upgraded tables' snapshot files, run_id from the folders (as the Delta connector
    takes it from the log), with the previous readers' answers."""
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    root, _ = old_store
    want = old_reader(root)
    upgrade(root)
    location = open_location(root)
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    spark = (SparkSession.builder.master("local[1]").appName("moescope-upgrade").config("spark.ui.enabled", "false")
             .config("spark.local.dir", str(tmp_path / "spark")).config("spark.sql.shuffle.partitions", "2")
             .getOrCreate())
    try:
        for table in ("steps", "layer_steps", "routes"):
            files = [str(root / table / p.path) for p in parts(location, table)]
            frame = spark.read.option("basePath", str(root / table)).parquet(*files)
            got = collections.Counter(tuple(r) for r in frame.groupBy("run_id", "rank", "step").count().collect())
            brute = collections.Counter()
            for run_id, rank, step in zip(*(want[table].column(c).to_pylist() for c in ("run_id", "rank", "step"))):
                brute[(run_id, rank, step)] += 1
            assert got == collections.Counter({(*k, n): 1 for k, n in brute.items()}), table
    finally:
        spark.stop()
