"""The README's plain-DuckDB query reads every row once, even with a compaction's sources still
there; the bare glob it warns about does not."""

from __future__ import annotations

import os
import re
from collections import Counter

import duckdb
import numpy as np
import pyarrow.parquet as pq

from moescope.store.compact import compact
from moescope.store.writer import ParquetExporter
from tests.store.conftest import REPO
from tests.store.helpers import make_record, run_info


def _readme_query() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        blocks = re.findall(r"```sql\n(.*?)```", f.read(), flags=re.S)
    [query] = [b for b in blocks if "moescope.replaces" in b]
    return query


def test_the_readme_duckdb_query_skips_replaced_parts(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    rng = np.random.default_rng(0)
    exporter = ParquetExporter(root, run_info("r"), max_rows=48)  # one routes file per step
    for step in range(6):
        exporter.export([make_record("r", step, rng)])
    exporter.shutdown()
    sources = sorted((root / "routes" / "run_id=r").glob("part-*.parquet"))
    want = Counter((row["layer"], tuple(row["expert_ids"])) for p in sources for row in pq.read_table(p).to_pylist())
    kept = {p: p.read_bytes() for p in sources}
    compact(root, tables=("routes",), grace_s=0)
    for path, data in kept.items():  # as during the grace period, or after a crash before the deletion
        path.write_bytes(data)
    monkeypatch.chdir(tmp_path)
    got = duckdb.connect().sql(_readme_query()).fetchall()
    assert Counter({(layer, tuple(ids)): n for layer, ids, n in got}) == want
    bare = duckdb.connect().sql("select count(*) from read_parquet('runs/routes/**/*.parquet')").fetchall()[0][0]
    assert bare == 2 * sum(want.values())  # what the README warns about
