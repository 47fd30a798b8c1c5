"""The store's exceptions; `store.store.map_error` is the one place database errors become these."""

from __future__ import annotations


class StoreError(Exception):
    """A store could not be read or a query over it failed; the message says what to do."""


class EmptyStoreError(StoreError):
    """The store holds no data yet (no folder, or no run recorded in it)."""


class UnknownRunError(StoreError, ValueError):
    """A run id the store does not hold; the message names the store's latest run."""


class QueryError(StoreError):
    """The SQL itself is wrong (syntax, unknown table or column, bad parameter)."""
