"""moescope's store: Parquet tables written by the probe, read through DuckDB views."""

from __future__ import annotations

from store.errors import EmptyStoreError, QueryError, StoreError
from store.quarantine import BadFileWarning, QuarantinedFile
from store.queries import Selection
from store.schema import SCHEMAS, TABLES
from store.store import Store
from store.writer import BatchProcessor, InMemoryExporter, ParquetExporter

__all__ = [
           "SCHEMAS",
           "TABLES",
           "BadFileWarning",
           "BatchProcessor",
           "EmptyStoreError",
           "InMemoryExporter",
           "ParquetExporter",
           "QuarantinedFile",
           "QueryError",
           "Selection",
           "Store",
           "StoreError",
]
