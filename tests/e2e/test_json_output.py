"""`--format json` through the installed `moescope` script, as a program reading its stdout runs it: one
document on stdout whatever stderr says, its figures those of the Python API, an error still exit 1
with stdout empty, and `--help` teaching the option."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from moescope.analyses.placement import placement_report
from moescope.analyses.summary import summary_report
from moescope.metrics.placement import Placement
from moescope.store import Store
from moescope.store.writer import ParquetExporter
from tests.support.json_documents import check_keys, same, same_rows
from tests.support.store_records import make_record, run_info

SCRIPT = os.path.join(os.path.dirname(sys.executable), "moescope")


def _moescope(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=600)


def test_the_installed_command_prints_one_document(tmp_path):
    root = str(tmp_path / "store")
    exporter = ParquetExporter(root, run_info("r", 2, 4))
    rng = np.random.default_rng(1)
    exporter.export([make_record("r", step, rng, 2, 4) for step in range(4)])
    exporter.shutdown()

    summary = _moescope("summary", root, "--format", "json")
    assert summary.returncode == 0, summary.stderr
    doc = json.loads(summary.stdout)
    check_keys(doc)
    with Store(root) as store:
        report = summary_report(store, "r")
        placement = placement_report(store, "r", Placement.contiguous(2), 2)
    assert doc["run_id"] == "r" and doc["tokens"] == report.counts.tokens
    same(doc["all"]["entropy"], report.run.entropy.nats)

    out = _moescope("placement", root, "--ranks", "2", "--window", "2", "--whatif", "--export",
                    str(tmp_path / "eplb.yaml"), "--format", "json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)  # the "wrote the eplb placement" note is on stderr
    check_keys(doc)
    assert "wrote the eplb placement" in out.stderr
    same_rows(doc["layers"], placement.layers, list(placement.layers.columns))

    missing = _moescope("summary", root, "--run", "nosuchrun", "--format", "json")
    assert missing.returncode == 1 and missing.stdout == "" and "'nosuchrun' is not in the store" in missing.stderr


def test_help_teaches_the_format():
    for command in (["summary"], ["placement"], ["traffic"], ["whatif", "cache"], ["jitter"], ["mismatch"]):
        text = _moescope(*command, "--help").stdout
        assert "--format {table,json}" in text and "--format json" in text, command
