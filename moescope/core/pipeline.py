"""The write pipeline: a batch processor that owns the bounded queue and the worker thread.

Every producer hands its records over with `BatchProcessor.emit(record)`, which never raises and,
under the `drop` policy, never waits: the probe session (its windows), the proxy (captured
responses), and, through a run's writer (`store.writer.RunWriter.emit`), the importers, the
training monitor, the trust and cooldown policies, the alerts tables and dashboard gate requests.
A worker thread builds deferred records (`Deferred`, e.g. the probe's window waiting for its device
copies) and hands batches to exporters (`Exporter`: `export(records) -> bool`,
`force_flush(timeout_s) -> bool`, `shutdown()`): the store's writers, the Prometheus exporter, an
alerts engine, or the `InMemoryExporter` kept here for tests and in-process consumers. What else an
exporter offers it declares as a protocol, checked with `isinstance`: `BindsProcessor` (it wants
the processor feeding it), `WritesRows` (it says how many rows it wrote), `DropCounts`.

This module is a leaf (the standard library and numpy): probe, store and alerts all use it and it
knows none of their types. A record says what queueing it costs and what dropping it loses through
`Record` (its host bytes, its rows per table: the probe's `StepRecord` and its deferred window do).
`new_run_id` is the one generator of run ids; `current_host` the one source of the host a row
records (the probe's runs row, a writer's probe_stats, its part names, the importers').
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import queue
import socket
import threading
import uuid
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

log = logging.getLogger(__name__)

POLICIES = ("block", "drop")
# The queue between the model and the writer holds at most this many bytes of records (and at
# most `max_queue` records): 256 MiB is a few seconds of per-token routes of a large model at
# serving rates, or about 60 records of 4 Ki sampled router inputs of width 4096 in float32.
DEFAULT_MAX_QUEUE_BYTES = 256 * 1024 * 1024


def new_run_id(source: str | None = None) -> str:
    """A fresh run id: UTC time to the second, the source where one is given (an importer's engine,
    "proxy"), and a random suffix, e.g. `20250101T120000-ab12cd34` or `20250101T120000-vllm-ab12cd34`."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{source}-{uuid.uuid4().hex[:8]}" if source else f"{stamp}-{uuid.uuid4().hex[:8]}"


def current_host() -> str:
    """The host this process records in `runs` and `probe_stats`: MOESCOPE_HOST where set (a fleet
    names its hosts itself, e.g. a pod name, or several writers of one machine stand for hosts in a
    test), else the machine's hostname."""
    return os.environ.get("MOESCOPE_HOST", "").strip() or socket.gethostname() or "unknown"


@runtime_checkable
class Record(Protocol):
    """What the queue asks of a record that can answer: the host bytes it holds (what queueing it
    costs, against `max_queue_bytes`) and the rows it adds to each table (what dropping it loses)."""

    @property
    def nbytes(self) -> int: ...

    def rows(self) -> Mapping[str, int]: ...


@runtime_checkable
class Deferred(Protocol):
    """A record built on the worker thread, not the producer's (the probe's window: its device
    copies are waited for there). `materialize()` returns what the exporters receive."""

    def materialize(self) -> Any: ...


class Exporter(Protocol):
    """What consumes the pipeline's records, on its worker thread."""

    def export(self, records: Sequence[Any]) -> bool: ...
    def force_flush(self, timeout_s: float = 30.0) -> bool: ...
    def shutdown(self) -> None: ...


@runtime_checkable
class BindsProcessor(Protocol):
    """An exporter that wants the processor feeding it, to count what it loses in the processor's
    drop counters (the store's `ParquetExporter`). A producer that owns the processor (the probe
    session) hands it over before the first record."""

    def bind_processor(self, processor: BatchProcessor) -> None: ...


@runtime_checkable
class WritesRows(Protocol):
    """An exporter that writes rows says how many, per table (the store's `ParquetExporter`)."""

    @property
    def written_rows(self) -> Mapping[str, int]: ...


@runtime_checkable
class ForkAware(Protocol):
    """An exporter that holds per-process state (buffers, a writer's identity) and must start afresh
    in a forked child that records on its own; its processor calls this once, before the child's
    first record reaches it."""

    def after_fork_in_child(self) -> None: ...


class DropCounts(Protocol):
    """Anything that counts what it lost: a processor, or an exporter that writes without one."""

    def drop_counts(self) -> tuple[dict[tuple[str, str], int], dict[str, int]]: ...


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


class BatchProcessor:
    """A bounded queue and one worker thread between a producer and its exporters.

    The queue is bounded by records (`max_queue`) and by bytes (`max_queue_bytes`, counted with
    `record_bytes`, and held until the record's batch is exported): a burst of large records
    cannot hold more memory than that. A record larger than the whole byte bound is let into an
    empty queue only. policy="block" is lossless: when the queue is full the producer waits.
    policy="drop" never makes the producer wait: a record that does not fit is dropped and counted,
    per table, with a reason ("queue_full" for the record bound, "queue_bytes_full" for bytes).
    A record emitted after `shutdown` is counted as "closed"; one an exporter refused as
    "export_failed:<exporter>". `drop_counts()` gives the counts (a `DropCounts`).
    """

    def __init__(self, exporters: Sequence[Exporter], max_queue: int = 256, policy: str = "block",
                 flush_interval_s: float = 5.0, max_batch: int = 32,
                 max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES, name: str = "moescope-writer"):
        """name: the worker thread's name (what a thread dump shows)."""
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
        self._closed = False
        self._name = name
        self._start_lock = threading.Lock()
        self._worker: threading.Thread | None = threading.Thread(target=self._run, name=name, daemon=True)
        self._worker.start()
        _PROCESSORS.add(self)

    def _reset_in_child(self) -> None:
        """In a forked child: the parent's queue, locks and counts stay the parent's (its worker thread
        did not come through the fork, and the records queued there are the parent's to write). The
        child starts empty, with no worker until it emits: a child that never records (a DataLoader
        worker) starts no thread and writes nothing."""
        self._queue = queue.Queue(maxsize=self._queue.maxsize)
        self._space = threading.Condition(threading.Lock())
        self.queued_bytes = 0
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        self.dropped_records = Counter()
        self.dropped_rows = Counter()
        self.exported_records = 0
        self._worker = None

    def _start_in_child(self) -> None:
        with self._start_lock:
            if self._worker is not None:
                return
            for exporter in self.exporters:
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

    def emit(self, record: Any) -> None:
        """Hand a record over; never raises."""
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

    def _count_drop(self, record: Any, reason: str) -> None:
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

    def _built(self, item: object) -> Any:
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
            batch: list[Any] = []
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
                self._flush_exporters()
                return

    def _export(self, batch: list[Any]) -> None:
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

    def force_flush(self, timeout_s: float | None = 30.0) -> bool:
        """Export everything queued so far and flush the exporters; False on timeout (None: none)."""
        if self._closed or self._worker is None:  # closed, or a forked child that recorded nothing
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def wait_idle(self, timeout_s: float | None = 30.0) -> bool:
        """Wait until every record handed over so far is built and exported, without flushing the
        exporters (`force_flush` does both); False on timeout (None: none)."""
        if self._closed or self._worker is None:
            return True
        done = self._queue.all_tasks_done
        with done:
            return done.wait_for(lambda: not self._queue.unfinished_tasks, timeout_s)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Drain the queue, flush and join; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._worker is None:  # a forked child that recorded nothing: the exporters are the parent's
            return
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
_PROCESSORS: weakref.WeakSet[BatchProcessor] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for processor in list(_PROCESSORS):
        processor._reset_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


class InMemoryExporter(Exporter):
    """Keeps every exported record; for tests and in-process consumers."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def export(self, records: Sequence[Any]) -> bool:
        self.records.extend(records)
        return True

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self) -> None:
        pass
