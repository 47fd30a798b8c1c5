"""The engine-vs-reference check's top-1 on a router whose chosen experts are not in score order.

DeepSeek-V3's router takes its top-k with `torch.topk(..., sorted=False)` over the scores plus a
correction bias, so the reference's slot 0 is often not its highest-scoring chosen expert; an engine
records its top-1 first. The reference here is a tiny DeepSeek-V3 (random-initialised, with a
correction bias) and the "engine" is the same model's own router outputs, read by hooks of the test's
on each gate, written in vLLM's response format with the chosen experts in score order, and with
the two slots swapped on a known set of pairs: exactly those pairs' top-1 differs, and no set does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moescope.analyses.mismatch import mismatch
from moescope.ingest.importers import import_files
from tests.support.engine_standin import fed, token_sequences, vllm_responses
from tests.support.zoo import tiny_model


def own_routing(model, sequence: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(ids as the router returned them, router logits), each (tokens, MoE layers, ...), from hooks on
    the model's own gates, the sequence run alone."""
    gates = [module for name, module in model.named_modules() if name.endswith("mlp.gate")]
    seen: list = []
    handles = [gate.register_forward_hook(lambda module, args, out: seen.append(out)) for gate in gates]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([sequence]), attention_mask=torch.ones((1, len(sequence)), dtype=torch.long),
                  position_ids=torch.arange(len(sequence))[None], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    ids = np.stack([out[2].numpy() for out in seen], axis=1).astype(np.int64)
    logits = np.stack([out[0].float().numpy() for out in seen], axis=1).astype(np.float64)
    return ids, logits


@pytest.fixture(scope="module")
def routed_by_deepseek():
    model = tiny_model("deepseek_v3", correction_bias=0.3)
    requests = token_sequences(seed=3, prompts=3)
    keys = [(r, c) for r, (_, gens) in enumerate(requests) for c in range(len(gens))]
    routing = {key: own_routing(model, fed(requests[key[0]][0], requests[key[0]][1][key[1]])) for key in keys}
    return model, requests, routing


def test_top1_is_the_references_highest_scoring_chosen_expert_not_its_slot_0(routed_by_deepseek, tmp_path):
    model, requests, routing = routed_by_deepseek
    engine, swapped, router_order_differs, pairs = {}, set(), 0, 0
    for (r, c), (ids, logits) in routing.items():
        scores = np.take_along_axis(logits, ids, axis=2)
        in_score_order = np.take_along_axis(ids, np.argsort(-scores, axis=2, kind="stable"), axis=2)
        first = 0 if c == 0 else len(requests[r][0])  # vLLM routes a prompt once, in choice 0
        for position in range(first, len(ids)):
            for layer in range(ids.shape[1]):
                pairs += 1
                router_order_differs += int(ids[position, layer, 0] != in_score_order[position, layer, 0])
                if (position + layer + r) % 4 == 0:  # the engine's top-1 is the other chosen expert
                    in_score_order[position, layer] = in_score_order[position, layer, ::-1]
                    swapped.add(((r, c), position, layer))
        engine[(r, c)] = in_score_order
    assert 0 < router_order_differs < pairs  # the reference's slot 0 is often not its top-1 here
    path = tmp_path / "vllm.jsonl"
    path.write_text(vllm_responses(requests, engine))
    import_files("vllm", [str(path)], tmp_path / "store", run_id="engine")

    report = mismatch(model, store=tmp_path / "store", run="engine", batch_size=1, write=False)
    overall = report.overall()
    assert (overall.pairs, overall.set_changed, overall.top1_changed) == (pairs, 0, len(swapped))
    listed = {((t.step, t.sequence), t.position, t.layer) for t in report.tokens.itertuples()}
    assert listed == swapped and report.tokens.top1_changed.all()
