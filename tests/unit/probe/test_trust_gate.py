"""The trust gate in every supported family.

Oracles: each router's own output (a rule at weight 1 must rebuild it bit for bit), the un-probed
model (an untouched gate changes no bit), what the experts module really received (a hook written
here), the model's output with the masked expert's weights replaced by NaN (a masked expert must
contribute nothing), and brute-force per-token re-routing loops over the router's raw scores.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moescope
from moescope import probe
from moescope.core.exporters import InMemoryExporter
from moescope.probe.adapters import experts_arguments
from moescope.probe.health_sampling import _expert_tensors
from moescope.probe.trust_gate import RULES, TrustGate, TrustGateError
from tests.support.zoo import FAMILIES, tiny_model

# DeepSeek-V3 routes by scores plus a correction bias: a non-zero one makes the final choice differ from a
# top-k of the scores, and the probe must record what the experts really got.
CORRECTION_BIAS = {"deepseek_v3": 0.2}

torch.set_num_threads(1)
BATCH, SEQ = 3, 7


# Families the gate cannot mask cleanly, and what it does there instead (see probe/trust_gate.py):
UNGATEABLE = {"jetmoe", "nllb_moe"}  # no (states, ids, weights) experts module and no rule: set() refuses


def _inputs(family: str, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=g)
    if family in ("switch_transformers", "nllb_moe"):
        return dict(input_ids=ids, decoder_input_ids=torch.randint(0, 128, (BATCH, SEQ), generator=g))
    return dict(input_ids=ids)




def _logits(output) -> torch.Tensor:
    return output.logits


def _busiest_expert(model, family: str) -> int:
    memory = InMemoryExporter()
    with probe.attach(model, exporters=[memory]) as session, torch.no_grad():
        model(**_inputs(family))
        session.flush()
    return int(np.argmax(memory.records[0].layers[0].expert_load[: session.layers[0].num_experts]))


def _poison(layer, expert: int, value: float = float("nan")) -> None:
    with torch.no_grad():
        for param, row in _expert_tensors(layer)[expert]:
            (param.view(-1) if row is None else param.view(layer.num_experts, -1)[row]).fill_(value)


@pytest.mark.parametrize("family", sorted(f for f in FAMILIES if f in RULES))
def test_rule_rebuilds_the_router_output_at_weight_one(family):
    model = tiny_model(family, correction_bias=CORRECTION_BIAS.get(family))
    layers = probe.find_moe_layers(model)
    gate = TrustGate(layers)
    seen = {}
    handles = [layer.router.register_forward_hook(lambda m, a, o, i=layer.index: seen.__setitem__(i, (a, o)))
               for layer in layers]
    with torch.no_grad():
        model(**_inputs(family))
    for handle in handles:
        handle.remove()
    for layer in layers:
        args, output = seen[layer.index]
        rebuilt = RULES[layer.family](layer.router, args, output, gate._states[layer.index])
        expected = output if isinstance(output, tuple) else (output,)
        got = rebuilt if isinstance(rebuilt, tuple) else (rebuilt,)
        assert len(got) == len(expected)
        for a, b in zip(expected, got):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - UNGATEABLE))
def test_untouched_gate_changes_no_bit(family):
    model = tiny_model(family, correction_bias=CORRECTION_BIAS.get(family))
    inputs = _inputs(family)
    expert = _busiest_expert(model, family)
    with torch.no_grad():
        bare = _logits(model(**inputs))
        with moescope.attach(model, trust_gate="manual") as session:
            assert session.gate is not None
            untouched = _logits(model(**inputs))
            session.trust.override(0, expert, 0.5, "test")
            touched = _logits(model(**inputs))
            session.trust.release(0, expert)
            released = _logits(model(**inputs))
        after = _logits(model(**inputs))
    assert torch.equal(bare, untouched) and torch.equal(bare, released) and torch.equal(bare, after)
    assert not torch.equal(bare, touched)  # the gate did act in between: the comparison can fail


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - UNGATEABLE))
def test_masked_expert_contributes_nothing(family):
    model = tiny_model(family, correction_bias=CORRECTION_BIAS.get(family))
    inputs = _inputs(family)
    expert = _busiest_expert(model, family)
    layer = probe.find_moe_layers(model)[0]
    received = []

    def experts_seen(module, args, kwargs):
        if family == "switch_transformers":
            received.append(experts_arguments(args, kwargs)[0].reshape(-1, layer.num_experts)[:, expert].sum())
        else:
            received.append((experts_arguments(args, kwargs)[0] == expert).sum())

    def router_seen(module, args, output):  # Llama4's experts see dense scores, not ids
        received.append((output[0][:, expert] != 0).sum())

    with moescope.attach(model, trust_gate="manual", layers=layer.name) as session, torch.no_grad():
        if family in ("llama4",):
            handle = layer.router.register_forward_hook(router_seen)  # after the gate's prepended hook
        else:
            handle = layer.experts.register_forward_pre_hook(experts_seen, with_kwargs=True)
        session.trust.override(0, expert, 0.0, "test: mask")
        masked = _logits(model(**inputs))
        handle.remove()
        _poison(layer, expert)
        poisoned = _logits(model(**inputs))
        session.trust.release(0, expert)
        released = _logits(model(**inputs))
    assert received and all(int(count) == 0 for count in received)
    assert torch.isfinite(masked).all()
    assert torch.equal(masked, poisoned)  # whatever the expert's weights, the output does not move
    assert not torch.isfinite(released).all()  # un-masked, the poisoned expert does reach the output


@pytest.mark.parametrize("family", sorted(UNGATEABLE))
def test_families_the_gate_cannot_reach_say_so(family):
    model = tiny_model(family, correction_bias=CORRECTION_BIAS.get(family))
    with moescope.attach(model, trust_gate="manual") as session:
        assert session.gate.mechanism(0) is None
        with pytest.raises(TrustGateError, match="cannot be gated"):
            session.trust.override(0, 0, 0.0, "test")


def _raw_logits(model, family: str, layer) -> torch.Tensor:
    """The router's own logits, ungated, (tokens, E)."""
    seen = {}
    handle = layer.router.register_forward_hook(lambda m, a, o: seen.update(out=o))
    with torch.no_grad():
        model(**_inputs(family))
    handle.remove()
    out = seen["out"]
    logits = {"llama4": lambda: out[1], "dbrx": lambda: out, "switch_transformers": lambda: out[2]}.get(
        family, lambda: out[0])()
    return logits.reshape(-1, logits.shape[-1])


def _what_the_experts_got(model, family: str, layer) -> dict[str, np.ndarray]:
    """What the experts really used in one forward: ids and weights per token (and, for Switch, whether
    the slot was kept; for Llama4, the dense scores that scale every expert's input)."""
    seen = {}
    if family in ("llama4", "switch_transformers"):  # the choice lives in the router's output
        handle = layer.router.register_forward_hook(lambda m, a, o: seen.update(out=o))
    else:  # registered after the gate's prepended hook: sees the arguments the experts are called with
        handle = layer.experts.register_forward_pre_hook(
            lambda m, a, kw: seen.update(out=experts_arguments(a, kw)), with_kwargs=True)
    with torch.no_grad():
        model(**_inputs(family))
    handle.remove()
    out = seen["out"]
    if family == "llama4":
        return {"scores": out[0].double().numpy()}
    if family == "switch_transformers":
        mask, probs, logits = out
        ids = logits.reshape(-1, logits.shape[-1]).argmax(-1, keepdim=True)
        return {"ids": ids.numpy(), "weights": probs.reshape(-1, 1).double().numpy(),
                "kept": mask.reshape(-1, mask.shape[-1]).gather(1, ids).numpy() > 0}
    ids, weights = out
    return {"ids": ids.reshape(-1, ids.shape[-1]).numpy(), "weights": weights.reshape(ids.shape).double().numpy()}


def _softmax(values: list[float]) -> list[float]:
    top = max(v for v in values if v != float("-inf"))
    exps = [0.0 if v == float("-inf") else float(np.exp(v - top)) for v in values]
    return [x / sum(exps) for x in exps]


def _sparsemixer(scores: list[float], eps: float) -> tuple[list[int], list[float]]:
    """PhiMoE's eval-mode choice, token by token: the best expert, weighted by a softmax over the
    experts within 2*eps (relative) of it; then the best of the rest, the same way without the first."""
    ids, weights = [], []
    masked = list(scores)
    for _ in range(2):
        best = max(range(len(masked)), key=lambda e: masked[e])
        top = masked[best]
        kept = [masked[e] if masked[e] != float("-inf") and (top - scores[e]) / max(abs(scores[e]), top) <= 2 * eps
                else float("-inf") for e in range(len(scores))]
        ids.append(best)
        weights.append(_softmax(kept)[best])
        masked[best] = float("-inf")
    return ids, weights


def _brute_force(family: str, layer, logits: torch.Tensor, expert: int, weight: float) -> dict[str, np.ndarray]:
    """Per token, the family's own routing rule (transformers' modeling code, rewritten as loops)
    with expert `expert`'s score scaled by `weight`: its probability for softmax routers (the rest
    renormalise), its sigmoid score for sigmoid routers, its logit by log(weight) where the choice
    is a top-k of logits; at 0 the expert is never chosen."""
    router, k, experts = layer.router, layer.top_k, layer.num_experts
    log_w = np.log(weight) if weight > 0 else float("-inf")
    ids, weights, scores = [], [], []
    for row in logits.double().tolist():
        gated = [v + (log_w if e == expert else 0.0) for e, v in enumerate(row)]
        if family in ("gpt_oss", "granitemoe"):  # top-k of the logits, softmax over the k
            chosen = sorted(range(experts), key=lambda e: gated[e], reverse=True)[:k]
            ids.append(chosen)
            weights.append(_softmax([gated[e] for e in chosen]))
        elif family == "llama4":  # top-k of the logits; sigmoid of the chosen raw logit, times w
            chosen = sorted(range(experts), key=lambda e: gated[e], reverse=True)[:k]
            scores.append([1 / (1 + np.exp(-row[e])) * (weight if e == expert else 1.0) if e in chosen else 0.0
                           for e in range(experts)])
        elif family == "phimoe":
            chosen, values = _sparsemixer(gated, router.router_jitter_noise)
            ids.append(chosen)
            weights.append(values)
        elif family == "deepseek_v3":  # sigmoid * w; bias-corrected groups and top-k; renormalised, scaled
            score = [1 / (1 + np.exp(-v)) * (weight if e == expert else 1.0) for e, v in enumerate(row)]
            bias = router.e_score_correction_bias.double().tolist()
            allowed = [e for e in range(experts) if not (e == expert and weight == 0)]
            per = experts // router.num_group
            group_score = []
            for g in range(router.num_group):
                members = sorted((score[e] + bias[e] for e in allowed if e // per == g), reverse=True)[:2]
                members = members * 2 if len(members) == 1 else members  # a lone survivor counts twice
                group_score.append((sum(members) if members else float("-inf"), g))
            groups = {g for _, g in sorted(group_score, reverse=True)[: router.topk_group]}
            chosen = sorted(((score[e] + bias[e], e) for e in allowed if e // per in groups), reverse=True)[:k]
            total = sum(score[e] for _, e in chosen)
            ids.append([e for _, e in chosen])
            weights.append([score[e] / total * router.routed_scaling_factor for _, e in chosen])
        else:  # a softmax over all experts, then the family's top-k and normalisation
            p = _softmax(gated)
            if family == "deepseek_v2" and router.topk_method == "group_limited_greedy":
                per = experts // router.num_group
                best = sorted(range(router.num_group), key=lambda g: max(p[g * per:(g + 1) * per]), reverse=True)
                p = [v if e // per in best[: router.topk_group] else 0.0 for e, v in enumerate(p)]
            top = 1 if family == "switch_transformers" else k
            chosen = sorted((e for e in range(experts) if not (e == expert and weight == 0)),
                            key=lambda e: p[e], reverse=True)[:top]
            values = [p[e] for e in chosen]
            if family == "mixtral" or getattr(router, "norm_topk_prob", False):
                values = [v / sum(values) for v in values]
            elif family == "dbrx":
                norm = layer.block.moe_normalize_expert_weights
                values = [v / sum(abs(x) ** norm for x in values) ** (1 / norm) for v in values]
            elif family == "deepseek_v2":
                values = [v * router.routed_scaling_factor for v in values]
            ids.append(chosen)
            weights.append(values)
    if family == "llama4":
        return {"scores": np.array(scores)}
    result = {"ids": np.array(ids), "weights": np.array(weights)}
    if family == "switch_transformers":  # capacity per batch row, first come first served
        kept, taken = [], {}
        for token, (chosen,) in enumerate(ids):
            row = token // SEQ
            taken[(row, chosen)] = taken.get((row, chosen), 0) + 1
            kept.append([taken[(row, chosen)] <= router.expert_capacity])
        result["kept"] = np.array(kept)
    return result


# Every family with a re-routing rule, and variants of the rules' options: renormalised or not,
# group-limited, scaled.
RULE_CASES = [(family, {}) for family in sorted(set(FAMILIES) & set(RULES))] + [
    ("qwen3_moe", {"norm_topk_prob": True}), ("qwen2_moe", {"norm_topk_prob": True}),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                     "routed_scaling_factor": 2.0})]


def _case_id(case) -> str:
    family, overrides = case
    return family + "".join(f"-{k}={v}" for k, v in overrides.items() if k in ("norm_topk_prob", "topk_method"))


def test_every_family_with_a_rule_is_checked_against_the_brute_force_loop():
    assert {family for family, _ in RULE_CASES} == set(FAMILIES) & set(RULES)
    assert len({family for family, _ in RULE_CASES}) >= 13  # today's count: a family leaving RULES fails here


@pytest.mark.parametrize("weight", [0.0, 0.4])
@pytest.mark.parametrize("case", RULE_CASES, ids=_case_id)
def test_rerouting_matches_a_brute_force_loop(case, weight):
    family, overrides = case
    model = tiny_model(family, **overrides or {"correction_bias": CORRECTION_BIAS.get(family)})
    layer = probe.find_moe_layers(model)[0]
    raw_logits = _raw_logits(model, family, layer)
    expert = int(torch.topk(raw_logits, 1, dim=-1).indices.flatten().mode().values)  # often the first choice
    before = _what_the_experts_got(model, family, layer)
    gate = TrustGate([layer])
    handles = gate.install()
    gate.set(0, expert, weight, "test")
    got = _what_the_experts_got(model, family, layer)
    for handle in handles:
        handle.remove()
    want = _brute_force(family, layer, raw_logits, expert, weight)
    if family == "llama4":
        np.testing.assert_allclose(got["scores"], want["scores"], rtol=1e-6, atol=1e-7)
        assert not np.array_equal(got["scores"], before["scores"])  # the gate changed something
        return
    order_got, order_want = np.argsort(got["ids"], axis=1), np.argsort(want["ids"], axis=1)
    np.testing.assert_array_equal(np.take_along_axis(got["ids"], order_got, 1),
                                  np.take_along_axis(want["ids"], order_want, 1))
    np.testing.assert_allclose(np.take_along_axis(got["weights"], order_got, 1),
                               np.take_along_axis(want["weights"], order_want, 1), rtol=1e-5, atol=1e-7)
    if "kept" in want:
        np.testing.assert_array_equal(got["kept"], want["kept"])
    # the comparison can fail: the gate moved tokens or changed their weights
    assert not (np.array_equal(got["ids"], before["ids"]) and np.allclose(got["weights"], before["weights"]))
    if weight == 0:
        assert (got["ids"] != expert).all()
        assert (before["ids"] == expert).any()  # some tokens did move


FALLBACK = sorted(set(FAMILIES) - set(RULES) - UNGATEABLE)


@pytest.mark.parametrize("weight", [0.0, 0.4])
@pytest.mark.parametrize("family", FALLBACK)
def test_families_without_a_rule_get_their_weights_scaled_not_rerouted(family, weight):
    """The fallback (probe/trust_gate.py): the ids the experts receive stay the router's; the gated expert's
    weight is multiplied by w, nothing renormalises; at 0 its slot points, at weight 0, at an expert
    the token already uses (else the first unmasked one)."""
    model = tiny_model(family, correction_bias=CORRECTION_BIAS.get(family))
    layer = probe.find_moe_layers(model)[0]
    gate = TrustGate([layer])
    assert gate.mechanism(0) == "remove"
    before = _what_the_experts_got(model, family, layer)
    expert = int(np.bincount(before["ids"][before["ids"] < layer.num_experts].ravel()).argmax())
    handles = gate.install()
    gate.set(0, expert, weight, "test")
    got = _what_the_experts_got(model, family, layer)
    for handle in handles:
        handle.remove()
    want_ids, want_weights = before["ids"].copy(), before["weights"].copy()
    for t, row in enumerate(before["ids"]):
        for s, e in enumerate(row):
            if e != expert:
                continue
            if weight == 0:
                others = [x for x in row if x != expert and x < layer.num_experts]  # not a zero expert
                want_ids[t, s] = others[0] if others else next(x for x in range(layer.num_experts) if x != expert)
                want_weights[t, s] = 0.0
            else:
                want_weights[t, s] = float(np.float32(before["weights"][t, s]) * np.float32(weight))
    np.testing.assert_array_equal(got["ids"], want_ids)
    np.testing.assert_allclose(got["weights"], want_weights, rtol=1e-6, atol=0)
    assert (before["ids"] == expert).any()  # the gated expert was in use: the comparison can fail


def test_gate_api_checks_its_input():
    model = tiny_model("mixtral", correction_bias=CORRECTION_BIAS.get("mixtral"))
    layers = probe.find_moe_layers(model)
    gate = TrustGate(layers)
    changes = []
    gate.listeners.append(changes.append)
    with pytest.raises(TrustGateError, match=r"\[0, 1\]"):
        gate.set(0, 0, 1.5, "too much")
    with pytest.raises(TrustGateError, match="experts 0..7"):
        gate.set(0, 8, 0.0, "no such expert")
    with pytest.raises(TrustGateError, match="no MoE layer 9"):
        gate.set(9, 0, 0.0, "no such layer")
    for expert in range(6):
        gate.set(0, expert, 0.0, "mask")
    with pytest.raises(TrustGateError, match="fewer than its k=2"):
        gate.set(0, 6, 0.0, "one too many")
    assert gate.set(0, 0, 0.0, "again") is None  # no change, no event
    assert len(changes) == 6 and changes[0].old_weight == 1.0 and changes[0].new_weight == 0.0
    assert gate.weights(0).tolist() == [0.0] * 6 + [1.0, 1.0]
    assert len(gate.reset()) == 6 and (gate.weights(0) == 1).all()
