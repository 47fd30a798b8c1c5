"""A table's data files: one Parquet file per write, written with pyarrow (our row groups, page
checksums, key-value metadata), and what the log says of each (`PartFile`, `Snapshot`).

    <store>/<table>/run_id=<id>/part-<...>.parquet           data files, partitioned by run

`write_part` is the first of a write's two steps and uses no delta-rs: it runs in a forked child as
it does anywhere. The file is invisible to every reader until `commit` adds it to the table.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from moescope.store.delta.errors import clean, message
from moescope.store.delta.filesystems import filesystem
from moescope.store.delta.retries import APP_RETRIES, APP_RETRY_DEADLINE_S, backoff, transient
from moescope.store.delta.stats import file_stats
from moescope.store.location import StoreLocation, open_location
from moescope.store.naming import WRITER_ROW_GROUP_ROWS, check_name, check_part_name, parquet_options
from moescope.store.schema import SCHEMAS

__all__ = ["PARTITION_COLUMN", "PartFile", "SkippedFile", "Snapshot", "run_of", "write_part"]

log = logging.getLogger(__name__)

PARTITION_COLUMN = "run_id"


@dataclasses.dataclass(frozen=True)
class PartFile:
    """One data file of a table: `path` relative to the table's root (`run_id=<id>/<name>`), its size
    in bytes, its rows, its run, and its Delta stats (JSON: numRecords, minValues, maxValues,
    nullCount of top-level primitive columns), or None where not read. `modification_time`: when it
    was added, in ms since the epoch, as the log says (a snapshot's files; None for a file not
    committed yet)."""

    path: str
    size: int
    rows: int
    run_id: str
    stats: str | None = None
    modification_time: int | None = None


@dataclasses.dataclass(frozen=True)
class SkippedFile:
    """A file a table's log names that no command reads, moves or rewrites: its run id (the log's
    partition value, or a value of the file's own `run_id` column) or its path cannot be part of a
    store path (`moescope.store.naming`), so no path is ever built from them. `path` and `run_id` are the
    log's values as they are (`run_id` None: no partition value); `reason` says which failed."""

    path: str
    run_id: str | None
    rows: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One version of a table: its live data files, and the files its log names that are left out
    because a name in them fails the store's rule (`skipped`; see `moescope.store.delta.snapshot`), and, when
    asked for, the version of one app transaction it holds (`app_version`)."""

    version: int
    files: list[PartFile]
    skipped: list[SkippedFile] = dataclasses.field(default_factory=list)
    app_version: int | None = None  # the latest version of the app id asked for (`snapshot(app=...)`), None: none


def write_part(loc: StoreLocation | str | os.PathLike, table: str, run_id: str, data: pa.Table, name: str, *,
               row_group_size: int = WRITER_ROW_GROUP_ROWS,
               metadata: Mapping[bytes | str, bytes | str] | None = None) -> PartFile:
    """Write `data` as the file `run_id=<run_id>/<name>` of the table, uncommitted: no reader sees it
    before `commit` adds it.

    The rows take the table's schema (`moescope.store.schema.SCHEMAS`; missing columns are null, `run_id` is
    left out of the file); every page carries a CRC checksum. A local file is fsynced before this
    returns; an upload cut short (a reset, a 503) is made again under the same name.

    Args:
        loc: the store.
        table: the table the rows belong to.
        run_id: their run (the file's partition).
        data: the rows.
        name: the file's name within the run's folder (`part-...parquet`).
        row_group_size: rows per row group.
        metadata: key-value metadata added to the file's footer.

    Returns:
        The file's PartFile, its stats read from the footer.

    Raises:
        InvalidNameError: (a ValueError) a table, run id or name that cannot be part of a path.
        KeyError: an unknown table.
        ValueError: a column the table does not have.
        OSError: the storage refused the write (a partial object is never visible on object
            storage; a partial local file is an orphan that `vacuum` removes).
    """
    loc = open_location(loc)
    check_name("table", table)
    check_name("run_id", run_id)
    check_part_name(name)
    data = _conform(table, data)
    if metadata:
        data = data.replace_schema_metadata({**(data.schema.metadata or {}), **metadata})
    folder = loc.join(table, f"{PARTITION_COLUMN}={run_id}")
    if loc.is_local:
        path = os.path.join(folder, name)
        os.makedirs(folder, exist_ok=True)
        size, footer = _write_file(loc, path, data, row_group_size)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    else:  # an upload is whole or absent; one cut by a reset or a 503 is made again under the same name
        path = f"{folder}/{name}"
        deadline = time.monotonic() + APP_RETRY_DEADLINE_S
        for attempt in range(APP_RETRIES + 1):
            if attempt:
                backoff(attempt)
            try:
                size, footer = _write_file(loc, path, data, row_group_size)
                break
            except OSError as e:
                if not transient(e) or attempt == APP_RETRIES or time.monotonic() > deadline:
                    raise OSError(message(f"cannot upload {loc.redacted}/{table}/{PARTITION_COLUMN}={run_id}/"
                                          f"{name} after {attempt + 1} tries", e)) from e
                log.info("moescope: upload to %s/%s failed (try %d), retrying: %s", loc.redacted, table,
                         attempt + 1, clean(e))
    return PartFile(f"{PARTITION_COLUMN}={run_id}/{name}", size, data.num_rows, run_id, file_stats(footer))


def _write_file(loc: StoreLocation, path: str, data: pa.Table, row_group_size: int) -> tuple[int, pq.FileMetaData]:
    """Write `data` as one Parquet file at `path`; returns its size and footer."""
    with filesystem(loc).open_output_stream(path) as stream:
        writer = pq.ParquetWriter(stream, data.schema, **parquet_options(data.column_names))
        try:
            writer.write_table(data, row_group_size=row_group_size)
        finally:
            writer.close()
        size = stream.tell()
        footer = writer.writer.metadata
    return size, footer


def _conform(table: str, data: pa.Table) -> pa.Table:
    """`data` in the file schema of `table`: its columns in order, cast, nulls for missing ones."""
    schema = SCHEMAS[table]
    unknown = [c for c in data.column_names if c not in schema.names]
    if unknown:
        raise ValueError(f"table {table!r} has no column {', '.join(map(repr, unknown))}: its columns are "
                         f"store.schema.SCHEMAS[{table!r}]")
    fields = [f for f in schema if f.name != PARTITION_COLUMN]
    columns = []
    for f in fields:
        if f.name in data.column_names:
            column = data.column(f.name)
            columns.append(column if column.type == f.type else column.cast(f.type))
        else:
            columns.append(pa.nulls(data.num_rows, f.type))
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=data.schema.metadata))


def run_of(path: str) -> str:
    """The run of a data file from its path (`run_id=<id>/<name>`); ValueError for a path outside a run's folder."""
    first = path.split("/", 1)[0]
    if not first.startswith(f"{PARTITION_COLUMN}="):
        raise ValueError(f"{path!r} is not a data file of a table partitioned by run ({PARTITION_COLUMN}=<id>/...)")
    return first.split("=", 1)[1]
