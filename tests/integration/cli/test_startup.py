"""Commands that need no model start without torch: each runs in a fresh interpreter, which reports
what it imported when it exits (issue 34, part 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from moescope.cli import COMMANDS
from moescope.store.writer import ParquetExporter
from tests.support.paths import REPO
from tests.support.store_records import make_record, run_info

NEEDS_A_MODEL = {"demo", "train-demo", "jitter"}
HEAVY = ("torch", "transformers")

# Runs `main(argv)` in this interpreter, then prints which heavy modules it had loaded by its exit.
PROBE = """
import atexit, json, sys
atexit.register(lambda: print("LOADED " + json.dumps([m for m in {heavy!r} if m in sys.modules]), file=sys.stderr))
from moescope.cli import main
try:
    status = main({argv!r})
except SystemExit as e:
    status = e.code
sys.exit(status or 0)
"""


def loaded(argv: list[str]) -> tuple[int, list[str]]:
    """(exit status, heavy modules imported) of `moescope ARGV` in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY, argv=argv)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    line = next(line for line in done.stderr.splitlines() if line.startswith("LOADED "))
    return done.returncode, json.loads(line.removeprefix("LOADED "))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("startup") / "store")
    exporter = ParquetExporter(root)
    exporter.on_attach(run_info("run-a"))
    rng = np.random.default_rng(0)
    exporter.export([make_record("run-a", step, rng) for step in range(4)])
    exporter.shutdown()
    return root


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - NEEDS_A_MODEL))
def test_a_command_that_needs_no_model_starts_without_torch(command):
    status, heavy = loaded([command, "--help"])
    assert status == 0
    assert heavy == [], f"`moescope {command} --help` imported {heavy}"


def test_the_overview_of_commands_starts_without_torch():
    assert loaded(["--help"]) == (0, [])


@pytest.mark.parametrize("argv", [
    ["summary", "{store}"],
    ["query", "{store}", "select count(*) from steps"],
    ["compact", "{store}"],
    ["prune", "{store}", "--older-than", "30d", "--dry-run"],
    ["whatif", "cache", "{store}"],
], ids=lambda argv: argv[0])
def test_commands_over_a_store_run_without_torch(store, argv):
    status, heavy = loaded([word.format(store=store) for word in argv])
    assert status == 0
    assert heavy == [], f"`moescope {argv[0]}` imported {heavy}"


def test_a_command_that_needs_a_model_does_load_torch():
    """The check sees torch where it is imported: `demo --help` builds the demo's parser, whose module
    holds the model's story."""
    assert "torch" in loaded(["demo", "--help"])[1]
