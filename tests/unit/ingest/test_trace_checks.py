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

import numpy as np
import pytest

from moescope.cli import main
from moescope.ingest.importers import import_files
from moescope.ingest.stored_trace import RECHECKED, check_stored_trace
from moescope.store import Store
from tests.support.engine_standin import engine_standin, fed, sglang_responses, token_sequences, vllm_responses
from tests.support.importing import parquet_rows
from tests.support.zoo import tiny_model

FORMATS = ("vllm", "sglang")


@pytest.fixture(scope="module")
def standin():
    model = tiny_model("mixtral")
    requests = token_sequences(seed=3)
    keys = [(r, c) for r, (_, gens) in enumerate(requests) for c in range(len(gens))]
    engine = dict(zip(keys, engine_standin(model, [fed(requests[r][0], requests[r][1][c]) for r, c in keys])))
    config = model.config
    return requests, engine, config.num_hidden_layers, config.num_experts_per_tok, config.num_local_experts


def sent(fmt: str, requests, engine) -> list[np.ndarray]:
    """The arrays a format sends, sequence by sequence: vLLM the prompt's rows once (choice 0's run)
    and each choice's generated rows; SGLang every (prompt, choice) whole."""
    if fmt == "sglang":
        return list(engine.values())
    out = []
    for r, (prompt, generated) in enumerate(requests):
        out.append(engine[(r, 0)][:len(prompt)])
        out += [engine[(r, c)][len(prompt):] for c in range(len(generated))]
    return out


def write(tmp_path, fmt: str, requests, engine) -> str:
    path = str(tmp_path / f"{fmt}.jsonl")
    with open(path, "w") as f:
        f.write((vllm_responses if fmt == "vllm" else sglang_responses)(requests, engine))
    return path


def imported(tmp_path, fmt: str, requests, engine, layers: int, k: int, **options):
    root = str(tmp_path / "store")
    extra = dict(num_layers=layers, top_k=k) if fmt == "sglang" else {}
    return root, import_files(fmt, [write(tmp_path, fmt, requests, engine)], root, **extra, **options)


def zero_rows(requests, engine, experts):
    engine[(0, 0)][1:4] = 0  # three prompt rows whose capture never wrote the buffer
    return "zero_rows", lambda arrays: sum(int((~a[:-1].reshape(len(a) - 1, -1).any(axis=1)).sum()) for a in arrays)


def sentinel(requests, engine, experts):
    engine[(0, 0)][1:3] = -1  # two prompt rows vLLM did not compute (prefix-cache hits)
    return "sentinel_rows", lambda arrays: sum(int((a.reshape(len(a), -1) == -1).all(axis=1).sum()) for a in arrays)


def final_row(requests, engine, experts):
    for key in engine:  # verl's zero-filled last token
        engine[key][-1] = 0
    # the last row of each sequence: vLLM's prompt rows are followed by a choice's, so it ends none
    return "final_row_zero", lambda arrays: sum(1 for a in arrays if not a[-1].any() and a is not None)


def repeated(requests, engine, experts):
    engine[(1, 0)][2, 0, 1] = engine[(1, 0)][2, 0, 0]  # a prompt row of layer 0 names one expert twice
    return "repeated_ids", lambda arrays: sum(int((np.sort(a, axis=2)[:, :, 1:] == np.sort(a, axis=2)[:, :, :-1])
                                                  .any(axis=2).sum()) for a in arrays)


def truncated(requests, engine, experts):
    engine[(0, 0)] = engine[(0, 0)][:-2]  # two rows short: choice 0 of request 0
    return "row_count", lambda arrays: 2


def physical(requests, engine, experts):
    # an EPLB map with two redundant slots: physical E is a replica of expert 0, E + 1 of expert 1;
    # the engine returned the physical slot of every other token routed to experts 0 and 1
    for ids in engine.values():
        odd = (np.arange(len(ids)) % 2 == 1)[:, None, None]
        ids[:] = np.where(odd & (ids == 0), experts, np.where(odd & (ids == 1), experts + 1, ids))
    return "physical_ids", lambda arrays: sum(int((a >= experts).sum()) for a in arrays)


FAULTS = [zero_rows, sentinel, final_row, repeated, truncated, physical]


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
    (tmp_path / "clean").mkdir()
    clean_root, clean_summary = imported(tmp_path / "clean", "vllm", requests, clean, layers, k)
    assert main(["check", clean_root, "--run", clean_summary.run_id]) == 0
