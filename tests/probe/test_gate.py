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

import probe
from probe.adapters import experts_arguments
from probe.gate import RULES, TrustGate, TrustGateError
from probe.health import _expert_tensors
from probe.zoo import FAMILIES, tiny_model
from store import InMemoryExporter

torch.set_num_threads(1)
BATCH, SEQ = 3, 7


# Families the gate cannot mask cleanly, and what it does there instead (see probe/gate.py):
UNGATEABLE = {"jetmoe", "nllb_moe"}  # no (states, ids, weights) experts module and no rule: set() refuses


def _inputs(family: str, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=g)
    if family in ("switch_transformers", "nllb_moe"):
        return dict(input_ids=ids, decoder_input_ids=torch.randint(0, 128, (BATCH, SEQ), generator=g))
    return dict(input_ids=ids)


def _model(family: str, seed: int = 0):
    model = tiny_model(family, seed=seed)
    if family == "deepseek_v3":  # a non-zero correction bias, so the choice is not a top-k of the scores
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.linspace(-0.2, 0.2, buffer.numel())[torch.randperm(buffer.numel())])
    return model


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
    model = _model(family)
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
    model = _model(family)
    inputs = _inputs(family)
    expert = _busiest_expert(model, family)
    with torch.no_grad():
        bare = _logits(model(**inputs))
        with probe.attach(model, trust_gate="manual") as session:
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
    model = _model(family)
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

    with probe.attach(model, trust_gate="manual", layers=layer.name) as session, torch.no_grad():
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
    with probe.attach(_model(family), trust_gate="manual") as session:
        assert session.gate.mechanism(0) is None
        with pytest.raises(TrustGateError, match="cannot be gated"):
            session.trust.override(0, 0, 0.0, "test")


def _router_io(model, family: str, layer) -> tuple[torch.Tensor, tuple]:
    seen = {}
    handle = layer.router.register_forward_hook(lambda m, a, o: seen.setdefault("out", o))
    with torch.no_grad():
        model(**_inputs(family))
    handle.remove()
    return seen["out"]


def _brute_force(family: str, router, logits: torch.Tensor, expert: int, weight: float):
    """Per token: the family's choice with expert `expert`'s score scaled by `weight` (0: excluded)."""
    ids, weights = [], []
    k = router.top_k
    for row in logits.double():
        if family == "gpt_oss":
            gated = [(float(v) + (np.log(weight) if e == expert and weight > 0 else 0.0), e) for e, v in enumerate(row)
                     if not (e == expert and weight == 0)]
            chosen = sorted(gated, reverse=True)[:k]
            z = sum(np.exp(v) for v, _ in chosen)
            ids.append([e for _, e in chosen])
            weights.append([np.exp(v) / z for v, _ in chosen])
            continue
        if family == "deepseek_v3":
            score = [1 / (1 + np.exp(-float(v))) * (weight if e == expert else 1.0) for e, v in enumerate(row)]
            bias = router.e_score_correction_bias.double().tolist()
            allowed = [e for e in range(len(score)) if not (e == expert and weight == 0)]
            per = router.num_experts // router.num_group
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
            continue
        p = np.exp(row.numpy() - row.numpy().max())
        p = p / p.sum()
        p[expert] *= weight
        p = p / p.sum()  # the softmax over all experts, with the expert's probability scaled by w
        chosen = sorted(((p[e], e) for e in range(len(p)) if not (e == expert and weight == 0)), reverse=True)[:k]
        renorm = family == "mixtral" or router.norm_topk_prob
        total = sum(v for v, _ in chosen) if renorm else 1.0
        ids.append([e for _, e in chosen])
        weights.append([v / total for v, _ in chosen])
    return np.array(ids), np.array(weights)


@pytest.mark.parametrize("family,weight", [("mixtral", 0.0), ("mixtral", 0.3), ("qwen3_moe", 0.0),
                                           ("qwen3_moe", 0.6), ("qwen2_moe", 0.0), ("gpt_oss", 0.0), ("gpt_oss", 0.5),
                                           ("deepseek_v3", 0.0), ("deepseek_v3", 0.4)])
def test_rerouting_matches_a_brute_force_loop(family, weight):
    # one family renormalising its top-k, one not
    model = tiny_model(family, norm_topk_prob=True) if family == "qwen3_moe" else _model(family)
    layer = probe.find_moe_layers(model)[0]
    raw_logits = _router_io(model, family, layer)[0]
    expert = int(torch.topk(raw_logits, 1, dim=-1).indices.flatten().mode().values)  # often the first choice
    gate = TrustGate([layer])
    handles = gate.install()
    gate.set(0, expert, weight, "test")
    gated = _router_io(model, family, layer)
    for handle in handles:
        handle.remove()
    want_ids, want_weights = _brute_force(family, layer.router, raw_logits, expert, weight)
    got_ids, got_weights = gated[2].numpy(), gated[1].double().numpy()
    order_got, order_want = np.argsort(got_ids, axis=1), np.argsort(want_ids, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(got_ids, order_got, 1), np.take_along_axis(want_ids, order_want, 1))
    np.testing.assert_allclose(np.take_along_axis(got_weights, order_got, 1),
                               np.take_along_axis(want_weights, order_want, 1), rtol=1e-5, atol=1e-7)
    if weight == 0:
        assert (got_ids != expert).all()
        assert (raw_logits.topk(layer.top_k, dim=-1).indices == expert).any()  # some tokens did move


def test_gate_api_checks_its_input():
    model = _model("mixtral")
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
