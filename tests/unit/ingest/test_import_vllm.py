"""`moescope import vllm`: routed-experts replay responses and arrays into a store.

vLLM cannot run here (no GPU, no engine), so the files are built to the layouts vLLM documents
for `--enable-return-routed-experts`: `prompt_routed_experts` once per response and
`routed_experts` per choice, as nested lists or base64 of a `.npy` file, `CompletionOutput`
arrays saved as `.npy`, int16/int32/uint8 ids, -1 rows for prefix-cache hits, n or n-1 rows for
the generated tokens, streamed chunks. Expected loads, co-selection, drift and switches are
counted by plain loops over the arrays the test built; stored rows are read from the Parquet files.
"""

from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
import pytest
from scipy.spatial.distance import jensenshannon

from moescope.cli import main
from moescope.ingest.importers import SourceFormatError, import_files
from moescope.metrics import signals
from moescope.store import Store
from tests.support.importing import (
    loop_coselection,
    loop_loads,
    parquet_rows,
    store_files,
    stored_loads,
    top1_switches,
)

E, L, K = 6, 3, 2  # layer 1 is dense: -1 throughout
DENSE = 1


def routing(rng: np.random.Generator, rows: int, skewed: bool) -> np.ndarray:
    p = np.array([1, 1, 1, 1, 6, 6.0]) if skewed else np.ones(E)
    out = np.full((rows, L, K), -1, dtype=np.int64)
    for t in range(rows):
        for layer in range(L):
            if layer != DENSE:
                out[t, layer] = rng.choice(E, K, replace=False, p=p / p.sum())
    return out


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def b64_npy(array: np.ndarray) -> str:
    return base64.b64encode(npy_bytes(array)).decode()


class Recording:
    """Six requests, their expected token rows, and the files holding them in four encodings."""

    def __init__(self, folder: str):
        rng = np.random.default_rng(7)
        self.token_rows: list[tuple] = []  # (step, layer, ids) per computed token
        self.routes: set[tuple] = set()  # (step, layer, sequence, position, token_id, ids)
        self.not_computed = 0
        responses = []
        for r in range(6):
            prompt_len, gen_len = 5 + r, 4
            prompt = routing(rng, prompt_len, skewed=r >= 3)
            if r in (1, 4):  # a prefix-cache hit: the first three prompt positions were not computed
                prompt[:3] = -1
                self.not_computed += 3
            gen_rows = gen_len if r == 2 else gen_len - 1  # the last generated token never ran a forward
            generated = routing(rng, gen_rows, skewed=r >= 3)
            prompt_ids = rng.integers(10, 1000, prompt_len).tolist()
            gen_ids = rng.integers(10, 1000, gen_len).tolist()
            for rows, first, ids in ((prompt, 0, prompt_ids), (generated, prompt_len, gen_ids)):
                for i, row in enumerate(rows):
                    for layer in range(L):
                        if row[layer][0] >= 0:
                            self.token_rows.append((r, layer, row[layer].tolist()))
                            token_id = ids[i] if r != 5 else None
                            self.routes.add((r, layer, 0, first + i, token_id, tuple(row[layer].tolist())))
            responses.append((prompt, generated, prompt_ids, gen_ids))
        self.responses = responses

        def body(r: int, encode) -> dict:
            prompt, generated, prompt_ids, gen_ids = responses[r]
            return {"id": f"cmpl-{r}", "object": "text_completion", "created": 1_700_000_000 + r,
                    "model": "test-moe", "prompt_token_ids": prompt_ids, "prompt_routed_experts": encode(prompt),
                    "choices": [{"index": 0, "text": "x", "token_ids": gen_ids, "routed_experts": encode(generated)}],
                    "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(gen_ids)}}

        self.paths = [os.path.join(folder, n) for n in ("a.json", "b.jsonl", "c.json", "d.npy")]
        with open(self.paths[0], "w") as f:  # nested lists
            json.dump(body(0, lambda a: a.tolist()), f)
        with open(self.paths[1], "w") as f:  # base64 .npy of int16; then a stream of three chunks
            f.write(json.dumps(body(1, lambda a: b64_npy(a.astype(np.int16)))) + "\n")
            prompt, generated, prompt_ids, gen_ids = responses[2]
            chunks = [{"id": "cmpl-2", "object": "text_completion", "created": 1_700_000_002, "model": "test-moe",
                       "prompt_token_ids": prompt_ids, "prompt_routed_experts": prompt.tolist(),
                       "choices": [{"index": 0, "text": "a", "token_ids": gen_ids[:2],
                                    "routed_experts": generated[:2].tolist()}]},
                      {"id": "cmpl-2", "object": "text_completion", "created": 1_700_000_002, "model": "test-moe",
                       "choices": [{"index": 0, "text": "b", "token_ids": gen_ids[2:],
                                    "routed_experts": b64_npy(generated[2:].astype(np.int32))}]},
                      {"id": "cmpl-2", "object": "text_completion", "created": 1_700_000_002, "model": "test-moe",
                       "choices": [], "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": 4}}]
            f.write("".join(json.dumps(c) + "\n" for c in chunks))
        with open(self.paths[2], "w") as f:  # a list of two responses, int32 base64 and lists
            json.dump([body(3, lambda a: b64_npy(a.astype(np.int32))), body(4, lambda a: a.tolist())], f)
        prompt, generated, _, _ = responses[5]  # CompletionOutput.routed_experts: the whole sequence
        np.save(self.paths[3], np.concatenate([prompt, generated]).astype(np.int32))


@pytest.fixture
def recording(tmp_path) -> Recording:
    return Recording(str(tmp_path))


def test_loads_coselection_routes_and_nulls_match_a_loop_over_the_responses(tmp_path, recording):
    root = str(tmp_path / "store")
    summary = import_files("vllm", recording.paths, root, num_experts=E, tags={"router": "v2"})
    assert (summary.steps, summary.layers, summary.routes) == (6, 2, len(recording.token_rows))
    assert sum(summary.notes.values()) == recording.not_computed

    assert stored_loads(root, summary.run_id) == loop_loads(recording.token_rows, E)
    with Store(root) as store:
        for layer in (0, 2):
            np.testing.assert_array_equal(store.coselection(summary.run_id, layer),
                                          loop_coselection(recording.token_rows, layer, E))
        assert sorted(store.layers(summary.run_id).layer) == [0, 2]

    routes = parquet_rows(root, "routes", summary.run_id).to_pylist()
    assert {(r["step"], r["layer"], r["sequence"], r["position"], r["token_id"], tuple(r["expert_ids"]))
            for r in routes} == recording.routes
    assert all(r["gate_weights"] is None and r["kept"] is None and r["tags"] == [("router", "v2")] for r in routes)

    layer_steps = parquet_rows(root, "layer_steps", summary.run_id).to_pylist()
    for column in ("router_entropy_mean", "router_entropy_p95", "top1_margin_mean", "gate_weight_sum",
                   "router_prob_sum", "dropped_tokens", "capacity_use", "active_params_per_token"):
        assert all(row[column] is None for row in layer_steps), column
    steps = parquet_rows(root, "steps", summary.run_id).to_pylist()
    assert all(s["active_param_fraction"] is None and s["duration_s"] is None for s in steps)
    assert [s["ts"].timestamp() for s in sorted(steps, key=lambda s: s["step"])][:5] == [
        1_700_000_000 + r for r in range(5)]
    run = parquet_rows(root, "runs", summary.run_id).to_pylist()
    assert [(r["source"], r["model_class"], r["total_params"]) for r in run] == [("vllm", "test-moe", None)]


def test_drift_and_switches_follow_from_the_imported_routes(tmp_path, recording):
    root = str(tmp_path / "store")
    run = import_files("vllm", recording.paths, root, num_experts=E).run_id
    expected = loop_loads(recording.token_rows, E)
    with Store(root) as store:
        drift = store.drift_windows(run, window_steps=3, layer=0)
    later = drift[drift.window_start == 3].iloc[0]
    base = np.sum([expected[(s, 0)] for s in range(3)], axis=0)
    window = np.sum([expected[(s, 0)] for s in range(3, 6)], axis=0)
    np.testing.assert_array_equal(later.baseline_load, base)
    np.testing.assert_array_equal(later.expert_load, window)
    js = signals.js_divergence(later.expert_load, later.baseline_load)
    assert js == pytest.approx(jensenshannon(window / window.sum(), base / base.sum()) ** 2, rel=1e-9)
    assert js > 0.05  # the later requests favour experts 4 and 5

    stored = [((r["step"], r["rank"], r["sequence"]), r["position"], r["expert_ids"][0])
              for r in parquet_rows(root, "routes", run).to_pylist() if r["layer"] == 2]
    built = [((step, 0, seq), pos, ids[0]) for step, layer, seq, pos, _, ids in recording.routes if layer == 2]
    changes, pairs = top1_switches(built)
    assert top1_switches(stored) == (changes, pairs) and pairs > 30
    keys = {k: i for i, k in enumerate(sorted({s for s, _, _ in stored}))}
    rate = signals.routing_drift_rate(np.array([e for _, _, e in stored]), np.array([keys[s] for s, _, _ in stored]),
                                      np.array([p for _, p, _ in stored]))
    assert rate == pytest.approx(changes * 1000 / pairs)


def test_uint8_completion_output_array_without_num_experts(tmp_path):
    rng = np.random.default_rng(3)
    ids = np.stack([[rng.choice(4, 2, replace=False) for _ in range(2)] for _ in range(9)]).astype(np.uint8)
    path = str(tmp_path / "output.npy")
    np.save(path, ids)
    root = str(tmp_path / "store")
    summary = import_files("vllm", [path], root)
    rows = [(0, layer, ids[t, layer].tolist()) for t in range(9) for layer in range(2)]
    width = int(ids.max()) + 1  # no --num-experts: the largest id seen + 1
    assert stored_loads(root, summary.run_id) == loop_loads(rows, width)
    positions = sorted(r["position"] for r in parquet_rows(root, "routes", summary.run_id).to_pylist()
                       if r["layer"] == 0)
    assert positions == list(range(9))


@pytest.mark.parametrize("gen_rows, prompt_rows, sequence", [
    (2, 5, "choice 0: 2 rows for 4 tokens, 4 or 3 expected"),
    (3, 4, "the prompt: 4 rows for 5 tokens"),
])
def test_rows_that_do_not_align_to_the_tokens_are_imported_with_a_row_count_finding(tmp_path, gen_rows, prompt_rows,
                                                                                     sequence):
    rng = np.random.default_rng(1)
    prompt, generated = routing(rng, prompt_rows, False), routing(rng, gen_rows, False)
    body = {"id": "x", "prompt_token_ids": [1, 2, 3, 4, 5], "prompt_routed_experts": prompt.tolist(),
            "choices": [{"index": 0, "token_ids": [6, 7, 8, 9], "routed_experts": generated.tolist()}]}
    path = str(tmp_path / "resp.json")
    with open(path, "w") as f:
        json.dump(body, f)
    root = str(tmp_path / "store")
    summary = import_files("vllm", [path], root)
    # one row missing in either case (`sequence` says which), and the rows there are are kept
    assert [(f.check, f.count) for f in summary.findings] == [("row_count", 1)], sequence
    assert "row_count 1" in summary.report()
    stored = parquet_rows(root, "trace_findings", summary.run_id).to_pylist()
    assert [(r["check_name"], r["count"], r["origin"]) for r in stored] == [("row_count", 1, "import")]
    assert summary.routes == (prompt_rows + gen_rows) * (L - 1)


def _bad_files(folder: str) -> dict[str, str]:
    rng = np.random.default_rng(2)
    good = routing(rng, 3, False)
    files = {
        "ragged.json": json.dumps({"prompt_routed_experts": [[[1, 2]], [[1]]]}),
        "truncated.json": json.dumps({"prompt_routed_experts": good.tolist(), "choices": []})[:-7],
        "notnpy.json": json.dumps({"prompt_routed_experts": base64.b64encode(b"hello world").decode()}),
        "floats.json": json.dumps({"prompt_routed_experts": b64_npy(good.astype(np.float32))}),
        "flat.json": json.dumps({"prompt_routed_experts": [1, 2, 3]}),
        "partial.json": json.dumps({"prompt_routed_experts": [[[1, -1]], [[2, 3]]]}),
        "sglang.json": json.dumps({"text": "x", "meta_info": {"routed_experts": "AAAA"}}),
    }
    out = {}
    for name, text in files.items():
        out[name] = os.path.join(folder, name)
        with open(out[name], "w") as f:
            f.write(text)
    out["truncated.npy"] = os.path.join(folder, "truncated.npy")
    with open(out["truncated.npy"], "wb") as f:
        f.write(npy_bytes(good.astype(np.int32))[:-10])
    return out


@pytest.mark.parametrize("name, expected", [
    ("ragged.json", "ragged nested lists"), ("truncated.json", "not valid JSON"),
    ("notnpy.json", "not a .npy payload"), ("floats.json", "integer expert ids"),
    ("flat.json", r"\(tokens, layers, top_k\)"), ("partial.json", "slots set and -1"),
    ("sglang.json", "moescope import sglang"), ("truncated.npy", "truncated"),
])
def test_bad_files_name_the_file_and_write_nothing(tmp_path, recording, name, expected):
    bad = _bad_files(str(tmp_path))[name]
    root = str(tmp_path / "store")
    with pytest.raises(SourceFormatError, match=expected) as error:
        import_files("vllm", [*recording.paths, bad], root)  # good files first: still nothing written
    assert name in str(error.value)
    assert store_files(root) == []


def test_command_line_imports_and_reports_errors(tmp_path, recording, capsys):
    root = str(tmp_path / "store")
    assert main(["import", "vllm", *recording.paths, "--store", root, "--run-id", "replay-1", "--tag", "pool=a",
                 "--num-experts", str(E)]) == 0
    assert "imported 6 steps of 2 MoE layers" in capsys.readouterr().out
    assert parquet_rows(root, "runs", "replay-1").to_pylist()[0]["tags"] == [("pool", "a")]
    assert main(["import", "vllm", recording.paths[0], "--store", root, "--run-id", "replay-1"]) == 1
    assert "already holds a run 'replay-1'" in capsys.readouterr().err
    bad = _bad_files(str(tmp_path))["truncated.json"]
    assert main(["import", "vllm", bad, "--store", root]) == 1
    assert "truncated.json" in capsys.readouterr().err
    assert main(["import", "vllm", recording.paths[0], "--store", root, "--run-id", "../escape"]) == 1
    assert "cannot be used in a store path" in capsys.readouterr().err
