"""The probe pipeline's exporter to the store: a session's records, buffered per table, as Delta commits.

    probe session ──emit──► BatchProcessor (moescope/core/pipeline.py) ──export──► DeltaExporter
        ──write──► the run's RunWriter (moescope/store/writer.py) ──► one Delta commit per table and flush

`DeltaExporter` turns `StepRecord`s into the rows of each table (`moescope.store.schema.step_tables`,
routes kept as numpy arrays until their flush: `routes_table`), holds them until a table's buffer is
big or old, and writes each as one part through the run's one writer (`run_writer`), which owns part
names, commits and the counts. At attach it writes the run's own rows (`runs`, `layers`), and at the
end the run's `run_ends` row and final `probe_stats`: in the pipeline's last flush, when the pipeline
tells it that it drains (`moescope.core.exporters.DrainListener`), so that its last parts and the
run's end are committed together.

`ParquetExporter`, the name of releases before this one (it always wrote Delta tables), is the same
class, kept for a release.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from moescope.core.exporters import (
    AttachListener,
    BindsProcessor,
    DrainListener,
    DropCounts,
    Exporter,
    ForkAware,
    WritesRows,
)
from moescope.core.pipeline import BatchProcessor, array_bytes
from moescope.core.records import RunInfo, StepRecord
from moescope.store import columns
from moescope.store.location import StoreLocation, open_location
from moescope.store.schema import SCHEMAS, RoutePiece, routes_table, run_tables, step_tables
from moescope.store.writer import RunWriter, run_writer

__all__ = ["DEFAULT_MAX_BUFFER_BYTES", "DeltaExporter", "ParquetExporter"]

log = logging.getLogger(__name__)

# A table's rows are written once they hold this many bytes, even before `max_rows` or `max_age_s`.
DEFAULT_MAX_BUFFER_BYTES = 64 * 1024 * 1024
# The tables every probe session commits to (its steps, its end, its final counts), opened at attach on
# object storage: a session shorter than a flush interval writes them first in its close.
SESSION_TABLES = ("steps", "layer_steps", "run_ends", "probe_stats")
# Parts of different tables a flush writes at once (a probe's flush has up to 4 tables; a close adds run_ends).
FLUSH_THREADS = 6


class DeltaExporter(Exporter[StepRecord], AttachListener, BindsProcessor[StepRecord], WritesRows, DropCounts,
                    ForkAware, DrainListener):
    """The probe pipeline's exporter: buffers a probe's records per table and commits them to a
    store's Delta tables.

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
            store: a folder or a URL (`moescope.store.location.open_location`, with `storage_options`).
            run: the run to write; None (default) to learn it from the probe at attach (`on_attach`).
            max_rows: rows per table at which a buffer is written (default 262144).
            max_age_s: seconds after a buffer's first row at which it is written (default 5.0, the
                pipeline's flush interval).
            processor: the probe's processor, whose drop counters go into `probe_stats`; None (default):
                the probe binds it (`bind_processor`).
            max_bytes: bytes per table at which a buffer is written (default 64 MiB).
            storage_options: how to reach a URL store (a dict or `key=value` strings; no secrets).

        Raises:
            moescope.store.location.LocationError: for a store that cannot be used as given.
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

    def on_attach(self, run: RunInfo, run_rows: bool = True) -> None:
        """Start writing `run`: its `runs` and `layers` rows first. The probe calls this at attach.

        Args:
            run: the run the probe attached as; the same run again is a no-op.
            run_rows: write the run's own rows (default True); False where another exporter of the
                run wrote them (the writer process that took over from one that died, or a forked child's).

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
        self._unwritten_run = list(run_tables(run).items()) if run_rows else []
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
        assert self.run is not None and self.writer is not None, "DeltaExporter used before on_attach"
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
        self._flush_tables(list(self._first_at))
        if self._unwritten_run:
            self._write_run()
        self.writer.write_changed_stats()  # drops are made durable at the next flush, not only at exit
        return True

    def state(self) -> dict[str, Any]:
        """What a writer process tells the model's process after each request
        (`moescope.store.writer_process`): rows written per table, rows buffered per table (lost if
        the process dies now), rows dropped as [table, reason, rows], and whether the run's own rows
        are still to be written.

        Returns:
            {"written": ..., "buffered": ..., "dropped": ..., "run_rows_due": ...}.
        """
        with self._drops_lock:
            dropped = [[table, reason, rows] for (table, reason), rows in self.dropped_rows.items()]
        return {"written": dict(self.written_rows), "buffered": dict(self._rows), "dropped": dropped,
                "run_rows_due": bool(self._unwritten_run)}

    def abandon(self) -> None:
        """The producer is gone without closing (its process was killed): write what is buffered and
        the counts, and release the writer, without a `run_ends` row (the session did not end; a
        reader tells a killed run by its missing end). Safe to call twice, and after `shutdown`."""
        if self._closed:
            return
        self._closed = True
        if self.writer is None:
            return
        with self._run_rows_lock:
            self._flush_tables(list(self._first_at), [(table, data, False) for table, data in self._unwritten_run])
            self._unwritten_run = []
        self.writer.write_probe_stats()
        self.writer.release()

    def on_drain(self) -> None:
        """The pipeline drains (a `moescope.core.exporters.DrainListener`): no record comes after this
        and `shutdown` follows, so do the shutdown's work now. The buffers and the `run_ends` row are
        then committed together (a table each, at once), not in a last flush and a shutdown after it;
        the shutdown that follows finds nothing left to do."""
        self.shutdown()

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
        ended = columns.rows_table([dict(run_id=run.run_id, rank=run.rank, pid=os.getpid(),
                                         ended_at=dt.datetime.now(dt.timezone.utc), last_step=self.last_step)],
                                   SCHEMAS["run_ends"])
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


# The name before 0.2.0 (the class always wrote Delta tables), kept for a release: removed in 0.3.0.
ParquetExporter = DeltaExporter
