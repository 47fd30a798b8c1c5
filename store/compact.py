"""Long runs: merge a run's small files into large sorted ones, and drop old runs.

Compaction never stops writers and never shows a reader a row twice or misses one:

1. It takes the live files of one (table, run) (`Catalog`), picks the small ones, and merges them
   into a file sorted by (layer, step, ...) (DuckDB sorts, pyarrow writes it with page checksums),
   under a temporary name. Sources that fail their checksums are quarantined, never merged.
2. The merged file's footer names the files it replaces (`moescope.replaces`); it is fsynced and
   renamed into place. From that instant every new listing reads the merged file and leaves the
   sources out; a listing taken just before still reads the sources, which are all still there.
3. After a grace period, longer than any listing takes, the sources are deleted. A reader whose
   views still point at them fails to open one, refreshes and runs its query again.

Writers keep appending new parts throughout; those are not in the replaced list and stay live.
One compaction per (table, run) at a time (an advisory lock; a second one skips it). A crash
at any point leaves a readable store: before the rename nothing changed (a `.tmp-` file remains,
which readers ignore and `clean_tmp` removes), after it the leftover sources are excluded by the
footer and deleted by the next compaction.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from moescope.store.catalog import Catalog, FileInfo, Vanished
from moescope.store.layout import (
    COMPACT_FILE_ROWS,
    COMPACT_ROW_GROUP_BYTES,
    COMPACT_ROW_GROUP_ROWS,
    check_name,
    clean_tmp,
    compacted_name,
    encode_replaces,
    is_valid_name,
    list_runs,
    parquet_options,
    run_folder,
    tmp_path,
)
from moescope.store.schema import TABLES
from moescope.store.store import connect

log = logging.getLogger(__name__)

SORT_KEYS = {
    "routes": "layer, step, rank, token",
    "router_logits": "layer, step, rank, token",
    "router_inputs": "layer, step, rank, token",
    "layer_steps": "layer, step, rank",
    "steps": "step, rank",
    "kv_cache": "layer, step, rank",
}
LOCK_DIR = "_locks"


@dataclass
class CompactResult:
    table: str
    run_id: str
    merged_files: int = 0  # sources merged away
    written_files: list[str] = field(default_factory=list)
    rows: int = 0
    skipped: str | None = None  # why nothing was done


@contextlib.contextmanager
def _lock(root: str, table: str, run_id: str) -> Iterator[bool]:
    folder = os.path.join(root, LOCK_DIR)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"compact-{table}-{run_id}.lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _live(catalog: Catalog, table: str, run_id: str) -> list[FileInfo]:
    for attempt in range(50):
        try:
            return catalog.live_files(table, run_id)
        except Vanished:
            time.sleep(0.01 * attempt)
    raise RuntimeError(f"files of {table}/{run_id} kept vanishing")


def _groups(small: list[FileInfo], target_rows: int) -> list[list[FileInfo]]:
    groups: list[list[FileInfo]] = [[]]
    rows = 0
    for info in small:
        if groups[-1] and rows + info.rows > target_rows:
            groups.append([])
            rows = 0
        groups[-1].append(info)
        rows += info.rows
    return [g for g in groups if len(g) >= 2]


def _delete_sources(folder: str, names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, name))


def _merge(con: duckdb.DuckDBPyConnection, table: str, group: list[FileInfo], tmp: str, row_group_rows: int,
           metadata: dict[bytes, bytes]) -> int:
    """Write the rows of `group`, sorted by the table's keys, to `tmp`; returns the rows in its footer.

    DuckDB sorts within its memory limit (spilling if it must); pyarrow writes, so the merged
    file has page checksums like every other file of the store (DuckDB's writer has none). Row
    groups hold `row_group_rows` rows, or fewer where they would exceed COMPACT_ROW_GROUP_BYTES.
    """
    schemas = [pq.read_schema(i.path) for i in group]
    con.read_parquet([i.path for i in group], hive_partitioning=False,
                     union_by_name=len({i.columns for i in group}) > 1).create_view("sources", replace=True)
    order = f" ORDER BY {SORT_KEYS[table]}" if table in SORT_KEYS else ""
    reader = con.sql(f"SELECT * FROM sources{order}").to_arrow_reader(min(row_group_rows, 64 * 1024))
    # DuckDB's Arrow types differ in names only (list items, time zone spelling): write the sources' own.
    unified = pa.unify_schemas([s.remove_metadata() for s in schemas], promote_options="permissive")
    schema = pa.schema([unified.field(name) for name in reader.schema.names], metadata=metadata)
    pending: list[pa.RecordBatch] = []
    rows = size = 0
    with pq.ParquetWriter(tmp, schema, **parquet_options(schema.names)) as writer:
        for batch in reader:
            batch = batch.cast(schema)
            pending.append(batch)
            rows, size = rows + batch.num_rows, size + batch.nbytes
            while rows >= row_group_rows or (rows and size >= COMPACT_ROW_GROUP_BYTES):
                held = pa.Table.from_batches(pending, schema)
                take = min(rows, row_group_rows)
                writer.write_table(held.slice(0, take), row_group_size=take)
                rest = held.slice(take)
                pending, rows, size = rest.to_batches(), rest.num_rows, rest.nbytes
        if rows:
            writer.write_table(pa.Table.from_batches(pending, schema), row_group_size=rows)
    return pq.read_metadata(tmp).num_rows


def compact_run(root: str | os.PathLike, table: str, run_id: str, target_rows: int = COMPACT_FILE_ROWS,
                row_group_rows: int = COMPACT_ROW_GROUP_ROWS, grace_s: float = 2.0,
                memory_limit: str = "4GB") -> CompactResult:
    """Merge the small live files of one table of one run; see the module docstring.

    Returns what was done. Raises OSError when the disk cannot take the merged file (nothing
    is changed then) and RuntimeError when the merged rows do not add up (nothing is published).
    """
    root = os.fspath(root)
    folder = run_folder(root, table, run_id)  # checks both names before the lock file is named after them
    result = CompactResult(table, run_id)
    with _lock(root, table, run_id) as locked:
        if not locked:
            result.skipped = "another compaction of this run is in progress"
            return result
        catalog = Catalog(root)
        live = _live(catalog, table, run_id)
        # Sources a crashed compaction published over but did not delete: excluded already.
        for info in live:
            leftovers = [n for n in info.replaces if os.path.exists(os.path.join(folder, n))]
            if leftovers:
                time.sleep(max(0.0, grace_s - (time.time() - os.path.getmtime(info.path))))
                _delete_sources(folder, leftovers)
        small = sorted((i for i in live if i.rows < target_rows // 2), key=lambda i: os.path.getmtime(i.path))
        groups = _groups(small, target_rows)
        if not groups:
            result.skipped = "nothing to merge"
            return result
        con = connect(memory_limit=memory_limit, preserve_insertion_order=True)
        published: list[list[str]] = []
        try:
            for group in groups:
                name = compacted_name()
                tmp = tmp_path(os.path.join(folder, name))
                names = sorted(os.path.basename(i.path) for i in group)
                try:
                    merged_rows = _merge(con, table, group, tmp, row_group_rows, encode_replaces(names))
                    expected = sum(i.rows for i in group)
                    if merged_rows != expected:
                        raise RuntimeError(f"merged {merged_rows} rows of {table}/{run_id}, expected {expected}")
                    with open(tmp, "rb") as f:
                        os.fsync(f.fileno())
                    os.replace(tmp, os.path.join(folder, name))
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.remove(tmp)
                    raise
                published.append(names)
                result.written_files.append(os.path.join(folder, name))
                result.merged_files += len(group)
                result.rows += expected
        finally:
            con.close()
            if published:
                time.sleep(grace_s)  # readers that listed just before the swap finish listing
                for names in published:
                    _delete_sources(folder, names)
    return result


def compact(root: str | os.PathLike, run_id: str | None = None, tables: tuple[str, ...] | None = None,
            target_rows: int = COMPACT_FILE_ROWS, row_group_rows: int = COMPACT_ROW_GROUP_ROWS,
            grace_s: float = 2.0, tmp_older_than_s: float = 900.0) -> list[CompactResult]:
    """Compact every table of one run (or of every run); also removes stale temporary files.

    Returns one CompactResult per (table, run) looked at. Raises InvalidNameError for a run id
    not of `store.layout.NAME_FORM`.
    """
    root = os.fspath(root)
    if run_id is not None:
        check_name("run_id", run_id)
    results = []
    for table in tables or TABLES:
        for run in ([run_id] if run_id else list_runs(root, table)):
            if os.path.isdir(run_folder(root, table, run)):
                results.append(compact_run(root, table, run, target_rows, row_group_rows, grace_s))
    clean_tmp(root, tmp_older_than_s)
    return results


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """'90s', '30m', '12h', '7d', '2w' as seconds; raises ValueError with the accepted forms."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if not match:
        raise ValueError(f"cannot read the age {text!r}: write a number and a unit, e.g. 90s, 30m, 12h, 7d, 2w")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _tables(root: str | os.PathLike) -> list[str]:
    """Table folders of a store (not `_quarantine`, `_locks`, nor a folder whose name is not a table's)."""
    return [name for name in sorted(os.listdir(root))
            if is_valid_name(name, "table") and os.path.isdir(os.path.join(root, name))]


def run_last_write(root: str | os.PathLike, run_id: str) -> float:
    """Newest modification time of any file of a run, over all tables (0 if none)."""
    newest = 0.0
    for table in _tables(root):
        folder = run_folder(root, table, run_id)
        if not os.path.isdir(folder):
            continue
        for entry in os.scandir(folder):
            newest = max(newest, entry.stat().st_mtime)
    return newest


def prune(root: str | os.PathLike, older_than_s: float, dry_run: bool = False,
          now: float | None = None) -> list[str]:
    """Remove every run whose newest file is older than `older_than_s`; returns their ids.

    A run still being written keeps getting new files, so it is never pruned. Each table's run
    folder is first renamed into `<root>/_trash` (atomic per table), then deleted; a reader with
    stale views refreshes when a file vanishes. The quarantine folder is left to the user.
    """
    root = os.fspath(root)
    now = time.time() if now is None else now
    runs = sorted({run for table in _tables(root) for run in list_runs(root, table)})
    old = [run for run in runs if now - run_last_write(root, run) > older_than_s]
    if dry_run:
        return old
    trash = os.path.join(root, "_trash", uuid.uuid4().hex)
    for run in old:
        for table in _tables(root):
            folder = run_folder(root, table, run)
            if not os.path.isdir(folder):
                continue
            target = os.path.join(trash, table, os.path.basename(folder))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(folder, target)
        log.info("moescope: pruned run %s from %s", run, root)
    shutil.rmtree(trash, ignore_errors=True)
    return old
