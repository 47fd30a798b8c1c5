"""moescope's store: Delta Lake tables written by the probe, read as snapshots through DuckDB views.

The names below are imported on first use, so a command that needs one module of the store (its
location, its naming rule) does not load DuckDB, pandas and delta-rs with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module that defines it
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
    "BatchProcessor": "moescope.store.writer",
    "InMemoryExporter": "moescope.store.writer",
    "ParquetExporter": "moescope.store.writer",
}

__all__ = [
    "BadFileWarning",
    "BatchProcessor",
    "CommitError",
    "EmptyStoreError",
    "InMemoryExporter",
    "InvalidNameWarning",
    "LegacyStoreError",
    "ParquetExporter",
    "QuarantinedFile",
    "QueryError",
    "SCHEMAS",
    "Selection",
    "Store",
    "StoreAccessError",
    "StoreError",
    "TABLES",
    "UnknownRunError",
]

if TYPE_CHECKING:
    from moescope.store.delta import CommitError, LegacyStoreError, StoreAccessError
    from moescope.store.errors import EmptyStoreError, QueryError, StoreError, UnknownRunError
    from moescope.store.naming import InvalidNameWarning
    from moescope.store.quarantine import BadFileWarning, QuarantinedFile
    from moescope.store.queries import Selection
    from moescope.store.schema import SCHEMAS, TABLES
    from moescope.store.store import Store
    from moescope.store.writer import BatchProcessor, InMemoryExporter, ParquetExporter


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moescope.store' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
