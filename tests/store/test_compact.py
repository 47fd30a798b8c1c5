"""Compaction in several groups keeps every row once, sorted; a crash after the swap is healed."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow.parquet as pq

from store import Store
from store.compact import compact, parse_age
from store.writer import ParquetExporter
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
