"""Reading a store: DuckDB views over the Parquet files, and typed queries on top.

Every table of `store.schema` is a view named after it. A table with no file yet is an empty view
of the right schema, so a query over a new or empty store answers with no rows instead of failing.
Every value that comes from a user goes into the SQL as a `?` parameter.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

import duckdb
import pandas as pd
import pyarrow as pa

from store.schema import SCHEMAS, TABLES


class StoreError(Exception):
    """A store could not be read or a query over it failed; the message says what to do."""


class EmptyStoreError(StoreError):
    """The store holds no data yet."""


def connect(read_only: bool = True) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection set to UTC; views are made on it by `Store`."""
    con = duckdb.connect(":memory:")
    con.execute("SET TimeZone = 'UTC'")
    return con


def table_files(root: str | os.PathLike, table: str) -> list[str]:
    """Committed Parquet files of a table (temporary names of writes in flight are not matched)."""
    pattern = os.path.join(os.fspath(root), table, "run_id=*", "part-*.parquet")
    return sorted(glob.glob(pattern))


class Store:
    """A read-only view of a store folder. Re-open (or call `refresh`) to see files written since."""

    def __init__(self, root: str | os.PathLike):
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise EmptyStoreError(
                f"no store at {self.root!r}: record a run first, e.g. `probe.attach(model, store={self.root!r})`"
                " or `moescope demo`")
        self.con = connect()
        self.refresh()

    def refresh(self) -> None:
        """Re-create the views over the files present now."""
        for table in TABLES:
            files = table_files(self.root, table)
            self.con.execute(f'DROP VIEW IF EXISTS "{table}"')
            if files:
                listing = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
                self.con.execute(
                    f'CREATE VIEW "{table}" AS SELECT * FROM read_parquet([{listing}], '
                    "hive_partitioning = false, union_by_name = true)")
            else:
                empty = pa.Table.from_batches([], schema=SCHEMAS[table])
                self.con.register(f"_empty_{table}", empty)
                self.con.execute(f'CREATE VIEW "{table}" AS SELECT * FROM "_empty_{table}"')

    def sql(self, query: str, params: Sequence | None = None) -> pd.DataFrame:
        """Run a query over the views with `?` parameters; returns a DataFrame.

        Raises StoreError with the database's message when the query fails.
        """
        try:
            return self.con.execute(query, list(params or [])).df()
        except duckdb.Error as e:
            raise StoreError(f"query over {self.root!r} failed: {e}") from e

    def arrow(self, query: str, params: Sequence | None = None) -> pa.Table:
        try:
            return self.con.execute(query, list(params or [])).fetch_arrow_table()
        except duckdb.Error as e:
            raise StoreError(f"query over {self.root!r} failed: {e}") from e

    # -- typed queries -------------------------------------------------------------------------

    def runs(self) -> pd.DataFrame:
        """One row per run: id, start, model class, parameters, tags, steps and tokens recorded."""
        return self.sql("""
            SELECT r.run_id, min(r.started_at) AS started_at, any_value(r.model_class) AS model_class,
                   any_value(r.total_params) AS total_params, any_value(r.tags) AS tags,
                   max(r.world_size) AS world_size,
                   (SELECT count(*) FROM steps s WHERE s.run_id = r.run_id) AS steps,
                   (SELECT coalesce(sum(tokens), 0) FROM steps s WHERE s.run_id = r.run_id) AS tokens
            FROM runs r GROUP BY r.run_id ORDER BY started_at""")

    def latest_run(self) -> str:
        """The id of the most recently started run; raises EmptyStoreError when there is none."""
        runs = self.sql("SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 1")
        if runs.empty:
            raise EmptyStoreError(f"the store {self.root!r} holds no run yet: record one first")
        return str(runs.run_id[0])

    def layers(self, run_id: str) -> pd.DataFrame:
        return self.sql("SELECT DISTINCT * EXCLUDE (rank) FROM layers WHERE run_id = ? ORDER BY layer",
                        [run_id])

    def load_per_step(self, run_id: str, layer: int) -> pd.DataFrame:
        """Tokens per expert at each step of one layer: columns step, expert, load."""
        return self.sql("""
            SELECT step, e.expert - 1 AS expert, sum(e.load)::BIGINT AS load
            FROM (SELECT step, unnest(expert_load) AS load, generate_subscripts(expert_load, 1) AS expert
                  FROM layer_steps WHERE run_id = ? AND layer = ?) e
            GROUP BY step, expert ORDER BY step, expert""", [run_id, layer])

    def layer_summary(self, run_id: str) -> pd.DataFrame:
        """Per layer over the whole run: tokens, expert load totals, mean entropy, drops."""
        return self.sql("""
            WITH per_expert AS (
                SELECT layer, e.expert - 1 AS expert, sum(e.load) AS load
                FROM (SELECT layer, unnest(expert_load) AS load,
                             generate_subscripts(expert_load, 1) AS expert
                      FROM layer_steps WHERE run_id = ?) e
                GROUP BY layer, expert)
            SELECT p.layer, list(p.load::BIGINT ORDER BY p.expert) AS expert_load,
                   (SELECT sum(tokens) FROM layer_steps l WHERE l.run_id = ? AND l.layer = p.layer) AS tokens,
                   (SELECT avg(router_entropy_mean) FROM layer_steps l
                     WHERE l.run_id = ? AND l.layer = p.layer) AS router_entropy_mean,
                   (SELECT sum(dropped_tokens) FROM layer_steps l
                     WHERE l.run_id = ? AND l.layer = p.layer) AS dropped_tokens
            FROM per_expert p GROUP BY p.layer ORDER BY p.layer""", [run_id] * 4)

    def expert_routes(self, run_id: str, layer: int, expert: int, limit: int = 1000) -> pd.DataFrame:
        """Tokens that layer `layer` sent to `expert`: step, token, token_id, slot, weight, tags."""
        return self.sql("""
            SELECT step, token, sequence, position, token_id,
                   list_position(expert_ids, ?::INTEGER) - 1 AS slot,
                   gate_weights[list_position(expert_ids, ?::INTEGER)] AS gate_weight, tags
            FROM routes
            WHERE run_id = ? AND layer = ? AND list_contains(expert_ids, ?::INTEGER)
            ORDER BY step, token LIMIT ?""", [expert, expert, run_id, layer, expert, limit])
