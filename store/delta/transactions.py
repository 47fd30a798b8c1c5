"""App transactions: the latest version of an app id a table holds, read once per process and then
only from the log entries committed since.

delta-rs answers `DeltaTable.transaction_version(app_id)` by reading every log entry since the last
checkpoint, one GET each on object storage (up to 49 at a checkpoint every 50 commits), at every
call. A compaction asks at each of its commits, and a fleet's tables take a commit every few
seconds; so this process keeps, per (table, app id), the version it last knew the answer at. A log
entry never changes once written (a commit is a put-if-absent of a new version's file), so the
answer at a later version is the one known plus what the entries since then add: each is read
once, and a commit this process made right after the version it knew is counted without a read.
Where the entries since are many or one cannot be read (cleaned up past the log's retention),
delta-rs answers as before.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING

from moescope.core import forking
from moescope.store.delta.filesystems import filesystem
from moescope.store.location import StoreLocation

if TYPE_CHECKING:
    from deltalake import DeltaTable

__all__ = ["held_version", "record_commit"]

# Past this many entries since the version known, delta-rs's own read (from the last checkpoint) is cheaper.
MAX_ENTRIES_READ = 8

_KNOWN: dict[tuple[str, tuple, str], tuple[int, int | None]] = {}  # (table, options, app) -> (version, txn at it)
_LOCK = threading.Lock()


def _key(loc: StoreLocation, table: str, app_id: str) -> tuple[str, tuple, str]:
    return (loc.table_uri(table), tuple(sorted(loc.storage_options.items())), app_id)


def held_version(loc: StoreLocation, table: str, delta_table: DeltaTable, app_id: str) -> int | None:
    """The latest version of app transaction `app_id` in `delta_table`'s version (None: none).

    The caller holds the table's lock (`moescope.store.delta.tables.OpenTable`) and has brought it to the
    version it asks about. Raises what delta-rs raises when the log cannot be read."""
    current = delta_table.version()
    key = _key(loc, table, app_id)
    with _LOCK:
        known = _KNOWN.get(key)
    found: tuple[bool, int | None] = (False, None)
    if known is not None and known[0] == current:
        return known[1]
    if known is not None and known[0] < current <= known[0] + MAX_ENTRIES_READ:
        found = _read_since(loc, table, app_id, known[0], known[1], current)
    if not found[0]:
        txn = delta_table.transaction_version(app_id)
        found = (True, None if txn is None else int(txn))
    _remember(key, current, found[1])
    return found[1]


def record_commit(loc: StoreLocation, table: str, app: tuple[str, int], version: int) -> None:
    """Note that `version` is this process's commit carrying `app` (the only version after the one
    it was made from): the answer there is `app`'s (an app id's latest entry is its answer), no read needed."""
    _remember(_key(loc, table, app[0]), version, app[1])


def _remember(key: tuple[str, tuple, str], version: int, txn: int | None) -> None:
    with _LOCK:
        _KNOWN[key] = (version, txn)


def _read_since(loc: StoreLocation, table: str, app_id: str, since: int, txn: int | None,
                current: int) -> tuple[bool, int | None]:
    """(True, the answer at `current`) from the answer at `since` and the entries after it, read
    here; (False, None) when one cannot be read."""
    fs = filesystem(loc)
    for version in range(since + 1, current + 1):
        path = loc.join(table, "_delta_log", f"{version:020d}.json")
        try:
            with fs.open_input_stream(path) as f:
                text = f.read().decode("utf-8")
        except OSError:
            return False, None
        for line in text.splitlines():
            if '"txn"' not in line:
                continue
            try:
                action = json.loads(line).get("txn")
            except ValueError:
                return False, None
            if isinstance(action, dict) and action.get("appId") == app_id and isinstance(action.get("version"), int):
                txn = action["version"]  # the latest entry of an app id is its answer
    return True, txn


def _reset_in_child() -> None:
    global _LOCK
    _KNOWN.clear()
    _LOCK = threading.Lock()


forking.join_module(_reset_in_child)
