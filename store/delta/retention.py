"""Retention: `vacuum` deletes the files of a table that no recent version needs (files compacted
away or pruned long enough ago) and, past an hour, files no commit added (a crashed writer's orphans).
"""

from __future__ import annotations

import math
import os

from moescope.store.delta.helper import call_helper, guarded, routed
from moescope.store.delta.tables import open_table
from moescope.store.location import StoreLocation, open_location
from moescope.store.naming import check_name

__all__ = ["ORPHAN_MIN_HOURS", "vacuum"]

# A file no commit added may be one a writer is writing now (written, not yet committed): orphans
# are only deleted past this age, which no write takes.
ORPHAN_MIN_HOURS = 1


def vacuum(loc: StoreLocation | str | os.PathLike, table: str, retention_hours: float) -> list[str]:
    """Delete the table's files that no version younger than `retention_hours` needs: files removed
    from it (compacted away, pruned) longer ago than that, and, with a retention of at least
    `ORPHAN_MIN_HOURS`, files no commit added (a crashed writer's orphans) older than that. delta-rs
    counts whole hours: the retention is rounded up.

    Returns:
        The deleted files' paths; [] when there is no table.

    Raises:
        ValueError: a negative retention.
        StoreError: the storage refused.
    """
    loc = open_location(loc)
    check_name("table", table)
    if retention_hours < 0:
        raise ValueError(f"retention_hours must be >= 0, not {retention_hours}")
    if routed():
        return call_helper("vacuum", loc, table, retention_hours)
    return guarded(lambda: _vacuum(loc, table, retention_hours), loc, "vacuum", table, retention_hours)


def _vacuum(loc: StoreLocation, table: str, retention_hours: float) -> list[str]:
    cached = open_table(loc, table, create=False)
    if cached is None:
        return []
    hours = math.ceil(retention_hours)
    with cached.lock:
        cached.latest()
        return list(cached.dt.vacuum(retention_hours=hours, dry_run=False, enforce_retention_duration=False,
                                     full=hours >= ORPHAN_MIN_HOURS))
