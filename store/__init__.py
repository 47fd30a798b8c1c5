"""moescope's store: Delta Lake tables written by the probe, read as snapshots through DuckDB views."""

from __future__ import annotations

from moescope.store.delta import CommitError, LegacyStoreError, StoreAccessError
from moescope.store.errors import EmptyStoreError, QueryError, StoreError, UnknownRunError
from moescope.store.naming import InvalidNameWarning
from moescope.store.quarantine import BadFileWarning, QuarantinedFile
from moescope.store.queries import Selection
from moescope.store.schema import SCHEMAS, TABLES
from moescope.store.store import Store
from moescope.store.writer import BatchProcessor, InMemoryExporter, ParquetExporter

__all__ = [
           "SCHEMAS",
           "TABLES",
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
           "Selection",
           "Store",
           "StoreAccessError",
           "StoreError",
           "UnknownRunError",
]
