"""The command line as a user runs it: a real subprocess, real files."""

from __future__ import annotations

import subprocess
import sys


def _moescope(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moescope.cli", *args], capture_output=True, text=True,
                          timeout=600, check=check)


def test_help_teaches():
    out = _moescope("--help").stdout
    assert "moescope.attach" in out and "moescope demo" in out
    for command in ("demo", "summary"):
        assert "example" in _moescope(command, "--help").stdout


def test_summary_of_a_missing_store_says_what_to_do(tmp_path):
    result = _moescope("summary", str(tmp_path / "nothing"), check=False)
    assert result.returncode == 1
    assert "record a run first" in result.stderr
    assert "Traceback" not in result.stderr


def _small_store(root) -> str:
    """A store with one run (two steps) written through the real writer; returns the run id."""
    import numpy as np

    from moescope.store.writer import ParquetExporter
    from tests.support.store_records import make_record, run_info

    rng = np.random.default_rng(0)
    exporter = ParquetExporter(root, run_info("r1"))
    exporter.export([make_record("r1", step, rng) for step in range(2)])
    exporter.shutdown()
    return "r1"


def test_a_missing_store_is_exit_1_for_every_command(tmp_path):
    """Issue 24: `query` printed "no data yet" and exited 0; every command says it and exits 1."""
    missing = str(tmp_path / "nope")
    for args in (["query", missing, "SELECT 1"], ["summary", missing], ["whatif", "cache", missing],
                 ["dashboard", missing, "--port", "1"]):
        result = _moescope(*args, check=False)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert "no store at" in result.stderr or "no data yet" in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_a_run_the_store_does_not_hold_is_exit_1_naming_the_latest(tmp_path):
    run = _small_store(tmp_path / "store")
    for args in (["summary", str(tmp_path / "store"), "--run", "nosuchrun"],
                 ["whatif", "cache", str(tmp_path / "store"), "--run", "nosuchrun"]):
        result = _moescope(*args, check=False)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert "'nosuchrun' is not in the store" in result.stderr and repr(run) in result.stderr
    assert _moescope("summary", str(tmp_path / "store"), "--run", run).returncode == 0


def test_a_store_that_is_a_file_says_so(tmp_path):
    """`summary README.md` advised `moescope.attach(model, store='README.md')`; it says "is a file"."""
    path = tmp_path / "README.md"
    path.write_text("# not a store\n")
    for args in (["summary", str(path)], ["query", str(path), "SELECT 1"], ["whatif", "cache", str(path)],
                 ["dashboard", str(path), "--port", "1"]):
        result = _moescope(*args, check=False)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert "is a file" in result.stderr and "attach(model" not in result.stderr, (args, result.stderr)


def test_attach_to_a_file_is_refused_at_attach(tmp_path):
    """attach(store=<a file>) logged "Not a directory ... rows are dropped" and carried on."""
    import pytest
    import torch

    import moescope
    from moescope.store import StoreError
    from tests.support.zoo import tiny_model

    path = tmp_path / "notes.txt"
    path.write_text("x")
    model = tiny_model("mixtral")
    for store in (path, path / "runs"):
        with pytest.raises(StoreError, match="is a file"):
            with moescope.attach(model, store=store):
                model(torch.randint(0, 128, (1, 4)))
    assert path.read_text() == "x"


def test_every_command_takes_the_store_as_store_too(tmp_path):
    """One convention: `--store STORE` works in every command (import and proxy take only that);
    where the store is the only path it may also come first, positionally. Both spellings give the
    same output; two different stores are refused."""
    root = str(tmp_path / "store")
    _small_store(root)
    for command in (["summary"], ["whatif", "cache"]):
        positional = _moescope(*command, root)
        flagged = _moescope(*command, "--store", root)
        assert positional.stdout == flagged.stdout and positional.stdout
    sql = "SELECT count(*) AS n FROM routes"
    assert _moescope("query", "--store", root, sql).stdout == _moescope("query", root, sql).stdout
    assert _moescope("query", sql, "--store", root).stdout == _moescope("query", root, sql).stdout
    # an option between the store and the query (how the S3 examples in docs/fleet.md read) still parses
    csv = _moescope("query", root, "--format", "csv", "--storage-option", "", sql, check=False)
    assert csv.returncode == 1 and "option" in csv.stderr  # an empty --storage-option is refused, not the SQL
    assert _moescope("query", root, "--format", "csv", sql).stdout.split() == ["n", str(2 * 3 * 16)]
    twice = _moescope("summary", root, "--store", str(tmp_path / "other"), check=False)
    assert twice.returncode == 2 and "the store is given twice" in twice.stderr
    missing = _moescope("summary", check=False)
    assert missing.returncode == 1 and "no store given" in missing.stderr
