"""The exporter seam: every protocol between the write pipeline and what consumes its records.

An exporter consumes batches of records on the pipeline's worker thread (`Exporter[R]`, generic
over the record type `R` it takes: the probe's exporters are `Exporter[StepRecord]`, a run
writer's own is `Exporter[TableRows]`). What else it offers or wants it declares by implementing
one of the capability protocols below (explicitly, as a base class, where that helps a reader);
the processor and the probe session check with `isinstance`, never by attribute names:

- `AttachListener.on_attach(run)`: the run being recorded (its id, rank and layers), before the
  first record (the store's `DeltaExporter` writes its `runs` rows, alerts learn the experts);
- `ProbeStatsReader.bind_probe_stats(source)`: `source()` returns the probe's `ProbeStats` (rows
  written per table, rows dropped per (table, reason)), read afresh whenever the exporter wants;
- `BindsProcessor.bind_processor(processor)`: the `BatchProcessor` feeding it, to count its losses
  in the processor's drop counters;
- `WritesRows.written_rows`: rows written per table (the session's `probe_stats()` adds them up);
- `DropCounts.drop_counts()`: what it lost, when it counts that itself;
- `ForkAware.after_fork_in_child()`: drop the parent's buffers before a forked child records;
- `DrainListener.on_drain()`: the pipeline drains (no record comes after this, `shutdown` follows):
  called instead of the last `force_flush`, so the exporter may do its shutdown's work at once.

A record itself may answer what queueing it costs and what dropping it loses (`Record`), or be
built on the worker thread rather than the producer's (`Deferred`). `InMemoryExporter` keeps what
it is given, for tests and in-process consumers.

This module imports nothing of moescope at run time (the types it names in annotations only):
every room may depend on it, and `moescope.core.pipeline` imports its protocols from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:  # annotations only: pipeline imports this module, and records imports pipeline
    from moescope.core.pipeline import BatchProcessor
    from moescope.core.records import RunInfo

__all__ = [
    "AttachListener", "BindsProcessor", "Deferred", "DrainListener", "DropCounts", "Exporter", "ForkAware",
    "InMemoryExporter",
    "ProbeStats", "ProbeStatsReader", "Record", "WritesRows",
]

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
# An exporter of a record type takes every subtype's records too: contravariant in what it consumes.
R_contra = TypeVar("R_contra", contravariant=True)

# (rows written per table, rows dropped per (table, reason)): `ProbeSession.probe_stats()`
ProbeStats = tuple[dict[str, int], dict[tuple[str, str], int]]


class Exporter(Protocol[R_contra]):
    """What consumes the pipeline's records of type `R_contra`, on its worker thread.

    `export` returns False when it refused the batch (the processor counts every record of it as
    dropped, "export_failed:<exporter>"); it may raise, which counts the same. `force_flush` writes
    what the exporter buffers and returns False when that did not finish in `timeout_s`;
    `shutdown` is called once, after the last batch.
    """

    def export(self, records: Sequence[R_contra]) -> bool: ...
    def force_flush(self, timeout_s: float = 30.0) -> bool: ...
    def shutdown(self) -> None: ...


@runtime_checkable
class Record(Protocol):
    """What the queue asks of a record that can answer: the host bytes it holds (what queueing it
    costs, against `max_queue_bytes`) and the rows it adds to each table (what dropping it loses)."""

    @property
    def nbytes(self) -> int: ...

    def rows(self) -> Mapping[str, int]: ...


@runtime_checkable
class Deferred(Protocol[R_co]):
    """A record built on the worker thread, not the producer's (the probe's window: its device
    copies are waited for there). `materialize()` returns what the exporters receive."""

    def materialize(self) -> R_co: ...


@runtime_checkable
class BindsProcessor(Protocol[R]):
    """An exporter that wants the processor feeding it, to count what it loses in the processor's
    drop counters (the store's `DeltaExporter`). A producer that owns the processor (the probe
    session) hands it over before the first record."""

    def bind_processor(self, processor: BatchProcessor[R]) -> None: ...


@runtime_checkable
class WritesRows(Protocol):
    """An exporter that writes rows says how many, per table (the store's `DeltaExporter`)."""

    @property
    def written_rows(self) -> Mapping[str, int]: ...


@runtime_checkable
class ForkAware(Protocol):
    """An exporter that holds per-process state (buffers, a writer's identity) and must start afresh
    in a forked child that records on its own; its processor calls this once, before the child's
    first record reaches it."""

    def after_fork_in_child(self) -> None: ...


@runtime_checkable
class DrainListener(Protocol):
    """An exporter told that its pipeline drains: the worker has exported the last record and is
    flushing its exporters for the last time, and `shutdown` follows. The processor calls
    `on_drain()` instead of that last `force_flush`, once; an exporter may do its shutdown's work
    now (the store's `DeltaExporter` commits its last parts and its run's end together, not in two
    rounds), its `shutdown` then finding nothing left to do. One that is not a listener gets the
    last `force_flush`, as at every flush."""

    def on_drain(self) -> None: ...


@runtime_checkable
class DropCounts(Protocol):
    """Anything that counts what it lost: a processor, or an exporter that writes without one.
    Returns (rows dropped per (table, reason), records dropped per reason)."""

    def drop_counts(self) -> tuple[dict[tuple[str, str], int], dict[str, int]]: ...


@runtime_checkable
class AttachListener(Protocol):
    """An exporter told which run it gets records of, at attach (before the first record)."""

    def on_attach(self, run: RunInfo) -> None: ...


@runtime_checkable
class ProbeStatsReader(Protocol):
    """An exporter that reads the probe's counts of rows written and dropped (the Prometheus
    exporter, at each scrape) through the `source` bound at attach."""

    def bind_probe_stats(self, source: Callable[[], ProbeStats]) -> None: ...


class InMemoryExporter(Exporter[R]):
    """Keeps every exported record, in order, in `records`; for tests and in-process consumers.

    `InMemoryExporter[StepRecord]()` is what a probe session takes; nothing is ever dropped or
    written anywhere, and the list grows without bound.
    """

    def __init__(self) -> None:
        self.records: list[R] = []

    def export(self, records: Sequence[R]) -> bool:
        """Keep `records`.

        Args:
            records: a batch, appended in order to `records`.

        Returns:
            True (it never refuses).
        """
        self.records.extend(records)
        return True

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Nothing is buffered.

        Args:
            timeout_s: unused.

        Returns:
            True.
        """
        return True

    def shutdown(self) -> None:
        """Nothing to close; the records stay readable."""
