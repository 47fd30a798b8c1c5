"""The model-based trace checks inside `moescope mismatch`: agreement at token offsets -2..+2, a
trace near chance called broken, large-margin flips.

The engine is a STAND-IN (tests/support/engine_standin.py: the model in bfloat16, left-padded
batches of three), its routing written as vLLM responses and imported by the real importer, faults
injected into its arrays. The oracle is the float32 model run on each sequence alone, read from its
own router logits (`output_router_logits`); expected figures are plain loops over the two routings.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from transformers import MixtralForCausalLM

from moescope.analyses.mismatch import mismatch
from moescope.analyses.trace_check import LARGE_MARGIN, OFFSETS
from moescope.demo.data import demo_model_path, domain_windows, load_demo_model
from moescope.ingest.importers import import_files
from tests.support.engine_standin import engine_standin, fed, routed, token_sequences, vllm_responses
from tests.support.importing import parquet_rows
from tests.support.jitter import near_tied_mixtral
from tests.support.zoo import tiny_model


def setup(model, prompts: int = 4, requests=None):
    requests = requests or token_sequences(seed=3, prompts=prompts)
    keys = [(r, c) for r, (_, gens) in enumerate(requests) for c in range(len(gens))]
    sequences = {key: fed(requests[key[0]][0], requests[key[0]][1][key[1]]) for key in keys}
    engine = dict(zip(keys, engine_standin(model, [sequences[key] for key in keys])))
    oracle = {key: routed(model, [sequences[key]])[0] for key in keys}
    return requests, sequences, engine, oracle


def run_check(tmp_path, model, requests, engine):
    path = str(tmp_path / "vllm.jsonl")
    with open(path, "w") as f:
        f.write(vllm_responses(requests, engine))
    root = str(tmp_path / "store")
    run = import_files("vllm", [path], root, run_id="engine").run_id
    return root, mismatch(model, store=root, run=run)


def loop_agreement(requests, engine, oracle, k: int) -> dict[int, float]:
    """Per offset, shared experts / (pairs x k) over what vLLM sends: request r's prompt once (choice
    0's rows) and each choice's own rows, each row against the oracle's at position + d."""
    shared = {d: 0 for d in OFFSETS}
    pairs = {d: 0 for d in OFFSETS}
    for (r, c), ids in engine.items():
        ref = oracle[(r, c)][0]
        first = 0 if c == 0 else len(requests[r][0])
        for t in range(first, len(ids)):
            for layer in range(ids.shape[1]):
                for d in OFFSETS:
                    if 0 <= t + d < len(ids):
                        shared[d] += len(set(ids[t, layer].tolist()) & set(ref[t + d, layer].tolist()))
                        pairs[d] += 1
    return {d: shared[d] / (pairs[d] * k) for d in OFFSETS}


@pytest.fixture(scope="module")
def mixtral():
    model = tiny_model("mixtral")
    return model, *setup(model)


def test_a_clean_run_of_the_demo_model_has_no_large_margin_flip_at_the_default_threshold(tmp_path):
    # loaded dropless, as an engine (vLLM, SGLang) serves it: the demo's expert capacity makes routing
    # depend on the batch, a difference that is not rounding
    model = MixtralForCausalLM.from_pretrained(demo_model_path(), local_files_only=True, dtype="float32").eval()
    _, tokenizer = load_demo_model()
    windows = [w for domain in ("code", "prose", "math") for w in domain_windows(tokenizer, domain, 8, 64, seed=1)]
    requests, _, engine, oracle = setup(model, requests=[(w[:48], [w[48:]]) for w in windows])
    root, report = run_check(tmp_path, model, requests, engine)
    k = model.config.num_experts_per_tok
    flips = large = 0
    for (r, c), ids in engine.items():
        ref, logits = oracle[(r, c)]
        first = 0 if c == 0 else len(requests[r][0])
        for t in range(first, len(ids)):
            for layer in range(ids.shape[1]):
                if set(ids[t, layer].tolist()) != set(ref[t, layer].tolist()):
                    flips += 1
                    ordered = np.sort(logits[t, layer])[::-1]
                    large += ordered[k - 1] - ordered[k] >= LARGE_MARGIN
    assert flips > 0  # bfloat16 flips near-ties of the demo model's routing
    assert report.trace.flips == flips and report.trace.large_margin_flips == large == 0
    assert report.trace.verdict() == "sound"
    assert report.trace.agreement == pytest.approx(loop_agreement(requests, engine, oracle, k), rel=1e-12)
    assert parquet_rows(root, "trace_findings", "engine").num_rows == 0


def test_a_trace_shifted_by_one_token_agrees_best_at_plus_one_and_says_so(tmp_path, mixtral):
    model, requests, _, clean, oracle = mixtral
    engine = copy.deepcopy(clean)
    for key, ids in engine.items():  # row t holds token t + 1's routing (the last row repeated)
        engine[key] = np.concatenate([ids[1:], ids[-1:]])
    root, report = run_check(tmp_path, model, requests, engine)
    k = model.config.num_experts_per_tok
    expected = loop_agreement(requests, engine, oracle, k)
    assert report.trace.agreement == pytest.approx(expected, rel=1e-12)
    assert max(expected, key=expected.get) == 1 and report.trace.verdict() == "shifted by +1"
    rows = parquet_rows(root, "trace_findings", "engine").to_pylist()
    assert [(r["check_name"], r["origin"]) for r in rows] == [("shifted", "mismatch")]
    assert "trace shifted by +1" in report.line()


def test_a_trace_unrelated_to_the_router_is_broken_not_mismatched(tmp_path, mixtral):
    model, requests, _, clean, oracle = mixtral
    experts, k = model.config.num_local_experts, model.config.num_experts_per_tok
    rng = np.random.default_rng(0)
    engine = {key: np.stack([[rng.choice(experts, k, replace=False) for _ in range(ids.shape[1])] for _ in ids])
              for key, ids in clean.items()}  # another model's ids
    root, report = run_check(tmp_path, model, requests, engine)
    best = max(loop_agreement(requests, engine, oracle, k).values())
    chance = k / experts
    assert best < chance + 0.25 * (1 - chance) and report.trace.broken
    rows = parquet_rows(root, "trace_findings", "engine").to_pylist()
    assert [r["check_name"] for r in rows] == ["chance_agreement"]
    assert report.line().startswith("Engine vs reference (engine): trace broken")


def test_a_clean_standin_trace_is_sound(tmp_path, mixtral):
    model, requests, _, clean, oracle = mixtral
    root, report = run_check(tmp_path, model, requests, clean)
    assert report.trace.verdict() == "sound" and report.trace.best_offset == 0
    assert parquet_rows(root, "trace_findings", "engine").num_rows == 0


def test_the_replay_gives_later_choices_the_first_choices_result_on_the_shared_prompt(tmp_path):
    model = near_tied_mixtral()  # its near-ties flip under bfloat16, prompt rows included
    requests, _, engine, oracle = setup(model)
    _, report = run_check(tmp_path, model, requests, engine)
    replay = {(seq.step, seq.sequence): seq for seq in report.replay}
    flipped = 0
    for r, (prompt, generated) in enumerate(requests):
        p = len(prompt)
        expected = np.array([[set(engine[(r, 0)][t, layer].tolist()) != set(oracle[(r, 0)][0][t, layer].tolist())
                              for layer in range(engine[(r, 0)].shape[1])] for t in range(p)])
        flipped += int(expected.sum())
        for c in range(len(generated)):
            assert replay[(r, c)].own_from == (0 if c == 0 else p)
            np.testing.assert_array_equal(replay[(r, c)].set_changed[:p], expected)
    assert flipped > 0
