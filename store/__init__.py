"""moescope's store: Parquet tables written by the probe, read through DuckDB views."""

from __future__ import annotations

from store.schema import SCHEMAS, TABLES
from store.store import EmptyStoreError, Store, StoreError
from store.writer import BatchProcessor, InMemoryExporter, ParquetExporter

__all__ = ["BatchProcessor", "EmptyStoreError", "InMemoryExporter", "ParquetExporter", "SCHEMAS", "Store",
           "StoreError", "TABLES"]
