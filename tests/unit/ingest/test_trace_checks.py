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
import math

import numpy as np
import pytest

from moescope.cli import main
from moescope.cli.check import read_engine_map
from moescope.ingest.importers import import_files
from moescope.ingest.stored_trace import RECHECKED, check_stored_trace
from moescope.store import Store
from tests.support.engine_standin import sglang_responses, vllm_responses
from tests.support.importing import parquet_rows
from tests.support.trace_faults import (
    FAULTS,
    FORMATS,
    final_row,
    load_sorted_map,
    misread_slots,
    redundant_map,
    sent,
    sentinel,
    slot_loads,
    standin_trace,
    to_physical,
)


@pytest.fixture(scope="module")
def standin():
    return standin_trace()


def write(tmp_path, fmt: str, requests, engine) -> str:
    path = str(tmp_path / f"{fmt}.jsonl")
    with open(path, "w") as f:
        f.write((vllm_responses if fmt == "vllm" else sglang_responses)(requests, engine))
    return path


def map_file(tmp_path, mapping: list[list[int]], **load) -> str:
    """An engine's map as a JSON file: vLLM's physical_to_logical_map (a row per MoE layer), with the
    load the engine recorded beside it under the engine's own name."""
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"physical_to_logical_map": mapping, "ranks": 1, **load}))
    return str(path)


def imported(tmp_path, fmt: str, requests, engine, layers: int, k: int, **options):
    root = str(tmp_path / "store")
    extra = dict(num_layers=layers, top_k=k) if fmt == "sglang" else {}
    return root, import_files(fmt, [write(tmp_path, fmt, requests, engine)], root, **extra, **options)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_clean_trace_from_the_standin_engine_gives_no_finding(tmp_path, standin, fmt):
    requests, engine, layers, k, experts = standin
    engine_map = read_engine_map(map_file(tmp_path, redundant_map(experts, layers)))
    root, summary = imported(tmp_path, fmt, requests, engine, layers, k, engine_map=engine_map)
    assert summary.findings == []
    assert "trace checks: no finding" in summary.report()
    assert parquet_rows(root, "trace_findings", summary.run_id).num_rows == 0
    with Store(root) as store:
        assert check_stored_trace(store, summary.run_id, engine_map).findings() == []


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_fault_alone_is_found_by_the_check_that_names_it(tmp_path, standin, fmt, fault):
    requests, clean, layers, k, experts = standin
    engine = copy.deepcopy(clean)
    check, count_of = fault(requests, engine, experts)
    expected = count_of(sent(fmt, requests, engine))
    assert expected > 0
    engine_map = read_engine_map(map_file(tmp_path, redundant_map(experts, layers)))
    root, summary = imported(tmp_path, fmt, requests, engine, layers, k, engine_map=engine_map)
    assert [(f.check, f.count) for f in summary.findings] == [(check, expected)]
    assert f"{check} {expected:,} of" in summary.report()
    stored = parquet_rows(root, "trace_findings", summary.run_id).to_pylist()
    assert [(r["check_name"], r["count"], r["origin"]) for r in stored] == [(check, expected, "import")]
    assert stored[0]["sequences"]  # it names where
    if check in RECHECKED:  # and the stored routes say it again
        with Store(root) as store:
            again = check_stored_trace(store, summary.run_id, engine_map).findings()
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


def recorded_load(tmp_path, source: str, mapping, arrays, clean_arrays, experts: int):
    """The engine's map with the load it recorded over the same traffic, in an engine's own form:
    vLLM's expert_load_window ([window, MoE layers, physical slots]), SGLang's logical_count ([layers,
    logical experts]) or an SGLang per_pass recorder dump (.pt: last_physical_to_logical_map and each
    record's global_physical_count). Counted by plain loops over the arrays the engine sent."""
    slots = len(mapping[0])
    if source == "vllm-window":
        return read_engine_map(map_file(tmp_path, mapping, expert_load_window=[slot_loads(arrays, slots)]))
    if source == "sglang-logical":
        return read_engine_map(map_file(tmp_path, mapping, logical_count=slot_loads(clean_arrays, experts)))
    import torch

    path = str(tmp_path / "expert_distribution_recorder_1700000000.pt")
    load = torch.tensor(slot_loads(arrays, slots), dtype=torch.int32)
    torch.save({"records": [{"forward_pass_id": 0, "rank": 0, "global_physical_count": load // 2},
                            {"forward_pass_id": 1, "rank": 0, "global_physical_count": load - load // 2}],
                "last_physical_to_logical_map": torch.tensor(mapping, dtype=torch.int32)}, path)
    return read_engine_map(path, ranks=1)


@pytest.mark.parametrize("source", ["vllm-window", "sglang-logical", "sglang-dump"])
@pytest.mark.parametrize("redundant", [0, 2], ids=["permutation", "redundant"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_physical_ids_under_a_non_identity_map_are_found_with_the_slots_they_misread(tmp_path, standin, fmt,
                                                                                     redundant, source):
    requests, clean, layers, k, experts = standin
    mapping = load_sorted_map(list(clean.values()), experts, redundant)
    engine = {key: to_physical(ids, mapping) for key, ids in clean.items()}
    arrays = sent(fmt, requests, engine)
    expected = misread_slots(arrays, mapping)
    assert 0 < expected < sum(int((a > 0).any(axis=2).sum()) * k for a in arrays)  # some slots hold their own
    engine_map = recorded_load(tmp_path, source, mapping, arrays, sent(fmt, requests, clean), experts)
    root, summary = imported(tmp_path, fmt, requests, engine, layers, k, engine_map=engine_map)
    assert [(f.check, f.count) for f in summary.findings] == [("physical_ids", expected)]
    assert summary.findings[0].rows and summary.findings[0].sequences
    with Store(root) as store:
        again = check_stored_trace(store, summary.run_id, engine_map).findings()
    assert [(f.check, f.count) for f in again] == [("physical_ids", expected)]
    (tmp_path / "logical").mkdir()  # the same traffic returned logical, under the same map and load
    _, summary = imported(tmp_path / "logical", fmt, requests, clean, layers, k, engine_map=engine_map)
    assert summary.findings == []


def test_a_permutation_without_a_recorded_load_is_not_identifiable(tmp_path, standin):
    """Any count per id is as likely logical as permuted: without the engine's load, a map with no
    redundant slot gives the trace nothing to be told by, and the check says nothing."""
    requests, clean, layers, k, experts = standin
    mapping = load_sorted_map(list(clean.values()), experts)
    engine = {key: to_physical(ids, mapping) for key, ids in clean.items()}
    _, summary = imported(tmp_path, "vllm", requests, engine, layers, k,
                          engine_map=read_engine_map(map_file(tmp_path, mapping)))
    assert summary.findings == []


def test_the_load_evidence_is_the_log_likelihood_ratio_of_the_counts():
    from moescope.ingest.trace_checks import load_evidence

    # two slots swapped: slot 0 holds expert 1, slot 1 expert 0, slot 2 expert 2; the engine counted
    # 30, 10 and 20 tokens on its slots; the trace names ids 0, 1, 2 30, 10 and 20 times
    counts, mapping, load = [30, 10, 20], [1, 0, 2], [30, 10, 20]
    physical = [30.5 / 61.5, 10.5 / 61.5, 20.5 / 61.5]  # each count + 1/2, per slot
    logical = [10.5 / 61.5, 30.5 / 61.5, 20.5 / 61.5]  # expert e's load is its slot's
    expected = sum(n * (math.log(p) - math.log(q)) for n, p, q in zip(counts, physical, logical))
    assert load_evidence(np.array(counts), np.array(mapping), np.array(load, dtype=float), "physical") == (
        pytest.approx(expected))
    # the same load per logical expert: expert 0 sits on slot 1 (10 tokens), expert 1 on slot 0 (30)
    assert load_evidence(np.array(counts), np.array(mapping), np.array([10.0, 30.0, 20.0]), "logical") == (
        pytest.approx(expected))
    assert expected > math.log(1000)


def test_the_check_command_reads_the_map_and_its_load_from_the_placement_file(tmp_path, standin, capsys):
    requests, clean, layers, k, experts = standin
    mapping = load_sorted_map(list(clean.values()), experts)
    engine = {key: to_physical(ids, mapping) for key, ids in clean.items()}
    arrays = sent("vllm", requests, engine)
    path = map_file(tmp_path, mapping, expert_load_window=[slot_loads(arrays, experts)])
    root, summary = imported(tmp_path, "vllm", requests, engine, layers, k)  # imported without the map
    assert summary.findings == []
    capsys.readouterr()
    assert main(["check", root, "--run", summary.run_id, "--placement", path, "--format", "json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert [(f["check"], f["count"]) for f in report["stored_routes"]] == [
        ("physical_ids", misread_slots(arrays, mapping))]
    assert "physical_ids" in report["rechecked"]


def test_a_chunk_in_which_a_layer_routed_nothing_places_the_map_as_the_whole_trace_does(tmp_path):
    """The proxy judges each flush's responses and then resets: a flush in which layer 1 routed no
    token must still place vLLM's map (a row per MoE layer) on both layers, not refuse its row count."""
    from moescope.ingest.trace_checks import TraceChecks

    experts, layers = 4, 2
    checks = TraceChecks(read_engine_map(map_file(tmp_path, redundant_map(experts, layers))))
    checks.add(np.array([[[0, 1], [2, 3]], [[1, 2], [0, 3]]]), "response 0")
    assert checks.findings() == []
    checks.reset()
    checks.add(np.array([[[experts, 2], [0, 0]], [[1, experts + 1], [0, 0]]]), "response 1")  # layer 1: zeros
    assert [(f.check, f.count) for f in checks.findings()] == [("physical_ids", 2)]
