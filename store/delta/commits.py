"""Writing a table's log: making sure a table exists, and `commit`, the second step of a write,
which adds written files to the table (and removes rewritten ones) in one atomic Delta commit; and
`checkpoint`, which sums the log up to a version in one object.

Commits from many processes and hosts race on the log's next version; delta-rs retries a conflict
itself (`MAX_COMMIT_RETRIES`), and `commit` retries again with jittered backoff when that runs out.
A commit whose answer was lost (the PUT landed, the client saw an error) is resolved with an app
transaction: a writer commits with `app=(app_id, seq)`, seq rising per table, and a retry that finds
the table's app version `>= seq` (`moescope.store.delta.transactions`) knows its commit is in and
does not commit it twice.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from moescope.store.delta.errors import CommitConflictError, CommitError, clean, message
from moescope.store.delta.filesystems import filesystem
from moescope.store.delta.helper import call_helper, guarded, routed
from moescope.store.delta.parts import PARTITION_COLUMN, PartFile, run_of
from moescope.store.delta.retries import APP_RETRIES, APP_RETRY_DEADLINE_S, backoff, transient
from moescope.store.delta.tables import add_actions, forget_table, open_table, use_runtime
from moescope.store.delta.transactions import held_version, record_commit
from moescope.store.errors import StoreError
from moescope.store.location import StoreLocation, open_location
from moescope.store.naming import check_name
from moescope.store.schema import SCHEMAS

if TYPE_CHECKING:
    from deltalake import DeltaTable

__all__ = ["MAX_COMMIT_RETRIES", "checkpoint", "commit", "create_table"]

log = logging.getLogger(__name__)

# delta-rs's own retries of a conflicting commit (it re-reads the log and re-checks each time);
# appends never conflict with appends, so these only cost the time to read the versions in between.
MAX_COMMIT_RETRIES = 1000


def create_table(loc: StoreLocation | str | os.PathLike, table: str) -> None:
    """Make sure `table` exists (created empty if missing; safe when many processes do it at once).
    A writer does this before it writes the table's first file, so a table folder always has its
    log before its data.

    Raises:
        StoreError: the storage refused, or `table` is not a table of the store.
        InvalidNameError: a table name that cannot be part of a path.
    """
    loc = open_location(loc)
    check_name("table", table)
    if routed():
        call_helper("create_table", loc, table)
        return
    guarded(lambda: open_table(loc, table, create=True), loc, "create_table", table)


def commit(loc: StoreLocation | str | os.PathLike, table: str, adds: Iterable[PartFile] = (),
           removes: Iterable[PartFile | str] = (), *, data_change: bool = True,
           app: tuple[str, int] | None = None, app_unseen: bool = False) -> int:
    """Add `adds` and remove `removes` in one atomic Delta commit, creating the table first if it is
    missing. Conflicts are retried by delta-rs, then by this function with jittered backoff.

    Args:
        loc: the store.
        table: the table.
        adds: files written by `write_part` to add.
        removes: files of the table (or their paths) to remove; each must still be live.
        data_change: False marks a rewrite of the same rows (compaction), which streaming readers skip.
        app: (app_id, seq): the commit carries the app transaction, and is not made when the table
            already holds `seq` or a later one for `app_id` (a retry of a commit that landed). seq
            must rise with each commit of one app_id to one table.
        app_unseen: no commit can hold `app` yet (a writer's own app_id, with a seq it has not tried
            before): the first try then does not look for it, which saves a read of every log entry
            since the last checkpoint (on object storage a GET each, up to 49 per commit); a retry
            still looks.

    Returns:
        The version the commit created, or, when `app` was already in, the version that holds it.

    Raises:
        CommitError: (a StoreError) every retry failed.
        CommitConflictError: (a CommitError) a file to remove is no longer in the table; nothing
            was committed.
        ValueError: an empty commit, or a removed path outside a run's folder.
    """
    loc = open_location(loc)
    check_name("table", table)
    add_list, remove_list = list(adds), list(removes)
    if not add_list and not remove_list:
        raise ValueError("a commit needs at least one file to add or remove")
    if routed():
        return call_helper("commit", loc, table, add_list, remove_list, data_change=data_change, app=app,
                           app_unseen=app_unseen)
    return guarded(lambda: _commit(loc, table, add_list, remove_list, data_change, app, app_unseen), loc, "commit",
                   table, add_list, remove_list, data_change=data_change, app=app, app_unseen=app_unseen)


def _commit(loc: StoreLocation, table: str, adds: Sequence[PartFile], removes: Sequence[PartFile | str],
            data_change: bool, app: tuple[str, int] | None, app_unseen: bool = False) -> int:
    use_runtime()
    from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
    from deltalake.transaction import AddAction, CommitProperties, RemoveAction, Transaction

    now_ms = int(time.time() * 1000)
    actions: list[AddAction | RemoveAction] = [
        AddAction(p.path, p.size, {PARTITION_COLUMN: p.run_id}, now_ms, data_change,
                  p.stats or json.dumps({"numRecords": p.rows})) for p in adds]
    for p in removes:
        path = p.path if isinstance(p, PartFile) else p
        run_id = p.run_id if isinstance(p, PartFile) else run_of(path)
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
            backoff(attempt)
        try:
            cached = open_table(loc, table, create=True)
            assert cached is not None
            with cached.lock:
                delta_table = cached.latest()
                base = delta_table.version()
                if (app is not None and (attempt or not app_unseen)
                        and (held_version(loc, table, delta_table, app[0]) or -1) >= app[1]):
                    return _version_of(loc, table, delta_table, base, app)  # committed by an earlier try
                if removes:
                    _check_live(loc, table, delta_table, removes)
                delta_table.create_write_transaction(actions, mode="append", schema=SCHEMAS[table],
                                                     partition_by=[PARTITION_COLUMN], commit_properties=properties)
                delta_table.update_incremental()
                made = _version_of(loc, table, delta_table, base, app, adds[0].path if adds else None)
                if app is not None and made == base + 1 == delta_table.version():
                    record_commit(loc, table, app, made)
                return made
        except (DeltaError, OSError, StoreError) as e:
            last = e
            if isinstance(e, TableNotFoundError):  # deleted under us: open it again
                forget_table(loc, table)
            if isinstance(e, CommitConflictError):
                raise
            if app is not None and _landed(loc, table, app):
                cached = open_table(loc, table, create=True)
                assert cached is not None
                with cached.lock:
                    return _version_of(loc, table, cached.dt, -1, app)
            retry = isinstance(e, (CommitFailedError, TableNotFoundError))
            if time.monotonic() > deadline or not (retry or (not loc.is_local and transient(e))):
                break
            log.info("moescope: commit to %s/%s failed (try %d of %d), retrying: %s", loc.redacted, table,
                     attempt + 1, APP_RETRIES + 1, clean(e))
    what = f"{len(adds)} added and {len(removes)} removed file(s)"
    raise CommitError(message(f"could not commit {what} to {loc.redacted}/{table} after {attempt + 1} tries "
                              "(check that the store is reachable and writable)", last)) from last


def checkpoint(loc: StoreLocation | str | os.PathLike, table: str) -> int | None:
    """Write a checkpoint of the table's latest version (its live files and app transactions in one
    Parquet object, named in `_delta_log/_last_checkpoint`): whoever opens the table next reads it and
    the commits after it, not every commit since the last checkpoint (delta-rs writes one itself every
    `delta.checkpointInterval` commits, `TABLE_CONFIGURATION`). It changes no version: a reader or
    writer at any version reads the same files. Returns the version, or None when there is no table.

    Raises:
        StoreError: the storage refused.
    """
    loc = open_location(loc)
    check_name("table", table)
    if routed():
        return call_helper("checkpoint", loc, table)
    return guarded(lambda: _checkpoint(loc, table), loc, "checkpoint", table)


def _checkpoint(loc: StoreLocation, table: str) -> int | None:
    cached = open_table(loc, table, create=False)
    if cached is None:
        return None
    with cached.lock:
        delta_table = cached.latest()
        delta_table.create_checkpoint()
        return delta_table.version()


def _check_live(loc: StoreLocation, table: str, delta_table: DeltaTable, removes: Sequence[PartFile | str]) -> None:
    """Raise CommitConflictError unless every file to remove is live in `delta_table`'s version.

    delta-rs checks a commit against the commits made since the version its table object read, not
    since the caller read its snapshot; and it accepts a remove of a file that is already gone. A
    rewrite of files someone else removed meanwhile (a compaction of a file a quarantine took out)
    would then add their rows back. From the version checked here on, delta-rs's own conflict check
    takes over."""
    actions = add_actions(delta_table)
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
        cached = open_table(loc, table, create=False)
        if cached is None:
            return False
        with cached.lock:
            cached.latest()
            return (held_version(loc, table, cached.dt, app[0]) or -1) >= app[1]
    except Exception:
        return False


def _version_of(loc: StoreLocation, table: str, delta_table: DeltaTable, base: int, app: tuple[str, int] | None,
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
    fs = filesystem(loc)
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
