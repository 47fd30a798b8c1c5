"""Reading a store: DuckDB views over the live Parquet files, and typed queries on top.

Every table of `store.schema` (and any other table folder found in the store) is a view named
after it, over the files `Catalog` says are live: complete, footer-checked, not replaced by a
compacted file. A table with no file yet is an empty view of the right schema, so a query over a
new or empty store answers with no rows ("no data yet") instead of failing. Every value that
comes from a user goes into the SQL as a `?` parameter.

Sharp edges: the views hold the file list of the last `refresh()`. A file that vanished since
(compacted, pruned) makes DuckDB fail; `Store` then refreshes and runs the query again, so a
query always answers from one consistent set of files. A file that fails to read is checked
through, moved to quarantine if it is bad, and the query runs again without it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

import duckdb
import pandas as pd
import pyarrow as pa

from store.catalog import Catalog, FileInfo
from store.errors import EmptyStoreError, QueryError, StoreError
from store.layout import TABLE_FORM, is_valid_name
from store.quarantine import QuarantinedFile, deep_check, quarantine, quarantined
from store.queries import StoreQueries
from store.schema import SCHEMAS

log = logging.getLogger(__name__)
T = TypeVar("T")

QUERY_ATTEMPTS = 6


def connect() -> duckdb.DuckDBPyConnection:
    """The one place connections are opened: in-memory (the data are the Parquet files), UTC.

    Footers are cached between queries: files are immutable once they have their final name.
    """
    con = duckdb.connect(":memory:")
    con.execute("SET TimeZone = 'UTC'")
    con.execute("SET parquet_metadata_cache = true")
    return con


def map_error(error: duckdb.Error, root: str) -> StoreError:
    """The one place database errors become the project's exceptions."""
    if isinstance(error, (duckdb.ParserException, duckdb.BinderException, duckdb.CatalogException,
                          duckdb.InvalidInputException)) and "parquet" not in str(error).lower():
        return QueryError(f"query over the store {root!r} is not valid: {error}. Tables: "
                          + ", ".join(sorted(SCHEMAS)) + ", e.g. `SELECT * FROM runs`")
    return StoreError(f"query over the store {root!r} failed: {error}")


class Store(StoreQueries):
    """A read-only view of a store folder. Call `refresh()` to see files written since opening.

    Raises EmptyStoreError when `root` does not exist ("no data yet"). Bad files found while
    opening are moved to `<root>/_quarantine` with a `BadFileWarning`; see `quarantined()`.
    """

    def __init__(self, root: str | os.PathLike, quarantine_bad: bool = True):
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise EmptyStoreError(
                f"no data yet: there is no store at {self.root!r}: record a run first, e.g. "
                f"`probe.attach(model, store={self.root!r})`, or `moescope demo`")
        self.con = connect()
        self.catalog = Catalog(self.root, quarantine_bad=quarantine_bad)
        self.files: dict[str, list[FileInfo]] = {}
        self._deep_checked: set[tuple[str, int]] = set()
        self.refresh()

    # -- views ---------------------------------------------------------------------------------

    def tables(self) -> list[str]:
        """Tables of the schema, plus any other table folder another component wrote."""
        extra = []
        for name in sorted(os.listdir(self.root)):
            if name in SCHEMAS or name.startswith(("_", ".")) or not os.path.isdir(os.path.join(self.root, name)):
                continue
            if is_valid_name(name, "table"):
                extra.append(name)
            else:
                log.warning("moescope store: skipping folder %r in %s: a table name must be %s", name, self.root,
                            TABLE_FORM)
        return list(SCHEMAS) + extra

    def refresh(self) -> None:
        """Re-create every view over the files live now (the one place views are made)."""
        self.files = self.catalog.snapshot(tuple(self.tables()))
        for table, infos in self.files.items():
            if infos:
                columns = {info.columns for info in infos}
                relation = self.con.read_parquet([i.path for i in infos], hive_partitioning=False,
                                                 union_by_name=len(columns) > 1)
            elif table in SCHEMAS:
                relation = self.con.from_arrow(SCHEMAS[table].empty_table())
            else:
                continue
            relation.create_view(table, replace=True)

    @property
    def has_data(self) -> bool:
        """Whether any run has been recorded; False means "no data yet"."""
        return bool(self.files.get("runs"))

    # -- running SQL ---------------------------------------------------------------------------

    def _run(self, fetch: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
        for attempt in range(QUERY_ATTEMPTS):
            try:
                return fetch(self.con)
            except duckdb.Error as error:
                if attempt + 1 < QUERY_ATTEMPTS and (self._files_vanished() or self._quarantine_bad(error)):
                    self.refresh()
                    continue
                raise map_error(error, self.root) from error
        raise AssertionError("unreachable")

    def _files_vanished(self) -> bool:
        return any(not os.path.exists(i.path) for infos in self.files.values() for i in infos)

    def _quarantine_bad(self, error: duckdb.Error) -> bool:
        """Read through the files a failed query may have tripped on; move bad ones aside."""
        if isinstance(error, (duckdb.ParserException, duckdb.BinderException, duckdb.CatalogException)):
            return False  # the SQL is wrong, not a file (a damaged page may raise a bare duckdb.Error)
        infos = [i for infos in self.files.values() for i in infos]
        named = [i for i in infos if i.path in str(error)]
        moved = False
        for info in named or infos:
            key = (info.path, info.rows)
            if key in self._deep_checked:
                continue
            problem = deep_check(info.path)
            if problem is None:
                self._deep_checked.add(key)
            elif quarantine(self.root, info.path, f"unreadable data: {problem}"):
                moved = True
        return moved

    def sql(self, query: str, params: Sequence | None = None) -> pd.DataFrame:
        """Run a query over the views with `?` parameters; returns a DataFrame.

        Raises QueryError when the SQL is wrong, StoreError when the store cannot be read.
        """
        return self._run(lambda con: con.execute(query, list(params or [])).df())

    def arrow(self, query: str, params: Sequence | None = None) -> pa.Table:
        """As `sql`, returning an Arrow table."""
        return self._run(lambda con: con.execute(query, list(params or [])).fetch_arrow_table())

    # -- housekeeping --------------------------------------------------------------------------

    def quarantined(self) -> list[QuarantinedFile]:
        """Files moved aside as unreadable (by this or any other reader), with the reason."""
        return quarantined(self.root)

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
