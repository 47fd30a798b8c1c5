"""What a table's snapshot holds, read without moescope's readers: pyarrow over the raw Parquet files
the Delta log names, for the store tests' brute-force checks."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moescope.store import delta
from moescope.store.location import StoreLocation, open_location
from moescope.store.schema import SCHEMAS
from moescope.store.writer import ParquetExporter
from tests.support.store_records import make_record, run_info


def parts(location: StoreLocation, table: str) -> list[delta.PartFile]:
    """The live files of a table's latest version ([] when there is no table)."""
    snap = delta.snapshot(location, table)
    return [] if snap is None else snap.files


def file_path(location: StoreLocation, table: str, part: delta.PartFile) -> str:
    return location.join(table, *part.path.split("/"))


def read_bytes(location: StoreLocation, path: str) -> bytes:
    with location.filesystem().open_input_stream(path) as f:
        return f.read()


def write_bytes(location: StoreLocation, path: str, data: bytes) -> None:
    """Overwrite a file (a local file, or an object) with `data`, as damage does."""
    with location.filesystem().open_output_stream(path) as f:
        f.write(data)


def exists(location: StoreLocation, path: str) -> bool:
    from pyarrow import fs

    return location.filesystem().get_file_info(path).type != fs.FileType.NotFound


def read_part(location: StoreLocation, table: str, part: delta.PartFile) -> pa.Table:
    """A file's rows with its run_id (from the log: the file does not hold it), checksums verified."""
    with location.filesystem().open_input_file(file_path(location, table, part)) as f:
        data = pq.ParquetFile(f, page_checksum_verification=True).read()
    return data.append_column("run_id", pa.array([part.run_id] * data.num_rows, pa.string()))


def read_table(location: StoreLocation, table: str) -> pa.Table:
    """Every row of a table's latest version, file by file (an empty table when there is none)."""
    pieces = [read_part(location, table, p) for p in parts(location, table)]
    return pa.concat_tables(pieces, promote_options="permissive") if pieces else pa.table({})


def write_run(store, run_id: str, steps: int, max_rows: int = 48, seed: int = 0, rank: int = 0,
              tokens: int = 16) -> None:
    """A run written through the real writer: with max_rows=48 (3 layers x 16 tokens), one routes file per step."""
    location = open_location(store)
    rng = np.random.default_rng(seed)
    exporter = ParquetExporter(location, run_info(run_id, rank=rank), max_rows=max_rows, max_age_s=1e9)
    for step in range(steps):
        exporter.export([make_record(run_id, step, rng, tokens=tokens)])
    exporter.shutdown()

def snapshot_files(loc: StoreLocation, table: str) -> list[dict]:
    """The add actions of the table's current version, as delta-rs lists them from the log."""
    from deltalake import DeltaTable

    delta_table = DeltaTable(loc.table_uri(table), storage_options=dict(loc.storage_options) or None)
    return pa.table(delta_table.get_add_actions(flatten=True)).to_pylist()


def snapshot_rows(store, table: str) -> pa.Table:
    """Every row of the table's current snapshot: the raw Parquet files the log lists, read with
    pyarrow (page checksums verified), `run_id` taken from each file's partition. An empty table
    of the schema when the table does not exist."""
    from deltalake import DeltaTable

    loc = open_location(store)
    if not DeltaTable.is_deltatable(loc.table_uri(table), storage_options=dict(loc.storage_options) or None):
        return SCHEMAS[table].empty_table()
    fs = loc.filesystem()
    parts = []
    for action in snapshot_files(loc, table):
        with fs.open_input_file(loc.join(table, action["path"])) as f:
            data = pq.ParquetFile(f, page_checksum_verification=True).read()
        assert "run_id" not in data.column_names  # the partition column lives in the path only
        run_id = action["partition.run_id"]
        parts.append(data.append_column("run_id", pa.repeat(pa.scalar(run_id, pa.string()), data.num_rows)))
    if not parts:
        return SCHEMAS[table].empty_table()
    return pa.concat_tables(parts, promote_options="permissive").select(SCHEMAS[table].names)


def latest_probe_stats(store, run_id: str) -> list[dict]:
    """The latest probe_stats snapshot of every writer (host, rank, pid) of a run, from the raw rows."""
    rows = [r for r in snapshot_rows(store, "probe_stats").to_pylist() if r["run_id"] == run_id]
    latest: dict[tuple, dt.datetime] = {}
    for r in rows:
        key = (r["host"], r["rank"], r["pid"])
        latest[key] = max(latest.get(key, r["ts"]), r["ts"])
    return [r for r in rows if r["ts"] == latest[(r["host"], r["rank"], r["pid"])]]



TS0 = dt.datetime(2026, 1, 2, 3, 4, 5, 678_901, tzinfo=dt.timezone.utc)


def steps_rows(run_id: str, first: int, n: int, rank: int = 0) -> pa.Table:
    return pa.Table.from_pylist([dict(run_id=run_id, step=step, ts=TS0 + dt.timedelta(seconds=step), tokens=step * 2,
                                      rank=rank, tags=[("k", "v")]) for step in range(first, first + n)],
                                schema=SCHEMAS["steps"])
