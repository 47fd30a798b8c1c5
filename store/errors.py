"""The store's exceptions; `moescope.store.store.map_error` is the one place database errors become these."""

from __future__ import annotations


class StoreError(Exception):
    """A store could not be read or a query over it failed; the message says what to do.

    The base of the store's exceptions: `EmptyStoreError`, `UnknownRunError`, `QueryError`,
    `CommitError`, `StoreAccessError` and `LegacyStoreError` are StoreErrors.
    """


class EmptyStoreError(StoreError):
    """The store holds no data yet (no folder, or no run recorded in it); a StoreError."""


class UnknownRunError(StoreError, ValueError):
    """A run id the store does not hold (a StoreError and a ValueError); the message names the latest run."""


class QueryError(StoreError):
    """The SQL itself is wrong (syntax, unknown table or column, bad parameter); a StoreError."""
