"""What a probe session offers its exporters at attach, beyond `moescope.core.pipeline.Exporter`.

An exporter declares what it wants by implementing one of these protocols (explicitly, as a base
class, where that helps a reader); the session checks with `isinstance`, never by attribute names:

- `AttachListener.on_attach(run)`: the run being recorded (its id, rank and layers), before the
  first record (the store's `ParquetExporter` writes its `runs` rows, alerts learn the experts);
- `ProbeStatsReader.bind_probe_stats(source)`: `source()` returns the probe's `ProbeStats` (rows
  written per table, rows dropped per (table, reason)), read afresh whenever the exporter wants;
- `moescope.core.pipeline.BindsProcessor.bind_processor(processor)`: the session's `BatchProcessor`.

Exporters that write rows say how many (`moescope.core.pipeline.WritesRows`); the session's
`probe_stats()` adds them up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from moescope.core.records import RunInfo

__all__ = ["AttachListener", "ProbeStats", "ProbeStatsReader"]

# (rows written per table, rows dropped per (table, reason)): `ProbeSession.probe_stats()`
ProbeStats = tuple[dict[str, int], dict[tuple[str, str], int]]


@runtime_checkable
class AttachListener(Protocol):
    """An exporter told which run it gets records of, at attach (before the first record)."""

    def on_attach(self, run: RunInfo) -> None: ...


@runtime_checkable
class ProbeStatsReader(Protocol):
    """An exporter that reads the probe's counts of rows written and dropped (the Prometheus
    exporter, at each scrape) through the `source` bound at attach."""

    def bind_probe_stats(self, source: Callable[[], ProbeStats]) -> None: ...
