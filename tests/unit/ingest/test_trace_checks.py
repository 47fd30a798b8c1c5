"""The trace checks on import: each fault injected alone is found by the one check that names it.

The engine is a STAND-IN (tests/support/engine_standin.py: vLLM and SGLang cannot run here): a tiny
Mixtral cast to bfloat16 and run in left-padded batches of three, its routing written in vLLM's and
SGLang's response formats (zero-initialised int32 buffers in both engines' capture code, -1 for a
row vLLM did not compute, prompt + generated - 1 rows) and read back by the real importers. Each
fault is injected into the stand-in's arrays; the expected count is what the injection put there,
counted by a plain loop over the arrays exactly as each format sends them.
"""

from __future__ import annotations

import copy
import json

import pytest

from moescope.cli import main
from moescope.ingest.importers import import_files
from moescope.ingest.stored_trace import RECHECKED, check_stored_trace
from moescope.store import Store
from tests.support.engine_standin import sglang_responses, vllm_responses
from tests.support.importing import parquet_rows
from tests.support.trace_faults import FAULTS, FORMATS, final_row, sent, sentinel, standin_trace


@pytest.fixture(scope="module")
def standin():
    return standin_trace()


def write(tmp_path, fmt: str, requests, engine) -> str:
    path = str(tmp_path / f"{fmt}.jsonl")
    with open(path, "w") as f:
        f.write((vllm_responses if fmt == "vllm" else sglang_responses)(requests, engine))
    return path


def imported(tmp_path, fmt: str, requests, engine, layers: int, k: int, **options):
    root = str(tmp_path / "store")
    extra = dict(num_layers=layers, top_k=k) if fmt == "sglang" else {}
    return root, import_files(fmt, [write(tmp_path, fmt, requests, engine)], root, **extra, **options)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_clean_trace_from_the_standin_engine_gives_no_finding(tmp_path, standin, fmt):
    requests, engine, layers, k, experts = standin
    root, summary = imported(tmp_path, fmt, requests, engine, layers, k, logical_experts=experts)
    assert summary.findings == []
    assert "trace checks: no finding" in summary.report()
    assert parquet_rows(root, "trace_findings", summary.run_id).num_rows == 0
    with Store(root) as store:
        assert check_stored_trace(store, summary.run_id, experts).findings() == []


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_fault_alone_is_found_by_the_check_that_names_it(tmp_path, standin, fmt, fault):
    requests, clean, layers, k, experts = standin
    engine = copy.deepcopy(clean)
    check, count_of = fault(requests, engine, experts)
    expected = count_of(sent(fmt, requests, engine))
    assert expected > 0
    root, summary = imported(tmp_path, fmt, requests, engine, layers, k, logical_experts=experts)
    assert [(f.check, f.count) for f in summary.findings] == [(check, expected)]
    assert f"{check} {expected:,} of" in summary.report()
    stored = parquet_rows(root, "trace_findings", summary.run_id).to_pylist()
    assert [(r["check_name"], r["count"], r["origin"]) for r in stored] == [(check, expected, "import")]
    assert stored[0]["sequences"]  # it names where
    if check in RECHECKED:  # and the stored routes say it again
        with Store(root) as store:
            again = check_stored_trace(store, summary.run_id, experts).findings()
        assert [(f.check, f.count) for f in again] == [(check, expected)]


def test_the_check_command_shows_recorded_findings_and_exits_3(tmp_path, standin, capsys):
    requests, clean, layers, k, experts = standin
    engine = copy.deepcopy(clean)
    final_row(requests, engine, experts)
    root, summary = imported(tmp_path, "vllm", requests, engine, layers, k)
    capsys.readouterr()
    assert main(["check", root, "--run", summary.run_id, "--save"]) == 3
    out = capsys.readouterr().out
    found = [line.split() for line in out.splitlines() if line.strip().startswith("final_row_zero ")]
    assert [words[:2] for words in found] == [["final_row_zero", "8"]] * 2  # when imported, and from the routes
    saved = parquet_rows(root, "trace_findings", summary.run_id).to_pylist()
    assert sorted(r["origin"] for r in saved) == ["check", "import"]
    assert "ALERT BrokenTrace firing (critical): trace_broken_share" in out
    [alert] = parquet_rows(root, "alerts", summary.run_id).to_pylist()
    sequences = sum(len(generated) for _, generated in requests)
    # the shipped rule reads the largest broken share: zeroed final rows of every sequence
    assert alert["alertname"] == "BrokenTrace" and alert["source"] == "trace_check"
    assert alert["signal_values"][0] == ("trace_broken_share", pytest.approx(sequences / sequences))
    (tmp_path / "clean").mkdir()
    clean_root, clean_summary = imported(tmp_path / "clean", "vllm", requests, clean, layers, k)
    assert main(["check", clean_root, "--run", clean_summary.run_id, "--save"]) == 0
    assert parquet_rows(clean_root, "alerts").num_rows == 0


def test_rows_vllm_did_not_compute_are_a_finding_but_do_not_make_the_trace_broken(tmp_path, standin, capsys):
    requests, clean, layers, k, experts = standin
    engine = copy.deepcopy(clean)
    sentinel(requests, engine, experts)  # prefix-cache hits: vLLM marks them -1 on purpose
    root, summary = imported(tmp_path, "vllm", requests, engine, layers, k)
    capsys.readouterr()
    assert main(["check", root, "--run", summary.run_id, "--format", "json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert [f["check"] for f in report["recorded"]] == ["sentinel_rows"] and report["stored_routes"] == []
    assert report["signals"]["trace_broken_share"] == 0.0 and report["alerts"] == []
