"""The store's subcommands, run as a user runs them: a real process over a real store."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from moescope.store.writer import ParquetExporter
from tests.support.deltafiles import parts
from tests.support.fixtures.store import REPO
from tests.support.store_records import make_record, run_info


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
    before = len(parts(tmp_path, "routes"))
    out = _cli("compact", str(tmp_path))
    assert out.returncode == 0 and "routes" in out.stdout
    assert len(parts(tmp_path, "routes")) < before
    assert "4" in _cli("query", str(tmp_path), "SELECT count(DISTINCT step) FROM steps WHERE run_id = 'old'").stdout
    # which runs are old enough is tested in test_prune.py; here, what the command does with them
    assert _cli("prune", str(tmp_path), "--older-than", "1w").stdout.startswith("deleted 0 run(s)")
    dry = _cli("prune", str(tmp_path), "--older-than", "0s", "--dry-run")
    assert "would delete 2 run(s)\n  new\n  old" in dry.stdout, dry.stdout + dry.stderr
    assert {p.run_id for p in parts(tmp_path, "steps")} == {"new", "old"}
    kept = [tmp_path / "steps" / p.path for p in parts(tmp_path, "steps")]
    out = _cli("prune", str(tmp_path), "--older-than", "0s", "--retention", "0")
    assert out.returncode == 0 and "deleted 2 run(s)" in out.stdout
    assert not any(parts(tmp_path, table) for table in ("steps", "routes", "runs"))
    assert not any(path.exists() for path in kept)  # --retention 0: vacuumed at once
    out = _cli("query", str(tmp_path), "SELECT DISTINCT run_id FROM runs")
    assert out.returncode == 0 and "new" not in out.stdout and "old" not in out.stdout


def test_errors_and_help_teach(tmp_path):
    missing = _cli("query", str(tmp_path / "none"), "SELECT 1")
    assert missing.returncode == 1 and "no data yet" in missing.stderr
    bad = _cli("query", str(tmp_path), "SELEC 1")
    assert bad.returncode == 1 and "not valid" in bad.stderr
    assert _cli("prune", str(tmp_path), "--older-than", "soon").returncode == 2
    assert _cli("prune", str(tmp_path), "--older-than", "1d", "--retention", "-1").returncode == 2
    for command in (["compact"], ["prune"], ["query"], ["store", "upgrade"]):
        text = _cli(*command, "--help").stdout
        assert "example:" in text, command
    prune_help = _cli("prune", "--help").stdout
    assert "--retention" in prune_help and "What it costs" in prune_help  # what a shorter retention risks
    assert "older version" in _cli("compact", "--help").stdout


def test_a_store_of_the_previous_release_is_refused_until_upgraded(tmp_path):
    folder = tmp_path / "steps" / "run_id=r"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"run_id": ["r"], "step": pa.array([1], pa.int64())}),
                   folder / "part-00000-1-000001-000000000001.parquet")
    for command in (["query", str(tmp_path), "SELECT count(*) FROM steps"], ["compact", str(tmp_path)],
                    ["prune", str(tmp_path), "--older-than", "1d"]):
        out = _cli(*command)
        assert out.returncode == 1 and f"moescope store upgrade {tmp_path}" in out.stderr, (command, out.stderr)
        assert "Traceback" not in out.stderr
    out = _cli("store", "upgrade", str(tmp_path))
    assert out.returncode == 0 and "steps" in out.stdout and "1 rows" in out.stdout, out.stdout + out.stderr
    out = _cli("query", str(tmp_path), "SELECT run_id, step FROM steps")
    assert out.returncode == 0 and "r" in out.stdout and "1" in out.stdout
    assert "nothing to upgrade" in _cli("store", "upgrade", str(tmp_path)).stdout


def test_compact_takes_a_target_size_and_says_what_it_read_and_wrote(tmp_path):
    """Issue 34, part 3: `--target-size`; the data files read and written are printed, and a second
    run with nothing to merge says it read none."""
    _write(tmp_path, "r")
    small = parts(tmp_path, "routes")
    out = _cli("compact", str(tmp_path), "--target-size", "64MiB")
    assert out.returncode == 0, out.stderr
    routes = [line for line in out.stdout.splitlines() if line.startswith("routes ")]
    assert routes and f"read {len(small)} footers and {len(small)} files" in routes[0], out.stdout
    again = _cli("compact", str(tmp_path), "--target-size", "64MiB")
    assert "nothing to compact" in again.stdout
    assert "data files: read 0 footers and 0 files (0 B), wrote 0 files (0 B)" in again.stdout, again.stdout
    bad = _cli("compact", str(tmp_path), "--target-size", "big")
    assert bad.returncode == 2 and "128MiB" in bad.stderr
