"""The store's subcommands, run as a user runs them: a real process over a real store."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from moescope.store.writer import ParquetExporter
from tests.store.conftest import REPO
from tests.store.helpers import make_record, run_info


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moescope.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)


def _write(root, run_id: str, steps: int = 4) -> None:
    rng = np.random.default_rng(0)
    exporter = ParquetExporter(root, run_info(run_id), max_rows=10)
    for step in range(steps):
        exporter.export([make_record(run_id, step, rng)])
    exporter.shutdown()


def test_query_compact_prune(tmp_path):
    _write(tmp_path, "old")
    _write(tmp_path, "new")
    out = _cli("query", str(tmp_path), "SELECT run_id, count(*) AS n FROM steps GROUP BY run_id ORDER BY run_id")
    assert out.returncode == 0 and "new" in out.stdout and "old" in out.stdout and " 4" in out.stdout
    before = len(list(tmp_path.rglob("part-*.parquet")))
    out = _cli("compact", str(tmp_path), "--grace", "0")
    assert out.returncode == 0 and "routes" in out.stdout
    assert len(list(tmp_path.rglob("part-*.parquet"))) < before
    assert "4" in _cli("query", str(tmp_path), "SELECT count(DISTINCT step) FROM steps WHERE run_id = 'old'").stdout
    for path in tmp_path.glob("*/run_id=old/*"):
        os.utime(path, (time.time() - 10 * 86400, time.time() - 10 * 86400))
    assert "would delete 1 run(s)\n  old" in _cli("prune", str(tmp_path), "--older-than", "7d", "--dry-run").stdout
    assert list(tmp_path.glob("*/run_id=old"))
    out = _cli("prune", str(tmp_path), "--older-than", "7d")
    assert out.returncode == 0 and not list(tmp_path.glob("*/run_id=old"))
    out = _cli("query", str(tmp_path), "SELECT DISTINCT run_id FROM runs")
    assert "new" in out.stdout and "old" not in out.stdout


def test_errors_and_help_teach(tmp_path):
    assert "no data yet" in _cli("query", str(tmp_path / "none"), "SELECT 1").stdout
    bad = _cli("query", str(tmp_path), "SELEC 1")
    assert bad.returncode == 1 and "not valid" in bad.stderr
    assert _cli("prune", str(tmp_path), "--older-than", "soon").returncode == 2
    for command in ("compact", "prune", "query"):
        text = _cli(command, "--help").stdout
        assert "example:" in text, command
