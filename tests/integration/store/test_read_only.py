"""A store is read-only to its readers: the DuckDB connection behind `Store`, `moescope query` and
the dashboard reads the store's own files and nothing else, and refuses every statement that writes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moescope.store import QueryError, Store
from moescope.store.exporter import DeltaExporter
from moescope.store.schema import SCHEMAS
from tests.support.fixtures.store import REPO
from tests.support.store_records import make_record, run_info


@pytest.fixture
def root(tmp_path):
    store = tmp_path / "store"
    rng = np.random.default_rng(0)
    exporter = DeltaExporter(store, run_info("r"), max_rows=40)
    for step in range(5):
        exporter.export([make_record("r", step, rng)])
    exporter.shutdown()
    # files a query must not reach: beside the store, and in a folder whose name starts like it
    for folder in (tmp_path / "outside", tmp_path / "store2"):
        folder.mkdir()
        pq.write_table(pa.table({"secret": [42]}), folder / "secret.parquet")
    (tmp_path / "outside" / "secret.csv").write_text("secret\n42\n")
    return store


def _files(path) -> set[str]:
    return {os.path.join(folder, name) for folder, _, names in os.walk(path) for name in names}


def hostile(root) -> list[str]:
    inside, outside, sibling = str(root), str(root.parent / "outside"), str(root.parent / "store2")
    return [
        f"COPY (SELECT 1 AS a) TO '{inside}/routes/run_id=r/part-evil.parquet'",
        f"COPY (SELECT 1 AS a) TO '{outside}/x.parquet'",
        f"COPY routes TO '{inside}/copy.csv'",
        f"EXPORT DATABASE '{inside}/export'",
        f"ATTACH '{outside}/db.duckdb' AS db",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET enable_external_access = true",
        "SET lock_configuration = false",
        "RESET allowed_directories",
        "CREATE TABLE t AS SELECT 1 AS a",
        "CREATE OR REPLACE VIEW routes AS SELECT 1 AS a",
        "DROP VIEW routes",
        "INSERT INTO routes SELECT * FROM routes",
        f"EXPLAIN ANALYZE COPY (SELECT 1) TO '{inside}/explained.parquet'",
        f"SELECT 1; COPY (SELECT 1 AS a) TO '{inside}/second.parquet'",
        f"SELECT * FROM read_parquet('{outside}/secret.parquet')",
        f"SELECT * FROM read_parquet('{sibling}/secret.parquet')",
        f"SELECT * FROM read_parquet('{inside}/../outside/secret.parquet')",
        f"SELECT * FROM read_csv('{outside}/secret.csv')",
        "SELECT * FROM read_text('/etc/passwd')",
        "SELECT * FROM glob('/etc/*')",
    ]


def test_every_statement_that_writes_or_reaches_outside_is_refused(root):
    store = Store(root)
    before = _files(root.parent)
    for statement in hostile(root):
        with pytest.raises(QueryError, match="read-only|not allowed") as error:
            store.sql(statement)
        assert "Traceback" not in str(error.value)
    assert _files(root.parent) == before
    # the views are still the store's: nothing above replaced or dropped one
    assert int(store.sql("SELECT count(*) AS n FROM routes").n[0]) == sum(
        pq.read_metadata(p).num_rows for p in (root / "routes").rglob("part-*.parquet"))


def test_reads_keep_working(root):
    store = Store(root)
    for table in SCHEMAS:
        store.sql(f"SELECT * FROM {table} LIMIT 1")
    assert int(store.sql("SELECT count(*) AS n FROM steps").n[0]) == 5
    assert store.sql("EXPLAIN SELECT * FROM steps").shape[0] == 1
    assert "step" in store.sql("DESCRIBE steps").column_name.tolist()
    assert len(store.sql("SUMMARIZE steps")) > 0
    assert int(store.sql("WITH s AS (FROM steps) SELECT count(*) AS n FROM s").n[0]) == 5
    # the store's own files are readable directly, as the DuckDB example in docs/attach.md does
    direct = store.sql(f"SELECT count(*) AS n FROM read_parquet('{root}/steps/**/*.parquet')")
    assert int(direct.n[0]) == 5
    assert store.arrow("SELECT step FROM steps WHERE step >= ? ORDER BY step", [3]).column("step").to_pylist() == [3, 4]


def test_moescope_query_refuses_writes_with_a_clear_error(root):
    target = root / "routes" / "run_id=r" / "part-evil.parquet"
    out = subprocess.run([sys.executable, "-m", "moescope.cli", "query", str(root),
                          f"COPY (SELECT 1 AS a) TO '{target}'"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 1 and "read-only" in out.stderr and "COPY" in out.stderr
    assert "Traceback" not in out.stderr
    assert not target.exists()
