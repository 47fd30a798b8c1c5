"""moescope's store: Delta Lake tables written by the probe, read as snapshots through DuckDB views.

The names below are imported on first use, so a command that needs one module of the store (its
location, its naming rule) does not load DuckDB, pandas and delta-rs with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moescope.core.lazy import lazy_exports

# name -> the module that defines it: the store's public names, and nothing but them (`__all__`); the
# pipeline they plug into (`BatchProcessor`, `InMemoryExporter`) is core's: `moescope.core.pipeline`,
# `moescope.core.exporters`
_EXPORTS = {
    "CommitError": "moescope.store.delta",
    "LegacyStoreError": "moescope.store.delta",
    "StoreAccessError": "moescope.store.delta",
    "EmptyStoreError": "moescope.store.errors",
    "QueryError": "moescope.store.errors",
    "StoreError": "moescope.store.errors",
    "UnknownRunError": "moescope.store.errors",
    "InvalidNameWarning": "moescope.store.naming",
    "BadFileWarning": "moescope.store.quarantine",
    "QuarantinedFile": "moescope.store.quarantine",
    "Selection": "moescope.store.queries",
    "SCHEMAS": "moescope.store.schema",
    "TABLES": "moescope.store.schema",
    "Store": "moescope.store.store",
    "DeltaExporter": "moescope.store.exporter",
    "ParquetExporter": "moescope.store.exporter",  # DeltaExporter's name before 0.2.0, for a release
    "ProcessExporter": "moescope.store.writer_process",
    "RunWriter": "moescope.store.writer",
    "run_writer": "moescope.store.writer",
}

__all__ = [
    "BadFileWarning",
    "CommitError",
    "DeltaExporter",
    "EmptyStoreError",
    "InvalidNameWarning",
    "LegacyStoreError",
    "ParquetExporter",
    "ProcessExporter",
    "QuarantinedFile",
    "QueryError",
    "RunWriter",
    "SCHEMAS",
    "Selection",
    "Store",
    "StoreAccessError",
    "StoreError",
    "TABLES",
    "UnknownRunError",
    "run_writer",
]

if TYPE_CHECKING:
    from moescope.store.delta import CommitError, LegacyStoreError, StoreAccessError
    from moescope.store.errors import EmptyStoreError, QueryError, StoreError, UnknownRunError
    from moescope.store.exporter import DeltaExporter, ParquetExporter
    from moescope.store.naming import InvalidNameWarning
    from moescope.store.quarantine import BadFileWarning, QuarantinedFile
    from moescope.store.queries import Selection
    from moescope.store.schema import SCHEMAS, TABLES
    from moescope.store.store import Store
    from moescope.store.writer import RunWriter, run_writer
    from moescope.store.writer_process import ProcessExporter

else:
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
