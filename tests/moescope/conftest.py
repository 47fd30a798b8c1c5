from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """`moescope demo --quick` run once as a process: (store root, its output, demo_summary.json)."""
    root = tmp_path_factory.mktemp("demo") / "store"
    result = subprocess.run([sys.executable, "-m", "moescope.cli", "demo", "--quick", "--store", str(root)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root, result.stdout + result.stderr, json.loads((root / "demo_summary.json").read_text())
