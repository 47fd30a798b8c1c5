"""Each table of a store is a Delta Lake table; this module is the one place that talks to delta-rs.

    <store>/<table>/_delta_log/                              the table's log (delta-rs commits it)
    <store>/<table>/run_id=<id>/part-<...>.parquet           data files, partitioned by run

A write is two steps: `write_part` writes one Parquet file with pyarrow (our row groups, page
checksums, key-value metadata; the partition column `run_id` lives in the folder name, not in the
file), then `commit` adds the files to the table in one atomic Delta commit. A file nobody
committed is invisible to every reader (they read a `snapshot`, never a folder listing), so a crash
between the two steps leaves an orphan for `vacuum`, never a torn or duplicated row.

Commits from many processes and hosts race on the log's next version; delta-rs retries a conflict
itself (`MAX_COMMIT_RETRIES`), and `commit` retries again with jittered backoff when that runs out.
A commit whose answer was lost (the PUT landed, the client saw an error) is resolved with an app
transaction: a writer commits with `app=(app_id, seq)`, seq rising per table, and a retry that finds
`transaction_version(app_id) >= seq` knows its commit is in and does not commit it twice.

Fork safety: delta-rs's runtime does not survive `fork` (a forked child's first delta call raises
PanicException, a BaseException). A child forked after this process used delta-rs routes every
call of this module through a helper process it starts on first use (a fresh interpreter, started
with `subprocess`, so no user `__main__` is re-run); only metadata crosses, as JSON (the location, file
actions, results), never Arrow data: `write_part` is pyarrow and runs in the child itself.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import math
import os
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from moescope.store.errors import StoreError
from moescope.store.location import StoreLocation, open_location
from moescope.store.naming import WRITER_ROW_GROUP_ROWS, check_name, check_part_name, is_valid_name, parquet_options
from moescope.store.schema import SCHEMAS

__all__ = ["CommitConflictError", "CommitError", "LegacyStoreError", "PartFile", "Snapshot", "StoreAccessError",
           "check_store", "commit", "create_table", "legacy_tables", "snapshot", "table_exists", "transaction_version",
           "vacuum", "write_part"]

log = logging.getLogger(__name__)

PARTITION_COLUMN = "run_id"
# delta-rs's own retries of a conflicting commit (it re-reads the log and re-checks each time);
# appends never conflict with appends, so these only cost the time to read the versions in between.
MAX_COMMIT_RETRIES = 1000
# Our retries around it: a commit that failed for a reason delta-rs does not retry (the object
# store's own retries ran out: 503s, resets) is tried again, with jittered backoff, this often and
# for at most this long.
APP_RETRIES = 8
APP_RETRY_DEADLINE_S = 300.0
BACKOFF_S = (0.05, 5.0)  # first and largest wait between our retries
# Table properties. Checkpoints every 50 commits keep a snapshot read to one checkpoint and a few
# JSON files; app transactions (one per writer process) are forgotten a week after their last use.
TABLE_CONFIGURATION = {
    "delta.checkpointInterval": "50",
    "delta.setTransactionRetentionDuration": "interval 7 days",
}
# Columns whose min/max go into a file's stats (what Delta readers prune on). Floats are left out:
# Parquet's statistics skip NaN, which Spark orders above every number, so a min/max without it
# could prune a file that holds a matching NaN.
_STATS_TYPES = (pa.types.is_integer, pa.types.is_string, pa.types.is_large_string, pa.types.is_timestamp,
                pa.types.is_date)


class CommitError(StoreError):
    """A commit to a table failed after every retry; the message names the table (redacted) and why."""


class CommitConflictError(CommitError):
    """A commit that removes files was refused because one of them is no longer in the table (another
    commit removed it since it was read: a compaction, a prune, a quarantine). Nothing was committed;
    read a new snapshot and decide again."""


class StoreAccessError(StoreError):
    """The store's bucket does not exist, the credentials were refused, or it cannot be reached; the
    message names the location (redacted, never a secret) and what to check."""


class LegacyStoreError(StoreError):
    """The store was written by a release before Delta tables (Parquet folders without a log); the
    message names `moescope store upgrade PATH`."""


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
class Snapshot:
    """One version of a table and its live data files."""

    version: int
    files: list[PartFile]


# -- writing a data file (pyarrow only: safe in a forked child) -------------------------------------

def write_part(loc: StoreLocation | str | os.PathLike, table: str, run_id: str, data: pa.Table, name: str, *,
               row_group_size: int = WRITER_ROW_GROUP_ROWS,
               metadata: Mapping[bytes | str, bytes | str] | None = None) -> PartFile:
    """Write `data` (rows of `table`, run `run_id`) as the file `run_id=<run_id>/<name>` of the table,
    uncommitted: no reader sees it before `commit` adds it. Returns its PartFile (stats from the footer).

    The rows take the table's schema (`store.schema.SCHEMAS`; missing columns are null, `run_id` is
    left out of the file); every page carries a CRC checksum. A local file is fsynced before this
    returns. Raises InvalidNameError (a ValueError) for a table, run id or name that cannot be part
    of a path, KeyError for an unknown table, ValueError for a column the table does not have, and
    OSError when the storage refuses the write (a partial object is never visible on object storage;
    a partial local file is an orphan that `vacuum` removes)."""
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
                _backoff(attempt)
            try:
                size, footer = _write_file(loc, path, data, row_group_size)
                break
            except OSError as e:
                if not _transient(e) or attempt == APP_RETRIES or time.monotonic() > deadline:
                    raise OSError(_message(f"cannot upload {loc.redacted}/{table}/{PARTITION_COLUMN}={run_id}/"
                                           f"{name} after {attempt + 1} tries", e)) from e
                log.info("moescope: upload to %s/%s failed (try %d), retrying: %s", loc.redacted, table,
                         attempt + 1, _clean(e))
    return PartFile(f"{PARTITION_COLUMN}={run_id}/{name}", size, data.num_rows, run_id, file_stats(footer))


def _write_file(loc: StoreLocation, path: str, data: pa.Table, row_group_size: int) -> tuple[int, pq.FileMetaData]:
    """Write `data` as one Parquet file at `path`; returns its size and footer."""
    with _filesystem(loc).open_output_stream(path) as stream:
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


def file_stats(footer: pq.FileMetaData) -> str:
    """The Delta stats of a Parquet file from its footer: numRecords, and per top-level primitive
    column its nullCount and (ints, strings, timestamps, dates) minValues / maxValues."""
    schema = footer.schema.to_arrow_schema()
    index: dict[str, int] = {}
    if footer.num_row_groups:
        group = footer.row_group(0)
        index = {group.column(i).path_in_schema: i for i in range(group.num_columns)}
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for field in schema:
        if pa.types.is_nested(field.type) or field.name not in index:
            continue
        i = index[field.name]
        with_min_max = any(check(field.type) for check in _STATS_TYPES)
        low = high = None
        null_count = 0
        for g in range(footer.num_row_groups):
            st = footer.row_group(g).column(i).statistics
            if st is None or not st.has_null_count:
                null_count = -1
                break
            null_count += st.null_count
            if not with_min_max:
                continue
            if not st.has_min_max:
                if st.null_count < footer.row_group(g).num_rows:  # values without bounds: no min/max at all
                    with_min_max = False
                continue
            low = st.min if low is None else min(low, st.min)
            high = st.max if high is None else max(high, st.max)
        if null_count < 0:
            continue
        nulls[field.name] = null_count
        if with_min_max and low is not None:
            mins[field.name], maxs[field.name] = _stat_value(low, floor=True), _stat_value(high, floor=False)
    return json.dumps({"numRecords": footer.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls},
                      separators=(",", ":"))


def _stat_value(value: Any, floor: bool) -> Any:
    """A Parquet statistic as Delta writes it; timestamps in milliseconds (Delta's precision), the
    minimum rounded down and the maximum up, so the bounds still hold every row."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        value = value.astimezone(dt.timezone.utc)
        micro = value.microsecond % 1000
        if micro:
            value -= dt.timedelta(microseconds=micro)
            if not floor:
                value += dt.timedelta(milliseconds=1)
        return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


_FILESYSTEMS: dict[tuple[str, tuple], Any] = {}


def _filesystem(loc: StoreLocation) -> Any:
    key = (loc.url, tuple(sorted(loc.storage_options.items())))
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        fs = _FILESYSTEMS[key] = loc.filesystem()
    return fs


# -- is the store usable? --------------------------------------------------------------------------

_CHECKED: set[tuple[str, tuple]] = set()


def check_store(loc: StoreLocation | str | os.PathLike) -> None:
    """Check once per process, cheaply, that the store can be used: on object storage one listing
    under the root (the bucket exists, the credentials are accepted, the endpoint answers); on a local
    folder, that it holds no table of the previous release. A writer calls this when it opens, so a
    wrong URL or credentials fail at attach, not at the first flush. Raises StoreAccessError or
    LegacyStoreError (StoreErrors) saying what to do."""
    loc = open_location(loc)
    key = (loc.url, tuple(sorted(loc.storage_options.items())))
    if key in _CHECKED:
        return
    if loc.is_local:
        if os.path.isfile(loc.url) or os.path.isfile(os.path.dirname(loc.url.rstrip(os.sep)) or "."):
            raise StoreAccessError(f"moescope: the store {loc.redacted!r} is a file (or inside one), not a folder: "
                                   f"give a folder to record into, e.g. store='runs/'")
        legacy = legacy_tables(loc)
        if legacy:
            raise LegacyStoreError(
                f"moescope: the store {loc.redacted} was written by an earlier moescope release (tables "
                f"{', '.join(legacy)} are Parquet folders without a Delta log): convert it once with "
                f"`moescope store upgrade {loc.redacted}` (query answers stay the same), then use it again")
    else:
        _check_reachable(loc)
    _CHECKED.add(key)


def legacy_tables(loc: StoreLocation | str | os.PathLike) -> list[str]:
    """Tables of a local store that the previous release wrote: a table folder holding run folders
    (`run_id=...`) but no `_delta_log`. A writer creates a table's log before its first file, so a
    Delta store never looks like this. A folder whose name is not a valid table name (`bad table`)
    is not a table, as the previous release's readers skipped it too. [] for object storage (the
    previous release never wrote there)."""
    loc = open_location(loc)
    if not loc.is_local:
        return []
    try:
        entries = sorted(os.scandir(loc.url), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    legacy = []
    for entry in entries:
        if not is_valid_name(entry.name, "table") or not entry.is_dir():
            continue
        if os.path.exists(os.path.join(entry.path, "_delta_log")):
            continue
        try:
            if any(name.startswith(f"{PARTITION_COLUMN}=") for name in os.listdir(entry.path)):
                legacy.append(entry.name)
        except OSError:
            continue
    return legacy


def _check_reachable(loc: StoreLocation) -> None:
    from pyarrow import fs as pafs

    try:
        _filesystem(loc).get_file_info(pafs.FileSelector(loc.join(), allow_not_found=False, recursive=False))
        return
    except FileNotFoundError:
        return  # nothing under the prefix yet: a new store
    except OSError as e:
        text = str(e)
        upper = text.upper()
        if "NO_SUCH_BUCKET" in upper or "NOSUCHBUCKET" in upper or "BUCKET DOES NOT EXIST" in upper:
            what = ("its bucket does not exist: create the bucket, or fix the URL (a fleet's processes need "
                    "the bucket made beforehand; moescope never creates one)")
        elif any(word in upper for word in ("ACCESS_DENIED", "ACCESSDENIED", "SIGNATURE", "INVALIDACCESSKEY",
                                            "INVALID_ACCESS_KEY", "FORBIDDEN", "403", "EXPIRED", "CREDENTIALS")):
            what = ("the credentials were refused: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or "
                    "AWS_PROFILE, the instance role) in this process's environment, and that they may list "
                    "and write under the prefix")
        else:
            what = ("it could not be reached: check the endpoint and region (--storage-option endpoint=..., "
                    "region=...) and the network")
        raise StoreAccessError(f"moescope: cannot use the store {loc.redacted}: {what} ({_clean(e)})") from e


# -- the Delta log ----------------------------------------------------------------------------------

class _Table:
    """This process's DeltaTable of one table, and the lock that serialises its use (a DeltaTable is
    not safe to use from two threads at once)."""

    def __init__(self, delta_table: Any):
        self.dt = delta_table
        self.lock = threading.Lock()


_TABLES: dict[tuple[str, tuple], _Table] = {}
_TABLES_LOCK = threading.Lock()
_USED = False  # this process started delta-rs's runtime (a child forked from it cannot use it)
_ROUTE = False  # this process is such a child: delta calls go through the helper process
_HELPER: _Helper | None = None
_HELPER_LOCK = threading.Lock()


def _deltalake() -> Any:
    global _USED
    import deltalake

    _USED = True
    return deltalake


def _key(loc: StoreLocation, table: str) -> tuple[str, tuple]:
    return (loc.table_uri(table), tuple(sorted(loc.storage_options.items())))


def _open(loc: StoreLocation, table: str, create: bool) -> _Table | None:
    """The process's cached table; created (empty, schema SCHEMAS[table], partitioned by run) when
    missing and `create`, else None when missing. A transient failure of object storage (a reset, a
    503, a timeout) is retried with backoff; raises StoreError when the storage cannot be read."""
    key = _key(loc, table)
    with _TABLES_LOCK:
        cached = _TABLES.get(key)
    if cached is not None:
        return cached
    deltalake = _deltalake()
    from deltalake.exceptions import TableNotFoundError

    uri, options = loc.table_uri(table), dict(loc.storage_options) or None
    deadline = time.monotonic() + APP_RETRY_DEADLINE_S
    for attempt in range(APP_RETRIES + 1):
        if attempt:
            _backoff(attempt)
        try:
            try:
                delta_table = deltalake.DeltaTable(uri, storage_options=options)
            except TableNotFoundError:
                if not create:
                    return None
                delta_table = _create(loc, table)
            break
        except (OSError, deltalake.exceptions.DeltaError) as e:  # e.g. a file where the table's folder should be
            if loc.is_local or not _transient(e) or attempt == APP_RETRIES or time.monotonic() > deadline:
                what = "create" if create else "read"
                raise StoreError(_message(f"cannot {what} the table {loc.redacted}/{table}", e)) from e
            log.info("moescope: opening %s/%s failed (try %d), retrying: %s", loc.redacted, table, attempt + 1,
                     _clean(e))
    with _TABLES_LOCK:
        return _TABLES.setdefault(key, _Table(delta_table))


def _create(loc: StoreLocation, table: str) -> Any:
    """Create the empty table, or open it if another process created it first (both may try at once:
    the log's version 0 is written with put-if-absent, so exactly one creation wins), or if our own
    creation landed though its answer was lost. Raises what delta-rs raised when neither works."""
    deltalake = _deltalake()
    uri, options = loc.table_uri(table), dict(loc.storage_options) or None
    if table not in SCHEMAS:
        raise StoreError(f"{table!r} is not a table of the store: the tables are {', '.join(SCHEMAS)}")
    if loc.is_local:
        os.makedirs(uri, exist_ok=True)
    try:
        # No commit retries: a creation that loses the race for version 0 must fail and open the
        # winner's table (below), not retry as version 1, a second creation in the log.
        return deltalake.DeltaTable.create(uri, schema=SCHEMAS[table], mode="ignore", partition_by=[PARTITION_COLUMN],
                                           configuration=TABLE_CONFIGURATION, storage_options=options,
                                           commit_properties=deltalake.CommitProperties(max_commit_retries=0))
    except Exception as first:  # lost the race to create it: open the winner's
        try:
            return deltalake.DeltaTable(uri, storage_options=options)
        except Exception:
            raise first from None


_TRANSIENT = ("503", "500 ", "502", "504", "slowdown", "slow down", "reset", "timed out", "timeout", "connection",
              "sending request", "broken pipe", "temporar", "internalerror", "service unavailable", "eof")
_PERMANENT = ("403", "forbidden", "access denied", "accessdenied", "signature", "invalidaccesskey", "nosuchbucket",
              "no_such_bucket", "lacked the necessary privileges", "404 not found")


def _transient(error: BaseException) -> bool:
    """Whether an object-storage error may pass if tried again (a reset, a 5xx, SlowDown, a timeout),
    as opposed to an answer that will not change (refused credentials, a missing bucket)."""
    text = str(error).lower()
    if any(word in text for word in _PERMANENT):
        return False
    return any(word in text for word in _TRANSIENT)


def create_table(loc: StoreLocation | str | os.PathLike, table: str) -> None:
    """Make sure `table` exists (created empty if missing; safe when many processes do it at once).
    A writer does this before it writes the table's first file, so a table folder always has its
    log before its data. Raises StoreError when the storage refuses."""
    loc = open_location(loc)
    check_name("table", table)
    if _routed():
        _call("create_table", loc, table)
        return
    _guarded(lambda: _open(loc, table, create=True), loc, "create_table", table)


def table_exists(loc: StoreLocation | str | os.PathLike, table: str) -> bool:
    """Whether `table` has a Delta log at `loc`. Raises StoreError when the storage cannot be read
    (a missing bucket, wrong credentials)."""
    loc = open_location(loc)
    check_name("table", table)
    if _routed():
        return _call("table_exists", loc, table)
    return _guarded(lambda: _open(loc, table, create=False) is not None, loc, "table_exists", table)


def transaction_version(loc: StoreLocation | str | os.PathLike, table: str, app_id: str) -> int | None:
    """The latest version of app transaction `app_id` the table holds now (None: none, or no table).
    Read before a snapshot, it is at most what that snapshot holds. Raises StoreError when the
    storage cannot be read."""
    loc = open_location(loc)
    check_name("table", table)
    if _routed():
        return _call("transaction_version", loc, table, app_id)
    return _guarded(lambda: _transaction_version(loc, table, app_id), loc, "transaction_version", table, app_id)


def _transaction_version(loc: StoreLocation, table: str, app_id: str) -> int | None:
    cached = _open(loc, table, create=False)
    if cached is None:
        return None
    with cached.lock:
        cached.dt.update_incremental()
        found = cached.dt.transaction_version(app_id)
    return None if found is None else int(found)


def snapshot(loc: StoreLocation | str | os.PathLike, table: str, version: int | None = None, *,
             with_stats: bool = False) -> Snapshot | None:
    """The live data files of `table` at `version` (None: the latest), or None when there is no
    table yet. `with_stats` also fills each file's stats (rebuilt from the log; slower on large
    tables). Raises StoreError when the storage cannot be read or the version does not exist."""
    loc = open_location(loc)
    check_name("table", table)
    if _routed():
        return _call("snapshot", loc, table, version, with_stats=with_stats)
    return _guarded(lambda: _snapshot(loc, table, version, with_stats), loc, "snapshot", table, version,
                    with_stats=with_stats)


def _snapshot(loc: StoreLocation, table: str, version: int | None, with_stats: bool) -> Snapshot | None:
    cached = _open(loc, table, create=False)
    if cached is None:
        return None
    with cached.lock:
        if version is None:
            cached.dt.update_incremental()
            delta_table = cached.dt
        else:
            deltalake = _deltalake()
            try:
                delta_table = deltalake.DeltaTable(loc.table_uri(table), version=version,
                                                   storage_options=dict(loc.storage_options) or None)
            except Exception as e:
                raise StoreError(_message(f"cannot read version {version} of {loc.redacted}/{table}", e)) from e
        return Snapshot(delta_table.version(), _files(delta_table, with_stats))


def _files(delta_table: Any, with_stats: bool) -> list[PartFile]:
    actions = pa.table(delta_table.get_add_actions(flatten=True))
    if not actions.num_rows:
        return []
    paths = actions.column("path").to_pylist()
    sizes = actions.column("size_bytes").to_pylist()
    rows = actions.column("num_records").to_pylist() if "num_records" in actions.column_names else [None] * len(paths)
    partition = f"partition.{PARTITION_COLUMN}"
    runs = actions.column(partition).to_pylist() if partition in actions.column_names else [None] * len(paths)
    times = (actions.column("modification_time").to_pylist() if "modification_time" in actions.column_names
             else [None] * len(paths))
    stats: list[str | None] = [None] * len(paths)
    if with_stats:
        stats = _stats_of(actions)
    return [PartFile(p, int(s), int(r) if r is not None else -1, run, st, None if t is None else int(t))
            for p, s, r, run, st, t in zip(paths, sizes, rows, runs, stats, times)]


def _stats_of(actions: pa.Table) -> list[str | None]:
    """Each file's stats as JSON, rebuilt from the log's flattened add actions."""
    out: list[str | None] = []
    columns = {name: actions.column(name).to_pylist() for name in actions.column_names}
    for i in range(actions.num_rows):
        rows = columns.get("num_records", [None] * actions.num_rows)[i]
        if rows is None:
            out.append(None)
            continue
        found: dict[str, dict[str, Any]] = {"minValues": {}, "maxValues": {}, "nullCount": {}}
        for name, values in columns.items():
            kind, _, column = name.partition(".")
            target = {"min": "minValues", "max": "maxValues", "null_count": "nullCount"}.get(kind)
            if target and column and values[i] is not None:
                found[target][column] = _stat_value(values[i], floor=kind == "min")
        out.append(json.dumps({"numRecords": rows, **found}, separators=(",", ":")))
    return out


def commit(loc: StoreLocation | str | os.PathLike, table: str, adds: Iterable[PartFile] = (),
           removes: Iterable[PartFile | str] = (), *, data_change: bool = True,
           app: tuple[str, int] | None = None, app_unseen: bool = False) -> int:
    """Add `adds` and remove `removes` (files of the table, or their paths) in one atomic Delta
    commit; returns the version it created. Creates the table first if it is missing.

    `data_change=False` marks a rewrite of the same rows (compaction), which streaming readers skip.
    `app=(app_id, seq)`: the commit carries the app transaction, and is not made when the table
    already holds `seq` or a later one for `app_id` (a retry of a commit that landed): then the
    version that holds it is returned. seq must rise with each commit of one app_id to one table.
    `app_unseen=True` says no commit can hold `app` yet (a writer's own app_id, with a seq it has
    not tried before): the first try then does not look for it, which costs a read of every log
    entry since the last checkpoint (on object storage a GET each, up to 49 per commit); a retry
    still looks. Conflicts are retried by delta-rs, then by this function with jittered backoff. Raises
    CommitError (a StoreError) when every retry failed, ValueError for an empty commit."""
    loc = open_location(loc)
    check_name("table", table)
    add_list, remove_list = list(adds), list(removes)
    if not add_list and not remove_list:
        raise ValueError("a commit needs at least one file to add or remove")
    if _routed():
        return _call("commit", loc, table, add_list, remove_list, data_change=data_change, app=app,
                     app_unseen=app_unseen)
    return _guarded(lambda: _commit(loc, table, add_list, remove_list, data_change, app, app_unseen), loc, "commit",
                    table, add_list, remove_list, data_change=data_change, app=app, app_unseen=app_unseen)


def _commit(loc: StoreLocation, table: str, adds: Sequence[PartFile], removes: Sequence[PartFile | str],
            data_change: bool, app: tuple[str, int] | None, app_unseen: bool = False) -> int:
    deltalake = _deltalake()
    from deltalake.transaction import AddAction, CommitProperties, RemoveAction, Transaction

    now_ms = int(time.time() * 1000)
    actions: list[Any] = [AddAction(p.path, p.size, {PARTITION_COLUMN: p.run_id}, now_ms, data_change,
                                    p.stats or json.dumps({"numRecords": p.rows})) for p in adds]
    for p in removes:
        path = p.path if isinstance(p, PartFile) else p
        run_id = p.run_id if isinstance(p, PartFile) else _run_of(path)
        size = p.size if isinstance(p, PartFile) else None
        actions.append(RemoveAction(path, data_change, now_ms, size, {PARTITION_COLUMN: run_id}))
    properties = CommitProperties(
        max_commit_retries=MAX_COMMIT_RETRIES,
        app_transactions=[Transaction(app[0], app[1])] if app else None,
        custom_metadata={"moescope.host": socket.gethostname(), "moescope.pid": os.getpid()})
    deadline = time.monotonic() + APP_RETRY_DEADLINE_S
    last: BaseException | None = None
    for attempt in range(APP_RETRIES + 1):
        if attempt:
            _backoff(attempt)
        try:
            cached = _open(loc, table, create=True)
            assert cached is not None
            with cached.lock:
                delta_table = cached.dt
                delta_table.update_incremental()
                base = delta_table.version()
                if (app is not None and (attempt or not app_unseen)
                        and (delta_table.transaction_version(app[0]) or -1) >= app[1]):
                    return _version_of(loc, table, delta_table, base, app)  # committed by an earlier try
                if removes:
                    _check_live(loc, table, delta_table, removes)
                delta_table.create_write_transaction(actions, mode="append", schema=SCHEMAS[table],
                                                     partition_by=[PARTITION_COLUMN], commit_properties=properties)
                delta_table.update_incremental()
                return _version_of(loc, table, delta_table, base, app, adds[0].path if adds else None)
        except (deltalake.exceptions.DeltaError, OSError, StoreError) as e:
            last = e
            if isinstance(e, deltalake.exceptions.TableNotFoundError):  # deleted under us: open it again
                with _TABLES_LOCK:
                    _TABLES.pop(_key(loc, table), None)
            if isinstance(e, CommitConflictError):
                raise
            if app is not None and _landed(loc, table, app):
                cached = _open(loc, table, create=True)
                assert cached is not None
                with cached.lock:
                    return _version_of(loc, table, cached.dt, -1, app)
            retry = isinstance(e, (deltalake.exceptions.CommitFailedError, deltalake.exceptions.TableNotFoundError))
            if time.monotonic() > deadline or not (retry or (not loc.is_local and _transient(e))):
                break
            log.info("moescope: commit to %s/%s failed (try %d of %d), retrying: %s", loc.redacted, table,
                     attempt + 1, APP_RETRIES + 1, _clean(e))
    what = f"{len(adds)} added and {len(removes)} removed file(s)"
    raise CommitError(_message(f"could not commit {what} to {loc.redacted}/{table} after {attempt + 1} tries "
                               "(check that the store is reachable and writable)", last)) from last


def _check_live(loc: StoreLocation, table: str, delta_table: Any, removes: Sequence[PartFile | str]) -> None:
    """Raise CommitConflictError unless every file to remove is live in `delta_table`'s version.

    delta-rs checks a commit against the commits made since the version its table object read, not
    since the caller read its snapshot; and it accepts a remove of a file that is already gone. A
    rewrite of files someone else removed meanwhile (a compaction of a file a quarantine took out)
    would then add their rows back. From the version checked here on, delta-rs's own conflict check
    takes over."""
    actions = pa.table(delta_table.get_add_actions(flatten=True))
    live = set(actions.column("path").to_pylist()) if actions.num_rows else set()
    gone = [p.path if isinstance(p, PartFile) else p for p in removes]
    gone = [path for path in gone if path not in live]
    if gone:
        raise CommitConflictError(
            f"moescope: not committed to {loc.redacted}/{table}: {len(gone)} file(s) to remove are no longer in "
            f"the table (another commit removed them since they were read, e.g. {gone[0]}): read a new snapshot "
            "and try again")


def _landed(loc: StoreLocation, table: str, app: tuple[str, int]) -> bool:
    """Whether the table holds app transaction `app` (a commit whose answer was lost did land)."""
    try:
        cached = _open(loc, table, create=False)
        if cached is None:
            return False
        with cached.lock:
            cached.dt.update_incremental()
            return (cached.dt.transaction_version(app[0]) or -1) >= app[1]
    except Exception:
        return False


def _version_of(loc: StoreLocation, table: str, delta_table: Any, base: int, app: tuple[str, int] | None,
                first_add: str | None = None) -> int:
    """The version our commit created: the only new one when a single version follows `base`, else
    found in the log (by its app transaction or its first added file) among the latest versions."""
    current = delta_table.version()
    if base >= 0 and current == base + 1:
        return current
    if app is not None:
        needle = f'"txn":{{"appId":{json.dumps(app[0])},"version":{app[1]}'
    elif first_add is not None:
        needle = f'"path":{json.dumps(first_add)}'
    else:
        return current
    fs = _filesystem(loc)
    lowest = max(base + 1 if base >= 0 else 0, current - 100)
    for version in range(current, lowest - 1, -1):
        path = loc.join(table, "_delta_log", f"{version:020d}.json")
        try:
            with fs.open_input_stream(path) as f:
                if needle in f.read().decode("utf-8", "replace").replace(" ", ""):
                    return version
        except OSError:
            break  # cleaned up or unreadable: the latest version is the best answer left
    return current


def _run_of(path: str) -> str:
    first = path.split("/", 1)[0]
    if not first.startswith(f"{PARTITION_COLUMN}="):
        raise ValueError(f"{path!r} is not a data file of a table partitioned by run ({PARTITION_COLUMN}=<id>/...)")
    return first.split("=", 1)[1]


def _backoff(attempt: int) -> None:
    low, high = BACKOFF_S
    time.sleep(random.uniform(0, min(high, low * 2 ** attempt)))  # full jitter: writers spread out


def vacuum(loc: StoreLocation | str | os.PathLike, table: str, retention_hours: float) -> list[str]:
    """Delete the table's files that no version younger than `retention_hours` needs: files removed
    from it (compacted away, pruned) longer ago than that, and, with a retention of at least
    `ORPHAN_MIN_HOURS`, files no commit added (a crashed writer's orphans) older than that. delta-rs
    counts whole hours: the retention is rounded up. Returns the deleted files' paths; [] when there
    is no table. Raises StoreError when the storage refuses."""
    loc = open_location(loc)
    check_name("table", table)
    if retention_hours < 0:
        raise ValueError(f"retention_hours must be >= 0, not {retention_hours}")
    if _routed():
        return _call("vacuum", loc, table, retention_hours)
    return _guarded(lambda: _vacuum(loc, table, retention_hours), loc, "vacuum", table, retention_hours)


# A file no commit added may be one a writer is writing now (written, not yet committed): orphans
# are only deleted past this age, which no write takes.
ORPHAN_MIN_HOURS = 1


def _vacuum(loc: StoreLocation, table: str, retention_hours: float) -> list[str]:
    cached = _open(loc, table, create=False)
    if cached is None:
        return []
    hours = math.ceil(retention_hours)
    with cached.lock:
        cached.dt.update_incremental()
        return list(cached.dt.vacuum(retention_hours=hours, dry_run=False, enforce_retention_duration=False,
                                     full=hours >= ORPHAN_MIN_HOURS))


# -- errors -----------------------------------------------------------------------------------------

_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AZURE_STORAGE_ACCOUNT_KEY",
               "AZURE_STORAGE_SAS_TOKEN", "AZURE_CLIENT_SECRET", "GOOGLE_SERVICE_ACCOUNT_KEY")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_QUERY = re.compile(r"(https?://[^\s?\"']+)\?[^\s\"']*")


def _clean(error: BaseException | None) -> str:
    """An error's text on one line: colours and arrows dropped, URLs' queries cut (they may carry
    signatures), at most 600 characters."""
    if error is None:
        return "unknown error"
    text = _ANSI.sub("", str(error)).replace("↳", "")
    for name in _SECRET_ENV:  # a library that echoed a secret back: never pass it on
        secret = os.environ.get(name)
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    text = _QUERY.sub(r"\1?...", text)
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("<")]
    text = " | ".join(lines) or type(error).__name__
    return f"{type(error).__name__}: {text[:600]}"


def _message(what: str, error: BaseException | None) -> str:
    return f"moescope: {what}: {_clean(error)}"


def _guarded(call: Any, loc: StoreLocation, op: str, *args: Any, **kwargs: Any) -> Any:
    """Run a delta call in this process; a PanicException from a runtime this process inherited
    through a fork (one we could not see being used) switches the process to the helper and retries
    there; an OSError becomes a StoreError naming the table."""
    global _ROUTE
    try:
        return call()
    except StoreError:
        raise
    except Exception as e:
        if not isinstance(e, OSError) and not _is_delta_error(e):
            raise
        raise StoreError(_message(f"{op} on {loc.redacted}/{args[0] if args else ''} failed", e)) from e
    except BaseException as e:
        if type(e).__name__ != "PanicException" or "fork" not in str(e).lower():
            raise
        log.info("moescope: delta-rs's runtime came through a fork; this process now commits through a helper")
        _ROUTE = True
        if "app_unseen" in kwargs:  # whatever the runtime did before it panicked, look before committing again
            kwargs = {**kwargs, "app_unseen": False}
        return _call(op, loc, *args, **kwargs)


def _is_delta_error(error: BaseException) -> bool:
    deltalake = sys.modules.get("deltalake")
    return deltalake is not None and isinstance(error, deltalake.exceptions.DeltaError)


# -- fork safety: the helper process ----------------------------------------------------------------

def _routed() -> bool:
    return _ROUTE


def _after_fork_in_child() -> None:
    """In a forked child: forget the parent's tables and helper; route delta calls through a helper
    of our own if the parent had started delta-rs's runtime (or deltalake was imported by code we
    cannot see, which may have)."""
    global _ROUTE, _HELPER, _TABLES, _TABLES_LOCK, _HELPER_LOCK, _FILESYSTEMS
    _ROUTE = _ROUTE or _USED or "deltalake" in sys.modules
    helper, _HELPER = _HELPER, None
    if helper is not None:
        helper.forget()
    _TABLES = {}
    _TABLES_LOCK = threading.Lock()
    _HELPER_LOCK = threading.Lock()
    _FILESYSTEMS = {}


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Helper:
    """A fresh interpreter that runs this module's delta calls for a forked child. It starts with
    `subprocess` (not multiprocessing's spawn, which re-imports the user's `__main__` and would re-run
    a script without a main guard) and talks over a socket pair in length-prefixed JSON messages
    (`_send`, `_receive`; never pickle); it exits when the child's end closes."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        code = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
                "from moescope.store.delta import _serve; _serve(int(sys.argv[2]))")
        try:
            self.process = subprocess.Popen([sys.executable, "-c", code, json.dumps(sys.path), str(theirs.fileno())],
                                            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        self.connection = ours
        self.lock = threading.Lock()

    def call(self, op: str, args: tuple, kwargs: dict) -> Any:
        with self.lock:
            _send(self.connection, {"op": op, "args": [_encode(a) for a in args],
                                    "kwargs": {k: _encode(v) for k, v in kwargs.items()}})
            answer = _receive(self.connection)
        if "error" in answer:
            error = answer["error"]
            raise _ERRORS.get(error.get("type"), StoreError)(error.get("message", "the delta helper failed"))
        return _decode(answer.get("ok"))

    def forget(self) -> None:
        """In a forked grandchild: close our copy of the connection (the helper is the parent's)."""
        try:
            self.connection.close()
        except OSError:
            pass

    def close(self) -> None:
        self.forget()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _call(op: str, *args: Any, **kwargs: Any) -> Any:
    """Run `op(*args, **kwargs)` of this module in the helper (started on first use; started again,
    once, if it died: a commit retried there is not made twice, its app transaction says so)."""
    global _HELPER
    for attempt in range(2):
        with _HELPER_LOCK:
            if _HELPER is None:
                _HELPER = _Helper()
            helper = _HELPER
        if attempt and "app_unseen" in kwargs:  # the helper that died may have made the commit: look for it
            kwargs = {**kwargs, "app_unseen": False}
        try:
            return helper.call(op, args, kwargs)
        except (EOFError, OSError) as e:
            with _HELPER_LOCK:
                if _HELPER is helper:
                    _HELPER = None
            helper.forget()
            if attempt:
                loc = args[0] if args and isinstance(args[0], StoreLocation) else None
                raise CommitError(_message(f"the delta helper process of this forked process failed during "
                                           f"{op} on {loc.redacted if loc else 'the store'}", e)) from e
    raise AssertionError("unreachable")


def _serve(fd: int) -> None:
    """The helper's loop: answer each {op, args, kwargs} with {"ok": result} or {"error": {type,
    message}}: a StoreError keeps its class (one of this module's), anything else becomes a
    StoreError with the error's cleaned text."""
    connection = socket.socket(fileno=fd)
    ops: dict[str, Callable[..., Any]] = {"commit": commit, "snapshot": snapshot, "table_exists": table_exists,
                                          "vacuum": vacuum, "create_table": create_table,
                                          "transaction_version": transaction_version}
    while True:
        try:
            request = _receive(connection)
        except (EOFError, OSError):
            return
        try:
            args = [_decode(a) for a in request["args"]]
            kwargs = {k: _decode(v) for k, v in request["kwargs"].items()}
            answer: dict[str, Any] = {"ok": _encode(ops[request["op"]](*args, **kwargs))}
        except StoreError as e:
            name = type(e).__name__ if type(e) in _ERRORS.values() else "StoreError"
            answer = {"error": {"type": name, "message": str(e)}}
        except Exception as e:
            answer = {"error": {"type": "StoreError", "message": _clean(e)}}
        try:
            _send(connection, answer)
        except (EOFError, OSError):
            return


# The helper's messages: JSON objects, each sent as its length (4 bytes, big-endian) and its UTF-8 text.
_HEADER = struct.Struct(">I")
_ERRORS: dict[str, type[StoreError]] = {cls.__name__: cls for cls in (
    StoreError, CommitError, CommitConflictError, StoreAccessError, LegacyStoreError)}


def _send(connection: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    connection.sendall(_HEADER.pack(len(body)) + body)


def _receive(connection: socket.socket) -> dict[str, Any]:
    """One message; EOFError when the other end closed."""
    size, = _HEADER.unpack(_read_exactly(connection, _HEADER.size))
    return json.loads(_read_exactly(connection, size).decode("utf-8"))


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = connection.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the delta helper's connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _encode(value: Any) -> Any:
    """A call's argument or result as JSON: scalars and lists as they are; a StoreLocation, a
    PartFile, a Snapshot and a tuple as an object tagged with its kind ("$")."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, StoreLocation):
        return {"$": "location", "url": value.url, "storage_options": dict(value.storage_options)}
    if isinstance(value, PartFile):
        return {"$": "part", **dataclasses.asdict(value)}
    if isinstance(value, Snapshot):
        return {"$": "snapshot", "version": value.version, "files": [_encode(f) for f in value.files]}
    if isinstance(value, tuple):
        return {"$": "tuple", "items": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    raise TypeError(f"the delta helper cannot send a {type(value).__name__}")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get("$")
    if kind == "location":
        return StoreLocation(value["url"], dict(value["storage_options"]))
    if kind == "part":
        return PartFile(**{f.name: value[f.name] for f in dataclasses.fields(PartFile)})
    if kind == "snapshot":
        return Snapshot(int(value["version"]), [_decode(f) for f in value["files"]])
    if kind == "tuple":
        return tuple(_decode(v) for v in value["items"])
    raise ValueError(f"the delta helper got a message it cannot read: {str(value)[:200]}")
