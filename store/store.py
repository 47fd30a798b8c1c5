"""Reading a store: DuckDB views over the live Parquet files, and typed queries on top.

Every table of `store.schema` (and any other table folder found in the store) is a view named
after it, over the files `Catalog` says are live: complete, checked (footer, page checksums),
not replaced by a compacted file. A table with no file yet is an empty view of the right schema,
so a query over a new or empty store answers with no rows ("no data yet") instead of failing.
Every value that comes from a user goes into the SQL as a `?` parameter. The connection reads
only the store's folder and runs only SELECTs (`connect`, `check_read_only`).

Sharp edges: the views hold the file list of the last `refresh()`. A file that vanished since
(compacted, pruned) makes DuckDB fail; `Store` then refreshes and runs the query again, so a
query always answers from one consistent set of files. A file that fails to read is checked
through (by pyarrow and by DuckDB), taken out of the views if it is bad, and the query runs
again without it. Each file is checked once per Store: damage that happens to a file after this
reader checked it, without changing its size or mtime, is not seen until the next Store.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import TypeVar

import duckdb
import pandas as pd
import pyarrow as pa

from moescope.store.catalog import Catalog, FileInfo
from moescope.store.errors import EmptyStoreError, QueryError, StoreError
from moescope.store.layout import TABLE_FORM, is_valid_name, list_parts
from moescope.store.quarantine import QuarantinedFile, deep_check, quarantined
from moescope.store.queries import StoreQueries
from moescope.store.reports import ReportQueries
from moescope.store.schema import SCHEMAS

log = logging.getLogger(__name__)
T = TypeVar("T")

QUERY_ATTEMPTS = 6


def connect(read_only_root: str | None = None, **settings: object) -> duckdb.DuckDBPyConnection:
    """The one place connections are opened: in-memory (the data are the Parquet files), UTC.

    Footers are cached between queries: files are immutable once they have their final name.
    `settings` are DuckDB settings (e.g. memory_limit="4GB"). With `read_only_root` (an absolute
    folder) the connection is locked to reading that folder: no file outside it can be read or
    written, no database attached, no extension installed or loaded, and no setting changed
    afterwards. Writes inside the folder (`COPY ... TO`) are refused by `check_read_only`.
    """
    con = duckdb.connect(":memory:")
    con.execute("SET TimeZone = 'UTC'")
    con.execute("SET parquet_metadata_cache = true")
    for name, value in settings.items():
        con.execute(f"SET {name} = ?", [value])
    if read_only_root is not None:
        con.execute("SET allowed_directories = ?", [[os.path.join(read_only_root, "")]])
        con.execute("SET enable_external_access = false")
        con.execute("SET autoinstall_known_extensions = false")
        con.execute("SET autoload_known_extensions = false")
        con.execute("SET lock_configuration = true")
    return con


_READS = {duckdb.StatementType.SELECT}  # also WITH, FROM-first, DESCRIBE, SUMMARIZE and SHOW
_EXPLAIN = re.compile(r"\s*EXPLAIN\s*(?:ANALY[SZ]E\b\s*|\([^)]*\)\s*)*", re.IGNORECASE)


def check_read_only(con: duckdb.DuckDBPyConnection, query: str) -> None:
    """Raises QueryError unless every statement of `query` only reads (a SELECT, or EXPLAIN of one).

    The views are over the store's own files, and a reader must not change them: `COPY ... TO`,
    `EXPORT`, `CREATE`, `INSERT`, `ATTACH`, `INSTALL`, `SET` and the like are refused before they run.
    """
    for statement in con.extract_statements(query):
        if statement.type == duckdb.StatementType.EXPLAIN:
            inner = _EXPLAIN.sub("", statement.query, count=1)
            inner_types = {s.type for s in con.extract_statements(inner)} if inner.strip() else {None}
            if inner_types <= _READS:
                continue
        elif statement.type in _READS:
            continue
        text = statement.query.strip()[:80]
        raise QueryError(f"the store is read-only here: a {statement.type.name} statement is refused ({text!r}). "
                         f"Run SELECT queries over the views (e.g. `SELECT * FROM steps LIMIT 10`); to copy rows "
                         f"out, use --format csv or json and redirect the output.")


def map_error(error: duckdb.Error, root: str) -> StoreError:
    """The one place database errors become the project's exceptions."""
    if isinstance(error, duckdb.PermissionException):
        return QueryError(f"query over the store {root!r} is not allowed: {error}. A store is read through its "
                          f"views, which hold only its own files: nothing outside {root!r} can be read, no database "
                          f"attached, no extension installed, no setting changed.")
    if isinstance(error, (duckdb.ParserException, duckdb.BinderException, duckdb.CatalogException,
                          duckdb.InvalidInputException)) and "parquet" not in str(error).lower():
        return QueryError(f"query over the store {root!r} is not valid: {error}. Tables: "
                          + ", ".join(sorted(SCHEMAS)) + ", e.g. `SELECT * FROM runs`")
    return StoreError(f"query over the store {root!r} failed: {error}")


def data_version(root: str | os.PathLike) -> str:
    """A fingerprint of a store's committed Parquet files: count, newest mtime and total size.

    It changes whenever a writer renames a new part into place, so a reader (the dashboard) knows
    when to refresh its views; '' when the folder is missing. Cheap: a listing and a stat per file.
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        return ""
    count, newest, size = 0, 0.0, 0
    for table in sorted(os.listdir(root)):
        if table.startswith(("_", ".")) or not is_valid_name(table, "table"):
            continue
        for path in list_parts(root, table):
            try:
                stat = os.stat(path)
            except FileNotFoundError:  # compacted away between listing and stat
                continue
            count += 1
            newest = max(newest, stat.st_mtime)
            size += stat.st_size
    return f"{count}:{newest:.6f}:{size}"


class Store(StoreQueries, ReportQueries):
    """A read-only view of a store folder. Call `refresh()` to see files written since opening.

    Raises EmptyStoreError when `root` does not exist ("no data yet"). Every file is checked when
    first seen (footer and page checksums; `verify=False`: footer only); bad files are moved to
    `<root>/_quarantine` with a `BadFileWarning` (see `quarantined()`), or skipped where the disk
    cannot take the move. The DuckDB connection reads only this folder and runs only SELECTs.
    """

    def __init__(self, root: str | os.PathLike, quarantine_bad: bool = True, verify: bool = True):
        self.root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise EmptyStoreError(
                f"no data yet: there is no store at {os.fspath(root)!r}: record a run first, e.g. "
                f"`moescope.attach(model, store={os.fspath(root)!r})`, or `moescope demo`")
        self.con = connect(read_only_root=self.root)
        self.catalog = Catalog(self.root, quarantine_bad=quarantine_bad, verify=verify)
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
        """Read through the files a failed query may have tripped on; take bad ones out of the views."""
        if isinstance(error, (duckdb.ParserException, duckdb.BinderException, duckdb.CatalogException,
                              duckdb.PermissionException)):
            return False  # the SQL is wrong, not a file (a damaged page may raise a bare duckdb.Error)
        infos = [i for infos in self.files.values() for i in infos]
        named = [i for i in infos if i.path in str(error)]
        found = False
        for info in named or infos:
            key = (info.path, info.rows)
            if key in self._deep_checked:
                continue
            problem = deep_check(info.path) or self._duckdb_problem(info.path)
            if problem is None:
                self._deep_checked.add(key)
            elif os.path.exists(info.path):
                self.catalog.reject(info.path, f"unreadable data: {problem}")
                found = True
        return found

    def _duckdb_problem(self, path: str) -> str | None:
        """Read a file through with DuckDB; the error text, or None if it reads.

        A few damaged page headers pass pyarrow's checks (the checksum covers the page, not its
        header) but stop DuckDB: those files are bad for this store too.
        """
        try:
            reader = self.con.sql("SELECT * FROM read_parquet(?)", params=[path]).to_arrow_reader(64 * 1024)
            for _ in reader:
                pass
        except duckdb.Error as e:
            return None if not os.path.exists(path) else f"{type(e).__name__}: {e}"
        return None

    def sql(self, query: str, params: Sequence | None = None) -> pd.DataFrame:
        """Run a read-only query over the views with `?` parameters; returns a DataFrame.

        Raises QueryError when the SQL is wrong or would write (see `check_read_only`), or reads
        outside the store; StoreError when the store cannot be read.
        """
        self._check(query)
        return self._run(lambda con: con.execute(query, list(params or [])).df())

    def arrow(self, query: str, params: Sequence | None = None) -> pa.Table:
        """As `sql`, returning an Arrow table."""
        self._check(query)
        return self._run(lambda con: con.sql(query, params=list(params or [])).to_arrow_table())

    def _check(self, query: str) -> None:
        try:
            check_read_only(self.con, query)
        except duckdb.Error as error:
            raise map_error(error, self.root) from error

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
