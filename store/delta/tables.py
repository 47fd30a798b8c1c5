"""This process's open Delta tables: one `DeltaTable` per table and location, opened (or created)
once and then brought up to date before each use, with the lock that serialises its use.

Opening a table is the first use of delta-rs's runtime in a process (`use_runtime`); a child forked
after that cannot use it and goes through the helper process (`moescope.store.delta.helper`). A forked child
forgets the parent's tables.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import pyarrow as pa

from moescope.core import forking
from moescope.store.delta.errors import clean, message
from moescope.store.delta.parts import PARTITION_COLUMN
from moescope.store.delta.retries import APP_RETRIES, APP_RETRY_DEADLINE_S, backoff, transient
from moescope.store.errors import StoreError
from moescope.store.location import StoreLocation
from moescope.store.schema import SCHEMAS

if TYPE_CHECKING:
    from deltalake import DeltaTable

__all__ = ["TABLE_CONFIGURATION", "OpenTable", "add_actions", "forget_table", "open_table", "runtime_used",
           "use_runtime"]

log = logging.getLogger(__name__)

# Table properties. Checkpoints every 50 commits keep a snapshot read to one checkpoint and a few
# JSON files; app transactions (one per writer process) are forgotten a week after their last use.
TABLE_CONFIGURATION = {
    "delta.checkpointInterval": "50",
    "delta.setTransactionRetentionDuration": "interval 7 days",
}


def add_actions(delta_table: DeltaTable) -> pa.Table:
    """The table's live add actions (`get_add_actions(flatten=True)`) as a pyarrow Table, read from the
    Arrow stream delta-rs hands over: `pa.table()` would first ask whether it is a pandas DataFrame,
    importing pandas (about 0.5 s) into a process that needs none, such as `moescope compact`."""
    return pa.RecordBatchReader.from_stream(delta_table.get_add_actions(flatten=True)).read_all()


class OpenTable:
    """This process's DeltaTable of one table, and the lock that serialises its use (a DeltaTable is
    not safe to use from two threads at once)."""

    def __init__(self, delta_table: DeltaTable):
        self.dt = delta_table
        self.lock = threading.Lock()
        # Just opened by the `open_table` call that returned it: the open read the latest version, so
        # its first use needs no update (`latest`). Any later `open_table` of the table clears it.
        self.just_opened = True

    def latest(self) -> DeltaTable:
        """The table brought up to its latest version: a listing of the log past its version (and the
        new entries), unless the `open_table` call that returned it has just opened it. Hold `lock`."""
        if self.just_opened:
            self.just_opened = False
        else:
            self.dt.update_incremental()
        return self.dt


_TABLES: dict[tuple[str, tuple], OpenTable] = {}
_TABLES_LOCK = threading.Lock()
_USED = False  # this process started delta-rs's runtime (a child forked from it cannot use it)


def use_runtime() -> None:
    """Import deltalake before a call into delta-rs, noting that this process has started its runtime
    (which a child forked from now on inherits and cannot use)."""
    global _USED
    import deltalake  # noqa: F401 - the import starts nothing; what follows it does

    _USED = True


def runtime_used() -> bool:
    """Whether this process has started delta-rs's runtime (`use_runtime`)."""
    return _USED


def _key(loc: StoreLocation, table: str) -> tuple[str, tuple]:
    return (loc.table_uri(table), tuple(sorted(loc.storage_options.items())))


def open_table(loc: StoreLocation, table: str, create: bool) -> OpenTable | None:
    """The process's cached table; created (empty, schema SCHEMAS[table], partitioned by run) when
    missing and `create`, else None when missing. A transient failure of object storage (a reset, a
    503, a timeout) is retried with backoff; raises StoreError when the storage cannot be read."""
    key = _key(loc, table)
    with _TABLES_LOCK:
        cached = _TABLES.get(key)
    if cached is not None:
        cached.just_opened = False  # opened before this call: it may be behind the log
        return cached
    use_runtime()
    from deltalake import DeltaTable
    from deltalake.exceptions import DeltaError, TableNotFoundError

    uri, options = loc.table_uri(table), dict(loc.storage_options) or None
    deadline = time.monotonic() + APP_RETRY_DEADLINE_S
    created = False
    for attempt in range(APP_RETRIES + 1):
        if attempt:
            backoff(attempt)
        try:
            try:
                delta_table = DeltaTable(uri, storage_options=options)
            except TableNotFoundError:
                if not create:
                    return None
                delta_table, created = _create(loc, table), True
            break
        except (OSError, DeltaError) as e:  # e.g. a file where the table's folder should be
            if loc.is_local or not transient(e) or attempt == APP_RETRIES or time.monotonic() > deadline:
                what = "create" if create else "read"
                raise StoreError(message(f"cannot {what} the table {loc.redacted}/{table}", e)) from e
            log.info("moescope: opening %s/%s failed (try %d), retrying: %s", loc.redacted, table, attempt + 1,
                     clean(e))
    opened = OpenTable(delta_table)
    # a creation that found the table made by another process may hold an earlier version than the log's
    opened.just_opened = not created
    with _TABLES_LOCK:
        return _TABLES.setdefault(key, opened)


def forget_table(loc: StoreLocation, table: str) -> None:
    """Drop the cached table (deleted under us): the next use opens it again."""
    with _TABLES_LOCK:
        _TABLES.pop(_key(loc, table), None)


def _create(loc: StoreLocation, table: str) -> DeltaTable:
    """Create the empty table, or open it if another process created it first (both may try at once:
    the log's version 0 is written with put-if-absent, so exactly one creation wins), or if our own
    creation landed though its answer was lost. Raises what delta-rs raised when neither works."""
    use_runtime()
    from deltalake import CommitProperties, DeltaTable

    uri, options = loc.table_uri(table), dict(loc.storage_options) or None
    if table not in SCHEMAS:
        raise StoreError(f"{table!r} is not a table of the store: the tables are {', '.join(SCHEMAS)}")
    if loc.is_local:
        os.makedirs(uri, exist_ok=True)
    try:
        # No commit retries: a creation that loses the race for version 0 must fail and open the
        # winner's table (below), not retry as version 1, a second creation in the log.
        return DeltaTable.create(uri, schema=SCHEMAS[table], mode="ignore", partition_by=[PARTITION_COLUMN],
                                 configuration=TABLE_CONFIGURATION, storage_options=options,
                                 commit_properties=CommitProperties(max_commit_retries=0))
    except Exception as first:  # lost the race to create it: open the winner's
        try:
            return DeltaTable(uri, storage_options=options)
        except Exception:
            raise first from None


def _reset_in_child() -> None:
    """In a forked child: forget the parent's tables (their DeltaTables live in a runtime the child lacks)."""
    global _TABLES, _TABLES_LOCK
    _TABLES = {}
    _TABLES_LOCK = threading.Lock()


forking.join_module(_reset_in_child)
