"""The write pipeline: a batch processor that owns the bounded queue and the worker thread.

Every producer hands its records over with `BatchProcessor.emit(record)`, which never raises and,
under the `drop` policy, never waits: the probe session (its windows), the proxy (captured
responses), and, through a run's writer (`moescope.store.writer.RunWriter.emit`), the importers, the
training monitor, the trust and cooldown policies, the alerts tables and dashboard gate requests.
A worker thread builds deferred records (`Deferred`, e.g. the probe's window waiting for its device
copies) and hands batches to its exporters: the store's writers, the Prometheus exporter, an alerts
engine, the trust and cooldown policies, or an `InMemoryExporter`. Every protocol of that seam
(`Exporter[R]`, `Record`, `Deferred`, the capabilities an exporter declares) lives in
`moescope.core.exporters`; this module keeps the processor and the record accounting (what a record
costs in the queue, what dropping it loses).

A neutral module (the standard library, numpy and the rest of core): probe, store and alerts all
use it and it knows none of their types. A processor joins the at-fork registry
(`moescope.core.forking`): a forked child starts with an empty queue of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Generic, TypeVar

import numpy as np

from moescope.core import forking
from moescope.core.exporters import Deferred, DrainListener, Exporter, ForkAware, Record

__all__ = [
    "DEFAULT_MAX_QUEUE_BYTES", "POLICIES", "BatchProcessor", "array_bytes", "record_bytes", "record_rows",
]

log = logging.getLogger(__name__)

R = TypeVar("R")

POLICIES = ("block", "drop")
# The queue between the model and the writer holds at most this many bytes of records (and at
# most `max_queue` records): 256 MiB is a few seconds of per-token routes of a large model at
# serving rates, or about 60 records of 4 Ki sampled router inputs of width 4096 in float32.
DEFAULT_MAX_QUEUE_BYTES = 256 * 1024 * 1024


def record_rows(record: object) -> dict[str, int]:
    """Rows a record would add to each table; what a dropped record costs, table by table.

    A `Record` answers itself; anything else adds no rows (a dropped one is still counted as a record).
    """
    if isinstance(record, Record):
        return dict(record.rows())
    return {}


def record_bytes(record: object) -> int:
    """Host memory a queued record holds: its own `nbytes` where it is a `Record`, else the bytes of
    the numpy arrays it holds, plus a small fixed cost for the Python objects."""
    if isinstance(record, Record):
        return int(record.nbytes) + _RECORD_OVERHEAD
    return array_bytes(record) + _RECORD_OVERHEAD


_RECORD_OVERHEAD = 1024


def array_bytes(value: object) -> int:
    """Bytes of the numpy arrays a record (or any dataclass, list or array) holds."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(array_bytes(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(array_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0



class BatchProcessor(Generic[R]):
    """A bounded queue and one worker thread between producers and their exporters.

    Generic over the record type `R` its exporters consume (`Exporter[R]`); a producer emits an `R`
    or a `Deferred[R]`, built on the worker thread. The queue is bounded by records (`max_queue`) and
    by bytes (`max_queue_bytes`, counted with `record_bytes`, and held until the record's batch is
    exported): a burst of large records cannot hold more memory than that. A record larger than the
    whole byte bound is let into an empty queue only. policy="block" is lossless: when the queue is
    full the producer waits. policy="drop" never makes the producer wait: a record that does not fit
    is dropped and counted, per table, with a reason ("queue_full" for the record bound,
    "queue_bytes_full" for bytes). A record emitted after `shutdown` is counted as "closed"; one an
    exporter refused as "export_failed:<exporter>". `drop_counts()` gives the counts (a `DropCounts`).

    Exporters may be added while the worker runs (`add_exporter`): the list is copied, changed and
    swapped in whole, so the worker, which takes the list once per batch, never walks one being
    changed. A batch under way goes to the exporters it started with.
    """

    def __init__(self, exporters: Sequence[Exporter[R]], max_queue: int = 256, policy: str = "block",
                 flush_interval_s: float = 5.0, max_batch: int = 32,
                 max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES, name: str = "moescope-writer"):
        """Start the worker thread.

        Args:
            exporters: what consumes the records, in order; more may be added with `add_exporter`.
            max_queue: the most records queued at once.
            policy: "block" (the producer waits for room) or "drop" (what does not fit is counted).
            flush_interval_s: how often an idle worker flushes its exporters.
            max_batch: the most records handed to the exporters in one `export`.
            max_queue_bytes: the most host bytes of records queued at once.
            name: the worker thread's name (what a thread dump shows).

        Raises:
            ValueError: for an unknown policy, or a byte bound under 1.
        """
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
        if max_queue_bytes < 1:
            raise ValueError(f"max_queue_bytes must be at least 1, not {max_queue_bytes!r}")
        # A tuple, replaced whole by add_exporter: the worker reads it without a lock.
        self._exporters: tuple[Exporter[R], ...] = tuple(exporters)
        self._exporters_lock = threading.Lock()  # one change of the exporters (or the shutdown) at a time
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
        self._closed = False
        self._name = name
        self._start_lock = threading.Lock()
        self._worker: threading.Thread | None = threading.Thread(target=self._run, name=name, daemon=True)
        self._worker.start()
        forking.join(self)

    @property
    def exporters(self) -> tuple[Exporter[R], ...]:
        """The exporters, in the order they receive each batch (a snapshot: add with `add_exporter`)."""
        return self._exporters

    def add_exporter(self, exporter: Exporter[R], *, first: bool = False) -> None:
        """Have `exporter` receive every batch exported from now on; safe while the worker runs.

        Args:
            exporter: the exporter to add; it is shut down with the processor.
            first: put it before the others (it sees each batch first, e.g. to fill in what later
                exporters read), instead of after them.

        Raises:
            ValueError: when the processor is shut down (the exporter would never be shut down).
        """
        with self._exporters_lock:
            if self._closed:
                raise ValueError("the pipeline is shut down; add exporters to an open one")
            self._exporters = (exporter, *self._exporters) if first else (*self._exporters, exporter)

    def reset_in_child(self) -> None:
        """Start afresh in a forked child (the at-fork registry calls this; nothing else should).

        The parent's queue, locks and counts stay the parent's (its worker thread did not come
        through the fork, and the records queued there are the parent's to write). The child starts
        empty, with no worker until it emits: a child that never records (a DataLoader worker)
        starts no thread and writes nothing.
        """
        self._queue = queue.Queue(maxsize=self._queue.maxsize)
        self._space = threading.Condition(threading.Lock())
        self.queued_bytes = 0
        self._lock = threading.Lock()
        self._exporters_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self.dropped_records = Counter()
        self.dropped_rows = Counter()
        self.exported_records = 0
        self._worker = None

    def _start_in_child(self) -> None:
        with self._start_lock:
            if self._worker is not None:
                return
            for exporter in self._exporters:
                if isinstance(exporter, ForkAware):
                    try:
                        exporter.after_fork_in_child()
                    except Exception:
                        log.exception("moescope: %s could not start afresh in a forked child",
                                      type(exporter).__name__)
            self._worker = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._worker.start()

    @property
    def closed(self) -> bool:
        """Whether `shutdown` was called: records emitted now are counted as dropped ("closed")."""
        return self._closed

    @property
    def worker_died(self) -> bool:
        """Whether the worker thread ended before `shutdown`: nothing emitted will be exported."""
        worker = self._worker
        return not self._closed and worker is not None and not worker.is_alive()

    def emit(self, record: R | Deferred[R]) -> None:
        """Hand a record over (or a `Deferred` one, built on the worker); never raises.

        With policy "block" the caller waits for room; with "drop" a record that does not fit is counted
        ("queue_full", "queue_bytes_full"). After `shutdown` it is counted as "closed", and a failure
        here as "error".

        Args:
            record: the record, or a `Deferred` that builds it on the worker thread.
        """
        if self._closed:
            self._count_drop(record, "closed")
            return
        if self._worker is None:  # the first record of a forked child
            self._start_in_child()
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

    def _count_drop(self, record: object, reason: str) -> None:
        with self._lock:
            self.dropped_records[reason] += 1
            for table, rows in record_rows(record).items():
                self.dropped_rows[(table, reason)] += rows

    def count_dropped_rows(self, table: str, reason: str, rows: int) -> None:
        """Count rows lost outside the queue.

        Before they became a record (e.g. a full device ring), or after, by an exporter (e.g. a write
        that failed: the store's `DeltaExporter`).

        Args:
            table: the table the rows were for.
            reason: why they were lost (e.g. "ring_full", "write_failed").
            rows: how many.
        """
        with self._lock:
            self.dropped_rows[(table, reason)] += rows

    def drop_counts(self) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
        """A consistent copy of the drop counts.

        Returns:
            (rows dropped per (table, reason), records dropped per reason).
        """
        with self._lock:
            return dict(self.dropped_rows), dict(self.dropped_records)

    def _built(self, item: R | Deferred[R]) -> R | None:
        """A record, building a `Deferred` one on this (the worker's) thread; None if that failed."""
        if not isinstance(item, Deferred):
            return item
        try:
            return item.materialize()
        except Exception:
            log.exception("moescope: building a record failed; it is counted as dropped")
            self._count_drop(item, "build_failed")
            return None

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.flush_interval_s)
            except queue.Empty:
                self._flush_exporters()
                continue
            batch: list[R] = []
            held = 0  # queue bytes of the batch, given back once it is exported
            taken = 1  # items taken off the queue, marked done once their batch is exported
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
                    taken += 1
                except queue.Empty:
                    item = None
            self._export(batch)
            self._release(held)
            for _ in range(taken):
                self._queue.task_done()
            if stop:
                self._flush_exporters(last=True)
                return

    def _export(self, batch: list[R]) -> None:
        if not batch:
            return
        for exporter in self._exporters:  # the tuple of now: an exporter added meanwhile gets the next batch
            try:
                ok = exporter.export(batch)
            except Exception:
                log.exception("exporter %s failed", type(exporter).__name__)
                ok = False
            if not ok:
                for record in batch:
                    self._count_drop(record, f"export_failed:{type(exporter).__name__}")
        self.exported_records += len(batch)

    def _flush_exporters(self, last: bool = False) -> None:
        """Flush every exporter; the `last` flush (the stop is taken: no record follows, `shutdown` does)
        tells a `DrainListener` that the pipeline drains instead."""
        for exporter in self._exporters:
            try:
                if last and isinstance(exporter, DrainListener):
                    exporter.on_drain()
                else:
                    exporter.force_flush()
            except Exception:
                log.exception("flush of %s failed", type(exporter).__name__)

    def force_flush(self, timeout_s: float | None = 30.0) -> bool:
        """Export everything queued so far and flush the exporters.

        Args:
            timeout_s: how long to wait, in seconds (default 30); None waits as long as it takes.

        Returns:
            False on timeout, else True (also when the processor is shut down).
        """
        if self._closed or self._worker is None:  # closed, or a forked child that recorded nothing
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def wait_idle(self, timeout_s: float | None = 30.0) -> bool:
        """Wait until every record handed over so far is built and exported, without flushing the exporters.

        `force_flush` does both.

        Args:
            timeout_s: how long to wait, in seconds (default 30); None waits as long as it takes.

        Returns:
            False on timeout, else True.
        """
        if self._closed or self._worker is None:
            return True
        done = self._queue.all_tasks_done
        with done:
            return done.wait_for(lambda: not self._queue.unfinished_tasks, timeout_s)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Drain the queue, flush and join the worker, then shut every exporter down; safe to call twice.

        The worker's last flush tells each exporter that is a `DrainListener` that the pipeline drains
        (`on_drain`), and flushes the others.

        A producer waiting for room gives up (its record is counted as "closed"); an exporter that fails
        to shut down is logged, not raised.

        Args:
            timeout_s: how long to wait for the worker to drain, in seconds (default 30).
        """
        with self._exporters_lock:  # no exporter is added after this: each one added is shut down below
            if self._closed:
                return
            self._closed = True
        if self._worker is None:  # a forked child that recorded nothing: the exporters are the parent's
            return
        with self._space:
            self._space.notify_all()  # a model thread waiting for queue bytes gives up ("closed")
        self._queue.put(_STOP)
        self._worker.join(timeout_s)
        for exporter in self._exporters:
            try:
                exporter.shutdown()
            except Exception:
                log.exception("shutdown of %s failed", type(exporter).__name__)


_STOP = object()
