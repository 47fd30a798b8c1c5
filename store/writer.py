"""The store's write path: one writer per (store, run, rank) in a process, fed by the write pipeline.

    producer ──emit──► BatchProcessor (moescope/core/pipeline.py) ──export──► RunWriter ──► Delta commits

`run_writer(store, run_id, rank)` hands out the process's one `RunWriter` of a run: every producer
of the process that writes the run (the probe's `DeltaExporter`, the trust and cooldown policies,
the alerts table, the training monitor, the proxy, an import, a dashboard gate request) shares it,
holds a reference and releases it; the last release drains it and writes its final counts. The
store is a local folder or a URL (`moescope.store.location`); opening a writer checks it once per process
(`moescope.store.delta.check_store`): a missing bucket, refused credentials or a store of the previous
release fail there, at attach, with a message that says what to do. The writer owns what a
written file is:

- the table's schema (`moescope.store.schema.SCHEMAS`; rows given as dicts are converted with it);
- the part's name, `<store>/<table>/run_id=<id>/part-<rank>-<host>-<pid>-<seq>-<ns>.parquet`, from
  the process's one sequence, so no two writers anywhere ever choose one name;
- the publication: each write is one Parquet file (`moescope.store.delta.write_part`) added to the table by
  one Delta commit (`moescope.store.delta.commit`, carrying the writer's app transaction, so a retry of a
  commit whose answer was lost is not committed twice). Readers see a table's snapshot, never a
  folder: a file is seen whole once committed, and not at all before (a crash leaves an orphan
  that vacuum removes, never a torn or duplicated row);
- the counts of rows written and dropped, per table and reason, and the run's `probe_stats` rows:
  cumulative snapshots of this process's counts for the run, with its host (readers take the
  latest per writer: host, rank, pid).

Rows reach it two ways. `RunWriter.emit(table, rows)` hands them to the writer's own pipeline (a
`BatchProcessor` started on first use): the write happens on its worker thread, never the
producer's, rows of a table emitted close together are written as one part and one commit, and a
failure is counted (`write_failed`, or `closed` after the writer closed), never lost silently,
unless the producer takes refused rows back to write them again later (`on_refused`: the alerts
table does, so that a full disk loses no transition). `RunWriter.write(table, data)` writes at once
on the caller's thread, for exporters that already run on a pipeline's worker: the probe's
`moescope.store.exporter.DeltaExporter` and the proxy's recorder.

A process forked from one that wrote starts with no writers (a child's rows are its own, under its
own pid); its commits go through `moescope.store.delta`'s helper process (delta-rs does not survive fork).

Sharp edge: a holder that never releases keeps the writer (and its thread) open for the life of
the process, and its final `probe_stats` is then the last one a holder wrote (`DeltaExporter`
writes one at shutdown for that reason).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from moescope.core import forking
from moescope.core.exporters import DropCounts, Exporter
from moescope.core.lazy import lazy_exports
from moescope.core.pipeline import BatchProcessor
from moescope.core.runs import current_host
from moescope.store import columns, delta
from moescope.store.errors import StoreError
from moescope.store.location import StoreLocation, open_location
from moescope.store.naming import check_name, check_rank, host_name_part, part_name
from moescope.store.schema import SCHEMAS, probe_stats_table

__all__ = ["RunWriter", "TableRows", "open_writers", "run_writer"]

log = logging.getLogger(__name__)

# One sequence for every writer of the process: two writers never choose one file name.
_SEQUENCE = itertools.count(1)


@dataclasses.dataclass
class TableRows:
    """Rows of one table on their way through a run writer's pipeline (a `moescope.core.exporters.Record`)."""

    table: str
    data: pa.Table
    on_refused: Callable[[pa.Table], None] | None = None  # takes refused rows back (not counted as lost)

    def rows(self) -> dict[str, int]:
        return {self.table: self.data.num_rows}

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class _Counts:
    """A run's counts in this process. They outlive a writer: a run opened again later in the
    process goes on counting, since its `probe_stats` snapshots are cumulative per process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards these counts, and the state of the writer holding them
        self.written: Counter[str] = Counter()
        self.dropped: Counter[tuple[str, str]] = Counter()  # (table, reason) -> rows
        self.dropped_records: Counter[str] = Counter()  # reason -> records
        self.sources: list[tuple[DropCounts, bool]] = []  # live counters added in, (source, its records too)

    def totals(self) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
        rows, records = Counter(self.dropped), Counter(self.dropped_records)
        for source, with_records in self.sources:
            source_rows, source_records = source.drop_counts()
            rows.update(source_rows)
            if with_records:
                records.update(source_records)
        return dict(rows), dict(records)

    def freeze(self) -> None:
        """Fold the live sources' counts in (they are final now) and let go of the sources."""
        rows, records = self.totals()
        self.dropped, self.dropped_records, self.sources = Counter(rows), Counter(records), []


_WRITERS: dict[tuple[str, str, int], RunWriter] = {}
_COUNTS: dict[tuple[str, str, int], _Counts] = {}
_REGISTRY = threading.Lock()


def _reset_in_child() -> None:
    """A forked child starts with no writers: the parent's live on in the parent (their threads did not
    come through the fork), and the child's rows are counted under its own pid. A writer object the
    child inherited (an exporter holds it) resets itself (`RunWriter.reset_in_child`)."""
    global _REGISTRY
    _WRITERS.clear()
    _COUNTS.clear()
    _REGISTRY = threading.Lock()


forking.join_module(_reset_in_child)


def run_writer(store: str | os.PathLike | StoreLocation, run_id: str, rank: int = 0,
               storage_options: Mapping[str, Any] | Sequence[str] | None = None) -> RunWriter:
    """The process's writer of run `run_id` (rank `rank`) in `store` (a folder or a URL), opened or shared.

    Each call takes a reference: give it back with `release()` (or use the writer as a context
    manager). Raises InvalidNameError for a run id or rank that cannot be part of a path,
    LocationError for a store URL or options that cannot be used, and, when the writer is opened,
    StoreAccessError (a missing bucket, refused credentials, an endpoint that does not answer) or
    LegacyStoreError (a store of the previous release: `moescope store upgrade PATH` converts it).
    """
    check_name("run_id", run_id)  # a run id that cannot be a folder name is refused here
    check_rank(rank)
    location = open_location(store, storage_options)
    key = (location.url, run_id, rank)
    with _REGISTRY:
        writer = _WRITERS.get(key)
    if writer is None:
        delta.check_store(location)  # once per process and store; outside the lock: it may take a request
    with _REGISTRY:
        writer = _WRITERS.get(key)
        if writer is None:
            writer = _WRITERS[key] = RunWriter(key, _COUNTS.setdefault(key, _Counts()), location)
        writer._references += 1
    return writer


def open_writers() -> list[RunWriter]:
    """The run writers open in this process now (for tests and diagnostics)."""
    with _REGISTRY:
        return list(_WRITERS.values())


class RunWriter:
    """The one writer of a run's tables (one rank of it) in this process; see the module doc.

    Get it from `run_writer`, never by constructing it. Thread-safe: producers on any thread emit,
    exporters on their workers write. `written_rows` and `drop_counts()` are this process's counts
    for the run (rows committed, rows lost); `files` the files this writer committed (paths or
    URLs); `last_error` why the last write failed (None once one succeeds).
    """

    FLUSH_INTERVAL_S = 2.0  # how often an idle writer writes its counts, if the drops changed

    def __init__(self, key: tuple[str, str, int], counts: _Counts, location: StoreLocation | None = None):
        self.root, self.run_id, self.rank = key
        self.location = location if location is not None else open_location(self.root)
        self.host = current_host()
        self._key = key
        self._counts = counts
        self._references = 0
        self._lock = counts.lock  # the counts and the failure state
        self._stats_lock = threading.Lock()  # one probe_stats snapshot at a time, in order
        # The writer's app transaction: each commit to a table carries (app_id, the table's next seq), so
        # a commit retried after its answer was lost is recognised as made. One commit per table at a
        # time: a later seq committed first would make an earlier one look made.
        self.app_id = f"moescope-writer-{host_name_part(self.host)}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._seq: Counter[str] = Counter()
        self._table_locks: dict[str, threading.Lock] = {}
        self._tables_made: set[str] = set()
        self.files: list[str] = []
        self.last_error: str | None = None
        self._failing: Counter[str] | None = None  # rows lost per table since writes started failing
        self._stats_written: tuple | None = None
        self._stats_final: tuple | None = None  # what the last probe_stats snapshot written says (`_stats_key`)
        self._stats_tried = time.monotonic()
        self._pipeline: BatchProcessor[TableRows] | None = None
        self.closed = False
        forking.join(self)

    def reset_in_child(self) -> None:
        """Become the forked child's own writer (the at-fork registry calls this; nothing else should):
        its own app transaction and counts, so a commit of the child's is never taken for one of the
        parent's, nor counted twice. The producers it watches stay (each resets itself in the child)
        and are counted afresh."""
        counts = _Counts()
        counts.sources = list(self._counts.sources)  # the same producers (reset in the child), counted afresh
        self._counts = counts
        self._lock = counts.lock
        self._stats_lock = threading.Lock()
        self.app_id = f"moescope-writer-{host_name_part(self.host)}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._seq = Counter()
        self._table_locks = {}
        self.files = []
        self.last_error = None
        self._failing = None
        self._stats_written = None
        self._stats_final = None

    # -- counts --------------------------------------------------------------------------------

    @property
    def written_rows(self) -> Counter[str]:
        """Rows written per table (by every producer of the run in this process)."""
        with self._lock:
            return Counter(self._counts.written)

    def drop_counts(self) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
        """(rows dropped per (table, reason), records dropped per reason): this writer's own counts
        and those of the counters it watches, as `probe_stats` writes them."""
        with self._lock:
            return self._counts.totals()

    def count_dropped(self, table: str, reason: str, rows: int, records: int = 0) -> None:
        """Count rows (and records) a producer lost before they reached the writer, e.g. a proxied
        response without routing: they land in `probe_stats` with `reason`."""
        with self._lock:
            self._counts.dropped[(table, reason)] += rows
            if records:
                self._counts.dropped_records[reason] += records

    def watch(self, source: DropCounts, records: bool = True) -> None:
        """Add a processor's (or an exporter's) drop counters to the run's `probe_stats`; with
        records=False only its rows (its records are not the run's steps)."""
        with self._lock:
            if not any(s is source for s, _ in self._counts.sources):
                self._counts.sources.append((source, records))

    # -- writing -------------------------------------------------------------------------------

    def write(self, table: str, data: pa.Table | Sequence[dict], retried: bool = False,
              on_dropped: Callable[[str, str, int], None] | None = None) -> bool:
        """Write `data` (a table, or rows as dicts) as a new part of `table` now, on this thread;
        False when the disk refused it.

        A refused write's rows are counted as `write_failed`: through `on_dropped(table, reason,
        rows)` where given (the probe's processor, so that `session.probe_stats()` and Prometheus
        see them too), else in this writer's counts; not at all when the caller keeps them to write
        again (`retried`). One error line when writes start failing, one when they work again.
        Raises InvalidNameError for a table name that cannot be a folder, and pyarrow's errors for
        rows that do not fit the table's schema.
        """
        data = _as_table(table, data)
        try:
            path = self._publish(table, data)
        except (OSError, StoreError) as e:
            with self._lock:
                self.last_error = f"{type(e).__name__}: {e}"
                if self._failing is None:
                    self._failing = Counter()
                    log.error("moescope: cannot write to the store %s (%s): rows are dropped and counted as "
                              "write_failed until a write succeeds again", self.location.redacted, e)
                if not retried:
                    self._failing[table] += data.num_rows
                    if on_dropped is None:
                        self._counts.dropped[(table, "write_failed")] += data.num_rows
            if not retried and on_dropped is not None:
                on_dropped(table, "write_failed", data.num_rows)
            return False
        with self._lock:
            if self._failing is not None:
                lost = ", ".join(f"{n} of {t}" for t, n in sorted(self._failing.items())) or "none"
                log.warning("moescope: writing to the store %s works again; rows lost meanwhile: %s",
                            self.location.redacted, lost)
                self._failing = None
            self.last_error = None
            self.files.append(path)
            self._counts.written[table] += data.num_rows
        return True

    def _publish(self, table: str, data: pa.Table) -> str:
        """Write `data` as one file of `table` and commit it (one Delta commit); returns its path.
        Raises OSError or StoreError when the storage refused either step (the rows are then not in
        the table: an uncommitted file is invisible)."""
        with self._lock:
            table_lock = self._table_locks.setdefault(table, threading.Lock())
        with table_lock:
            if table not in self._tables_made:  # the log before the first file: see delta.legacy_tables
                delta.create_table(self.location, table)
                self._tables_made.add(table)
            name = part_name(self.rank, next(_SEQUENCE), self.host)
            part = delta.write_part(self.location, table, self.run_id, data, name)
            self._seq[table] += 1
            # app_unseen: app_id is this writer's alone and the seq is new, so a first try cannot find it committed
            delta.commit(self.location, table, [part], app=(self.app_id, self._seq[table]), app_unseen=True)
        return self.location.join(table, part.path) if self.location.is_local else \
            f"{self.location.table_uri(table)}/{part.path}"

    def open_tables(self, tables: Sequence[str]) -> None:
        """Make sure `tables` exist and are open in this process before their first write (see
        `DeltaExporter.on_attach`); a table that cannot be opened now is tried again at its first write."""
        for table in tables:
            with self._lock:
                table_lock = self._table_locks.setdefault(table, threading.Lock())
            with table_lock:
                if table in self._tables_made:
                    continue
                try:
                    delta.create_table(self.location, table)
                except (OSError, StoreError) as e:
                    log.info("moescope: opening %s/%s ahead of the close failed (its first write tries again): %s",
                             self.location.redacted, table, e)
                    continue
                self._tables_made.add(table)

    def emit(self, table: str, data: pa.Table | Sequence[dict],
             on_refused: Callable[[pa.Table], None] | None = None) -> None:
        """Hand rows of `table` to the writer's pipeline: they are written on its worker thread, at
        once or at the latest by the next `flush()`. Waits only for room in the queue, never for the
        disk. Rows the disk refuses are counted as `write_failed`, or, with `on_refused`, handed back
        to it (on the writer's thread) for the producer to emit again later, and not counted. Raises
        InvalidNameError and pyarrow's errors, as `write`, before anything is queued."""
        data = _as_table(table, data)
        if not data.num_rows:
            return
        with self._lock:
            if self.closed:
                self._counts.dropped[(table, "closed")] += data.num_rows
                return
            if self._pipeline is None:
                self._pipeline = BatchProcessor([_WriterExporter(self)], policy="block",
                                                flush_interval_s=self.FLUSH_INTERVAL_S, name="moescope-run-writer")
                self._counts.sources.append((self._pipeline, False))
            pipeline = self._pipeline
        pipeline.emit(TableRows(table, data, on_refused))

    def flush(self, timeout_s: float | None = 30.0) -> bool:
        """Write everything emitted so far, and the counts if the drops changed; False if that did
        not finish within `timeout_s` (None: no limit)."""
        pipeline = self._pipeline
        if pipeline is not None:
            return pipeline.force_flush(timeout_s)
        self.write_changed_stats()
        return True

    def _write_batch(self, batch: Sequence[TableRows]) -> None:
        """The pipeline's export: each table's rows of the batch as one part, tables in the order
        they were first emitted."""
        parts: dict[tuple[str, Callable | None], list[pa.Table]] = {}
        for rows in batch:
            parts.setdefault((rows.table, rows.on_refused), []).append(rows.data)
        for (table, on_refused), tables in parts.items():
            data = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
            if self.write(table, data, retried=on_refused is not None) or on_refused is None:
                continue
            try:
                on_refused(data)
            except Exception:
                log.exception("moescope: %d refused rows of %s could not be handed back; they are lost", data.num_rows,
                              table)
                self.count_dropped(table, "write_failed", data.num_rows)

    # -- probe_stats ---------------------------------------------------------------------------

    def write_changed_stats(self, min_interval_s: float = 0.0) -> None:
        """Write `probe_stats` if the drops changed since the last snapshot on disk (or it failed),
        at most once per `min_interval_s`: drops reach the disk within a flush interval."""
        if time.monotonic() - self._stats_tried < min_interval_s:
            return
        self._stats_tried = time.monotonic()
        drops = tuple(sorted(self.drop_counts()[0].items()))
        if drops and drops != self._stats_written:
            self.write_probe_stats()

    def write_probe_stats(self) -> bool:
        """Write this process's cumulative rows written and dropped, per table and reason, into
        `probe_stats` (`moescope.store.schema.probe_stats_table`); readers take the latest snapshot per writer
        (host, rank, pid), `Store.probe_stats`. Returns False when the disk refused it: a later snapshot
        carries the same counts (they are cumulative; nothing is counted as lost)."""
        with self._stats_lock:
            drops, records = self.drop_counts()
            written = self.written_rows
            data = probe_stats_table(self.run_id, self.rank, os.getpid(), dt.datetime.now(dt.timezone.utc),
                                     written, drops, records, host=self.host)
            if data.num_rows and not self.write("probe_stats", data, retried=True):
                return False
            self._stats_written = tuple(sorted(drops.items()))
            self._stats_final = self._stats_key(written, drops, records)
            return True

    @staticmethod
    def _stats_key(written: Counter[str], drops: dict, records: dict) -> tuple:
        """What a `probe_stats` snapshot says (its own table's rows are not counted in it)."""
        return (tuple(sorted((t, n) for t, n in written.items() if t != "probe_stats")),
                tuple(sorted(drops.items())), tuple(sorted(records.items())))

    # -- closing -------------------------------------------------------------------------------

    def release(self) -> None:
        """Give back one reference; the last drains the writer's pipeline, writes the run's final
        `probe_stats` and closes the writer."""
        with _REGISTRY:
            self._references -= 1
            if self._references > 0:
                return
            if _WRITERS.get(self._key) is self:
                del _WRITERS[self._key]
        if self._pipeline is not None:
            self._pipeline.shutdown()
        with self._lock:
            self.closed = True
            anything = bool(self._counts.written) or bool(self._counts.totals()[0])
        # the last holder (the probe's exporter) has usually just written the final counts: not twice
        current = self._stats_key(self.written_rows, *self.drop_counts())
        if anything and current != self._stats_final and not self.write_probe_stats():
            log.error("moescope: the final probe_stats of run %s could not be written to %s; the counts were: %s",
                      self.run_id, self.location.redacted, self.drop_counts()[0] or "no drops")
        with self._lock:
            self._counts.freeze()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _WriterExporter(Exporter[TableRows]):
    """The exporter of a run writer's own pipeline: it writes the `TableRows` emitted to the writer."""

    def __init__(self, writer: RunWriter):
        self.writer = writer

    def export(self, records: Sequence[TableRows]) -> bool:
        self.writer._write_batch(records)  # what the disk refuses is counted, or handed back
        return True

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        self.writer.write_changed_stats()
        return True

    def shutdown(self) -> None:
        pass


def _as_table(table: str, data: pa.Table | Sequence[dict]) -> pa.Table:
    """Rows as a table of `table`'s schema; raises InvalidNameError for a name that cannot be a folder.
    A `runs` row without a host gets this process's (`moescope.core.runs.current_host`)."""
    check_name("table", table)  # before any row is converted or queued
    data = data if isinstance(data, pa.Table) else columns.rows_table(list(data), SCHEMAS[table])
    if table == "runs" and data.num_rows:
        host = columns.repeat(current_host(), data.num_rows, pa.string())
        if "host" not in data.column_names:
            data = data.append_column("host", host)
        elif data.column("host").null_count:
            data = data.set_column(data.column_names.index("host"), "host",
                                   pc.coalesce(data.column("host").cast(pa.string()), host))
    return data



# `ParquetExporter` at its home before 0.2.0, for a release: it is `DeltaExporter` of `moescope.store.exporter`
# now, which imports this module (hence loaded only when asked).
__getattr__, __dir__ = lazy_exports(__name__, {"ParquetExporter": "moescope.store.exporter"})
