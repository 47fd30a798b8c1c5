"""The store's write path: one writer per (store, run, rank) in a process, fed by the write pipeline.

    producer ──emit──► BatchProcessor (moescope/core/pipeline.py) ──export──► RunWriter ──► Delta commits

`run_writer(store, run_id, rank)` hands out the process's one `RunWriter` of a run: every producer
of the process that writes the run (the probe's `ParquetExporter`, the trust and cooldown policies,
the alerts table, the training monitor, the proxy, an import, a dashboard gate request) shares it,
holds a reference and releases it; the last release drains it and writes its final counts. The
store is a local folder or a URL (`store.location`); opening a writer checks it once per process
(`store.delta.check_store`): a missing bucket, refused credentials or a store of the previous
release fail there, at attach, with a message that says what to do. The writer owns what a
written file is:

- the table's schema (`store.schema.SCHEMAS`; rows given as dicts are converted with it);
- the part's name, `<store>/<table>/run_id=<id>/part-<rank>-<host>-<pid>-<seq>-<ns>.parquet`, from
  the process's one sequence, so no two writers anywhere ever choose one name;
- the publication: each write is one Parquet file (`store.delta.write_part`) added to the table by
  one Delta commit (`store.delta.commit`, carrying the writer's app transaction, so a retry of a
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
on the caller's thread, for exporters that already run on a pipeline's worker: `ParquetExporter`
(the probe's records) and the proxy's recorder.

A process forked from one that wrote starts with no writers (a child's rows are its own, under its
own pid); its commits go through `store.delta`'s helper process (delta-rs does not survive fork).

Sharp edge: a holder that never releases keeps the writer (and its thread) open for the life of
the process, and its final `probe_stats` is then the last one a holder wrote (`ParquetExporter`
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from moescope.core import forking
from moescope.core.exporters import (
    AttachListener,
    BindsProcessor,
    DropCounts,
    Exporter,
    ForkAware,
    InMemoryExporter,
    WritesRows,
)
from moescope.core.pipeline import BatchProcessor, array_bytes
from moescope.core.records import RunInfo, StepRecord
from moescope.core.runs import current_host
from moescope.store import delta
from moescope.store.errors import StoreError
from moescope.store.location import StoreLocation, open_location
from moescope.store.naming import check_name, check_rank, host_name_part, part_name
from moescope.store.schema import (
    SCHEMAS,
    RoutePiece,
    layers_table,
    probe_stats_table,
    routes_table,
    run_table,
    step_tables,
)

__all__ = [
    "BatchProcessor", "InMemoryExporter", "ParquetExporter", "RunWriter", "TableRows", "open_writers", "run_writer",
]

log = logging.getLogger(__name__)

# A table's rows are written once they hold this many bytes, even before `max_rows` or `max_age_s`.
DEFAULT_MAX_BUFFER_BYTES = 64 * 1024 * 1024
# The tables every probe session commits to (its steps, its end, its final counts), opened at attach on
# object storage: a session shorter than a flush interval writes them first in its close.
SESSION_TABLES = ("steps", "layer_steps", "run_ends", "probe_stats")
# Parts of different tables a flush writes at once (a probe's flush has up to 4 tables; a close adds run_ends).
FLUSH_THREADS = 6

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
        `ParquetExporter.on_attach`); a table that cannot be opened now is tried again at its first write."""
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
        `probe_stats` (`store.schema.probe_stats_table`); readers take the latest snapshot per writer
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
    data = data if isinstance(data, pa.Table) else pa.Table.from_pylist(list(data), schema=SCHEMAS[table])
    if table == "runs" and data.num_rows:
        host = pa.repeat(pa.scalar(current_host(), pa.string()), data.num_rows)
        if "host" not in data.column_names:
            data = data.append_column("host", host)
        elif data.column("host").null_count:
            data = data.set_column(data.column_names.index("host"), "host",
                                   pc.coalesce(data.column("host").cast(pa.string()), host))
    return data


class ParquetExporter(Exporter[StepRecord], AttachListener, BindsProcessor[StepRecord], WritesRows, DropCounts,
                      ForkAware):
    """The probe pipeline's exporter: buffers a probe's records per table and writes them to a store.

    A part per table is written, through the run's writer, when a buffer is big or old. One
    instance writes one run from one process; part names carry rank, host, pid, the process's
    sequence and the clock, and each part is added by its own Delta commit, so processes, ranks and
    hosts write one store side by side without locks. Rows are lost to a crash only from the
    buffers, which hold at most `max_age_s` seconds (the flush interval) of data, `max_rows` rows or
    `max_bytes` bytes per table. Route rows stay numpy arrays until their flush, which converts them
    in one vectorised pass.

    A write that fails (disk full, the bucket unreachable after every retry) loses its rows: they
    are counted with reason `write_failed` in the processor's `dropped_rows` (so
    `session.probe_stats()` and Prometheus see them; in this exporter's own `dropped_rows` when it
    has no processor), and the run's writer puts them into `probe_stats` at the first flush the
    store takes. The run's `runs` and `layers` rows are kept and retried until they are written
    (counted as lost only if the exporter shuts down first).
    """

    def __init__(self, store: str | os.PathLike | StoreLocation, run: RunInfo | None = None,
                 max_rows: int = 256 * 1024, max_age_s: float = 5.0,
                 processor: BatchProcessor[StepRecord] | None = None, max_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
                 storage_options: Mapping[str, Any] | Sequence[str] | None = None):
        """Open the store for writing; nothing is written before a run is known.

        Args:
            store: a folder or a URL (`store.location.open_location`, with `storage_options`).
            run: the run to write; None (default) to learn it from the probe at attach (`on_attach`).
            max_rows: rows per table at which a buffer is written (default 262144).
            max_age_s: seconds after a buffer's first row at which it is written (default 5.0, the
                pipeline's flush interval).
            processor: the probe's processor, whose drop counters go into `probe_stats`; None (default):
                the probe binds it (`bind_processor`).
            max_bytes: bytes per table at which a buffer is written (default 64 MiB).
            storage_options: how to reach a URL store (a dict or `key=value` strings; no secrets).

        Raises:
            store.location.LocationError: for a store that cannot be used as given.
            InvalidNameError: with `run`, for a run id that cannot be a folder name.
            StoreAccessError: with `run`, for a store that cannot be reached.
            LegacyStoreError: with `run`, for a store written before Delta tables.
        """
        self.location = open_location(store, storage_options)
        self.root = self.location.url
        self.run: RunInfo | None = None
        self.max_rows = max_rows
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.processor = processor  # whose drop counters go into probe_stats
        self._buffers: dict[str, list[pa.Table]] = {}
        self._route_pieces: list[RoutePiece] = []
        self._rows: Counter[str] = Counter()
        self._bytes: Counter[str] = Counter()
        self._first_at: dict[str, float] = {}
        self.dropped_rows: Counter[tuple[str, str]] = Counter()  # (table, reason) -> rows, without a processor
        self.writer: RunWriter | None = None  # the run's writer, from on_attach
        self._closed = False
        self.last_step: int | None = None  # the last forward exported, for the run_ends row
        self._unwritten_run: list[tuple[str, pa.Table]] = []
        # on_attach writes the run's rows on the caller's thread, export and force_flush retry them on the
        # pipeline's: one writer at a time, or a slow first commit has both threads commit them (seen: a
        # run's runs and layers rows twice with 8 writers on S3)
        self._run_rows_lock = threading.Lock()
        self._drops_lock = threading.Lock()
        if run is not None:
            self.on_attach(run)

    def on_attach(self, run: RunInfo) -> None:
        """Start writing `run`: its `runs` and `layers` rows first. The probe calls this at attach.

        Args:
            run: the run the probe attached as; the same run again is a no-op.

        Raises:
            InvalidNameError: for a run id or rank that cannot be part of a path.
            StoreAccessError: for a store that cannot be reached (see `run_writer`).
            LegacyStoreError: for a store written before Delta tables.
        """
        if self.run is run:
            return
        self.writer = run_writer(self.location, run.run_id, run.rank)
        self.writer.watch(self.processor if self.processor is not None else self)
        self.run = run
        self._unwritten_run = [("runs", run_table(run))] + ([("layers", layers_table(run))] if run.layers else [])
        self._write_run()
        if not self.location.is_local:
            # The tables the session writes, opened now on a thread of their own: a table's first open
            # reads its log since the last checkpoint, twice (on object storage up to about 100 GETs,
            # and a fleet's writers closing together wait for each other's); opened early, the first
            # flush and the close read only the entries committed since.
            threading.Thread(target=self.writer.open_tables, args=(SESSION_TABLES,), daemon=True,
                             name="moescope-open-tables").start()

    def after_fork_in_child(self) -> None:
        """Start afresh in a forked child that records (a `moescope.core.exporters.ForkAware`).

        The rows buffered at the fork are the parent's to write, and so are the run's own rows; the
        child writes its forwards under its pid.
        """
        self._buffers.clear()
        self._route_pieces = []
        self._rows.clear()
        self._bytes.clear()
        self._first_at.clear()
        self.dropped_rows.clear()
        self._unwritten_run = []
        self.last_step = None

    def bind_processor(self, processor: BatchProcessor[StepRecord]) -> None:
        """Take the probe's processor, whose drop counters go into the run's `probe_stats`.

        Args:
            processor: the session's `BatchProcessor`.
        """
        self.processor = processor
        if self.writer is not None:
            self.writer.watch(processor)

    def drop_counts(self) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
        """What this exporter lost without a processor to count it (a `moescope.core.exporters.DropCounts`).

        Returns:
            (rows dropped per (table, reason), records dropped per reason: always empty here).
        """
        return dict(self.dropped_rows), {}

    def _write_run(self) -> None:
        """Write the run's own rows that are not on disk yet (they are retried, not dropped)."""
        with self._run_rows_lock:
            done = self._flush_tables((), [(table, data, True) for table, data in self._unwritten_run])
            self._unwritten_run = [job for job, ok in zip(self._unwritten_run, done) if not ok]

    def _attached(self) -> tuple[RunInfo, RunWriter]:
        """The run and its writer, from `on_attach` (the probe calls it before any record)."""
        assert self.run is not None and self.writer is not None, "ParquetExporter used before on_attach"
        return self.run, self.writer

    def _write(self, table: str, data: pa.Table, retried: bool = False) -> bool:
        """Write `data` as a new part of `table` (see `RunWriter.write`); False when refused."""
        _, writer = self._attached()
        return writer.write(table, data, retried=retried, on_dropped=self._count_dropped)

    def _count_dropped(self, table: str, reason: str, rows: int) -> None:
        if self.processor is not None:
            self.processor.count_dropped_rows(table, reason, rows)
        else:
            with self._drops_lock:  # a flush writes its tables on threads
                self.dropped_rows[(table, reason)] += rows

    @property
    def written_rows(self) -> Counter[str]:
        """Rows written per table into the run (by its writer, for every producer of the process)."""
        return self.writer.written_rows if self.writer is not None else Counter()

    @property
    def files(self) -> list[str]:
        """Paths of the parts the run's writer wrote (empty before `on_attach`)."""
        return self.writer.files if self.writer is not None else []

    def export(self, records: Sequence[StepRecord]) -> bool:
        """Buffer `records` per table and write each buffer that is big or old.

        Args:
            records: a batch from the pipeline.

        Returns:
            False once the exporter is shut down (the records are refused), else True. A failed write is
                counted (`write_failed`), not returned.
        """
        if self._closed:
            return False
        now = time.monotonic()
        run, writer = self._attached()
        rank = run.rank
        for record in records:
            self.last_step = max(self.last_step or 0, int(record.step_end if record.step_end is not None
                                                          else record.step))
            for ls in record.layers:
                if ls.routes is not None:
                    self._route_pieces.append(RoutePiece(record.step, ls.layer, record.tags, ls.routes, rank))
                    self._rows["routes"] += len(ls.routes.expert_ids)
                    self._bytes["routes"] += array_bytes(ls.routes)
                    self._first_at.setdefault("routes", now)
            light = dataclasses.replace(record, layers=[dataclasses.replace(ls, routes=None)
                                                        for ls in record.layers])
            for table, rows in step_tables(light, rank).items():
                self._buffers.setdefault(table, []).append(rows)
                self._rows[table] += rows.num_rows
                self._bytes[table] += rows.nbytes
                self._first_at.setdefault(table, now)
        self._flush_tables([table for table in list(self._first_at)
                            if (self._rows[table] >= self.max_rows or self._bytes[table] >= self.max_bytes
                                or now - self._first_at[table] >= self.max_age_s)])
        if self._unwritten_run:
            self._write_run()
        # drops reach the disk within a flush interval under steady load
        writer.write_changed_stats(min_interval_s=self.max_age_s)
        return True

    def _take(self, table: str) -> tuple[str, pa.Table, bool] | None:
        """A table's buffered rows as one part to write (the buffer emptied), or None when it holds none."""
        self._rows.pop(table, None)
        self._bytes.pop(table, None)
        self._first_at.pop(table, None)
        if table == "routes":
            pieces, self._route_pieces = self._route_pieces, []
            return (table, routes_table(self._attached()[0].run_id, pieces), False) if pieces else None
        parts = self._buffers.pop(table, [])
        return (table, pa.concat_tables(parts), False) if parts else None

    def _flush_tables(self, tables: Sequence[str], more: Sequence[tuple[str, pa.Table, bool]] = ()) -> list[bool]:
        """Write the buffers of `tables`, and `more` parts (table, rows, retried); whether each of `more`
        was written. Parts of different tables are written and committed at once, a thread each: a
        commit is a few round trips to object storage (longer while other writers commit too), and
        commits to different tables never wait for each other (each table has its own log)."""
        jobs = [job for table in tables if (job := self._take(table)) is not None]
        jobs += list(more)
        if len(jobs) <= 1:
            done = [self._write(*job) for job in jobs]
        else:
            with ThreadPoolExecutor(max_workers=min(len(jobs), FLUSH_THREADS),
                                    thread_name_prefix="moescope-flush") as pool:
                done = list(pool.map(lambda job: self._write(*job), jobs))
        return done[len(done) - len(more):] if more else []

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Write every buffer now, retry the run's own rows, and write the changed counts to `probe_stats`.

        Args:
            timeout_s: accepted for the exporter interface; the writes are not cut short.

        Returns:
            True (failed writes are counted as dropped rows, not returned).
        """
        if self.writer is None:  # never attached (the attach failed): nothing to write
            return True
        if self.processor is not None and self.processor.draining:
            # the processor's last flush before it shuts this exporter down: do the shutdown's work now,
            # so the buffers and the run_ends row are committed together (a table each, at once), not
            # in two rounds; the shutdown that follows finds nothing left to do
            self.shutdown()
            return True
        self._flush_tables(list(self._first_at))
        if self._unwritten_run:
            self._write_run()
        self.writer.write_changed_stats()  # drops are made durable at the next flush, not only at exit
        return True

    def write_probe_stats(self) -> bool:
        """Write the run's counts into `probe_stats` now (see `RunWriter.write_probe_stats`).

        Returns:
            False when the store refused the row: a later snapshot carries the same counts (they are
                cumulative; nothing is counted as lost).
        """
        return self._attached()[1].write_probe_stats()

    def shutdown(self) -> None:
        """Write what is buffered, the run's `run_ends` row and its counts, and release the writer.

        Safe to call twice; records exported afterwards are refused. The run's own rows get a last try.
        """
        if self._closed:
            return
        self._closed = True
        if self.writer is None:  # never attached (the attach failed): nothing written, no writer to give back
            return
        run, writer = self._attached()
        # The session closed: readers (the alerts runner) resolve the run's open alerts on this row.
        ended = pa.Table.from_pylist([dict(run_id=run.run_id, rank=run.rank, pid=os.getpid(),
                                           ended_at=dt.datetime.now(dt.timezone.utc), last_step=self.last_step)],
                                     schema=SCHEMAS["run_ends"])
        with self._run_rows_lock:  # the run's own rows get their last try (no later flush retries them)
            self._flush_tables(list(self._first_at), [(table, data, False) for table, data in self._unwritten_run]
                               + [("run_ends", ended, True)])
            self._unwritten_run = []
        # Written now, after every other table (it counts their rows), not only when the writer's last
        # holder lets go: the session's counts are final.
        if not writer.write_probe_stats():
            log.error("moescope: the probe_stats of run %s could not be written to %s; the counts were: %s",
                      run.run_id, self.location.redacted, writer.drop_counts()[0] or "no drops")
        writer.release()
