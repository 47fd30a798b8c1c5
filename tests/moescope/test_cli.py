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
