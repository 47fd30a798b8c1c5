"""Which files a reader reads now: one Delta snapshot per table, each file checked once.

`Catalog.logs()` reads the latest version of every table (`moescope.store.delta.snapshot`: the log
says which files are live; no folder is listed, no data file read); `Catalog.check_all()` checks
the files a reader is about to read that it has not checked before: the footer (rows as the log
says), then every page against its checksum (`quarantine.deep_check`); `Catalog.snapshot()` does
both for every file. A file that fails is quarantined (`Catalog.reject`): copied to
`<store>/_quarantine/`, its rows counted as lost in `probe_stats` (reason `quarantined`), and
removed from its table by a Delta commit, so no reader reads it again; this reader leaves it out of
the files it was about to read.

A file the log names with a run id or path that fails the store's naming rule is left out of the
table's snapshot (`moescope.store.delta.snapshot`), and so is a file whose own `run_id` column disagrees
with its run (checked here, from the footer's columns): neither is read, quarantined or rewritten.
A reader counts its rows once in `probe_stats` (reason `invalid_name`, under the run
`INVALID_NAMES_RUN`, since the file's own run id cannot be trusted) and goes on with the rest.

A snapshot's files stay in place until `vacuum` deletes them, and vacuum keeps every file a
version younger than its retention still needs: a reader's pinned snapshot never loses a file
under it while the reader refreshes within the retention (one hour by default, `moescope prune`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs as pafs

from moescope.core import forking
from moescope.store import delta
from moescope.store.errors import StoreError
from moescope.store.location import StoreLocation
from moescope.store.naming import shown_name
from moescope.store.quarantine import BadFileWarning, copy_to_quarantine, deep_check, display
from moescope.store.schema import SCHEMAS, TABLES, table_from_columns

log = logging.getLogger(__name__)

QUARANTINED = "quarantined"  # the probe_stats reason of rows in a quarantined file
INVALID_NAME = "invalid_name"  # the probe_stats reason of rows in a file left out for its names
# The run whose probe_stats count files left out for their names: their own run id is not one to write under.
INVALID_NAMES_RUN = "moescope-invalid-names"
# Every table commit that removes files (compaction, prune, quarantine) carries this app
# transaction, its version one more than the one the snapshot the removes came from holds:
# of two such commits made from the same state only the first is made (`moescope.store.delta.commit`
# skips a commit whose app version the table already holds), so a file is never removed twice and
# rows a compaction rewrote are never committed twice (see `app_version`).
REWRITE_APP = "moescope-compact:{table}"


@dataclass(frozen=True)
class FileInfo:
    """A checked data file of one table's snapshot."""

    path: str  # a local path, or a path of the location's pyarrow filesystem (bucket/key)
    part: delta.PartFile  # its entry in the table's log (path relative to the table, rows, run)
    rows: int  # rows in its footer
    columns: tuple[str, ...]  # columns in the file (run_id is in the folder name, not here)
    decoded_bytes: int = -1  # its rows' size uncompressed, as its footer says (-1: not known)
    # object storage: the file as the views scan it (pyarrow's fragment, its footer read once); None locally
    fragment: Any = field(default=None, compare=False, repr=False)

    @property
    def run_id(self) -> str:
        return self.part.run_id


@dataclass(frozen=True)
class TableLog:
    """One version of a table as its log says: its live files, none read yet (version None: no table yet)."""

    version: int | None
    files: tuple[delta.PartFile, ...]


@dataclass(frozen=True)
class TableFiles:
    """One version of a table as a reader reads it: its checked files (None: no table yet)."""

    version: int | None
    files: list[FileInfo]


def quarantine_writer_id(table: str, relative: str) -> int:
    """The `pid` of the probe_stats rows that count a quarantined file's rows: a hash of the file,
    so two readers that both quarantine it write the same counter (readers take the latest per
    writer) and its rows are counted once."""
    return int.from_bytes(hashlib.sha256(f"{table}/{relative}".encode()).digest()[:7], "big")


# Threads a reader of object storage reads table logs and checks new files on.
READ_THREADS = 4
# Threads a reader of a local store checks files on: a check reads and sums bytes, with no lock held.
CHECK_THREADS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)

@dataclass(frozen=True)
class _Checked:
    """A file of object storage this process has checked: what it found, whether it read the pages
    too, and the object it checked (its size and ETag: an object written over has another)."""

    info: FileInfo
    deep: bool
    identity: tuple[int, str]


# Object storage: the files this process has checked, per (store, options, table, path, size in the log).
# Shared by every Catalog (every Store) of the process; another Catalog takes one after a HEAD says the
# object is still the one checked.
_SHARED: dict[tuple, _Checked] = {}
_SHARED_LOCK = threading.Lock()
# At most this many files are remembered (each holds its parsed footer); one forgotten is checked again.
MAX_SHARED = 4096


def _identity(source: Any) -> tuple[int, str]:
    """An opened object's size and ETag (from the HEAD that opened it; '' where the store gives none)."""
    etag = source.metadata().get("ETag", b"")
    return source.size(), etag.decode("ascii", "replace") if isinstance(etag, bytes) else str(etag)


class _Opened(pafs.FileSystemHandler):
    """A pyarrow filesystem handler over a store's filesystem that hands out the objects a check
    opened, so a view's scan of a checked file asks for its column chunks and nothing else.

    A check opens an object (a HEAD: its size and ETag) and reads it whole (one GET); the file's
    fragment is made on this handler's `pyarrow.fs.PyFileSystem` and reads its footer from those
    bytes (`serve`), then keeps the opened object (`keep`): every later scan reads ranges of it, with
    no HEAD and no footer. A path no check opened is opened afresh. Read-only: the views only read."""

    def __init__(self, filesystem: Any):
        self.filesystem = filesystem
        self.files: dict[str, Any] = {}

    def serve(self, path: str, source: Any) -> None:
        self.files[path] = source

    def forget(self, path: str) -> None:
        self.files.pop(path, None)

    def get_type_name(self) -> str:
        return "moescope-checked-" + self.filesystem.type_name

    def normalize_path(self, path: str) -> str:
        return self.filesystem.normalize_path(path)

    def equals(self, other: Any) -> bool:
        return other is self

    def get_file_info(self, paths: list[str]) -> list:
        return self.filesystem.get_file_info(paths)

    def get_file_info_selector(self, selector: Any) -> list:
        return self.filesystem.get_file_info(selector)

    def open_input_file(self, path: str) -> Any:
        opened = self.files.get(path)
        return opened if opened is not None else self.filesystem.open_input_file(path)

    def open_input_stream(self, path: str) -> Any:
        return self.open_input_file(path)

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise OSError("moescope: a store's views only read")

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = delete_file = _refuse
    move = copy_file = open_output_stream = open_append_stream = _refuse


# Object storage: this process's _Opened handler (and its PyFileSystem) per store location.
_OPENED: dict[tuple, tuple[_Opened, Any]] = {}
_OPENED_LOCK = threading.Lock()


def _opened(location: StoreLocation, filesystem: Any) -> tuple[_Opened, Any]:
    key = (location.url, tuple(sorted(location.storage_options.items())))
    with _OPENED_LOCK:
        if key not in _OPENED:
            handler = _Opened(filesystem)
            _OPENED[key] = (handler, pafs.PyFileSystem(handler))
        return _OPENED[key]


def _reset_in_child() -> None:
    global _SHARED_LOCK, _OPENED_LOCK
    _SHARED.clear()  # the parent's fragments hold its filesystem's connections
    _OPENED.clear()
    _OPENED_LOCK = threading.Lock()
    _SHARED_LOCK = threading.Lock()


forking.join_module(_reset_in_child)


def parquet_format() -> Any:
    """The pyarrow Parquet format the views of an object-storage store scan with: column chunks
    fetched ahead in coalesced range requests (a row group's chunks that lie within 1 MiB of each
    other are one GET), pages not checked again (the Catalog checked each file once)."""
    import pyarrow.dataset as ds

    return ds.ParquetFileFormat(default_fragment_scan_options=ds.ParquetFragmentScanOptions(
        pre_buffer=True, cache_options=pa.CacheOptions(hole_size_limit=1024 * 1024, range_size_limit=64 * 1024**2)))


def _fragment(filesystem: Any, path: str, part: delta.PartFile) -> Any:
    """A file of a table as a dataset fragment: its run from the log (the hive folder), and its size
    from the log too, so no request asks for it."""
    import pyarrow.dataset as ds

    return parquet_format().make_fragment(path, filesystem,
                                          partition_expression=ds.field(delta.PARTITION_COLUMN) == part.run_id,
                                          file_size=part.size if part.size > 0 else None)


class Catalog:
    """Checked files of one store, cached per file: each file is checked once per reader.

    verify=False checks footers only (no read through the pages): faster on a large store, but a
    damaged page is then found only if it makes a query fail, and bit rot can read as other values.
    quarantine_bad=False skips bad files in this reader without touching the store.
    """

    def __init__(self, location: StoreLocation, quarantine_bad: bool = True, verify: bool = True):
        self.location = location
        self.quarantine_bad = quarantine_bad
        self.verify = verify
        self.filesystem: Any = location.filesystem()
        self._checked: dict[tuple, FileInfo] = {}
        self._bad: dict[tuple, str] = {}  # files found bad that are still in their table -> why
        self._missing: set[tuple] = set()
        self.quarantined_now: list[str] = []
        # files left out for their names, per (table, path): the log's (store.delta.snapshot) and
        # those whose own run_id column disagrees with their run (`check`)
        self.skipped: dict[tuple[str, str], delta.SkippedFile] = {}
        self._counted: set[tuple[str, str]] = set()
        # rows counted as lost in probe_stats by this Catalog (a file quarantined, or left out for its
        # names): a reader whose probe_stats view is older reads that table's log again
        self.probe_stats_writes = 0

    def full_path(self, table: str, part: delta.PartFile) -> str:
        """Where a table's file is, as `self.filesystem` (and, for a local store, DuckDB) reads it."""
        return self.location.join(table, *part.path.split("/"))

    def _key(self, table: str, part: delta.PartFile, path: str) -> tuple | None:
        """The cache key of a file: a local file by its size and mtime too (damage written over a
        file in place makes it a new file to this reader); None when a local file is not there."""
        if not self.location.is_local:
            return (table, part.path, part.size)
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return None
        return (table, part.path, stat.st_size, stat.st_mtime_ns)

    def check(self, table: str, part: delta.PartFile, verify: bool | None = None) -> FileInfo | None:
        """The file's footer, checked (cached); None when it is bad (quarantined, or skipped) or missing.

        verify=False checks the footer only, for a caller that reads the file through itself with
        the same check (`moescope.store.quarantine.read_checked`: compaction) and rejects it if that fails;
        such a result is not cached as checked.

        On object storage a file is checked once per process, in two requests: a HEAD (the
        object's size and ETag) and one GET of the whole object, footer and every page checked from
        memory (a footer-only check: the HEAD and a GET of its footer). The `FileInfo.fragment` the
        views scan holds its footer, read from those bytes, and reads ranges of the object the HEAD
        opened (`_Opened`): a fresh query asks a file it has not seen for three requests in all, the
        two of the check and its column chunks. Every Catalog of the process shares what was
        checked, keyed by the file's path, size and ETag: another reader's first look at it is the
        HEAD alone, and an object written over (another ETag) is checked again."""
        path = self.full_path(table, part)
        key = self._key(table, part, path)
        if key is None:
            self._warn_missing(table, part, (table, part.path))
            return None
        if key in self._checked:
            return self._checked[key]
        if key in self._bad:
            return None
        deep = self.verify if verify is None else verify and self.verify
        fragment = data = identity = None
        try:
            if self.location.is_local:
                meta = pq.read_metadata(path)
            else:
                source = self.filesystem.open_input_file(path)  # a HEAD: the object's size and ETag; kept open
                identity = _identity(source)
                handler, opened = _opened(self.location, self.filesystem)
                shared = _SHARED.get(self._shared_key(key))
                if shared is not None and shared.identity == identity and (shared.deep or not deep):
                    handler.serve(path, source)
                    if shared.deep or not self.verify:  # checked by another reader of this process
                        self._checked[key] = shared.info
                    return shared.info
                if deep:
                    data = source.read_buffer()  # the whole object: one GET, checked from memory
                    meta = pq.read_metadata(pa.BufferReader(data))
                fragment = _fragment(opened, path, part)
                # the fragment's footer, kept: from the bytes in hand (a footer-only check: one GET of it)
                handler.serve(path, pa.BufferReader(data) if data is not None else source)
                try:
                    fragment.ensure_complete_metadata()
                finally:
                    handler.serve(path, source)  # scans read ranges of the object the HEAD opened
                if not deep:
                    meta = fragment.metadata
        except FileNotFoundError:
            self._warn_missing(table, part, key)
            return None
        except Exception as e:  # a truncated or foreign file: pyarrow raises several types
            self.reject(table, part, f"unreadable footer: {type(e).__name__}: {e}", key)
            return None
        filesystem = None if self.location.is_local else self.filesystem
        if delta.PARTITION_COLUMN in meta.schema.to_arrow_schema().names:
            problem = _run_column_problem(path, filesystem, part.run_id, data)
            if problem is not None:  # not bad data: a name that cannot be trusted, so never quarantined or rewritten
                skipped = delta.SkippedFile(part.path, part.run_id, part.rows, problem)
                self.skipped[(table, part.path)] = skipped
                self._bad[key] = problem
                delta.warn_skipped(self.location, table, [skipped])
                return None
        if part.rows >= 0 and meta.num_rows != part.rows:
            self.reject(table, part, f"its footer holds {meta.num_rows} rows, the table's log says {part.rows}", key)
            return None
        if deep and (problem := deep_check(path, filesystem, data=data)):
            self.reject(table, part, f"damaged data: {problem}", key)
            return None
        info = FileInfo(path, part, meta.num_rows, tuple(meta.schema.to_arrow_schema().names),
                        sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)), fragment)
        if deep or not self.verify:
            self._checked[key] = info
        if identity is not None:
            with _SHARED_LOCK:
                _SHARED[self._shared_key(key)] = _Checked(info, deep, identity)
                while len(_SHARED) > MAX_SHARED:  # the oldest first: mostly files compacted away since
                    forgotten = _SHARED.pop(next(iter(_SHARED)))
                    _opened(self.location, self.filesystem)[0].forget(forgotten.info.path)
        return info

    def _shared_key(self, key: tuple) -> tuple:
        return (self.location.url, tuple(sorted(self.location.storage_options.items())), *key)

    def _warn_missing(self, table: str, part: delta.PartFile, key: tuple) -> None:
        if key in self._missing:
            return
        self._missing.add(key)
        shown = display(self.location, self.full_path(table, part))
        message = (f"moescope store: {shown}, a file of table {table!r}, is missing from the storage: its "
                   f"{part.rows} rows are left out. A file of a live version is only deleted by hand or by a vacuum "
                   f"with a retention shorter than a reader's refresh; run `moescope prune` with the default retention")
        log.warning(message)
        warnings.warn(message, BadFileWarning, stacklevel=3)

    def reject(self, table: str, part: delta.PartFile, reason: str, key: tuple | None = None) -> None:
        """Take a bad file out of its table: copied to quarantine, its rows counted as lost, removed
        by a Delta commit. Where the copy or the commit cannot be made (a full or read-only disk,
        an unreachable store) the file stays in its table and this reader skips it, with a warning."""
        path = self.full_path(table, part)
        if key is None:
            key = self._key(table, part, path) or (table, part.path)
        self._checked.pop(key, None)
        if not self.location.is_local:
            _SHARED.pop(self._shared_key(key), None)
            _opened(self.location, self.filesystem)[0].forget(path)
        self._bad[key] = reason
        if not self.quarantine_bad:
            return
        copy = copy_to_quarantine(self.location, self.filesystem, table, part.path, reason)
        if copy is None:
            return
        self.probe_stats_writes += 1  # its rows are counted first (`remove_bad_file`), even if the removal fails
        try:
            remove_bad_file(self.location, table, part)
        except (StoreError, OSError) as e:
            message = (f"moescope store: {display(self.location, path)} was copied to quarantine but could not be "
                       f"taken out of table {table!r} ({e}); readers skip it until one can")
            log.warning(message)
            warnings.warn(message, BadFileWarning, stacklevel=3)
            return
        self.quarantined_now.append(copy)

    def logs(self, tables: tuple[str, ...] = TABLES) -> dict[str, TableLog]:
        """The latest version of every table and its live files, as the logs say: no data file is read
        (`check_all` checks them). Files left out for their names are counted in `probe_stats` here,
        and that table's log read again so this reader sees the count. Raises StoreError when the
        storage cannot be read."""
        # on object storage a table that is not there costs requests to find out: one listing says which are
        present = None if self.location.is_local or len(tables) == 1 else delta.table_folders(self.location)
        wanted = [t for t in tables if present is None or t in present]
        threads = 1 if self.location.is_local else max(1, min(READ_THREADS, len(wanted)))
        with ThreadPoolExecutor(max_workers=threads) as pool:
            snaps = dict(zip(wanted, pool.map(lambda table: delta.snapshot(self.location, table), wanted)))
        snaps = {table: snaps.get(table) for table in tables}
        result: dict[str, TableLog] = {}
        for table, snap in snaps.items():
            if snap is None:
                result[table] = TableLog(None, ())
                continue
            self.skipped.update({(table, file.path): file for file in snap.skipped})
            result[table] = TableLog(snap.version, tuple(snap.files))
        if self._count_skipped() and "probe_stats" in result:  # this reader sees its own count
            result.update(self.logs(("probe_stats",)))
        return result

    def check_all(self, files: dict[str, tuple[delta.PartFile, ...]]) -> dict[str, list[FileInfo]]:
        """Check each table's given files (`check`: those this Catalog checked before cost a stat, or
        nothing); the good ones per table, in the given order. A few at once: a check's time is mostly
        reading and summing bytes, or waiting for its GET. A bad file is quarantined (or skipped); its
        count in `probe_stats` bumps `probe_stats_writes`, so a reader knows to read that table's log again."""
        checks = [(table, part) for table, parts in files.items() for part in parts]
        # a check mostly reads and sums bytes (no lock held: the CRC of a page, a read) or waits for its GET
        threads = max(1, min(READ_THREADS if not self.location.is_local else CHECK_THREADS, len(checks)))
        with ThreadPoolExecutor(max_workers=threads) as pool:
            infos = dict(zip(checks, pool.map(lambda check: self.check(*check), checks)))
        self._count_skipped()  # files found here whose own run_id column disagrees with their run
        return {table: [info for part in parts if (info := infos[(table, part)]) is not None]
                for table, parts in files.items()}

    def snapshot(self, tables: tuple[str, ...] = TABLES) -> dict[str, TableFiles]:
        """The latest version of every table and its checked files: every file of the store read
        through (`logs`, then `check_all` on them all), as `moescope store check` does. Raises
        StoreError when the storage cannot be read."""
        logs = self.logs(tables)
        writes = self.probe_stats_writes
        checked = self.check_all({table: log.files for table, log in logs.items()})
        result = {table: TableFiles(log.version, checked[table]) for table, log in logs.items()}
        if self.probe_stats_writes != writes and "probe_stats" in result:  # this reader sees its own count
            result.update(self.snapshot(("probe_stats",)))
        return result

    def _count_skipped(self) -> bool:
        """Count the rows of each file left out for its names in `probe_stats`, once per reader and
        once in the store (`count_skipped` is idempotent); True when a count was written now. A store
        that refuses the write (read-only) gets a log line: the warning has named the file already."""
        if not self.quarantine_bad:
            return False
        wrote = False
        for key, file in list(self.skipped.items()):
            if key in self._counted:
                continue
            self._counted.add(key)
            try:
                counted = count_skipped(self.location, key[0], file)
                wrote |= counted
                self.probe_stats_writes += counted
            except (StoreError, OSError) as e:
                log.warning("moescope store: cannot count the rows of %s/%s left out for its names: %s",
                            self.location.redacted, key[0], e)
        return wrote


def app_version(snap: delta.Snapshot) -> int:
    """The version of `REWRITE_APP` that a snapshot read with `app=` holds (0: none; the versions committed
    start at 1, since `moescope.store.delta.commit` cannot tell a held version 0 from none). A commit that removes
    the snapshot's files with `app=(app_id, app_version(snap) + 1)` is then made only if no other such
    commit came after that snapshot: both are read from the same version of the log."""
    return 0 if snap.app_version is None else int(snap.app_version)


def remove_bad_file(location: StoreLocation, table: str, part: delta.PartFile, attempts: int = 5) -> bool:
    """Count a bad file's rows as lost in `probe_stats`, then remove it from its table; False when
    it was no longer live (removed by someone else meanwhile: a compaction, a prune, another reader).

    The count comes first and is idempotent (one counter per file, `quarantine_writer_id`): a crash
    between the two leaves the file live and counted, and the next reader that finds it counts it
    again under the same counter and removes it. Raises StoreError (CommitError) when the store
    refuses the commits."""
    count_lost(location, table, part)
    app = REWRITE_APP.format(table=table)
    for _ in range(attempts):
        snap = delta.snapshot(location, table, app=app)
        if snap is None or not any(p.path == part.path for p in snap.files):
            return False
        try:
            delta.commit(location, table, removes=[part], app=(app, app_version(snap) + 1))
        except delta.CommitConflictError:
            continue  # removed meanwhile: the next look says so
        after = delta.snapshot(location, table)
        if after is None or not any(p.path == part.path for p in after.files):
            return True
        # a compaction or prune made from the same state committed first: look again
    raise StoreError(f"moescope store: could not remove {part.path} from {location.redacted}/{table}: other "
                     f"commits that remove files kept coming first")


def _run_column_problem(path: str, filesystem: Any, run_id: str, data: pa.Buffer | None = None) -> str | None:
    """Why a file's own `run_id` column cannot be read as its run's, or None when every value is
    `run_id`. A file of this store holds none (the run is its folder); one that does came from
    another writer, and a value that differs from its run would be read, or compacted, as another run.
    `data`: the file's bytes, when they are at hand."""
    import pyarrow.compute as pc

    try:
        if data is not None:
            column = pq.read_table(pa.BufferReader(data), columns=[delta.PARTITION_COLUMN]).column(0)
        elif filesystem is None:
            column = pq.read_table(path, columns=[delta.PARTITION_COLUMN]).column(0)
        else:
            with filesystem.open_input_file(path) as source:
                column = pq.read_table(source, columns=[delta.PARTITION_COLUMN]).column(0)
    except Exception as e:  # pyarrow raises several types; the deep check names damage
        return f"its own run_id column cannot be read ({type(e).__name__})"
    if not len(column):
        return None
    distinct = pc.unique(column.cast(pa.string())).to_pylist()
    if distinct != [run_id]:
        shown = ", ".join(shown_name(v, 60) for v in distinct[:3]) + (", ..." if len(distinct) > 3 else "")
        return f"its own run_id column holds {shown}, not its run {run_id!r}"
    return None


def skipped_writer_id(table: str, file: delta.SkippedFile) -> int:
    """The `pid` of the probe_stats row that counts a skipped file's rows: a hash of the file and its
    run id as the log has them, so every reader writes the same counter (and the same file)."""
    return int.from_bytes(hashlib.sha256(repr((table, file.path, file.run_id)).encode()).digest()[:7], "big")


def count_skipped(location: StoreLocation, table: str, file: delta.SkippedFile) -> bool:
    """Count a skipped file's rows (as its log says) as dropped in `probe_stats`: reason
    `invalid_name`, table_name its table, under the run INVALID_NAMES_RUN, on no writer's account
    (rank -1, pid `skipped_writer_id`). Its commit carries an app transaction named after the file, so
    the count is made once in the store however many readers meet it (and stays made when compaction
    merges the counter away); False when it was made already.
    Raises StoreError or OSError when the store refuses the write."""
    pid = skipped_writer_id(table, file)
    app = f"moescope-invalid-name-{pid:016x}"  # an app transaction outlives the counter's file (compaction)
    if delta.table_exists(location, "probe_stats") and delta.transaction_version(location, "probe_stats", app):
        return False
    name = f"part-invalid-name-{pid:016x}.parquet"
    _write_count(location, table, INVALID_NAMES_RUN, max(file.rows, 0), INVALID_NAME, pid, name, app=(app, 1))
    return True


def count_lost(location: StoreLocation, table: str, part: delta.PartFile) -> None:
    """Write the `probe_stats` rows that count a quarantined file's rows as lost: table_name the
    file's table, reason `quarantined`, dropped_rows its rows (as the table's log says), on no
    writer's account (rank -1, no host, pid `quarantine_writer_id`)."""
    now = dt.datetime.now(dt.timezone.utc)
    pid = quarantine_writer_id(table, part.path)
    name = f"part-quarantine-{pid:016x}-{now.strftime('%Y%m%dT%H%M%S%f')}.parquet"
    _write_count(location, table, part.run_id, max(part.rows, 0), QUARANTINED, pid, name, now)


def _write_count(location: StoreLocation, table: str, run_id: str, rows: int, reason: str, pid: int, name: str,
                 now: dt.datetime | None = None, app: tuple[str, int] | None = None) -> None:
    """One probe_stats row, committed: `rows` of `table` dropped for `reason`, by no writer (rank -1, `pid`)."""
    now = now if now is not None else dt.datetime.now(dt.timezone.utc)
    schema = SCHEMAS["probe_stats"]
    values: dict[str, object] = {
        "run_id": run_id, "ts": now, "table_name": table, "written_rows": 0, "dropped_rows": rows,
        "dropped_records": 0, "reason": reason, "rank": -1, "pid": pid,
    }
    columns = {column: pa.array([value], schema.field(column).type) for column, value in values.items()
               if column in schema.names}
    data = table_from_columns("probe_stats", columns, 1)
    added = delta.write_part(location, "probe_stats", run_id, data, name)
    delta.commit(location, "probe_stats", adds=[added], app=app)
