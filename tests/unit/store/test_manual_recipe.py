"""The manual's plain-DuckDB recipe (docs/attach.md: a Delta snapshot's file list into `read_parquet`)
reads every row once, also after a compaction whose replaced files are still on the disk; the bare glob
it warns about does not."""

from __future__ import annotations

import os
import re
from collections import Counter

import duckdb
import numpy as np

from moescope.store.compact import compact
from moescope.store.exporter import DeltaExporter
from tests.support.fixtures.store import REPO
from tests.support.store_records import make_record, run_info

PAGE = os.path.join(REPO, "docs", "attach.md")  # the recipe's page; the README links to it


def _recipe() -> str:
    with open(PAGE) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    [recipe] = [b for b in blocks if 'DeltaTable("runs/routes")' in b]
    return recipe


def test_the_manuals_recipe_reads_each_row_once(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    rng = np.random.default_rng(0)
    records = [make_record("r", step, rng) for step in range(6)]
    exporter = DeltaExporter(root, run_info("r"), max_rows=48)  # one routes file per step
    exporter.export(records[:3])
    exporter.force_flush()
    exporter.export(records[3:])
    exporter.shutdown()
    # what was recorded, from the records themselves
    want = Counter((layer.layer, tuple(int(e) for e in ids)) for record in records for layer in record.layers
                   for ids in layer.routes.expert_ids)
    compact(root, tables=("routes",), retention_hours=1.0)  # the merged-away files stay on the disk
    monkeypatch.chdir(tmp_path)
    captured = {}
    real_sql = duckdb.sql

    def sql(query, *args, **kwargs):
        relation = real_sql(query, *args, **kwargs)
        captured["rows"] = relation.fetchall()
        return relation

    monkeypatch.setattr(duckdb, "sql", sql)
    exec(compile(_recipe(), PAGE, "exec"), {})
    got = Counter({(layer, tuple(ids)): n for layer, ids, n in captured["rows"]})
    assert got == want
    bare = duckdb.connect().sql("select count(*) from read_parquet('runs/routes/**/*.parquet')").fetchall()[0][0]
    assert bare > sum(want.values())  # what the page warns about: the replaced files are read too
