"""The engine-vs-reference check's top-1 and top-k margin on a router whose chosen experts are not in
score order, and whose choice is not made on its logits.

DeepSeek-V3's router takes its top-k with `torch.topk(..., sorted=False)` over sigmoid(logit) plus a
correction bias within its best groups, and so do the engines: vLLM's grouped and biased top-k call
`torch.topk(..., sorted=VLLM_BATCH_INVARIANT)` (off by default), SGLang's biased grouped top-k sorts
only with fused shared experts. Neither side's slot 0 is its top-1, so the check compares the
engine's chosen expert of highest reference logit; a Mixtral engine's top-k is sorted, and its slot 0
stays its top-1.

The reference is a tiny DeepSeek-V3 (random-initialised, with a non-zero correction bias) and the
"engine" the same model's own router outputs, read by hooks of the test's on each gate, written in
vLLM's response format with the slots permuted on a known set of pairs. The margin's oracle is a
brute force over every choice of groups and the router's own chosen ids.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from moescope.analyses.mismatch import mismatch
from moescope.analyses.routing_compare import decision_margin, router_rule
from moescope.analyses.trace_check import LARGE_SCORE_MARGIN
from moescope.ingest.importers import import_files
from tests.support.engine_standin import fed, routed, token_sequences, vllm_responses
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


def permuted(requests, routing):
    """The engine: each row's ids in the router's order, reversed on a known set of pairs; and that set,
    the pairs compared (vLLM routes a prompt once, in choice 0), and those whose slot 0 is not the
    chosen expert of highest logit."""
    engine, swapped, pairs, unsorted = {}, set(), 0, 0
    for (r, c), (ids, logits) in routing.items():
        ids = ids.copy()
        first = 0 if c == 0 else len(requests[r][0])
        for position in range(first, len(ids)):
            for layer in range(ids.shape[1]):
                pairs += 1
                chosen = ids[position, layer].copy()
                unsorted += int(logits[position, layer, chosen].argmax() != 0)
                if (position + layer + r) % 4 == 0:
                    ids[position, layer] = chosen[::-1]
                    swapped.add(((r, c), position, layer))
        engine[(r, c)] = ids
    return engine, swapped, pairs, unsorted


def run(model, requests, engine, tmp_path):
    path = tmp_path / "vllm.jsonl"
    path.write_text(vllm_responses(requests, engine))
    import_files("vllm", [str(path)], tmp_path / "store", run_id="engine")
    return mismatch(model, store=tmp_path / "store", run="engine", batch_size=1, write=False)


def test_a_biased_routers_engine_slots_permuting_the_references_set_flip_no_top1(routed_by_deepseek, tmp_path):
    model, requests, routing = routed_by_deepseek
    engine, swapped, pairs, unsorted = permuted(requests, routing)
    assert swapped and 0 < unsorted < pairs  # the router's own slot 0 is often not its top-1 here
    report = run(model, requests, engine, tmp_path)
    overall = report.overall()
    assert (overall.pairs, overall.set_changed, overall.top1_changed) == (pairs, 0, 0)
    assert report.tokens.empty


def test_a_sorted_routers_engine_slot_0_stays_its_top1(tmp_path):
    model = tiny_model("mixtral")
    requests = token_sequences(seed=3, prompts=3)
    keys = [(r, c) for r, (_, gens) in enumerate(requests) for c in range(len(gens))]
    routing = {key: routed(model, [fed(requests[key[0]][0], requests[key[0]][1][key[1]])])[0] for key in keys}
    engine, swapped, pairs, unsorted = permuted(requests, routing)  # torch.topk's order: slot 0 the top-1
    assert unsorted == 0 and swapped
    report = run(model, requests, engine, tmp_path)
    overall = report.overall()
    assert (overall.pairs, overall.set_changed, overall.top1_changed) == (pairs, 0, len(swapped))
    listed = {((t.step, t.sequence), t.position, t.layer) for t in report.tokens.itertuples()}
    assert listed == swapped and report.tokens.top1_changed.all()


def brute_margin(logits: np.ndarray, chosen: np.ndarray, bias: np.ndarray, groups: int, kept: int) -> float:
    """One token's decision margin by brute force: the groups kept are the best of every choice of
    `kept` groups by the sum of each group's two best biased scores; the margin is the router's
    weakest chosen expert's biased score minus the best unchosen one's within those groups."""
    score = [1 / (1 + np.exp(-x)) + b for x, b in zip(logits.tolist(), bias.tolist())]
    size = len(score) // groups
    best_two = [sum(sorted(score[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(groups)]
    best = max(itertools.combinations(range(groups), kept), key=lambda c: sum(best_two[g] for g in c))
    candidates = [e for g in best for e in range(g * size, (g + 1) * size)]
    assert set(chosen.tolist()) <= set(candidates)  # the router chose within the groups found here
    rest = [score[e] for e in candidates if e not in set(chosen.tolist())]
    return min(score[e] for e in chosen.tolist()) - max(rest) if rest else float("inf")


def test_a_biased_routers_margin_is_in_biased_scores_within_its_kept_groups(routed_by_deepseek):
    model, _, routing = routed_by_deepseek
    gates = [module for name, module in model.named_modules() if name.endswith("mlp.gate")]
    config = model.config
    assert config.n_group > config.topk_group > 1
    rules = [router_rule(gate) for gate in gates]
    assert all(rule.margin_kind == "biased score" and not rule.ranked for rule in rules)
    differs = 0
    for ids, logits in routing.values():
        for layer, (gate, rule) in enumerate(zip(gates, rules)):
            bias = gate.e_score_correction_bias.double().numpy()
            assert np.abs(bias).max() > 0
            expected = [brute_margin(logits[t, layer], ids[t, layer], bias, config.n_group, config.topk_group)
                        for t in range(len(ids))]
            got = decision_margin(logits[:, layer], config.num_experts_per_tok, rule)
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
            ordered = -np.sort(-logits[:, layer], axis=1)
            differs += int((np.abs(ordered[:, 1] - ordered[:, 2] - np.array(expected)) > 1e-3).sum())
    assert differs  # the logits' margin is not the decision margin here


def test_a_biased_routers_large_margin_flips_are_counted_on_its_decision_margin(routed_by_deepseek, tmp_path):
    model, requests, routing = routed_by_deepseek
    gates = [module for name, module in model.named_modules() if name.endswith("mlp.gate")]
    config = model.config
    engine, flipped, large = {}, 0, 0
    for (r, c), (ids, logits) in routing.items():
        ids = ids.copy()
        first = 0 if c == 0 else len(requests[r][0])
        for position in range(first, len(ids)):
            for layer, gate in enumerate(gates):
                if (position + 2 * layer + r) % 5:
                    continue
                chosen = ids[position, layer].copy()
                ids[position, layer, 1] = next(e for e in range(config.n_routed_experts) if e not in chosen)
                flipped += 1
                margin = brute_margin(logits[position, layer], chosen, gate.e_score_correction_bias.double().numpy(),
                                      config.n_group, config.topk_group)
                large += margin >= LARGE_SCORE_MARGIN
        engine[(r, c)] = ids
    report = run(model, requests, engine, tmp_path)
    assert report.margin_kind == "biased score" and report.trace.margin_kind == "biased score"
    assert report.trace.threshold == LARGE_SCORE_MARGIN == 0.25
    assert (report.trace.flips, report.trace.large_margin_flips) == (flipped, large)
    assert 0 < large < flipped
