"""`moescope store upgrade PATH`: a store of the previous release, converted in place to Delta tables.

The previous release (before Delta tables) kept each table as Parquet folders with its own commit
protocol, and only on local disks:

    <root>/<table>/run_id=<id>/part-<rank>-<pid>-<seq>-<ns>.parquet    a writer's file (run_id inside too)
    <root>/<table>/run_id=<id>/part-compacted-<ns>-<uuid>.parquet     a merged file; its footer's
        key "moescope.replaces" names the files of its folder it replaces (left out by its readers)
    <root>/<table>/run_id=<id>/.tmp-<name>.inprogress                  a write in flight, or a crash's
    <root>/_quarantine/..., <root>/_locks/, <root>/_trash/             bad files, compaction locks, a prune's

Readers and writers of this release refuse such a store (`moescope.store.delta.LegacyStoreError`), so
nothing is rewritten until this command runs. Per table it resolves what the previous readers
read: every `part-*.parquet` whose footer reads and whose pages pass their checksums, less the
files a good merged file replaces; those are rewritten beside the originals as the files of a Delta
table (`<name without .parquet>-delta.parquet`: the same rows in the same order and row groups,
every column of the table's schema, `run_id` only in the folder name as Delta wants it, page
checksums) and added in one commit; then the originals are deleted. Why rewrite rather than commit
the old files as they are: every file of a table then has one physical schema, the table's, as a
Delta writer leaves it (the partition column only in the log and the folder; columns added since an
old file was written present as nulls; the old footer keys gone), so an engine that takes a table's
columns from one file (Spark without mergeSchema, a fixed-schema Dask read) reads every file alike,
and no reader has to decide between a file's run_id and the log's. It costs one read and one write
of the store, once. Files the previous readers left out are deleted: replaced sources,
`.tmp-*.inprogress` files; bad files are moved to `_quarantine/` with their reason and their rows
(where the footer says) counted as lost in `probe_stats` (reason `quarantined`). The old
`_quarantine/` folder moves as it is to `_previous-release/quarantine/`, folders of tables this
release does not know to `_previous-release/<table>/`; `_locks/` and `_trash/` are deleted.

Crash safety: before a table's first file is written, `_upgrade/<table>.json` lists the files it
will replace and create; run the command again after a crash and it finishes the table (the
commit was made: the originals are deleted) or starts it again (it was not: the new files are
deleted). Stop every writer of the store before upgrading: a writer of the previous release would
go on writing files no Delta reader sees.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import shutil
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from moescope.store import delta
from moescope.store.catalog import count_lost
from moescope.store.errors import EmptyStoreError, StoreError
from moescope.store.location import StoreLocation, open_location
from moescope.store.naming import QUARANTINE_DIR, is_valid_name, parquet_options
from moescope.store.schema import SCHEMAS

log = logging.getLogger(__name__)

REPLACES_KEY = b"moescope.replaces"  # the previous release's merged-file footer key
TMP_PREFIX = ".tmp-"
UPGRADE_DIR = "_upgrade"
ASIDE_DIR = "_previous-release"
SUFFIX = "-delta.parquet"


class UpgradeError(StoreError):
    """A store could not be upgraded; the message says what to do (nothing was committed for that table)."""


@dataclass
class TableUpgrade:
    table: str
    files: int = 0  # files the table's Delta version holds (rewritten)
    rows: int = 0
    replaced: int = 0  # merged files' sources left out and deleted
    in_flight: int = 0  # .tmp-*.inprogress files deleted
    bad: list[str] = field(default_factory=list)  # moved to _quarantine (paths)
    dropped_columns: list[str] = field(default_factory=list)  # columns no schema of this release has
    version: int | None = None


@dataclass
class UpgradeReport:
    root: str
    tables: list[TableUpgrade] = field(default_factory=list)
    moved_aside: list[str] = field(default_factory=list)  # paths under _previous-release/

    @property
    def upgraded(self) -> bool:
        return bool(self.tables or self.moved_aside)


@dataclass
class _OldFile:
    name: str
    run_id: str
    path: str
    rows: int | None = None  # from the footer, when it reads
    replaces: tuple[str, ...] = ()
    error: str = ""  # why the footer does not read


class _BadFile(Exception):
    """An old file that does not read through (a damaged page, a short column): it goes to quarantine."""


def upgrade(store: str | os.PathLike | StoreLocation) -> UpgradeReport:
    """Convert a store of the previous release to Delta tables in place (see the module docstring);
    returns what was done (nothing for a store that is already converted). Raises EmptyStoreError
    for a missing folder, UpgradeError for a store on object storage (the previous release wrote
    only local folders) or a table whose files cannot be converted, OSError when the disk refuses."""
    location = open_location(store)
    if not location.is_local:
        raise UpgradeError(f"moescope store upgrade: {location.redacted} is on object storage; stores of the previous "
                           "release were local folders, and a store on object storage is already in Delta tables")
    root = location.url
    if not os.path.isdir(root):
        raise EmptyStoreError(f"there is no store at {root!r} to upgrade")
    report = UpgradeReport(root)
    pending = _pending(root)
    legacy = [t for t in delta.legacy_tables(location) if t not in pending]
    if not legacy and not pending:
        return report
    if not pending:  # the first run of an upgrade: the old quarantine goes aside before any file moves
        _move_aside(root, QUARANTINE_DIR, "quarantine", report)
        os.makedirs(os.path.join(root, UPGRADE_DIR), exist_ok=True)
    lost: list[tuple[str, delta.PartFile]] = []  # (table, file) of bad files whose rows the footer gives
    for table in sorted(set(legacy) | set(pending)):
        if table not in SCHEMAS:
            _move_aside(root, table, table, report)
            continue
        report.tables.append(_upgrade_table(location, table, lost))
    for table, part in lost:  # probe_stats is a Delta table by now
        count_lost(location, table, part)
    for folder in ("_locks", "_trash", UPGRADE_DIR):
        shutil.rmtree(os.path.join(root, folder), ignore_errors=True)
    return report


def _pending(root: str) -> list[str]:
    """Tables whose upgrade started and did not finish (their plan is still in `_upgrade/`)."""
    try:
        names = os.listdir(os.path.join(root, UPGRADE_DIR))
    except FileNotFoundError:
        return []
    return sorted(n[:-len(".json")] for n in names if n.endswith(".json") and is_valid_name(n[:-len(".json")], "table"))


def _move_aside(root: str, name: str, target: str, report: UpgradeReport) -> None:
    source = os.path.join(root, name)
    if not os.path.exists(source):
        return
    destination = os.path.join(root, ASIDE_DIR, target)
    if os.path.exists(destination):
        destination += "-" + dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    os.replace(source, destination)
    report.moved_aside.append(destination)
    log.warning("moescope store upgrade: moved %s to %s, as it was", source, destination)


def _plan_path(root: str, table: str) -> str:
    return os.path.join(root, UPGRADE_DIR, f"{table}.json")


def _upgrade_table(location: StoreLocation, table: str, lost: list[tuple[str, delta.PartFile]]) -> TableUpgrade:
    root = location.url
    result = TableUpgrade(table)
    plan_path = _plan_path(root, table)
    if os.path.exists(plan_path):
        with open(plan_path) as saved:
            plan = json.load(saved)
        created = set(plan["create"])
        snap = delta.snapshot(location, table)
        if snap is not None and created and created <= {p.path for p in snap.files}:
            _delete(root, table, plan["delete"])  # committed before the crash: finish the table
            os.remove(plan_path)
            result.files, result.rows, result.version = len(created), sum(p.rows for p in snap.files), snap.version
            return result
        live = {p.path for p in snap.files} if snap is not None else set()
        if live:  # a Delta table with files was never this plan's: the plan is not ours, the table is left as it is
            log.warning("moescope store upgrade: %s names files table %s does not hold, and the table is a Delta "
                        "table already: the plan was not written by an upgrade of this store; removed it, nothing "
                        "else touched", plan_path, table)
            os.remove(plan_path)
            result.files, result.version = len(live), snap.version if snap is not None else None
            return result
        _delete(root, table, [p for p in plan["create"] if p not in live])  # not committed: start again
        os.remove(plan_path)
    old = _old_files(root, table)
    plan = {"delete": sorted(f"run_id={f.run_id}/{f.name}" for f in old) + _in_flight(root, table),
            "create": sorted(f"run_id={f.run_id}/{f.name[:-len('.parquet')]}{SUFFIX}" for f in old)}
    _write_json(plan_path, plan)
    result.in_flight = len(_in_flight(root, table))
    readable = {(f.run_id, f.name): f for f in old if f.rows is not None}
    for f in old:
        if f.rows is None:  # its rows are unknown: nothing to count
            result.bad.append(_quarantine(root, table, f, f"unreadable footer: {f.error}"))
    adds: dict[tuple[str, str], delta.PartFile] = {}
    bad: set[tuple[str, str]] = set()
    dropped: set[str] = set()
    while True:  # the previous readers' rule: a good file's `replaces` leave its folder's sources out
        replaced = {(f.run_id, name) for key, f in readable.items() if key not in bad for name in f.replaces}
        todo = [key for key in readable if key not in bad and key not in replaced and key not in adds]
        if not todo:
            break
        for key in todo:
            f = readable[key]
            try:
                adds[key] = _rewrite(location, table, f, dropped)
            except _BadFile as e:
                bad.add(key)
                lost.append((table, delta.PartFile(f"run_id={f.run_id}/{f.name}", 0, f.rows or 0, f.run_id)))
                result.bad.append(_quarantine(root, table, f, f"damaged data: {e}"))
    if adds:
        result.version = delta.commit(location, table, adds=list(adds.values()))
    else:  # no file to keep: an empty table, so the folder is no longer one of the previous release
        delta.create_table(location, table)
        empty = delta.snapshot(location, table)
        result.version = empty.version if empty is not None else None
    result.files = len(adds)
    result.rows = sum(p.rows for p in adds.values())
    result.replaced = sum(1 for key in readable if key in replaced and key not in bad)
    result.dropped_columns = sorted(dropped)
    _delete(root, table, plan["delete"])
    os.remove(plan_path)
    return result


def _old_files(root: str, table: str) -> list[_OldFile]:
    """Every `part-*.parquet` of the table's run folders, with its footer's rows and replaces
    (rows None: the footer does not read, or names files outside its folder; the reason in replaces)."""
    folder = os.path.join(root, table)
    found = []
    for entry in sorted(os.listdir(folder)):
        if not entry.startswith("run_id="):
            continue
        run_id = entry[len("run_id="):]
        if not is_valid_name(run_id):
            log.warning("moescope store upgrade: skipping folder %s: a run id must be a valid name", entry)
            continue
        for name in sorted(os.listdir(os.path.join(folder, entry))):
            if not (name.startswith("part-") and name.endswith(".parquet")) or name.endswith(SUFFIX):
                continue
            path = os.path.join(folder, entry, name)
            try:
                meta = pq.read_metadata(path)
                replaces = _replaces(meta.metadata)
            except Exception as e:  # a truncated or foreign file, or a footer naming files elsewhere
                found.append(_OldFile(name, run_id, path, None, error=f"{type(e).__name__}: {e}"))
                continue
            found.append(_OldFile(name, run_id, path, meta.num_rows, tuple(replaces)))
    return found


def _replaces(metadata: dict[bytes, bytes] | None) -> list[str]:
    """The base names a merged file replaces; raises ValueError for anything but names of part files
    (the previous release deleted them: none may point outside its folder)."""
    if not metadata or REPLACES_KEY not in metadata:
        return []
    names = json.loads(metadata[REPLACES_KEY])
    if not isinstance(names, list) or not all(isinstance(n, str) and n.startswith("part-") and n.endswith(".parquet")
                                                and "/" not in n and "\\" not in n and ".." not in n for n in names):
        raise ValueError(f"{REPLACES_KEY.decode()} must list part file names of the same folder, not {names!r}")
    return names


def _in_flight(root: str, table: str) -> list[str]:
    folder = os.path.join(root, table)
    found = []
    for entry in sorted(os.listdir(folder)):
        if (entry.startswith("run_id=") and is_valid_name(entry[len("run_id="):])
                and os.path.isdir(os.path.join(folder, entry))):
            found += [f"{entry}/{name}" for name in sorted(os.listdir(os.path.join(folder, entry)))
                      if name.startswith(TMP_PREFIX)]
    return found


def _rewrite(location: StoreLocation, table: str, old: _OldFile, dropped: set[str]) -> delta.PartFile:
    """The old file as a file of the Delta table: same rows, order and row groups; the table's
    schema without run_id (checked against the folder's run id); page checksums checked on the way.
    Raises _BadFile when the old file does not read through (the new file is deleted), UpgradeError
    when its rows are of another run, OSError when the disk refuses the new file."""
    schema = SCHEMAS[table]
    fields = [f for f in schema if f.name != delta.PARTITION_COLUMN]
    target = pa.schema(fields)
    name = old.name[:-len(".parquet")] + SUFFIX
    relative = f"{delta.PARTITION_COLUMN}={old.run_id}/{name}"
    path = os.path.join(location.url, table, *relative.split("/"))
    try:
        source = pq.ParquetFile(old.path, page_checksum_verification=True)
        groups = source.metadata.num_row_groups
    except Exception as e:
        raise _BadFile(f"{type(e).__name__}: {e}") from e
    dropped.update(n for n in source.schema_arrow.names if n not in schema.names)
    try:
        with open(path, "wb") as out:
            writer = pq.ParquetWriter(out, target, **parquet_options(target.names))
            try:
                for group in range(groups):
                    data = _read_group(source, group)
                    if delta.PARTITION_COLUMN in data.column_names:
                        run_ids = data.column(delta.PARTITION_COLUMN)
                        if run_ids.null_count or not pc.all(pc.equal(run_ids, old.run_id)).as_py():
                            raise UpgradeError(f"moescope store upgrade: {old.path} holds rows of another run than its "
                                               f"folder's ({old.run_id}); move it to the folder of its run and upgrade "
                                               "again")
                    columns = [data.column(f.name).cast(f.type) if f.name in data.column_names
                               else pa.nulls(data.num_rows, f.type) for f in fields]
                    writer.write_table(pa.Table.from_arrays(columns, schema=target),
                                       row_group_size=max(data.num_rows, 1))
            finally:
                writer.close()
            out.flush()
            os.fsync(out.fileno())
            footer = writer.writer.metadata
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise
    if footer.num_rows != old.rows:
        os.remove(path)
        raise _BadFile(f"it reads {footer.num_rows} rows, its footer says {old.rows}")
    return delta.PartFile(relative, os.path.getsize(path), footer.num_rows, old.run_id, delta.file_stats(footer))


def _read_group(source: pq.ParquetFile, group: int) -> pa.Table:
    """One row group, every page checked; _BadFile when it does not read (or a column is short)."""
    try:
        data = source.read_row_group(group)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise _BadFile(f"{type(e).__name__}: {e}") from e
    expected = source.metadata.row_group(group).num_rows
    if data.num_rows != expected:
        raise _BadFile(f"row group {group} holds {data.num_rows} rows, its footer says {expected}")
    return data


def _quarantine(root: str, table: str, old: _OldFile, reason: str) -> str:
    """Move a bad file of the previous release to `_quarantine/` with its reason (it is in no table)."""
    target = os.path.join(root, QUARANTINE_DIR, table, f"run_id={old.run_id}", old.name)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.replace(old.path, target)
    _write_json(target + ".reason.json", {"original_path": old.path, "reason": reason,
                                          "moved_at": dt.datetime.now(dt.timezone.utc).isoformat()})
    log.warning("moescope store upgrade: unreadable file %s moved to %s (%s)", old.path, target, reason)
    return target


def _delete(root: str, table: str, relatives: list[str]) -> None:
    for relative in relatives:
        if not _is_run_file(relative):  # a plan is read back from the store: never a path out of a run's folder
            log.warning("moescope store upgrade: not deleting %r of table %s: not run_id=<run id>/<file>",
                        relative[:200] if isinstance(relative, str) else relative, table)
            continue
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(root, table, *relative.split("/")))


def _is_run_file(relative: object) -> bool:
    """Whether `relative` (from a plan in `_upgrade/`) is `run_id=<valid run id>/<a file's name>`, the
    only paths a plan names: a file in a run's folder, never a folder above it."""
    if not isinstance(relative, str) or relative.count("/") != 1:
        return False
    folder, name = relative.split("/")
    return (folder.startswith("run_id=") and is_valid_name(folder[len("run_id="):]) and "\\" not in name
            and "\0" not in name and name.startswith(("part-", TMP_PREFIX)) and name not in ("", ".", ".."))


def _write_json(path: str, value: object) -> None:
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".inprogress")
    with open(tmp, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
