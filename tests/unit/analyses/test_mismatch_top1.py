"""The engine-vs-reference check's top-1 and top-k margin on a router whose chosen experts are not in
score order, and whose choice is not made on its logits.

DeepSeek-V3's router takes its top-k with `torch.topk(..., sorted=False)` over sigmoid(logit) plus a
correction bias within its best groups, and so do the engines: vLLM's grouped and biased top-k call
`torch.topk(..., sorted=VLLM_BATCH_INVARIANT)` (off by default), SGLang's biased grouped top-k sorts
only with fused shared experts. Neither side's slot 0 is its top-1, so the check compares the
engine's chosen expert of highest reference logit; a Mixtral engine's top-k is sorted, and its slot 0
stays its top-1.

The references are a tiny DeepSeek-V3 (random-initialised, with a non-zero correction bias) and a
tiny DeepSeek-V2 with group-limited greedy routing, and the "engine" the same model's own router
outputs, read by hooks of the test's on each gate, written in vLLM's response format with the slots
permuted on a known set of pairs. The margin's oracle is the router re-derived as transformers
writes it (checked against the router's own chosen ids) and a brute force over its two decisions:
within the kept groups, and every exchange of a kept and a dropped group.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moescope.analyses.mismatch import mismatch
from moescope.analyses.routing_compare import decision_margin, margins, router_rule
from moescope.analyses.trace_check import LARGE_MARGIN, LARGE_SCORE_MARGIN
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
    """A tiny DeepSeek-V3 with a correction bias, its router weights scaled up so that its sigmoid
    scores spread as much as the bias does and its margins over the large-margin threshold."""
    model = tiny_model("deepseek_v3", correction_bias=0.3)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.weight.mul_(10.0)
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


def grouped_choice(score: list[float], groups: int, kept: int, k: int, group_of) -> tuple[list[int], list[int]]:
    """A grouped router as transformers writes it (DeepSeek-V2's `group_limited_greedy`, DeepSeek-V3's
    biased top-k): the `kept` groups of best `group_of(their scores)`, then the k best scores among
    their experts. Returns (kept groups, chosen experts), each sorted."""
    size = len(score) // groups
    best = sorted(sorted(range(groups), key=lambda g: -group_of(score[g * size:(g + 1) * size]))[:kept])
    return best, chosen_among(score, best, size, k)


def chosen_among(score: list[float], kept, size: int, k: int) -> list[int]:
    candidates = [e for g in kept for e in range(g * size, (g + 1) * size)]
    return sorted(sorted(candidates, key=lambda e: -score[e])[:k])


def brute_grouped_margin(score: list[float], chosen: np.ndarray, groups: int, kept: int, group_of) -> float:
    """One token's decision margin by brute force over the router's two decisions: within the kept
    groups, the weakest chosen score minus the best unchosen one; between groups, for every kept group
    and every dropped one whose exchange changes the chosen experts, the gap of their group scores."""
    k = len(chosen)
    size = len(score) // groups
    best, mine = grouped_choice(score, groups, kept, k, group_of)
    assert mine == sorted(chosen.tolist())  # the router chose what this re-derivation chooses
    candidates = [e for g in best for e in range(g * size, (g + 1) * size)]
    rest = [score[e] for e in candidates if e not in mine]
    margin = min(score[e] for e in mine) - max(rest) if rest else float("inf")
    group = [group_of(score[g * size:(g + 1) * size]) for g in range(groups)]
    for g in best:
        for h in (h for h in range(groups) if h not in best):
            if chosen_among(score, [h if x == g else x for x in best], size, k) != mine:
                margin = min(margin, group[g] - group[h])
    return margin


def brute_margin(logits: np.ndarray, chosen: np.ndarray, bias: np.ndarray, groups: int, kept: int) -> float:
    """DeepSeek-V3's decision margin by brute force: biased scores sigmoid(logit) + bias, groups ranked
    by the sum of their two best."""
    score = [1 / (1 + np.exp(-x)) + b for x, b in zip(logits.tolist(), bias.tolist())]
    return brute_grouped_margin(score, chosen, groups, kept, lambda s: sum(sorted(s, reverse=True)[:2]))


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


def top2_probability(log_probability: list[float]) -> float:
    """Mistral 4's group score, the sum of its two best probabilities, as a log."""
    return float(np.logaddexp(*sorted(log_probability, reverse=True)[:2]))


# the softmax routers that choose within groups: (family, topk_method, the group score on log-probabilities)
SOFTMAX_GROUPED = {"deepseek_v2": ("group_limited_greedy", max, "max"),
                   "mistral4": (None, top2_probability, "top2")}


@pytest.fixture(scope="module", params=sorted(SOFTMAX_GROUPED))
def routed_by_grouped_softmax(request):
    """A tiny group-limited softmax router (DeepSeek-V2's group-limited greedy, which ranks a group by
    its best probability; Mistral 4's, by its two best): 16 experts in 4 groups, the best 2 kept, top-4
    (more experts chosen than groups kept, as DeepSeek-V2's 6 of 3 groups, so a dropped group's second
    expert can outscore a chosen one), its router weights scaled up so that its margins spread over
    the large-margin threshold."""
    family = request.param
    method = SOFTMAX_GROUPED[family][0]
    model = tiny_model(family, n_group=4, topk_group=2, n_routed_experts=16, num_experts_per_tok=4,
                       **({"topk_method": method} if method else {}))
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.weight.mul_(40.0)
    requests = token_sequences(seed=3, prompts=3)
    keys = [(r, c) for r, (_, gens) in enumerate(requests) for c in range(len(gens))]
    routing = {key: own_routing(model, fed(requests[key[0]][0], requests[key[0]][1][key[1]])) for key in keys}
    return family, model, requests, routing


def log_probabilities(logits: np.ndarray) -> list[float]:
    shifted = np.exp(logits - logits.max())
    return [float(np.log(p)) for p in (shifted / shifted.sum()).tolist()]


def softmax_margin(family: str, logits: np.ndarray, chosen: np.ndarray, groups: int, kept: int) -> float:
    """A softmax router's grouped decision margin by brute force, in logits: the router ranks groups and
    chooses on probabilities, and a gap of log-probabilities is one of logits."""
    return brute_grouped_margin(log_probabilities(logits), chosen, groups, kept, SOFTMAX_GROUPED[family][1])


def test_a_group_limited_softmax_routers_margin_is_taken_where_it_decides(routed_by_grouped_softmax):
    family, model, _, routing = routed_by_grouped_softmax
    gates = [module for name, module in model.named_modules() if name.endswith("mlp.gate")]
    config = model.config
    rules = [router_rule(gate) for gate in gates]
    assert all(rule.margin_kind == "logit" and not rule.ranked and rule.group_score == SOFTMAX_GROUPED[family][2]
               for rule in rules)
    differs = 0
    for ids, logits in routing.values():
        for layer, rule in enumerate(rules):
            expected = [softmax_margin(family, logits[t, layer], ids[t, layer], config.n_group, config.topk_group)
                        for t in range(len(ids))]
            got = decision_margin(logits[:, layer], config.num_experts_per_tok, rule)
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-9)
            differs += int((np.abs(margins(logits[:, layer], config.num_experts_per_tok)[0] - expected) > 1e-3).sum())
    assert differs  # the raw logits' margin is not the decision margin here


def test_a_flip_to_an_expert_of_a_dropped_group_is_no_near_tie_for_its_close_logit(routed_by_grouped_softmax,
                                                                                   tmp_path):
    """The engine swaps a chosen expert for the unchosen expert of closest logit: where that expert's
    group was dropped, the flip is large-margin by the router's decision though the logits are close."""
    family, model, requests, routing = routed_by_grouped_softmax
    config = model.config
    size = config.n_routed_experts // config.n_group
    engine, flipped, large, close_but_large = {}, 0, 0, 0
    for (r, c), (ids, logits) in routing.items():
        ids = ids.copy()
        first = 0 if c == 0 else len(requests[r][0])
        for position in range(first, len(ids)):
            for layer in range(ids.shape[1]):
                chosen = ids[position, layer].copy()
                row = logits[position, layer]
                weakest = chosen[np.argmin(row[chosen])]
                unchosen = [e for e in range(config.n_routed_experts) if e not in chosen]
                closest = min(unchosen, key=lambda e: row[weakest] - row[e])
                ids[position, layer, list(chosen).index(weakest)] = closest
                flipped += 1
                margin = softmax_margin(family, row, chosen, config.n_group, config.topk_group)
                large += margin >= LARGE_MARGIN
                kept = grouped_choice(log_probabilities(row), config.n_group, config.topk_group, len(chosen),
                                      SOFTMAX_GROUPED[family][1])[0]
                close_but_large += (margin >= LARGE_MARGIN and row[weakest] - row[closest] < LARGE_MARGIN
                                    and closest // size not in kept)
        engine[(r, c)] = ids
    report = run(model, requests, engine, tmp_path)
    assert report.margin_kind == "logit" and report.trace.threshold == LARGE_MARGIN
    assert (report.trace.flips, report.trace.large_margin_flips) == (flipped, large)
    assert 0 < large < flipped and close_but_large  # the raw logits would call these near-ties
