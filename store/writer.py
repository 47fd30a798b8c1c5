"""The write path: a batch processor that owns the queue and thread, and exporters that write.

The model thread only calls `BatchProcessor.emit(record)`, which never raises and, under the
`drop` policy, never waits. A worker thread hands batches to exporters. `ParquetExporter` writes
each table's rows to `<root>/<table>/run_id=<id>/part-<rank>-<pid>-<seq>-<ns>.parquet` through a
temporary name and a rename, so a reader (or a crash) never sees a torn file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from probe.records import Routes, RunInfo, StepRecord
from store.layout import (
    WRITER_ROW_GROUP_ROWS,
    check_part_name,
    check_rank,
    parquet_options,
    part_name,
    run_folder,
    tmp_path,
)
from store.schema import SCHEMAS, layers_table, routes_table, run_table, step_tables

log = logging.getLogger(__name__)

POLICIES = ("block", "drop")
# The queue between the model and the writer holds at most this many bytes of records (and at
# most `max_queue` records): 256 MiB is a few seconds of per-token routes of a large model at
# serving rates, or about 60 records of 4 Ki sampled router inputs of width 4096 in float32.
DEFAULT_MAX_QUEUE_BYTES = 256 * 1024 * 1024
# A table's rows are written once they hold this many bytes, even before `max_rows` or `max_age_s`.
DEFAULT_MAX_BUFFER_BYTES = 64 * 1024 * 1024


class Exporter(Protocol):
    def export(self, records: Sequence[StepRecord]) -> bool: ...
    def force_flush(self, timeout_s: float = 30.0) -> bool: ...
    def shutdown(self) -> None: ...


def record_rows(record: StepRecord) -> dict[str, int]:
    """Rows a record would add to each table; what a dropped record costs, table by table.

    A window not yet built (the probe's `PendingWindow`) answers from its layout.
    """
    if hasattr(record, "materialize"):
        return record.rows()
    rows = {"steps": 1, "layer_steps": len(record.layers)}
    for layer in record.layers:
        if layer.routes is not None:
            rows["routes"] = rows.get("routes", 0) + len(layer.routes.expert_ids)
        for name in ("router_logits", "router_inputs"):
            sample = getattr(layer, name)
            if sample is not None:
                rows[name] = rows.get(name, 0) + len(sample.token)
    if record.kv_cache:
        rows["kv_cache"] = len(record.kv_cache)
    return rows


def record_bytes(record: object) -> int:
    """Host memory a queued record holds: its numpy arrays' bytes (a probe window not yet built:
    its host buffers'), plus a small fixed cost for the Python objects."""
    nbytes = getattr(record, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes + _RECORD_OVERHEAD
    return _array_bytes(record) + _RECORD_OVERHEAD


_RECORD_OVERHEAD = 1024


def _array_bytes(value: object) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_array_bytes(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(_array_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


class BatchProcessor:
    """A bounded queue and one worker thread between the model and the exporters.

    The queue is bounded by records (`max_queue`) and by bytes (`max_queue_bytes`, counted from
    each record's arrays, and held until the record's batch is exported): a burst of large records
    cannot hold more memory than that. A record larger than the whole byte bound is let into an
    empty queue only. policy="block" is lossless: when the queue is full the model waits.
    policy="drop" never makes the model wait: a record that does not fit is dropped and counted,
    per table, with a reason ("queue_full" for the record bound, "queue_bytes_full" for bytes).
    """

    def __init__(self, exporters: Sequence[Exporter], max_queue: int = 256, policy: str = "block",
                 flush_interval_s: float = 5.0, max_batch: int = 32,
                 max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
        if max_queue_bytes < 1:
            raise ValueError(f"max_queue_bytes must be at least 1, not {max_queue_bytes!r}")
        self.exporters = list(exporters)
        self.policy = policy
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self.max_queue_bytes = max_queue_bytes
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._space = threading.Condition(threading.Lock())  # guards queued_bytes
        self.queued_bytes = 0  # bytes of records emitted and not yet exported
        self._lock = threading.Lock()
        self.dropped_records: Counter[str] = Counter()  # reason -> records
        self.dropped_rows: Counter[tuple[str, str]] = Counter()  # (table, reason) -> rows
        self.exported_records = 0
        self._flush_requests: list[threading.Event] = []
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="moescope-writer", daemon=True)
        self._worker.start()

    def emit(self, record: StepRecord) -> None:
        """Hand a record over; never raises."""
        if self._closed:
            self._count_drop(record, "closed")
            return
        size = 0
        try:
            size = record_bytes(record)
            refused = self._reserve(size)
            if refused:
                self._count_drop(record, refused)
                return
            if self.policy == "block":
                self._queue.put((record, size))
            else:
                self._queue.put_nowait((record, size))
        except queue.Full:
            self._release(size)
            self._count_drop(record, "queue_full")
        except Exception:  # the model thread must never see the probe fail
            self._release(size)
            self._count_drop(record, "error")

    def _reserve(self, size: int) -> str | None:
        """Take `size` bytes of the queue's bound; the reason a record is refused, or None."""
        with self._space:
            def fits() -> bool:
                return not self.queued_bytes or self.queued_bytes + size <= self.max_queue_bytes

            if self.policy == "block":
                while not fits() and not self._closed:
                    self._space.wait()
                if self._closed:
                    return "closed"
            elif not fits():
                return "queue_bytes_full"
            self.queued_bytes += size
            return None

    def _release(self, size: int) -> None:
        if size:
            with self._space:
                self.queued_bytes -= size
                self._space.notify_all()

    def _count_drop(self, record: StepRecord, reason: str) -> None:
        with self._lock:
            self.dropped_records[reason] += 1
            for table, rows in record_rows(record).items():
                self.dropped_rows[(table, reason)] += rows

    def count_dropped_rows(self, table: str, reason: str, rows: int) -> None:
        """Rows lost outside the queue: before they became a record (e.g. a full device ring), or
        after, by an exporter (e.g. a write that failed: `ParquetExporter`)."""
        with self._lock:
            self.dropped_rows[(table, reason)] += rows

    def drop_counts(self) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
        """A consistent copy of (rows dropped per (table, reason), records dropped per reason)."""
        with self._lock:
            return dict(self.dropped_rows), dict(self.dropped_records)

    def _built(self, item: object) -> StepRecord | None:
        """A record, building a probe window on this (the writer's) thread; None if that failed."""
        if not hasattr(item, "materialize"):
            return item  # type: ignore[return-value]
        try:
            return item.materialize()
        except Exception:
            log.exception("moescope: building a window's record failed; it is counted as dropped")
            self._count_drop(item, "build_failed")  # type: ignore[arg-type]
            return None

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.flush_interval_s)
            except queue.Empty:
                self._flush_exporters()
                continue
            batch: list[StepRecord] = []
            held = 0  # queue bytes of the batch, given back once it is exported
            stop = False
            while item is not None:
                if isinstance(item, threading.Event):
                    self._export(batch)
                    self._release(held)
                    batch, held = [], 0
                    self._flush_exporters()
                    item.set()
                elif item is _STOP:
                    stop = True
                    break
                else:
                    pending, size = item
                    held += size
                    record = self._built(pending)
                    if record is not None:
                        batch.append(record)
                if len(batch) >= self.max_batch:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            self._export(batch)
            self._release(held)
            if stop:
                self._flush_exporters()
                return

    def _export(self, batch: list[StepRecord]) -> None:
        if not batch:
            return
        for exporter in self.exporters:
            try:
                ok = exporter.export(batch)
            except Exception:
                log.exception("exporter %s failed", type(exporter).__name__)
                ok = False
            if not ok:
                for record in batch:
                    self._count_drop(record, f"export_failed:{type(exporter).__name__}")
        self.exported_records += len(batch)

    def _flush_exporters(self) -> None:
        for exporter in self.exporters:
            try:
                exporter.force_flush()
            except Exception:
                log.exception("flush of %s failed", type(exporter).__name__)

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Export everything queued so far and flush the exporters; False on timeout."""
        if self._closed:
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Drain the queue, flush and join; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with self._space:
            self._space.notify_all()  # a model thread waiting for queue bytes gives up ("closed")
        self._queue.put(_STOP)
        self._worker.join(timeout_s)
        for exporter in self.exporters:
            try:
                exporter.shutdown()
            except Exception:
                log.exception("shutdown of %s failed", type(exporter).__name__)


_STOP = object()


class InMemoryExporter:
    """Keeps every exported record; for tests and in-process consumers."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def export(self, records: Sequence[StepRecord]) -> bool:
        self.records.extend(records)
        return True

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def write_table_file(root: str | os.PathLike, table: str, run_id: str, data: pa.Table, rank: int = 0,
                     seq: int = 0, row_group_size: int = WRITER_ROW_GROUP_ROWS,
                     name: str | None = None, metadata: dict[bytes, bytes] | None = None) -> str:
    """Write one Parquet file atomically into the store layout; returns its path.

    The rows go to a temporary name, are fsynced, and the file is renamed into place: readers
    and crashes see the whole file or nothing. Raises OSError (disk full, permissions) after
    removing the temporary file, InvalidNameError (a ValueError) for a table, run id, rank or name
    that cannot be part of a path (see `store.layout.NAME_FORM`), before anything is written.
    """
    folder = run_folder(root, table, run_id)
    name = check_part_name(name) if name is not None else part_name(rank, seq)
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

    def __init__(self, root: str | os.PathLike, run: RunInfo, max_rows: int = 256 * 1024,
                 max_age_s: float = 5.0, processor: BatchProcessor | None = None,
                 max_bytes: int = DEFAULT_MAX_BUFFER_BYTES):
        run_folder(root, "runs", run.run_id)  # a run id that cannot be a folder is refused at attach
        check_rank(run.rank)
        self.root = os.fspath(root)
        self.run = run
        self.max_rows = max_rows
        self.max_age_s = max_age_s
        self.max_bytes = max_bytes
        self.processor = processor  # whose drop counters go into probe_stats
        self._buffers: dict[str, list[pa.Table]] = {}
        self._route_pieces: list[tuple[int, int, dict[str, str], Routes]] = []
        self._rows: Counter[str] = Counter()
        self._bytes: Counter[str] = Counter()
        self._first_at: dict[str, float] = {}
        self.written_rows: Counter[str] = Counter()
        self.dropped_rows: Counter[tuple[str, str]] = Counter()  # (table, reason) -> rows, without a processor
        self.files: list[str] = []
        self._seq = 0
        self._stats_written: tuple | None = None
        self._stats_tried = time.monotonic()
        self._failing: Counter[str] | None = None  # rows lost per table since writes started failing
        self._closed = False
        self.last_step: int | None = None  # the last forward exported, for the run_ends row
        self._unwritten_run = [("runs", run_table(run))] + ([("layers", layers_table(run))] if run.layers else [])
        self._write_run()

    def _write_run(self) -> None:
        """Write the run's own rows that are not on disk yet (they are retried, not dropped)."""
        self._unwritten_run = [(table, data) for table, data in self._unwritten_run
                               if not self._write(table, data, retried=True)]

    def _write(self, table: str, data: pa.Table, retried: bool = False) -> bool:
        """Write `data` as a new part of `table`; False when the disk refused it.

        Rows of a failed write are counted as dropped (`write_failed`) unless the caller keeps
        them to write again (`retried`).
        """
        self._seq += 1
        try:
            path = write_table_file(self.root, table, self.run.run_id, data, self.run.rank, self._seq)
        except OSError as e:
            if self._failing is None:
                self._failing = Counter()
                log.error("moescope: cannot write to the store %s (%s): rows are dropped and counted as "
                          "write_failed (session.probe_stats(), Prometheus, the probe_stats table) until a "
                          "write succeeds again", self.root, e)
            if not retried:
                self._failing[table] += data.num_rows
                if self.processor is not None:
                    self.processor.count_dropped_rows(table, "write_failed", data.num_rows)
                else:
                    self.dropped_rows[(table, "write_failed")] += data.num_rows
            return False
        if self._failing is not None:
            lost = ", ".join(f"{n} of {t}" for t, n in sorted(self._failing.items())) or "none"
            log.warning("moescope: writing to the store %s works again; rows lost meanwhile: %s", self.root, lost)
            self._failing = None
        self.files.append(path)
        self.written_rows[table] += data.num_rows
        return True

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
                    self._bytes["routes"] += _array_bytes(ls.routes)
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
