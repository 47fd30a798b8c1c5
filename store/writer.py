"""The store's write path: `ParquetExporter`, the exporter that writes a probe's records as tables.

The model thread only calls the probe's `BatchProcessor.emit(record)` (moescope/pipeline.py), which
never raises and, under the `drop` policy, never waits; its worker thread hands batches to
exporters. `ParquetExporter` writes
each table's rows to `<root>/<table>/run_id=<id>/part-<rank>-<pid>-<seq>-<ns>.parquet` through a
temporary name and a rename, so a reader (or a crash) never sees a torn file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

# The queue between the model and the exporters belongs to the probe; re-exported for store users.
from moescope.pipeline import BatchProcessor, InMemoryExporter, array_bytes, record_rows  # noqa: F401
from moescope.probe.records import Routes, RunInfo, StepRecord
from moescope.store.layout import (
    WRITER_ROW_GROUP_ROWS,
    check_part_name,
    check_rank,
    parquet_options,
    part_name,
    run_folder,
    tmp_path,
)
from moescope.store.schema import SCHEMAS, layers_table, routes_table, run_table, step_tables

log = logging.getLogger(__name__)

# A table's rows are written once they hold this many bytes, even before `max_rows` or `max_age_s`.
DEFAULT_MAX_BUFFER_BYTES = 64 * 1024 * 1024


# One sequence for every writer of the process: two writers never choose one file name.
_SEQUENCE = itertools.count(1)


def write_table_file(root: str | os.PathLike, table: str, run_id: str, data: pa.Table, rank: int = 0,
                     seq: int | None = None, row_group_size: int = WRITER_ROW_GROUP_ROWS,
                     name: str | None = None, metadata: dict[bytes, bytes] | None = None) -> str:
    """Write one Parquet file atomically into the store layout; returns its path.

    The rows go to a temporary name, are fsynced, and the file is renamed into place: readers
    and crashes see the whole file or nothing. Raises OSError (disk full, permissions) after
    removing the temporary file, InvalidNameError (a ValueError) for a table, run id, rank or name
    that cannot be part of a path (see `store.layout.NAME_FORM`), before anything is written.
    """
    folder = run_folder(root, table, run_id)
    name = check_part_name(name) if name is not None else part_name(rank, next(_SEQUENCE) if seq is None else seq)
    check_rank(rank)
    os.makedirs(folder, exist_ok=True)
    final = os.path.join(folder, name)
    tmp = tmp_path(final)
    if metadata:
        data = data.replace_schema_metadata({**(data.schema.metadata or {}), **metadata})
    # run_id lives in the folder name (hive partitioning); keeping it in the file too means a
    # file copied elsewhere still says which run it belongs to.
    try:
        pq.write_table(data, tmp, row_group_size=row_group_size, **parquet_options(data.column_names))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return final


class TableWriter:
    """The one writer of store tables: every table of one run (and rank) goes through it.

    It owns what a written file is: the table's schema (`store.schema.SCHEMAS`; rows given as
    dicts are converted with it), the part's name (the process's one sequence, so writers in one
    process never collide), the atomic write (`write_table_file`), and the count of what could not
    be written. A failed write's rows are counted as `write_failed` through `on_dropped(table,
    reason, rows)` (for the probe: its processor, which puts them into `probe_stats`, Prometheus
    and `session.probe_stats()`), or in `dropped_rows` without one, unless the caller keeps them
    to write again (`retried`). One error line when writes start failing, one when they work
    again. Used by the probe's `ParquetExporter`, the trust policy, the alerts table and the
    dashboard's gate requests.
    """

    def __init__(self, root: str | os.PathLike, run_id: str, rank: int = 0,
                 on_dropped: Callable[[str, str, int], None] | None = None):
        run_folder(root, "runs", run_id)  # a run id that cannot be a folder name is refused here
        self.root = os.fspath(root)
        self.run_id = run_id
        self.rank = check_rank(rank)
        self.on_dropped = on_dropped
        self.written_rows: Counter[str] = Counter()
        self.dropped_rows: Counter[tuple[str, str]] = Counter()  # (table, reason) -> rows, without on_dropped
        self.files: list[str] = []
        self._failing: Counter[str] | None = None  # rows lost per table since writes started failing
        self.last_error: str | None = None  # why the last write failed; None once one succeeds

    def write(self, table: str, data: pa.Table | Sequence[dict], retried: bool = False) -> bool:
        """Write `data` (a table, or rows as dicts) as a new part of `table`; False when the disk
        refused it. Raises InvalidNameError for a table name that cannot be a folder."""
        if not isinstance(data, pa.Table):
            data = pa.Table.from_pylist(list(data), schema=SCHEMAS[table])
        try:
            path = write_table_file(self.root, table, self.run_id, data, self.rank)
        except OSError as e:
            self.last_error = f"{type(e).__name__}: {e}"
            if self._failing is None:
                self._failing = Counter()
                log.error("moescope: cannot write to the store %s (%s): rows are dropped and counted as "
                          "write_failed until a write succeeds again", self.root, e)
            if not retried:
                self._failing[table] += data.num_rows
                if self.on_dropped is not None:
                    self.on_dropped(table, "write_failed", data.num_rows)
                else:
                    self.dropped_rows[(table, "write_failed")] += data.num_rows
            return False
        if self._failing is not None:
            lost = ", ".join(f"{n} of {t}" for t, n in sorted(self._failing.items())) or "none"
            log.warning("moescope: writing to the store %s works again; rows lost meanwhile: %s", self.root, lost)
            self._failing = None
        self.last_error = None
        self.files.append(path)
        self.written_rows[table] += data.num_rows
        return True


class ParquetExporter:
    """Buffers rows per table and writes a Parquet file per table when a buffer is big or old.

    One instance writes one run from one process; file names carry rank, pid, a sequence number
    and the clock, so processes and ranks write side by side without locks. Rows are lost to a
    crash only from the buffers, which hold at most `max_age_s` seconds (the flush interval) of
    data, `max_rows` rows or `max_bytes` bytes per table. Route rows stay numpy arrays until their
    flush, which converts them in one vectorised pass.

    A write that fails (disk full) loses its rows: they are counted with reason `write_failed` in
    the processor's `dropped_rows` (so `session.probe_stats()` and Prometheus see them; in this
    exporter's own `dropped_rows` when it has no processor), one error is logged when failures
    start and one line when writes work again, and the counts reach the `probe_stats` table at
    the first flush the disk takes. The run's `runs` and `layers` rows are kept and retried
    until they are written (counted as lost only if the exporter shuts down first).
    """

    def __init__(self, root: str | os.PathLike, run: RunInfo | None = None, max_rows: int = 256 * 1024,
                 max_age_s: float = 5.0, processor: BatchProcessor | None = None,
                 max_bytes: int = DEFAULT_MAX_BUFFER_BYTES):
        """run: the run to write; None to learn it from the probe at attach (`on_attach`)."""
        self.root = os.fspath(root)
        self.run: RunInfo | None = None
        self.max_rows = max_rows
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.processor = processor  # whose drop counters go into probe_stats
        self._buffers: dict[str, list[pa.Table]] = {}
        self._route_pieces: list[tuple[int, int, dict[str, str], Routes]] = []
        self._rows: Counter[str] = Counter()
        self._bytes: Counter[str] = Counter()
        self._first_at: dict[str, float] = {}
        self.dropped_rows: Counter[tuple[str, str]] = Counter()  # (table, reason) -> rows, without a processor
        self.tables: TableWriter | None = None  # the run's writer, from on_attach
        self._stats_written: tuple | None = None
        self._stats_tried = time.monotonic()
        self._closed = False
        self.last_step: int | None = None  # the last forward exported, for the run_ends row
        self._unwritten_run: list[tuple[str, pa.Table]] = []
        if run is not None:
            self.on_attach(run)

    def on_attach(self, run: RunInfo) -> None:
        """Start writing `run`: its `runs` and `layers` rows first. The probe calls this at attach;
        a run id that cannot be a folder name is refused here (`InvalidNameError`)."""
        if self.run is run:
            return
        self.tables = TableWriter(self.root, run.run_id, run.rank, on_dropped=self._count_dropped)
        self.run = run
        self._unwritten_run = [("runs", run_table(run))] + ([("layers", layers_table(run))] if run.layers else [])
        self._write_run()

    def bind_processor(self, processor: BatchProcessor) -> None:
        """The probe's processor, whose drop counters this exporter writes into `probe_stats`."""
        self.processor = processor

    def _write_run(self) -> None:
        """Write the run's own rows that are not on disk yet (they are retried, not dropped)."""
        self._unwritten_run = [(table, data) for table, data in self._unwritten_run
                               if not self._write(table, data, retried=True)]

    def _write(self, table: str, data: pa.Table, retried: bool = False) -> bool:
        """Write `data` as a new part of `table` (see `TableWriter.write`); False when refused."""
        return self.tables.write(table, data, retried=retried)

    def _count_dropped(self, table: str, reason: str, rows: int) -> None:
        if self.processor is not None:
            self.processor.count_dropped_rows(table, reason, rows)
        else:
            self.dropped_rows[(table, reason)] += rows

    @property
    def written_rows(self) -> Counter[str]:
        """Rows written per table."""
        return self.tables.written_rows if self.tables is not None else Counter()

    @property
    def files(self) -> list[str]:
        """Paths of the parts written."""
        return self.tables.files if self.tables is not None else []

    def export(self, records: Sequence[StepRecord]) -> bool:
        if self._closed:
            return False
        now = time.monotonic()
        rank = self.run.rank
        for record in records:
            self.last_step = max(self.last_step or 0, int(record.step_end if record.step_end is not None
                                                          else record.step))
            for ls in record.layers:
                if ls.routes is not None:
                    self._route_pieces.append((record.step, ls.layer, record.tags, ls.routes))
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
        for table in list(self._first_at):
            if (self._rows[table] >= self.max_rows or self._bytes[table] >= self.max_bytes
                    or now - self._first_at[table] >= self.max_age_s):
                self._flush_table(table)
        if self._unwritten_run:
            self._write_run()
        if now - self._stats_tried >= self.max_age_s:
            self._write_changed_stats()  # drops reach the disk within a flush interval under steady load
        return True

    def _flush_table(self, table: str) -> None:
        self._rows.pop(table, None)
        self._bytes.pop(table, None)
        self._first_at.pop(table, None)
        if table == "routes":
            pieces, self._route_pieces = self._route_pieces, []
            if pieces:
                self._write(table, routes_table(self.run.run_id, self.run.rank, pieces))
            return
        parts = self._buffers.pop(table, [])
        if parts:
            self._write(table, pa.concat_tables(parts))

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        for table in list(self._first_at):
            self._flush_table(table)
        if self._unwritten_run:
            self._write_run()
        self._write_changed_stats()  # drops are made durable at the next flush, not only at exit
        return True

    def _write_changed_stats(self) -> None:
        """Write probe_stats if drops changed since the last snapshot on disk (or it failed)."""
        self._stats_tried = time.monotonic()
        drops = self._drop_counts()[0]
        if drops != self._stats_written and drops:
            self.write_probe_stats()

    def _drop_counts(self) -> tuple[tuple, dict[str, int]]:
        """(rows dropped per (table, reason), sorted; records dropped per reason), copied consistently."""
        rows, records = self.processor.drop_counts() if self.processor else (dict(self.dropped_rows), {})
        return tuple(sorted(rows.items())), records

    def write_probe_stats(self) -> bool:
        """Write cumulative written and dropped rows, per table and reason, into probe_stats.

        Each write is a snapshot of this writer's counters (rank, pid); readers take the latest
        snapshot per writer (`Store.probe_stats`). Returns False when the disk refused it: the
        snapshot is then written at a later flush (it is cumulative; nothing is counted as lost).
        """
        now = dt.datetime.now(dt.timezone.utc)
        drops, dropped_records = self._drop_counts()
        dropped = Counter(dict(drops))
        rows = []
        for table in SCHEMAS:
            if table == "probe_stats":
                continue
            reasons = {reason for (t, reason) in dropped if t == table}
            if not reasons and not self.written_rows.get(table):
                continue
            base = dict(run_id=self.run.run_id, ts=now, table_name=table, rank=self.run.rank,
                        pid=os.getpid())
            rows.append(dict(base, written_rows=self.written_rows.get(table, 0), dropped_rows=0,
                             dropped_records=0, reason=None))
            for reason in sorted(reasons):
                rows.append(dict(base, written_rows=0, dropped_rows=dropped[(table, reason)],
                                 dropped_records=dropped_records.get(reason, 0) if table == "steps" else 0,
                                 reason=reason))
        if rows and not self._write("probe_stats", pa.Table.from_pylist(rows, schema=SCHEMAS["probe_stats"]),
                                    retried=True):
            return False
        self._stats_written = drops
        return True

    def shutdown(self) -> None:
        if self._closed:
            return
        for table in list(self._first_at):
            self._flush_table(table)
        for table, data in self._unwritten_run:  # the last try: no later flush will retry them
            self._write(table, data)
        self._unwritten_run = []
        # The session closed: readers (the alerts runner) resolve the run's open alerts on this row.
        ended = pa.Table.from_pylist([dict(run_id=self.run.run_id, rank=self.run.rank, pid=os.getpid(),
                                           ended_at=dt.datetime.now(dt.timezone.utc), last_step=self.last_step)],
                                     schema=SCHEMAS["run_ends"])
        self._write("run_ends", ended, retried=True)
        if not self.write_probe_stats():
            log.error("moescope: the final probe_stats of run %s could not be written to %s; the counts were: %s",
                      self.run.run_id, self.root, dict(self._drop_counts()[0]) or "no drops")
        self._closed = True
