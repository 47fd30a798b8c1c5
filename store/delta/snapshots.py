"""Reading a table through its log: which files are live at a version (`snapshot`: the log says,
never a folder listing, so a file nobody committed is invisible), whether the table exists, and
which app transaction it holds.

`snapshot` is also where names enter from a store: every file the log names is checked here
(`moescope.store.naming.stored_name_problem`: its partition value is a valid run id, its path
`run_id=<that run id>/<part name>`) before any command builds a path from it. A file that fails is
left out of `Snapshot.files` (so compaction, prune, quarantine, readers never read, move or rewrite
it), listed in `Snapshot.skipped`, and named once per process in an `InvalidNameWarning`; the rest
of the table reads as before. Someone who may write one store's log cannot make moescope write
outside it.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import TYPE_CHECKING

from moescope.store.delta.errors import message
from moescope.store.delta.helper import call_helper, guarded, routed
from moescope.store.delta.parts import PARTITION_COLUMN, PartFile, SkippedFile, Snapshot
from moescope.store.delta.stats import stats_of
from moescope.store.delta.tables import add_actions, open_table, use_runtime
from moescope.store.delta.transactions import held_version
from moescope.store.errors import StoreError
from moescope.store.location import StoreLocation, open_location
from moescope.store.naming import InvalidNameWarning, check_name, shown_name, stored_name_problem

if TYPE_CHECKING:
    from deltalake import DeltaTable

__all__ = ["snapshot", "table_exists", "transaction_version", "warn_skipped"]

log = logging.getLogger(__name__)

# Skipped files this process has warned of, (store, table, path, run id): each is named once, not at
# every snapshot (a compaction reads several). Bounded by the files of the logs this process reads.
_WARNED: set[tuple[str, str, str, object]] = set()
_WARNED_LOCK = threading.Lock()


def table_exists(loc: StoreLocation | str | os.PathLike, table: str) -> bool:
    """Whether `table` has a Delta log at `loc`.

    Raises:
        StoreError: the storage cannot be read (a missing bucket, wrong credentials).
    """
    loc = open_location(loc)
    check_name("table", table)
    if routed():
        return call_helper("table_exists", loc, table)
    return guarded(lambda: open_table(loc, table, create=False) is not None, loc, "table_exists", table)


def transaction_version(loc: StoreLocation | str | os.PathLike, table: str, app_id: str) -> int | None:
    """The latest version of app transaction `app_id` the table holds now. Read before a snapshot, it
    is at most what that snapshot holds.

    Returns:
        The version (a writer's seq), or None when the table holds none or there is no table.

    Raises:
        StoreError: the storage cannot be read.
    """
    loc = open_location(loc)
    check_name("table", table)
    if routed():
        return call_helper("transaction_version", loc, table, app_id)
    return guarded(lambda: _transaction_version(loc, table, app_id), loc, "transaction_version", table, app_id)


def _transaction_version(loc: StoreLocation, table: str, app_id: str) -> int | None:
    cached = open_table(loc, table, create=False)
    if cached is None:
        return None
    with cached.lock:
        cached.latest()
        return held_version(loc, table, cached.dt, app_id)


def snapshot(loc: StoreLocation | str | os.PathLike, table: str, version: int | None = None, *,
             with_stats: bool = False, app: str | None = None) -> Snapshot | None:
    """The live data files of `table` at a version, as the log says.

    Args:
        loc: the store.
        table: the table.
        version: the version to read; None: the latest. The version this process's table is at
            (the one its last commit made, say) is read without a request.
        with_stats: also fill each file's stats (rebuilt from the log; slower on large tables).
        app: an app id whose latest version at this version to give too (`Snapshot.app_version`,
            read from the same version of the log: a commit that removes these files with
            `app=(app, app_version + 1)` is made only if no such commit came after it).

    Returns:
        The Snapshot, or None when there is no table yet.

    Raises:
        StoreError: the storage cannot be read, or the version does not exist.
    """
    loc = open_location(loc)
    check_name("table", table)
    if routed():
        snap = call_helper("snapshot", loc, table, version, with_stats=with_stats, app=app)
    else:
        snap = guarded(lambda: _snapshot(loc, table, version, with_stats, app), loc, "snapshot", table, version,
                       with_stats=with_stats, app=app)
    if snap is not None and snap.skipped:
        warn_skipped(loc, table, snap.skipped)
    return snap


def warn_skipped(loc: StoreLocation, table: str, skipped: list[SkippedFile]) -> None:
    """Name each skipped file once per process: its table, the offending value and the file, in an
    `InvalidNameWarning` (logged too)."""
    for file in skipped:
        key = (loc.url, table, file.path, file.run_id)
        with _WARNED_LOCK:
            if key in _WARNED:
                continue
            _WARNED.add(key)
        rows = f"Its {file.rows} rows are" if file.rows >= 0 else "Its rows are"
        text = (f"moescope store: table {table!r} of {loc.redacted}: left out the file {shown_name(file.path)}: "
                f"{file.reason}. {rows} not read, and moescope never moves, rewrites or deletes it (another hand "
                f"wrote that log entry, or damaged it: remove it with a Delta tool if it is not yours)")
        log.warning(text)
        warnings.warn(text, InvalidNameWarning, stacklevel=3)


def _snapshot(loc: StoreLocation, table: str, version: int | None, with_stats: bool,
              app: str | None = None) -> Snapshot | None:
    cached = open_table(loc, table, create=False)
    if cached is None:
        return None
    with cached.lock:
        if version is None:
            delta_table = cached.latest()
        elif version == cached.dt.version():
            delta_table = cached.dt  # e.g. the version this process's commit just made: nothing to read
        else:
            use_runtime()
            from deltalake import DeltaTable

            try:
                delta_table = DeltaTable(loc.table_uri(table), version=version,
                                         storage_options=dict(loc.storage_options) or None)
            except Exception as e:
                raise StoreError(message(f"cannot read version {version} of {loc.redacted}/{table}", e)) from e
        files, skipped = _files(delta_table, with_stats)
        held = None
        if app is not None and delta_table is cached.dt:
            held = held_version(loc, table, delta_table, app)
        elif app is not None:
            found = delta_table.transaction_version(app)
            held = None if found is None else int(found)
        return Snapshot(delta_table.version(), files, skipped, held)


def _files(delta_table: DeltaTable, with_stats: bool) -> tuple[list[PartFile], list[SkippedFile]]:
    """The log's live files whose names pass `stored_name_problem`, and those that do not."""
    actions = add_actions(delta_table)
    if not actions.num_rows:
        return [], []
    paths = actions.column("path").to_pylist()
    sizes = actions.column("size_bytes").to_pylist()
    rows = actions.column("num_records").to_pylist() if "num_records" in actions.column_names else [None] * len(paths)
    partition = f"partition.{PARTITION_COLUMN}"
    runs = actions.column(partition).to_pylist() if partition in actions.column_names else [None] * len(paths)
    times = (actions.column("modification_time").to_pylist() if "modification_time" in actions.column_names
             else [None] * len(paths))
    stats: list[str | None] = [None] * len(paths)
    if with_stats:
        stats = stats_of(actions)
    files, skipped = [], []
    seen: set[str] = set()
    for p, s, r, run, st, t in zip(paths, sizes, rows, runs, stats, times):
        if p in seen:  # a live file is one path (Delta's action reconciliation): listed twice, it is read once
            continue
        seen.add(p)
        problem = stored_name_problem(run, p)
        if problem is not None:
            skipped.append(SkippedFile(p, run, int(r) if r is not None else -1, problem))
            continue
        files.append(PartFile(p, int(s), int(r) if r is not None else -1, run, st, None if t is None else int(t)))
    return files, skipped
