"""Each table of a store is a Delta Lake table; this package is the one place that talks to delta-rs.

    <store>/<table>/_delta_log/                              the table's log (delta-rs commits it)
    <store>/<table>/run_id=<id>/part-<...>.parquet           data files, partitioned by run

A write is two steps: `write_part` writes one Parquet file with pyarrow (our row groups, page
checksums, key-value metadata; the partition column `run_id` lives in the folder name, not in the
file), then `commit` adds the files to the table in one atomic Delta commit. A file nobody
committed is invisible to every reader (they read a `snapshot`, never a folder listing), so a crash
between the two steps leaves an orphan for `vacuum`, never a torn or duplicated row. A forked child
of a process that used delta-rs makes its delta calls through a helper process (`helper`).
One module per idea:

    parts        the data files: write_part (pyarrow only), PartFile, Snapshot, SkippedFile
    stats        a data file's Delta stats, from its footer or from the log
    commits      writing the log: create_table, commit (retries, app transactions), checkpoint
    snapshots    reading the log (names from it checked): snapshot, table_exists, transaction_version
    retention    vacuum: removed files and orphans past their retention
    access       is the store usable: reachable, and not a previous release's (legacy_tables); its tables' folders
    tables       this process's open DeltaTables, and whether it started delta-rs's runtime
    helper       fork safety: the helper process a forked child routes its delta calls through
    messages     what crosses between a child and its helper (length-prefixed JSON)
    retries      how often and for how long object storage is tried again
    errors       the exceptions, and error text safe to show
    filesystems  this process's pyarrow filesystem per location

Callers use `from moescope.store import delta` and `delta.commit(...)`: the names below are the
package's surface, and a test that wraps `delta.commit` sees every call made through it.
"""

from __future__ import annotations

from moescope.store.delta.access import check_store as check_store
from moescope.store.delta.access import legacy_tables as legacy_tables
from moescope.store.delta.access import table_folders as table_folders
from moescope.store.delta.commits import MAX_COMMIT_RETRIES as MAX_COMMIT_RETRIES
from moescope.store.delta.commits import checkpoint as checkpoint
from moescope.store.delta.commits import commit as commit
from moescope.store.delta.commits import create_table as create_table
from moescope.store.delta.errors import CommitConflictError as CommitConflictError
from moescope.store.delta.errors import CommitError as CommitError
from moescope.store.delta.errors import LegacyStoreError as LegacyStoreError
from moescope.store.delta.errors import StoreAccessError as StoreAccessError
from moescope.store.delta.parts import PARTITION_COLUMN as PARTITION_COLUMN
from moescope.store.delta.parts import PartFile as PartFile
from moescope.store.delta.parts import SkippedFile as SkippedFile
from moescope.store.delta.parts import Snapshot as Snapshot
from moescope.store.delta.parts import write_part as write_part
from moescope.store.delta.retention import ORPHAN_MIN_HOURS as ORPHAN_MIN_HOURS
from moescope.store.delta.retention import vacuum as vacuum
from moescope.store.delta.retries import APP_RETRIES as APP_RETRIES
from moescope.store.delta.retries import APP_RETRY_DEADLINE_S as APP_RETRY_DEADLINE_S
from moescope.store.delta.retries import BACKOFF_S as BACKOFF_S
from moescope.store.delta.snapshots import snapshot as snapshot
from moescope.store.delta.snapshots import table_exists as table_exists
from moescope.store.delta.snapshots import transaction_version as transaction_version
from moescope.store.delta.snapshots import warn_skipped as warn_skipped
from moescope.store.delta.stats import file_stats as file_stats
from moescope.store.delta.tables import TABLE_CONFIGURATION as TABLE_CONFIGURATION

__all__ = ["APP_RETRIES", "APP_RETRY_DEADLINE_S", "BACKOFF_S", "MAX_COMMIT_RETRIES", "ORPHAN_MIN_HOURS",
           "PARTITION_COLUMN", "TABLE_CONFIGURATION", "CommitConflictError", "CommitError", "LegacyStoreError",
           "PartFile", "SkippedFile", "Snapshot", "StoreAccessError", "check_store", "checkpoint", "commit",
           "create_table", "file_stats", "legacy_tables", "snapshot", "table_exists", "table_folders",
           "transaction_version", "vacuum", "warn_skipped", "write_part"]
