"""moescope's core: what every producer and consumer shares, importing none of them.

The record types every producer emits (`records`), the one write pipeline (`pipeline`: a bounded
batching processor; `exporters`: the protocols between it and what consumes its records, and an
in-memory exporter), run ids and the host a row records (`runs`), the one at-fork registry
(`forking`), how a long-running process stops on SIGTERM (`lifecycle`), the JSON Lines reader of
per-sequence files given beside a store (`sequence_file`) and re-exports imported on
first use (`lazy`). The names below are imported on first use, so a module that needs one of core's
leaves (`moescope.core.runs`, the standard library only) does not load numpy with the records.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moescope.core.lazy import lazy_exports

# name -> the module that defines it
_EXPORTS = {
    "AttachListener": "moescope.core.exporters",
    "BindsProcessor": "moescope.core.exporters",
    "Deferred": "moescope.core.exporters",
    "DropCounts": "moescope.core.exporters",
    "Exporter": "moescope.core.exporters",
    "ForkAware": "moescope.core.exporters",
    "InMemoryExporter": "moescope.core.exporters",
    "ProbeStats": "moescope.core.exporters",
    "ProbeStatsReader": "moescope.core.exporters",
    "Record": "moescope.core.exporters",
    "WritesRows": "moescope.core.exporters",
    "ForkSafe": "moescope.core.forking",
    "lazy_exports": "moescope.core.lazy",
    "DEFAULT_GRACE_S": "moescope.core.lifecycle",
    "GracefulStop": "moescope.core.lifecycle",
    "add_grace_period_argument": "moescope.core.lifecycle",
    "grace_period_s": "moescope.core.lifecycle",
    "DEFAULT_MAX_QUEUE_BYTES": "moescope.core.pipeline",
    "POLICIES": "moescope.core.pipeline",
    "BatchProcessor": "moescope.core.pipeline",
    "KVCacheLayer": "moescope.core.records",
    "LayerInfo": "moescope.core.records",
    "LayerStep": "moescope.core.records",
    "Routes": "moescope.core.records",
    "RunInfo": "moescope.core.records",
    "StepRecord": "moescope.core.records",
    "TokenSample": "moescope.core.records",
    "current_host": "moescope.core.runs",
    "new_run_id": "moescope.core.runs",
}

__all__ = [
    "DEFAULT_GRACE_S", "DEFAULT_MAX_QUEUE_BYTES", "POLICIES", "AttachListener", "BatchProcessor", "BindsProcessor",
    "Deferred", "DropCounts", "Exporter", "ForkAware", "ForkSafe", "GracefulStop", "InMemoryExporter", "KVCacheLayer",
    "LayerInfo", "LayerStep", "ProbeStats", "ProbeStatsReader", "Record", "Routes", "RunInfo", "StepRecord",
    "TokenSample", "WritesRows", "add_grace_period_argument", "current_host", "grace_period_s", "lazy_exports",
    "new_run_id",
]

if TYPE_CHECKING:
    from moescope.core.exporters import (
        AttachListener,
        BindsProcessor,
        Deferred,
        DropCounts,
        Exporter,
        ForkAware,
        InMemoryExporter,
        ProbeStats,
        ProbeStatsReader,
        Record,
        WritesRows,
    )
    from moescope.core.forking import ForkSafe
    from moescope.core.lifecycle import DEFAULT_GRACE_S, GracefulStop, add_grace_period_argument, grace_period_s
    from moescope.core.pipeline import DEFAULT_MAX_QUEUE_BYTES, POLICIES, BatchProcessor
    from moescope.core.records import KVCacheLayer, LayerInfo, LayerStep, Routes, RunInfo, StepRecord, TokenSample
    from moescope.core.runs import current_host, new_run_id
else:
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
