"""Compaction in several groups keeps every row once, sorted; a crash after the swap is healed; a merge
that does not add up is never published."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from moescope.store import Store
from moescope.store.compact import compact, parse_age
from moescope.store.writer import ParquetExporter
from tests.store.helpers import make_record, run_info


def test_compaction_in_groups_and_after_a_crash(tmp_path):
    rng = np.random.default_rng(0)
    exporter = ParquetExporter(tmp_path, run_info("r"), max_rows=48)  # one routes file per step
    for step in range(12):
        exporter.export([make_record("r", step, rng)])
    exporter.shutdown()
    want = Store(tmp_path).sql("SELECT * EXCLUDE (tags) FROM routes ORDER BY step, layer, token")
    sources = sorted((tmp_path / "routes" / "run_id=r").glob("part-*.parquet"))
    kept = tmp_path / "kept"
    kept.mkdir()
    for path in sources:
        shutil.copy(path, kept / path.name)
    [result] = compact(tmp_path, tables=("routes",), target_rows=48 * 4, grace_s=0)
    assert result.merged_files == 12 and len(result.written_files) == 3
    for path in result.written_files:
        layers_steps = pq.read_table(path, columns=["layer", "step"]).to_pandas()
        assert layers_steps.equals(layers_steps.sort_values(["layer", "step"], kind="stable"))
    got = Store(tmp_path).sql("SELECT * EXCLUDE (tags) FROM routes ORDER BY step, layer, token")
    assert got.equals(want)
    for path in sources:  # a crash between the swap and the deletion leaves the sources behind
        shutil.copy(kept / path.name, path)
    assert Store(tmp_path).sql("SELECT * EXCLUDE (tags) FROM routes ORDER BY step, layer, token").equals(want)
    compact(tmp_path, tables=("routes",), grace_s=0)
    assert not any(p.exists() for p in sources)
    assert Store(tmp_path).sql("SELECT * EXCLUDE (tags) FROM routes ORDER BY step, layer, token").equals(want)


def test_parse_age():
    assert parse_age("7d") == 7 * 86400 and parse_age("90s") == 90 and parse_age("1.5h") == 5400


def test_a_merge_that_loses_a_row_is_never_published(tmp_path, monkeypatch):
    """The row-count check: a merged file holding fewer rows than its sources (a lossy merge, made
    here by rewriting the real merge's output without its last row) raises, publishes nothing,
    deletes no source and leaves no temporary file; the store reads exactly what it read before."""
    from moescope.store import compact as compaction

    rng = np.random.default_rng(1)
    exporter = ParquetExporter(tmp_path, run_info("r"), max_rows=48)
    for step in range(4):
        exporter.export([make_record("r", step, rng)])
    exporter.shutdown()
    folder = tmp_path / "routes" / "run_id=r"
    sources = sorted(p.name for p in folder.iterdir())
    want = Store(tmp_path).sql("SELECT * EXCLUDE (tags) FROM routes ORDER BY step, layer, token")
    real_merge = compaction._merge

    def lossy_merge(con, table, group, tmp, row_group_rows, metadata):
        real_merge(con, table, group, tmp, row_group_rows, metadata)
        merged = pq.read_table(tmp)
        pq.write_table(merged.slice(0, merged.num_rows - 1), tmp)
        return pq.read_metadata(tmp).num_rows

    monkeypatch.setattr(compaction, "_merge", lossy_merge)
    with pytest.raises(RuntimeError, match=f"merged {4 * 48 - 1} rows of routes/r, expected {4 * 48}"):
        compact(tmp_path, tables=("routes",), grace_s=0)
    assert sorted(p.name for p in folder.iterdir()) == sources  # nothing published, nothing deleted, no .tmp-
    assert Store(tmp_path).sql("SELECT * EXCLUDE (tags) FROM routes ORDER BY step, layer, token").equals(want)
    monkeypatch.setattr(compaction, "_merge", real_merge)
    [result] = compact(tmp_path, tables=("routes",), grace_s=0)  # the honest merge goes through
    assert (result.merged_files, result.rows) == (4, 4 * 48)
    assert Store(tmp_path).sql("SELECT * EXCLUDE (tags) FROM routes ORDER BY step, layer, token").equals(want)
