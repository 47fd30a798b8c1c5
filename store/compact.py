"""Long runs: merge a run's small files into large sorted ones, and delete old runs.

Both are Delta commits on the store's tables; neither stops writers, and no reader ever sees a row
twice or misses one (a reader reads one version of each table; see `moescope.store.store`).

`compact` merges, per table and run, the small files of the table's latest version into files of
up to a target size (`target_size`, DEFAULT_TARGET_SIZE bytes as the log counts them, and at most
COMPACT_FILE_ROWS rows) sorted by (layer, step, ...), written by pyarrow with page checksums like
every file of the store. It plans from the log alone (`_groups`: a file at or above either target is
left alone, the others are packed in commit order into groups up to the targets, and a group of one
file is no merge): only the files of a planned group are read, so a run with nothing to merge reads no
data file at all. A merge whose rows fit in IN_MEMORY_MERGE_BYTES (routes: 8 Mi rows
take about 0.8 GB) reads each source once, checking it as it reads (footer, page checksums, rows
per column), and sorts in pyarrow; a larger one (wide rows) is sorted by DuckDB within its memory
limit, spilling if it must, after each source is checked. A bad source is quarantined, never
merged: the merge starts again without it. One commit then removes the sources and adds
the merged files, both marked `data_change=False` (the same rows, rewritten): a version either has
the sources or the merged files, never both. Writers keep appending meanwhile; their files are not
among the sources and stay live. Two compactions (or a compaction and a prune, or a quarantine)
made from the same version cannot both commit: each such commit carries the app transaction
`moescope-compact:<table>` at one more than the version its snapshot holds
(`moescope.store.catalog.app_version`), and `moescope.store.delta.commit` does not make a commit whose app version
the table already holds, nor one that removes a file no longer in the table; the one that lost
finds its merged files absent from the version it got (or gets CommitConflictError), deletes them
and starts again from a new version. A crash before the commit leaves merged files no
version names (never read; see the README's retention section); after it, the sources are removed
files, which `vacuum` deletes once they are older than the retention. A table a compaction merged in
gets a checkpoint of its new version (`moescope.store.delta.checkpoint`): the next open of it (the next
compaction's, a reader's) reads that and the commits after it, not every commit since the last one.

`prune` removes every file of the runs whose newest file was committed longer ago than an age, in
one commit per table, then vacuums each table: removed files older than the retention (default one
hour) are deleted. The retention is what protects running readers: a reader holds one version of
each table until it refreshes, and that version's files stay on the storage for the retention.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from moescope.store import delta
from moescope.store.catalog import REWRITE_APP, Catalog, FileInfo, app_version
from moescope.store.errors import StoreError
from moescope.store.location import StoreLocation, open_location
from moescope.store.naming import (
    COMPACT_FILE_ROWS,
    COMPACT_ROW_GROUP_BYTES,
    COMPACT_ROW_GROUP_ROWS,
    check_name,
    parquet_options,
)
from moescope.store.quarantine import display, read_checked
from moescope.store.schema import SCHEMAS, TABLES

if TYPE_CHECKING:  # DuckDB, numpy and pandas (the reader's) are imported by a merge: nothing to merge starts faster
    import duckdb

log = logging.getLogger(__name__)

SORT_KEYS = {
    "routes": "layer, step, rank, token",
    "router_logits": "layer, step, rank, token",
    "router_inputs": "layer, step, rank, token",
    "layer_steps": "layer, step, rank",
    "steps": "step, rank",
    "kv_cache": "layer, step, rank",
}
COMPACTED_PREFIX = "part-compacted-"
# Removed files stay on the storage this long before vacuum deletes them: a reader holding an older
# version (the dashboard between two refreshes, a long query, a Spark job) keeps reading them.
DEFAULT_RETENTION_HOURS = 1.0
COMMIT_ATTEMPTS = 5
# A merge whose sources take at most this much memory decoded (their footers say) is read and sorted
# in memory by pyarrow, each source read once; a larger one goes through DuckDB, which can spill.
IN_MEMORY_MERGE_BYTES = 2 * 1024**3
# Threads that read a merge's sources at once: reading (decoding, checking each page) is most of a
# merge's time, and on object storage each source is a request to wait for.
READ_THREADS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)

# Tables compacted at once on object storage (each mostly waits for its requests).
TABLE_THREADS = 4

# A file at or above this size (bytes, as the table's log records it) is left alone; smaller ones are
# packed into files up to it. 128 MiB: large enough that a query opens few files, small enough that
# one merge fits in IN_MEMORY_MERGE_BYTES decoded for the store's usual compression ratios.
DEFAULT_TARGET_SIZE = 128 * 1024**2


@dataclass
class CompactIO:
    """What a compaction asked of the storage for data files (the Delta log's reads and its commit are
    delta-rs' own and not counted here; `bench/store.py --s3` counts every request at the server).

    On object storage a footer read is a ranged GET (or two), a file read through is one or more
    ranged GETs, and a merged file is one PUT (a multipart upload when large)."""

    footer_reads: int = 0  # data files whose footer was read (the sources of planned groups)
    files_read: int = 0  # data files read through (the merge's sources)
    bytes_read: int = 0  # their sizes
    files_written: int = 0  # merged files written (kept or, after a lost race, deleted)
    bytes_written: int = 0

    def __add__(self, other: CompactIO) -> CompactIO:
        return CompactIO(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __str__(self) -> str:
        return (f"read {self.footer_reads} footers and {self.files_read} files ({_size(self.bytes_read)}), "
                f"wrote {self.files_written} files ({_size(self.bytes_written)})")


def _size(n: int) -> str:
    """Bytes as a person reads them: '812 B', '4.0 KiB', '12.3 MiB'."""
    if n < 1024:
        return f"{n:,} B"
    return f"{n / 1024:,.1f} KiB" if n < 1024**2 else f"{n / 1024**2:,.1f} MiB"


@dataclass
class CompactResult:
    table: str
    run_id: str
    merged_files: int = 0  # sources merged away
    written_files: list[str] = field(default_factory=list)  # the merged files (local paths, or URLs)
    rows: int = 0
    version: int | None = None  # the table version the merge was committed as
    skipped: str | None = None  # why nothing was done
    left_alone: int = 0  # files of the run at or above the target, not read
    io: CompactIO = field(default_factory=CompactIO)  # what the data files cost, retries included


def compacted_name() -> str:
    return f"{COMPACTED_PREFIX}{time.time_ns()}-{uuid.uuid4().hex[:8]}.parquet"


def _at_target(part: delta.PartFile, target_size: int, target_rows: int) -> bool:
    """A file as large as a merge would make it: left alone, never read."""
    return part.size >= target_size or part.rows >= target_rows


def _groups(parts: list[delta.PartFile], target_size: int, target_rows: int) -> list[list[delta.PartFile]]:
    """The merges to make of a run's files below the targets, from the log alone: packed in commit
    order (next fit: neighbours in the log hold neighbouring steps, so the sort has long runs to
    slice) into groups of at most `target_size` bytes and `target_rows` rows; a group of one file
    is no merge and is left out."""
    groups: list[list[delta.PartFile]] = [[]]
    size = rows = 0
    for part in parts:
        part_rows = max(part.rows, 0)  # -1: not in the log; its footer says (and is checked) before merging
        if groups[-1] and (size + part.size > target_size or rows + part_rows > target_rows):
            groups.append([])
            size = rows = 0
        groups[-1].append(part)
        size, rows = size + part.size, rows + part_rows
    return [g for g in groups if len(g) >= 2]


def _fits_in_memory(group: list[FileInfo]) -> bool:
    return all(i.decoded_bytes >= 0 for i in group) and sum(i.decoded_bytes for i in group) <= IN_MEMORY_MERGE_BYTES


def _merge(con: duckdb.DuckDBPyConnection, catalog: Catalog, table: str, run_id: str, group: list[FileInfo],
           row_group_rows: int) -> delta.PartFile:
    """Write the rows of `group`, sorted by the table's keys, as a new file of the run (uncommitted);
    returns its PartFile (rows and stats from the footer written). Raises _BadSource when a source
    fails its check (nothing is written then).

    A group whose rows fit in IN_MEMORY_MERGE_BYTES is merged by `_merge_in_memory` (each source
    read once, checked as it is read); a larger one by `_merge_duckdb`, each source checked through
    first (each source read twice)."""
    if _fits_in_memory(group):
        return _merge_in_memory(catalog, table, run_id, group, row_group_rows)
    for info in group:
        if catalog.check(table, info.part) is None:  # checked through; a bad one is quarantined (or skipped)
            raise _BadSource(info, "")
    return _merge_duckdb(con, catalog, table, run_id, group, row_group_rows)


def _merge_duckdb(con: duckdb.DuckDBPyConnection, catalog: Catalog, table: str, run_id: str, group: list[FileInfo],
                  row_group_rows: int) -> delta.PartFile:
    """`_merge` for a group too large to sort in memory.

    DuckDB sorts within its memory limit (spilling if it must); pyarrow writes, so the merged file
    has page checksums like every other file of the store (DuckDB's writer has none). Row groups
    hold `row_group_rows` rows, or fewer where they would exceed COMPACT_ROW_GROUP_BYTES. The file
    has every column of the table's schema but `run_id` (in the folder name), as the writer's do.
    """
    location = catalog.location
    if location.is_local:
        relation = con.read_parquet([i.path for i in group], hive_partitioning=False,
                                    union_by_name=len({i.columns for i in group}) > 1)
    else:
        import pyarrow.dataset as ds

        relation = con.from_arrow(ds.dataset([i.path for i in group], format="parquet",
                                             filesystem=catalog.filesystem))
    relation.create_view("sources", replace=True)
    present = set().union(*(i.columns for i in group))
    fields = [f for f in SCHEMAS[table] if f.name != delta.PARTITION_COLUMN]
    columns = ", ".join(f'"{f.name}"' for f in fields if f.name in present)
    order = f" ORDER BY {SORT_KEYS[table]}" if table in SORT_KEYS else ""
    reader = con.sql(f"SELECT {columns} FROM sources{order}").to_arrow_reader(min(row_group_rows, 64 * 1024))
    schema = pa.schema(fields)

    def conform(batch: pa.RecordBatch) -> pa.RecordBatch:
        # DuckDB's Arrow types differ in names only (list items, time zone spelling): write the schema's own.
        arrays = [batch.column(f.name).cast(f.type) if f.name in present else pa.nulls(batch.num_rows, f.type)
                  for f in fields]
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    def write_groups(writer: pq.ParquetWriter) -> None:
        pending: list[pa.RecordBatch] = []
        rows = size = 0
        for batch in reader:
            batch = conform(batch)
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

    return _write_merged(catalog, table, run_id, schema, write_groups)


def _write_merged(catalog: Catalog, table: str, run_id: str, schema: pa.Schema,
                  write_groups: Callable[[pq.ParquetWriter], None]) -> delta.PartFile:
    """A fresh compacted file in the run's folder, its row groups written by `write_groups`, with the
    store's Parquet options (page checksums), synced to disk on a local store; not yet committed."""
    location = catalog.location
    check_name("run_id", run_id)  # snapshots leave out files with such run ids; this is the last guard before a path
    name = compacted_name()
    relative = f"{delta.PARTITION_COLUMN}={run_id}/{name}"
    path = location.join(table, f"{delta.PARTITION_COLUMN}={run_id}", name)
    with catalog.filesystem.open_output_stream(path) as stream:
        writer = pq.ParquetWriter(stream, schema, **parquet_options(schema.names))
        try:
            write_groups(writer)
        finally:
            writer.close()
        written = stream.tell()
        footer = writer.writer.metadata
    if location.is_local:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return delta.PartFile(relative, written, footer.num_rows, run_id, delta.file_stats(footer))


class _BadSource(Exception):
    """A source of a merge failed its check while it was read: quarantine it and merge again without it."""

    def __init__(self, info: FileInfo, reason: str):
        super().__init__(reason)
        self.info, self.reason = info, reason


def _merge_in_memory(catalog: Catalog, table: str, run_id: str, group: list[FileInfo],
                     row_group_rows: int) -> delta.PartFile:
    """`_merge` for a group that fits in memory: each source read once, checked as it is read
    (`moescope.store.quarantine.read_checked`, on up to READ_THREADS threads; raises _BadSource for a bad
    one, before anything is written),
    the rows sorted by the table's keys with pyarrow (a stable sort) and written in row groups of
    `row_group_rows` rows, or fewer where they would exceed COMPACT_ROW_GROUP_BYTES.

    Where the sorted order is made of long runs of consecutive rows (a writer's files hold each
    layer's rows of a step together), a row group is assembled from slices of the sources, not
    copied row by row."""
    import numpy as np
    import pyarrow.compute as pc

    location = catalog.location
    filesystem = None if location.is_local else catalog.filesystem
    fields = [f for f in SCHEMAS[table] if f.name != delta.PARTITION_COLUMN]
    schema = pa.schema(fields)
    tables = []
    # the sources are read (decoded, their checksums checked) on several threads: pyarrow lets go of the GIL
    with ThreadPoolExecutor(max_workers=max(1, min(READ_THREADS, len(group)))) as pool:
        read = list(pool.map(lambda info: read_checked(info.path, filesystem), group))
    for info, (data, problem) in zip(group, read):
        if data is None:
            raise _BadSource(info, f"damaged data: {problem}" if problem else "")  # "": gone, not bad
        # the schema's own types (names of list items, time zone spelling), nulls for a column a file lacks
        tables.append(pa.Table.from_arrays(
            [data.column(f.name).cast(f.type) if f.name in data.column_names else pa.nulls(data.num_rows, f.type)
             for f in fields], schema=schema))
    merged = pa.concat_tables(tables)
    del tables, read
    rows = merged.num_rows
    keys = [k.strip() for k in SORT_KEYS[table].split(",")] if table in SORT_KEYS else []
    if keys and rows:
        # nulls last (pyarrow's default)
        order = pc.sort_indices(merged.select(keys), sort_keys=[(k, "ascending") for k in keys]).to_numpy()
    else:
        order = np.arange(rows)
    per_row = max(1, merged.nbytes // max(1, rows))
    step = max(1, min(row_group_rows, COMPACT_ROW_GROUP_BYTES // per_row))

    def write_groups(writer: pq.ParquetWriter) -> None:
        for start in range(0, rows, step):
            take = order[start:start + step]
            breaks = np.flatnonzero(np.diff(take) != 1) + 1
            if (len(breaks) + 1) * 64 <= len(take):  # runs of 64 rows or more on average: slices
                starts = np.concatenate([[0], breaks])
                ends = np.concatenate([breaks, [len(take)]])
                piece = pa.concat_tables([merged.slice(int(take[a]), int(b - a)) for a, b in zip(starts, ends)])
            else:
                piece = merged.take(pa.array(take))
            writer.write_table(piece, row_group_size=len(take))

    return _write_merged(catalog, table, run_id, schema, write_groups)


def _delete(catalog: Catalog, table: str, parts: Sequence[delta.PartFile]) -> None:
    """Delete files no version names (merged files whose commit was not made)."""
    for part in parts:
        with contextlib.suppress(OSError):
            catalog.filesystem.delete_file(catalog.full_path(table, part))


def compact_run(location: StoreLocation, table: str, run_id: str, catalog: Catalog | None = None,
                target_rows: int = COMPACT_FILE_ROWS, row_group_rows: int = COMPACT_ROW_GROUP_ROWS,
                memory_limit: str = "4GB", attempts: int = COMMIT_ATTEMPTS,
                target_size: int = DEFAULT_TARGET_SIZE) -> CompactResult:
    """Merge the files of one table of one run below `target_size` bytes (and `target_rows` rows)
    into files up to those targets; see the module docstring. Files at or above a target are left
    alone, and a run with no two files to merge reads no data file.

    Returns what was done, with the data files read and written (`CompactResult.io`). Raises
    ValueError for a target below 1; raises OSError or StoreError when the storage refuses the merged file
    or the commit (nothing is changed then: the merged files are deleted), and RuntimeError when
    the merged rows do not add up (nothing is committed).
    """
    if target_size < 1 or target_rows < 1:
        raise ValueError(f"the target size and rows must be at least 1, not {target_size} bytes, {target_rows} rows")
    return _compact_run(location, table, run_id, catalog if catalog is not None else Catalog(location), None,
                        target_rows, row_group_rows, memory_limit, attempts, target_size)[0]


def _compact_run(location: StoreLocation, table: str, run_id: str, catalog: Catalog, snap: delta.Snapshot | None,
                 target_rows: int, row_group_rows: int, memory_limit: str, attempts: int,
                 target_size: int) -> tuple[CompactResult, delta.Snapshot | None]:
    """`compact_run`, starting from `snap` (read with `app=REWRITE_APP`; None: read it here) on its
    first try. Returns the result and the version its commit made, read with the app version (for
    the next run of the table: no log read between the runs of one compaction), or None."""
    result = CompactResult(table, run_id)
    io = result.io
    app = REWRITE_APP.format(table=table)
    tries = restarts = 0
    while tries < attempts:
        if snap is None:
            snap = delta.snapshot(location, table, app=app)
        if snap is None:
            result.skipped = "no such table"
            return result, None
        seen = app_version(snap)  # the same version of the log as its files: see store.catalog.app_version
        files = [p for p in snap.files if p.run_id == run_id]
        small = [p for p in files if not _at_target(p, target_size, target_rows)]
        result.left_alone = len(files) - len(small)
        planned = _groups(small, target_size, target_rows)  # from the log: no data file read yet
        # footers of the planned groups' files now (bad ones: quarantined), then the groups again
        # without those; pages as each group is merged (`_merge_in_memory` reads them through once,
        # checked; a group for DuckDB is checked through first)
        candidates = [p for group in planned for p in group]
        io.footer_reads += len(candidates)
        with ThreadPoolExecutor(max_workers=max(1, min(READ_THREADS, len(candidates)))) as pool:  # request-bound
            footers = list(pool.map(lambda p: catalog.check(table, p, verify=False), candidates))
        checked = {info.part.path: info for info in footers if info is not None}
        groups = [[checked[p.path] for p in group]
                  for group in _groups([p for p in candidates if p.path in checked], target_size, target_rows)]
        if not groups:
            result.skipped = "nothing to merge"
            return result, snap
        from moescope.store.store import connect

        con = connect(memory_limit=memory_limit, preserve_insertion_order=True)
        merged: list[tuple[list[FileInfo], delta.PartFile]] = []
        try:
            for group in groups:
                reads = 1 if _fits_in_memory(group) else 2  # the DuckDB path checks each source through first
                io.files_read += reads * len(group)
                io.bytes_read += reads * sum(max(i.part.size, 0) for i in group)
                part = _merge(con, catalog, table, run_id, group, row_group_rows)
                io.files_written, io.bytes_written = io.files_written + 1, io.bytes_written + part.size
                merged.append((group, part))
                expected = sum(i.rows for i in group)
                if part.rows != expected:
                    raise RuntimeError(f"merged {part.rows} rows of {table}/{run_id}, expected {expected}")
            adds = [part for _, part in merged]
            removes = [info.part for group, _ in merged for info in group]
            try:
                version: int | None = delta.commit(location, table, adds=adds, removes=removes, data_change=False,
                                                   app=(app, seen + 1))
            except delta.CommitConflictError:  # a source was removed since the snapshot: nothing committed
                version = None
            committed = delta.snapshot(location, table, version, app=app) if version is not None else None
        except _BadSource as bad:
            snap = None
            _delete(catalog, table, [part for _, part in merged])
            if bad.reason:
                catalog.reject(table, bad.info.part, bad.reason)
            restarts += 1  # each restart leaves out one more file: they are bounded by the files
            if restarts > len(small):
                result.skipped = "sources kept failing their checks or going missing; run compact again"
                return result, None
            continue  # again without it: it is quarantined, or skipped by this catalog (not a commit race)
        except BaseException:
            _delete(catalog, table, [part for _, part in merged])
            raise
        finally:
            con.close()
        if committed is not None and {p.path for p in adds} <= {p.path for p in committed.files}:
            result.version = version
            result.written_files = [display(location, catalog.full_path(table, p)) for p in adds]
            result.merged_files = len(removes)
            result.rows = sum(p.rows for p in adds)
            return result, committed
        # another compaction, a prune or a quarantine made from the same version committed first
        log.info("moescope compact: %s/%s changed under the merge (another compaction?); merging again",
                 location.redacted, table)
        _delete(catalog, table, adds)
        snap = None
        tries += 1
    result.skipped = "other commits that remove files kept coming first; run compact again"
    return result, None


def compact(store: str | os.PathLike | StoreLocation, run_id: str | None = None, tables: tuple[str, ...] | None = None,
            target_rows: int = COMPACT_FILE_ROWS, row_group_rows: int = COMPACT_ROW_GROUP_ROWS,
            retention_hours: float | None = DEFAULT_RETENTION_HOURS,
            storage_options: Mapping[str, Any] | Sequence[str] | None = None,
            target_size: int = DEFAULT_TARGET_SIZE) -> list[CompactResult]:
    """Compact every table of one run (or of every run), then vacuum the tables it changed:
    removed files older than `retention_hours` are deleted (None: no vacuum).

    Args:
        target_size: bytes (as the log records a file's size) a merged file grows to; a file at or
            above it is left alone and never read.
        target_rows: rows a merged file holds at most; a file with as many is left alone too.

    Returns one CompactResult per (table, run) looked at, each with the data files it read and
    wrote (`io`). Raises ValueError for a target below 1, InvalidNameError for a run id
    not of `moescope.store.naming.NAME_FORM`, LegacyStoreError for a store of the previous release,
    StoreError when the storage cannot be read or written.
    """
    if target_size < 1 or target_rows < 1:
        raise ValueError(f"the target size and rows must be at least 1, not {target_size} bytes, {target_rows} rows")
    location = open_location(store, storage_options)
    if run_id is not None:
        check_name("run_id", run_id)
    delta.check_store(location)
    catalog = Catalog(location)

    def compact_table(table: str) -> list[CompactResult]:
        # the log is read once per table: each run starts from the version the previous one's commit
        # made (its files and app version known without a read), unless a try had to look again
        # The app transaction a merge's commit needs is read only once a run has files to merge: delta-rs
        # reads every log entry since the checkpoint to answer it, most of a table with nothing to merge.
        snap: delta.Snapshot | None = delta.snapshot(location, table)
        with_app = False  # whether `snap` was read with the app version
        if snap is None:
            return []
        runs = [run_id] if run_id else sorted({p.run_id for p in snap.files})
        table_results = []
        for run in runs:
            seen = snap if snap is not None else delta.snapshot(location, table)
            files = [p for p in seen.files if p.run_id == run] if seen is not None else []
            small = [p for p in files if not _at_target(p, target_size, target_rows)]
            if not files:
                continue
            if not _groups(small, target_size, target_rows):  # decided from this snapshot: nothing read again
                table_results.append(CompactResult(table, run, skipped="nothing to merge",
                                                   left_alone=len(files) - len(small)))
                continue
            result, snap = _compact_run(location, table, run, catalog, seen if with_app else None, target_rows,
                                        row_group_rows, "4GB", COMMIT_ATTEMPTS, target_size)
            with_app = snap is not None  # the version its commit made, read with the app version
            table_results.append(result)
        if any(r.merged_files for r in table_results):
            if retention_hours is not None:
                delta.vacuum(location, table, retention_hours)
            # the next open of the table (the next compaction's, every reader's) reads one checkpoint and
            # the commits after it, not each commit since the last one delta-rs wrote; without it (the
            # storage refused) every version still reads the same, from the commits
            try:
                delta.checkpoint(location, table)
            except StoreError as e:
                log.warning("moescope compact: no checkpoint of %s/%s written (the merge is committed): %s",
                            location.redacted, table, e)
        return table_results

    # Tables are independent (a log each): on object storage most of a table's time is waiting for
    # requests, so a few are compacted at once. A local store goes one table at a time.
    # On object storage a table that is not there costs requests to find out: one listing of the root
    # says which tables have a folder. A table created since has nothing to merge yet.
    threads = 1 if location.is_local else TABLE_THREADS
    present = None if location.is_local else delta.table_folders(location)
    names = [t for t in (tables or TABLES) if present is None or t in present]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names)))) as pool:
        return [r for table_results in pool.map(compact_table, names) for r in table_results]


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """'90s', '30m', '12h', '7d', '2w' as seconds; raises ValueError with the accepted forms."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if not match:
        raise ValueError(f"cannot read the age {text!r}: write a number and a unit, e.g. 90s, 30m, 12h, 7d, 2w")
    return float(match.group(1)) * _UNITS[match.group(2)]


_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
               "g": 1024**3, "gb": 1000**3, "gib": 1024**3}


def parse_size(text: str) -> int:
    """'128MiB', '64M' (MiB), '1GB', '500000' (bytes) as bytes; raises ValueError with the accepted forms."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text or "")
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS or float(match.group(1)) * _SIZE_UNITS[unit] < 1:
        raise ValueError(f"cannot read the size {text!r}: write bytes, or a number and a unit, e.g. 128MiB, 64M, 1GB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def run_last_commits(location: StoreLocation) -> dict[str, float]:
    """Per run, the newest commit time (seconds since the epoch) of any of its live files, over all
    tables. Raises StoreError when the storage cannot be read."""
    newest: dict[str, float] = {}
    for table in TABLES:
        for run_id, at in _file_times(location, table).items():
            newest[run_id] = max(newest.get(run_id, 0.0), at)
    return newest


def _file_times(location: StoreLocation, table: str) -> dict[str, float]:
    """Per run, the newest add time (seconds since the epoch) of its live files in one table.

    Read from a snapshot's PartFile.modification_time, so it works wherever store.delta does (in a
    forked child too, through its helper)."""
    snap = delta.snapshot(location, table)
    newest: dict[str, float] = {}
    for part in snap.files if snap is not None else ():
        if part.modification_time is not None:
            newest[part.run_id] = max(newest.get(part.run_id, 0.0), part.modification_time / 1000.0)
    return newest


def delete_runs(location: StoreLocation, run_ids: Sequence[str], attempts: int = COMMIT_ATTEMPTS) -> int:
    """Remove every file of `run_ids` from every table (one commit per table that holds any);
    returns the files removed. Writers that still append to one of these runs add new files, which
    are not removed. Raises StoreError when a commit is refused."""
    doomed = set(run_ids)
    removed = 0
    for table in TABLES:
        app = REWRITE_APP.format(table=table)
        for _ in range(attempts):
            snap = delta.snapshot(location, table, app=app)
            parts = [p for p in snap.files if p.run_id in doomed] if snap is not None else []
            if snap is None or not parts:
                break
            try:
                version = delta.commit(location, table, removes=parts, app=(app, app_version(snap) + 1))
            except delta.CommitConflictError:
                continue  # a compaction or quarantine removed some of them meanwhile: look again
            after = delta.snapshot(location, table, version)
            if after is not None and not {p.path for p in parts} & {p.path for p in after.files}:
                removed += len(parts)
            # else: a compaction made from the same version came first; look again
    return removed


def prune(store: str | os.PathLike | StoreLocation, older_than_s: float, dry_run: bool = False,
          now: float | None = None, retention_hours: float = DEFAULT_RETENTION_HOURS,
          storage_options: Mapping[str, Any] | Sequence[str] | None = None) -> list[str]:
    """Delete every run whose newest file was committed more than `older_than_s` ago; returns their ids.

    A run still being written keeps committing files, so it is never pruned. The runs' files are
    removed from every table (a Delta commit per table), then each table is vacuumed: files removed
    more than `retention_hours` ago (by this prune, an earlier one, or compaction) are deleted, so
    the storage shrinks by this prune's files only once a later prune or compact runs after the
    retention. The quarantine folder is left to the user. Raises StoreError when the storage
    refuses, LegacyStoreError for a store of the previous release.
    """
    location = open_location(store, storage_options)
    if retention_hours < 0:
        raise ValueError(f"the retention must be >= 0 hours, not {retention_hours}")
    delta.check_store(location)
    now = time.time() if now is None else now
    old = sorted(run for run, at in run_last_commits(location).items() if now - at > older_than_s)
    if dry_run:
        return old
    if old:
        delete_runs(location, old)
        for run in old:
            log.info("moescope: pruned run %s from %s", run, location.redacted)
    for table in TABLES:
        delta.vacuum(location, table, retention_hours)
    return old
