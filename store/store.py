"""Reading a store: DuckDB views over one Delta snapshot per table, and typed queries on top.

Every table of `moescope.store.schema` is a view named after it, over the files of the table's
version pinned by the last `refresh()`: `moescope.store.delta.snapshot` says which files are live (no
folder is listed). Opening a store reads the tables' logs only. A table's files are checked (footer,
then every page against its checksum: `Catalog`) when a query first names the table
(`tables_named`), and its view is made over the checked files then: a view never holds a file that
was not checked, and the first answer waits for the files of the tables it reads, not for the
store. A table with no Delta table yet is an empty view of the right schema, so a query over a new
or empty store answers with no rows ("no data yet") instead of failing. Columns are the schema's,
in its order (`run_id` comes from the folder name: hive partitioning), and a column a file predates
reads as null. Every value that comes from a user goes into the SQL as a `?` parameter.

Local store: the views read the snapshot's files with `read_parquet`, and the connection reads
only the store's folder and runs only SELECTs (`connect`, `check_read_only`). Object storage: each
view is a pyarrow dataset over the snapshot's checked files (`FileInfo.fragment`; pyarrow's
filesystem, credentials from the environment chain), that DuckDB scans with filter and projection
pushdown: a query asks only for the column chunks it reads, in coalesced range requests, and each
file's footer once. The connection reads no file at all itself.

Sharp edges: the views hold the versions of the last `refresh()`. Files a compaction or prune
removed since stay on the storage until `vacuum` deletes them after its retention (one hour by
default), so a reader that refreshes more often than that never loses a file under its views; one
that does not gets a StoreError naming the missing file. A file that fails to read is read through
(by pyarrow, and by DuckDB for a local store), quarantined if it is bad, and the query runs again
without it. Each file is checked once per Store (on object storage once per process: another
Store asks only whether the object is still the one checked, see `Catalog.check`): damage that
happens to a file after this reader checked it, without changing its size (or, locally, its mtime;
on object storage, its ETag), is not seen until the next Store. A file of a table no query has
named is not checked: `Store.check_files` (`moescope store check`) checks every file now.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import duckdb
import pandas as pd
import pyarrow as pa

from moescope.store import delta
from moescope.store.catalog import Catalog, FileInfo, TableLog, parquet_format
from moescope.store.errors import EmptyStoreError, QueryError, StoreError
from moescope.store.location import StoreLocation, open_location
from moescope.store.quarantine import QuarantinedFile, quarantined, read_through
from moescope.store.queries import StoreQueries
from moescope.store.reports import ReportQueries
from moescope.store.schema import SCHEMAS

log = logging.getLogger(__name__)
T = TypeVar("T")

QUERY_ATTEMPTS = 6
PARTITION = delta.PARTITION_COLUMN


def connect(read_only_root: str | None = None, *, read_no_files: bool = False,
            **settings: object) -> duckdb.DuckDBPyConnection:
    """The one place connections are opened: in-memory (the data are the Parquet files), UTC.

    Footers are cached between queries: a table's files are immutable once committed. `settings`
    are DuckDB settings (e.g. memory_limit="4GB"). With `read_only_root` (an absolute folder) the
    connection is locked to reading that folder: no file outside it can be read or written, no
    database attached, no extension installed or loaded, and no setting changed afterwards. With
    `read_no_files` it is locked the same way with no folder at all (a store on object storage,
    whose views are datasets that pyarrow reads). Writes inside the folder (`COPY ... TO`) are
    refused by `check_read_only`.
    """
    con = duckdb.connect(":memory:")
    con.execute("SET TimeZone = 'UTC'")
    con.execute("SET parquet_metadata_cache = true")
    for name, value in settings.items():
        con.execute(f"SET {name} = ?", [value])
    if read_only_root is not None or read_no_files:
        folders = [os.path.join(read_only_root, "")] if read_only_root is not None else []
        con.execute("SET allowed_directories = ?", [folders])
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
    if isinstance(error, duckdb.IOException) and "no files found" in str(error).lower():
        return StoreError(f"query over the store {root!r} failed: a file of the table versions this reader holds is "
                          f"gone ({error}). Files a compaction or prune removed are deleted once they are older than "
                          f"the retention of `moescope prune` (default 1 h): call refresh() more often than that, or "
                          f"open the store again")
    return StoreError(f"query over the store {root!r} failed: {error}")


def data_version(store: str | os.PathLike | StoreLocation,
                 storage_options: Mapping[str, Any] | Sequence[str] | None = None) -> str:
    """The Delta version of every table of a store, as one string: it changes with every commit (a
    writer's flush, a compaction, a prune), so a reader (the dashboard) knows when to refresh its
    views; '' when a local store's folder is missing. Cheap: for a local store a listing of each
    table's log folder, for object storage a look at each table's log since the last call.
    Raises StoreError when object storage cannot be read."""
    location = open_location(store, storage_options)
    if location.is_local and not os.path.isdir(location.url):
        return ""
    versions = []
    for table in SCHEMAS:
        version = _local_version(location, table) if location.is_local else _remote_version(location, table)
        versions.append("-" if version is None else str(version))
    return ":".join(versions)


_LOG_ENTRY = re.compile(r"(\d{20})\.json")  # a commit; the latest version always has one


def _local_version(location: StoreLocation, table: str) -> int | None:
    """A local table's latest version, from its log folder's names (commits are `<version>.json`)."""
    try:
        names = os.listdir(os.path.join(location.url, table, "_delta_log"))
    except (FileNotFoundError, NotADirectoryError):
        return None
    found = [int(m.group(1)) for name in names if (m := _LOG_ENTRY.fullmatch(name))]
    return max(found) if found else None


def _remote_version(location: StoreLocation, table: str) -> int | None:
    snap = delta.snapshot(location, table)
    return None if snap is None else snap.version


class Store(StoreQueries, ReportQueries):
    """A read-only view of a store: a local folder, or a URL (s3://, gs://, az://).

    Call `refresh()` to see what was committed since opening. Every file is checked before a
    query first reads its table (footer and page checksums; `verify=False`: footer only;
    `check_files()` checks every file now); a bad file is copied to `<store>/_quarantine`, removed
    from its table and its rows counted as lost, with a `BadFileWarning` (see `quarantined()`), or
    skipped where the store cannot take that. The DuckDB connection reads only the store and runs
    only SELECTs. The typed queries (runs, layer steps, reports) are methods too (`StoreQueries`,
    `ReportQueries`). Use as a context manager, or call `close()`.

    Args:
        store: a local folder, a URL (`s3://bucket/prefix`, `gs://...`, `az://...`), or a
            `StoreLocation`.
        storage_options: how to reach a URL store (endpoint, region, ...), as a dict or `key=value`
            strings; credentials come from the environment chain, never from here.
        quarantine_bad: copy a bad file to `<store>/_quarantine` and take it out of its table (default
            True); False skips it without moving anything.
        verify: check page checksums as well as footers when a file is first read (default True).

    Raises:
        EmptyStoreError: when a local folder does not exist ("no data yet").
        StoreError: when a local path is a file, not a folder, or the store cannot be read.
        LegacyStoreError: (a StoreError) for a store written by a release before Delta tables
            (`moescope store upgrade PATH` converts it).
        StoreAccessError: (a StoreError) when a bucket is missing or the credentials are refused.
        store.location.LocationError: (a ValueError) for a URL or storage options that cannot be used
            (an unknown scheme, storage options on a local folder, a secret among them).
    """

    def __init__(self, store: str | os.PathLike | StoreLocation,
                 storage_options: Mapping[str, Any] | Sequence[str] | None = None,
                 quarantine_bad: bool = True, verify: bool = True):
        self.location = open_location(store, storage_options)
        self.root = self.location.url  # a local folder, or the URL (never a secret: see StoreLocation)
        if self.location.is_local and os.path.isfile(self.root):
            raise StoreError(f"{self.root!r} is a file, not a store: give the folder that moescope.attach(store=...) "
                             f"or `moescope import` wrote into")
        if self.location.is_local and not os.path.isdir(self.root):
            raise EmptyStoreError(
                f"no data yet: there is no store at {self.root!r}: record a run first, e.g. "
                f"`moescope.attach(model, store={self.root!r})`, or `moescope demo`")
        delta.check_store(self.location)  # a store of the previous release, a missing bucket: say so now
        if self.location.is_local:
            self.con = connect(read_only_root=self.root)
        else:
            self.con = connect(read_no_files=True)
        self.catalog = Catalog(self.location, quarantine_bad=quarantine_bad, verify=verify)
        self.versions: dict[str, int | None] = {}
        self._logs: dict[str, TableLog] = {}  # each table's pinned version, as its log says
        self._files: dict[str, list[FileInfo]] = {}  # the checked files of the tables whose views are made
        self._datasets: dict[str, Any] = {}  # object storage: the pyarrow dataset behind each view
        self._duckdb_types: dict[str, dict[str, str]] = {}
        self._deep_checked: set[tuple[str, int]] = set()
        self._lock = threading.RLock()  # views are made, and files checked, one caller at a time
        for table in self.tables():  # every view is there (SHOW TABLES), empty until a query names its table
            self._make_view(table, [])
        self.refresh()

    # -- views ---------------------------------------------------------------------------------

    def tables(self) -> list[str]:
        """The store's tables: those of the schema (`moescope.store.schema.SCHEMAS`), whether or not they hold rows.

        Returns:
            The table names, in the schema's order.
        """
        return list(SCHEMAS)

    def refresh(self) -> None:
        """Pin the latest version of every table; the views are made over it as queries need them.

        Reads the tables' logs only. Each view is made again, over its table's pinned files, when
        a query next names the table; files this reader has not checked are checked then.

        Raises:
            StoreError: when the store cannot be read.
        """
        with self._lock:
            self._logs = self.catalog.logs(tuple(self.tables()))
            self.versions = {table: table_log.version for table, table_log in self._logs.items()}
            # every view is made again when a query next names its table: over the new version's files,
            # and over a file changed in place since (another size or mtime; on object storage, another
            # size) checked again; a file this reader checked and that has not changed is not read again
            self._files.clear()

    @property
    def files(self) -> dict[str, list[FileInfo]]:
        """Every table's checked files, at the pinned versions (every file of the store checked now,
        those checked before excepted: see `check_files`)."""
        self._prepare(self.tables())
        return dict(self._files)

    def check_files(self, tables: Sequence[str] | None = None) -> dict[str, list[FileInfo]]:
        """Check every file of these tables (default: all) now, as a query reading all of them would:
        footer, then every page against its checksum; a bad file is quarantined. A reader checks a
        file only when a query first reads its table, so a file no query read is unchecked until this.

        Returns:
            The checked files of each table asked for, at the pinned version.

        Raises:
            StoreError: when the store cannot be read.
        """
        names = list(tables) if tables is not None else self.tables()
        unknown = [t for t in names if t not in SCHEMAS]
        if unknown:
            raise QueryError(f"no table {', '.join(map(repr, unknown))}: the tables are {', '.join(SCHEMAS)}")
        self._prepare(names)
        return {table: list(self._files[table]) for table in names}

    def _prepare(self, tables: Sequence[str]) -> None:
        """Make the views of these tables over their checked files, checking the files not yet checked.

        A view holds only checked files: a query never reads a file before its check. A file
        quarantined now has its rows counted in probe_stats, so that table's log is read again (its
        view is made again when next needed)."""
        with self._lock:
            pending = [t for t in dict.fromkeys(tables) if t not in self._files and t in self._logs]
            if not pending:
                return
            writes = self.catalog.probe_stats_writes
            checked = self.catalog.check_all({t: self._logs[t].files for t in pending})
            for table in pending:
                self._files[table] = checked[table]
                self._make_view(table, checked[table])
            if self.catalog.probe_stats_writes != writes:  # this reader sees its own count
                self._logs.update(self.catalog.logs(("probe_stats",)))
                self.versions["probe_stats"] = self._logs["probe_stats"].version
                if self._files.pop("probe_stats", None) is not None or "probe_stats" in pending:
                    self._prepare(["probe_stats"])

    def _make_view(self, table: str, files: list[FileInfo]) -> None:
        schema = SCHEMAS[table]
        if not files:
            self._datasets.pop(table, None)
            self.con.from_arrow(schema.empty_table()).create_view(table, replace=True)
            return
        if not self.location.is_local:
            import pyarrow.dataset as ds

            # the checked files' fragments: a query asks only for the column chunks it reads
            dataset = ds.FileSystemDataset([info.fragment for info in files], schema, parquet_format(),
                                           self.catalog.filesystem)
            self._datasets[table] = dataset
            self.con.from_arrow(dataset).create_view(table, replace=True)
            return
        present = {PARTITION}.union(*(info.columns for info in files))
        types = self._types(table)
        columns = [_ident(name) if name in present else f"NULL::{types[name]} AS {_ident(name)}"
                   for name in schema.names]
        columns += [_ident(name) for name in sorted(present - set(schema.names))]
        paths = ", ".join(_literal(info.path) for info in files)
        union = "true" if len({info.columns for info in files}) > 1 else "false"
        self.con.execute(f"CREATE OR REPLACE VIEW {_ident(table)} AS SELECT {', '.join(columns)} FROM read_parquet("
                         f"[{paths}], hive_partitioning = true, hive_types = {{'{PARTITION}': 'VARCHAR'}}, "
                         f"union_by_name = {union})")

    def _types(self, table: str) -> dict[str, str]:
        """DuckDB's type of each column of a table's schema (for the nulls of a column no file has)."""
        if table not in self._duckdb_types:
            relation = self.con.from_arrow(SCHEMAS[table].empty_table())
            self._duckdb_types[table] = {name: str(kind) for name, kind in zip(relation.columns, relation.types)}
        return self._duckdb_types[table]

    @property
    def has_data(self) -> bool:
        """Whether any run has been recorded; False means "no data yet"."""
        self._prepare(["runs"])
        return bool(self._files.get("runs"))

    # -- running SQL ---------------------------------------------------------------------------

    def _run(self, query: str, fetch: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
        for attempt in range(QUERY_ATTEMPTS):
            self._prepare(tables_named(query))
            try:
                return fetch(self.con)
            except (duckdb.Error, OSError, pa.ArrowException) as error:
                if attempt + 1 < QUERY_ATTEMPTS and self._quarantine_bad(error):
                    self.refresh()
                    continue
                if isinstance(error, duckdb.Error):
                    raise map_error(error, self.location.redacted) from error
                raise StoreError(f"query over the store {self.location.redacted!r} failed: {error}") from error
        raise AssertionError("unreachable")

    def _quarantine_bad(self, error: Exception) -> bool:
        """Read through the files a failed query may have tripped on; take bad ones out of the store."""
        if isinstance(error, (duckdb.ParserException, duckdb.BinderException, duckdb.CatalogException,
                              duckdb.PermissionException)):
            return False  # the SQL is wrong, not a file (a damaged page may raise a bare duckdb.Error)
        infos = [(table, i) for table, infos in self._files.items() for i in infos]
        named = [(table, i) for table, i in infos if i.part.path in str(error) or i.path in str(error)]
        filesystem = None if self.location.is_local else self.catalog.filesystem
        found = False
        for table, info in named or infos:
            key = (info.path, info.rows)
            if key in self._deep_checked:
                continue
            problem = read_through(info.path, filesystem)
            if problem is None and self.location.is_local:
                problem = self._duckdb_problem(info.path)
            if problem is None:
                self._deep_checked.add(key)
            else:
                self.catalog.reject(table, info.part, f"unreadable data: {problem}")
                found = True
        return found

    def _duckdb_problem(self, path: str) -> str | None:
        """Read a local file through with DuckDB; the error text, or None if it reads.

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
        """Run a read-only query over the views with `?` parameters.

        A query that trips on a damaged file has the file quarantined and is run again.

        Args:
            query: DuckDB SQL over the table views (one view per table of `tables()`); a SELECT only.
            params: the values of the query's `?` placeholders, in order; a value from a user always goes
                here, never into the SQL text.

        Returns:
            The result as a pandas DataFrame.

        Raises:
            QueryError: when the SQL is wrong or would write (see `check_read_only`), or reads outside
                the store.
            StoreError: when the store cannot be read.
        """
        self._check(query)
        return self._run(query, lambda con: con.execute(query, list(params or [])).df())

    def arrow(self, query: str, params: Sequence | None = None) -> pa.Table:
        """Run a read-only query as `sql` does, returning an Arrow table.

        Args:
            query: DuckDB SQL over the table views; a SELECT only.
            params: the values of the query's `?` placeholders, in order.

        Returns:
            The result as a `pyarrow.Table`.

        Raises:
            QueryError: when the SQL is wrong or would write, or reads outside the store.
            StoreError: when the store cannot be read.
        """
        self._check(query)
        return self._run(query, lambda con: con.sql(query, params=list(params or [])).to_arrow_table())

    def _check(self, query: str) -> None:
        try:
            check_read_only(self.con, query)
        except duckdb.Error as error:
            raise map_error(error, self.location.redacted) from error

    # -- housekeeping --------------------------------------------------------------------------

    def quarantined(self) -> list[QuarantinedFile]:
        """Files copied aside as unreadable (by this or any other reader), with the reason.

        Returns:
            One `QuarantinedFile` per file copied aside.
        """
        return quarantined(self.location, self.catalog.filesystem)

    def close(self) -> None:
        """Close the DuckDB connection; queries fail after this."""
        self.con.close()

    def __enter__(self) -> Store:
        """Return the store itself; leaving the block calls `close()`."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the store (`close()`); exceptions pass through."""
        self.close()


def tables_named(query: str) -> list[str]:
    """The store's tables a query may read (a superset of those it reads): the tables DuckDB's parser
    finds in its statements (`json_serialize_sql`: FROM, JOIN, subqueries, CTEs; an alias or a column
    named like a table is not one). Where the parser cannot say (a statement that is not a SELECT,
    such as PIVOT; `query_table('t')` or `query('...')`; SQL that does not parse), each table whose
    name stands in the text as a word, in any case, quoted or not: a name in a comment or a string,
    or a column named like a table, costs that table's check, never a read of an unchecked file."""
    try:
        names: set[str] = set()
        with _PARSER_LOCK:
            parser = _parser()
            for statement in parser.extract_statements(query):
                row = parser.execute("SELECT json_serialize_sql(?)", [statement.query]).fetchone()
                tree = json.loads(row[0]) if row else {"error": True}
                if tree.get("error") or not _base_tables(tree, names):
                    raise ValueError("not a tree the parser can say all of")
        return [table for table in SCHEMAS if table in names]
    except (duckdb.Error, ValueError):
        return [table for table in SCHEMAS if _word(table).search(query)]


# A connection that only parses (`tables_named`): no views, no files, nothing else; one per process.
_PARSERS: dict[int, duckdb.DuckDBPyConnection] = {}
_PARSER_LOCK = threading.Lock()


def _parser() -> duckdb.DuckDBPyConnection:
    pid = os.getpid()  # a forked child opens its own: the parent's connection is not for it
    if pid not in _PARSERS:
        _PARSERS.clear()
        _PARSERS[pid] = duckdb.connect(":memory:")
    return _PARSERS[pid]
_QUERY_FUNCTIONS = {"query", "query_table"}  # table functions that read a table named by a string


def _base_tables(tree: Any, names: set[str]) -> bool:
    """Add every base table a parsed statement names (lower case) to `names`; False where it calls a
    table function that reads a table named in a string (the parser cannot say which)."""
    if isinstance(tree, dict):
        if tree.get("type") == "BASE_TABLE" and isinstance(tree.get("table_name"), str):
            names.add(tree["table_name"].lower())
        if str(tree.get("function_name", "")).lower() in _QUERY_FUNCTIONS:
            return False
        return all(_base_tables(value, names) for value in tree.values())
    if isinstance(tree, list):
        return all(_base_tables(value, names) for value in tree)
    return True


@functools.lru_cache(maxsize=None)
def _word(name: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![\w$]){re.escape(name)}(?![\w$])", re.IGNORECASE)


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
