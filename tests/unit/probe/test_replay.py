"""Routing replay (probe/replay.py, `moescope.replay`) in every family it covers.

Oracles: the model's own forward (its own routing, read here from what its experts module or router
really passed, replayed must give the same logits and loss bit for bit), a brute-force forward
whose routing step is replaced by per-token loops written from transformers' modeling code (the
forced experts, their weights by the family's rule over the router's raw logits), central finite
differences of the loss (float64) for the gradient through the gate weights, and a count of
router calls (bad input fails before the forward runs).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import moescope
from moescope import probe
from moescope.core.exporters import InMemoryExporter
from moescope.probe.adapters import experts_arguments
from moescope.probe.replay import ReplayError
from moescope.probe.trust_gate import RULES
from tests.support.zoo import FAMILIES, tiny_model

torch.set_num_threads(1)
BATCH, SEQ = 2, 6
CORRECTION_BIAS = {"deepseek_v3": 0.2}  # the final choice is not a top-k of the scores
COVERED = sorted(set(FAMILIES) & set(RULES))
ROUTER_CHOICE = ("llama4", "switch_transformers")  # the experts never see ids: the choice is the router's


def _inputs(family: str, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=g)
    inputs = dict(input_ids=ids, labels=ids)
    if family == "switch_transformers":
        inputs["decoder_input_ids"] = torch.randint(0, 128, (BATCH, SEQ), generator=g)
    return inputs


def _model(family: str, **overrides):
    return tiny_model(family, **overrides or {"correction_bias": CORRECTION_BIAS.get(family)})


def _own_routing(model, family: str, inputs: dict) -> tuple[np.ndarray, dict[int, torch.Tensor]]:
    """The experts each token went to, per MoE layer, as transformers passed them: the experts module's
    ids argument, or (Llama4, Switch) the router's own top-k / argmax of its logits. Also the raw logits."""
    layers = probe.find_moe_layers(model)
    ids: dict[int, torch.Tensor] = {}
    logits: dict[int, torch.Tensor] = {}
    handles = []
    for layer in layers:
        def router(m, a, o, i=layer.index, k=layer.top_k):
            raw = {"llama4": lambda: o[1], "switch_transformers": lambda: o[2], "dbrx": lambda: o}.get(
                family, lambda: o[0])()
            logits[i] = raw.reshape(-1, raw.shape[-1]).detach().clone()
            if family in ROUTER_CHOICE:
                ids[i] = torch.topk(logits[i], k, dim=-1).indices
        handles.append(layer.router.register_forward_hook(router))
        if family not in ROUTER_CHOICE:
            handles.append(layer.experts.register_forward_pre_hook(
                lambda m, a, kw, i=layer.index, k=layer.top_k: ids.__setitem__(
                    i, experts_arguments(a, kw)[0].reshape(-1, k).clone()), with_kwargs=True))
    with torch.no_grad():
        model(**inputs)
    for handle in handles:
        handle.remove()
    routes = np.stack([ids[i].reshape(BATCH, SEQ, -1).numpy() for i in range(len(layers))], axis=2)
    return routes, logits


def _other_routing(model, seed: int = 3) -> np.ndarray:
    layers = probe.find_moe_layers(model)
    g = torch.Generator().manual_seed(seed)
    return np.stack([np.stack([torch.randperm(layer.num_experts, generator=g)[: layer.top_k].numpy()
                               for _ in range(BATCH * SEQ)]).reshape(BATCH, SEQ, -1) for layer in layers], axis=2)


@pytest.mark.parametrize("family", COVERED)
def test_replaying_the_models_own_routing_changes_no_bit(family):
    model = _model(family)
    inputs = _inputs(family)
    routes, _ = _own_routing(model, family, inputs)
    with torch.no_grad():
        bare = model(**inputs)
        with moescope.replay(model, routes):
            replayed = model(**inputs)
        with moescope.replay(model, _other_routing(model)):
            other = model(**inputs)
        after = model(**inputs)
    assert torch.equal(bare.logits, replayed.logits) and torch.equal(bare.loss, replayed.loss)
    assert torch.equal(bare.logits, after.logits)  # the hooks are gone
    assert not torch.equal(bare.logits, other.logits)  # replay does act: the comparison can fail


def test_every_covered_family_is_checked():
    assert set(COVERED) == set(FAMILIES) & set(RULES) and len(COVERED) >= 13


def test_own_rows_of_minus_one_route_by_the_models_router():
    model = _model("deepseek_v3")
    inputs = _inputs("deepseek_v3")
    own, _ = _own_routing(model, "deepseek_v3", inputs)
    other = _other_routing(model)
    mixed = other.copy()
    mixed[0, 2:4] = -1  # the engine routed nothing for these tokens (in every layer)
    mixed[1, 5, 0] = -1  # ... or in one layer
    expected = other.copy()
    expected[0, 2:4] = own[0, 2:4]
    expected[1, 5, 0] = own[1, 5, 0]
    with torch.no_grad():
        with moescope.replay(model, mixed):
            got = model(**inputs).logits
        with moescope.replay(model, expected):
            want = model(**inputs).logits
    assert torch.equal(got, want)
    assert not np.array_equal(expected, other)


# -- another routing: a brute-force forward --------------------------------------------------------

def _softmax(values: list[float]) -> list[float]:
    top = max(v for v in values if v != -math.inf)
    exps = [0.0 if v == -math.inf else math.exp(v - top) for v in values]
    return [x / sum(exps) for x in exps]


def _phimoe_weight(scores: list[float], candidates: list[float], chosen: int, eps: float) -> float:
    """transformers' `sparsemixer` (eval), the chosen expert in place of the best: a softmax over the
    candidates within 2*eps (relative) of the chosen one's score, at the chosen."""
    top = candidates[chosen]
    kept = [c if (top - s) / max(abs(s), top) <= 2 * eps else -math.inf for s, c in zip(scores, candidates)]
    return _softmax(kept)[chosen]


def _hand_weights(family: str, layer, row: list[float], chosen: list[int]) -> list[float]:
    """The gate weights of the forced experts `chosen` for one token with router logits `row`: each
    family's rule from its transformers modeling code, as loops in float64."""
    router, block = layer.router, layer.block
    if family in ("gpt_oss", "granitemoe"):  # softmax over the chosen logits
        return _softmax([row[e] for e in chosen])
    if family == "phimoe":
        eps = router.router_jitter_noise
        first = _phimoe_weight(row, row, chosen[0], eps)
        without = [(-math.inf if e == chosen[0] else v) for e, v in enumerate(row)]
        return [first, _phimoe_weight(row, without, chosen[1], eps)]
    if family == "deepseek_v3":  # sigmoid scores, renormalised, scaled
        scores = [1 / (1 + math.exp(-row[e])) for e in chosen]
        if router.norm_topk_prob:
            scores = [s / (sum(scores) + 1e-20) for s in scores]
        return [s * router.routed_scaling_factor for s in scores]
    p = _softmax(row)  # a softmax over every expert
    values = [p[e] for e in chosen]
    if family == "mixtral" or getattr(router, "norm_topk_prob", False):
        values = [v / sum(values) for v in values]
    elif family == "dbrx":
        norm = block.moe_normalize_expert_weights
        values = [v / sum(abs(x) ** norm for x in values) ** (1 / norm) for v in values]
    elif family == "deepseek_v2":
        values = [v * router.routed_scaling_factor for v in values]
    return values


def _brute_force_forward(model, family: str, inputs: dict, forced: np.ndarray) -> torch.Tensor:
    """The model's forward with every MoE layer's routing step replaced by `_hand_weights` on the forced
    experts, handed to the experts as transformers' code hands them."""
    layers = probe.find_moe_layers(model)
    handles = []
    for layer in layers:
        chosen = forced[:, :, layer.index, :].reshape(-1, layer.top_k).tolist()

        def weights_of(raw: torch.Tensor, layer=layer, chosen=chosen) -> torch.Tensor:
            rows = raw.reshape(-1, raw.shape[-1]).double().tolist()
            return torch.tensor([_hand_weights(family, layer, row, ids) for row, ids in zip(rows, chosen)],
                                dtype=torch.float32)

        ids = torch.tensor(chosen)
        if family == "llama4":  # dense scores: sigmoid of the chosen raw logits, 0 elsewhere
            def router(m, a, o, ids=ids):
                scores = torch.zeros_like(o[1])
                for t, row in enumerate(ids.tolist()):
                    for e in row:
                        scores[t, e] = 1 / (1 + math.exp(-float(o[1][t, e])))
                return (scores, o[1])
            handles.append(layer.router.register_forward_hook(router))
        elif family == "switch_transformers":  # one-hot of the forced expert, capacity per batch row
            def router(m, a, o, ids=ids, layer=layer):
                logits = o[2]
                mask = torch.zeros_like(o[0])
                probs = torch.zeros(logits.shape[:-1] + (1,), dtype=logits.dtype)
                for b in range(logits.shape[0]):
                    taken: dict[int, int] = {}
                    for t in range(logits.shape[1]):
                        e = int(ids[b * logits.shape[1] + t, 0])
                        taken[e] = taken.get(e, 0) + 1
                        mask[b, t, e] = int(taken[e] <= m.expert_capacity)
                        probs[b, t, 0] = _softmax(logits[b, t].double().tolist())[e]
                return (mask, probs, logits)
            handles.append(layer.router.register_forward_hook(router))
        else:
            kept: dict[str, torch.Tensor] = {}
            handles.append(layer.router.register_forward_hook(lambda m, a, o, kept=kept: kept.update(
                logits=o if isinstance(o, torch.Tensor) else o[0])))

            def experts(m, a, kw, kept=kept, ids=ids, weights_of=weights_of):
                return (a[0], ids, weights_of(kept["logits"]).to(a[0].dtype), *a[3:]), kw
            handles.append(layer.experts.register_forward_pre_hook(experts, with_kwargs=True))
    try:
        with torch.no_grad():
            return model(**inputs).logits
    finally:
        for handle in handles:
            handle.remove()


# every family, and the rule options that change the weights: renormalised or not, group-limited, scaled
BRUTE_CASES = [(family, {}) for family in COVERED] + [
    ("qwen3_moe", {"norm_topk_prob": True}), ("qwen2_moe", {"norm_topk_prob": True}),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                     "routed_scaling_factor": 2.0})]


@pytest.mark.parametrize("case", BRUTE_CASES, ids=lambda c: c[0] + "".join(f"-{k}" for k in c[1]))
def test_replaying_another_routing_equals_a_brute_force_forward(case):
    family, overrides = case
    model = _model(family, **overrides)
    inputs = _inputs(family)
    forced = _other_routing(model)
    own, _ = _own_routing(model, family, inputs)
    assert not np.array_equal(np.sort(forced, -1), np.sort(own, -1))  # the routing does change
    with torch.no_grad(), moescope.replay(model, forced):
        got = model(**inputs).logits
    want = _brute_force_forward(model, family, inputs, forced)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(model(**inputs).logits, want, rtol=1e-4, atol=1e-4)  # plain forward differs


# -- the gradient through the gate weights ---------------------------------------------------------

# (family, finite-difference step, relative tolerance). GPT-OSS's router keeps the model's dtype: float64
# throughout, tight. Mixtral's, GraniteMoE's and DeepSeek-V3's take float32 logits or softmax whatever the
# model's dtype (their rule): a larger step and a tolerance at float32's rounding. The MoE block alone
# (transformers' RMS norms around it also compute in float32).
FD_CASES = [("gpt_oss", 1e-6, 1e-6), ("mixtral", 1e-3, 1e-2), ("granitemoe", 1e-3, 1e-2), ("deepseek_v3", 1e-3, 1e-2)]


@pytest.mark.parametrize("family, step, rel", FD_CASES)
def test_gradient_through_the_weights_equals_finite_differences(family, step, rel):
    """float64: d loss / d router weight of an MoE block under a forced routing, against central
    differences. The routing is fixed, so the loss is smooth in the router's weights; without replay the
    routing would move with them."""
    model = _model(family).double()
    model.set_experts_implementation("eager")
    layer = probe.find_moe_layers(model)[0]
    forced = _other_routing(model)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(BATCH, SEQ, model.config.hidden_size, generator=g, dtype=torch.float64)
    probe_vector = torch.randn(BATCH, SEQ, model.config.hidden_size, generator=g, dtype=torch.float64)
    weight = layer.router.weight

    def loss() -> torch.Tensor:
        with moescope.replay(model, forced):
            out = layer.block(hidden)
        out = out[0] if isinstance(out, tuple) else out
        return (out.reshape(probe_vector.shape) * probe_vector).sum()

    model.zero_grad()
    loss().backward()
    grad = weight.grad.detach().clone()
    assert grad.abs().max() > 1e-6  # gradients reach the router through the forced experts' weights
    for flat in torch.randperm(weight.numel(), generator=g)[:8].tolist():
        index = (flat // weight.shape[1], flat % weight.shape[1])
        with torch.no_grad():
            original = weight[index].item()
            weight[index] = original + step
            up = loss().item()
            weight[index] = original - step
            down = loss().item()
            weight[index] = original
        assert (up - down) / (2 * step) == pytest.approx(grad[index].item(), rel=rel, abs=rel * 1e-3)


# -- bad input: one clear line, before the forward -------------------------------------------------

def _calls(model) -> tuple[list[int], list]:
    count = [0]
    handles = [layer.router.register_forward_pre_hook(lambda m, a: count.__setitem__(0, count[0] + 1))
               for layer in probe.find_moe_layers(model)]
    return count, handles


def test_bad_routing_fails_before_the_forward_with_one_line():
    model = _model("mixtral")
    inputs = _inputs("mixtral")
    good, _ = _own_routing(model, "mixtral", inputs)
    count, handles = _calls(model)
    cases = {
        "layers, the model has 2 MoE layers": good[:, :, :1],
        "chooses top_k=2": good[..., :1],
        "out of range: the layer has experts 0..7": np.where(good == good[0, 0, 0, 0], 8, good),
        "repeats an expert within its top-k": np.concatenate([good[..., :1], good[..., :1]], axis=-1),
        "only partly routed": np.where(np.arange(2) == 0, -1, good),
        "must be shaped": good[0, 0],
        "integer expert ids": good.astype(np.float32),
    }
    for message, routes in cases.items():
        with pytest.raises(ReplayError, match=message) as error:
            with moescope.replay(model, routes):
                model(**inputs)
        assert "\n" not in str(error.value)
    with pytest.raises(ReplayError, match=r"\(batch, tokens\) = \(2, 5\), the replayed routing is \(2, 6\)"):
        with moescope.replay(model, good):
            model(**{k: v[:, :5] for k, v in inputs.items()})
    with pytest.raises(ReplayError, match=r"\(batch, tokens\) = \(2, 6\), the replayed routing is \(1, 6\)"):
        with moescope.replay(model, good[0]):
            model(**inputs)
    assert count[0] == 0  # no router ran
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("family", ["jetmoe", "qwen3_next"])
def test_a_family_without_a_rule_is_refused_by_name(family):
    model = tiny_model(family)
    layers = probe.find_moe_layers(model)
    routes = np.zeros((1, 4, len(layers), layers[0].top_k), dtype=np.int64)
    routes[..., 1:] = 1
    with pytest.raises(ReplayError, match=f"no rule for the {family} family"):
        with moescope.replay(model, routes):
            pass


# -- what the session records ------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["mixtral", "llama4", "switch_transformers", "dbrx"])
def test_the_session_records_the_forced_experts_tagged_replay(family):
    model = _model(family)
    inputs = _inputs(family)
    forced = _other_routing(model)
    memory = InMemoryExporter()
    with torch.no_grad(), moescope.attach(model, exporters=[memory], routes=True, window=1, replay=forced) as session:
        model(**inputs)
        session.flush()
    record = memory.records[0]
    assert record.tags["replay"] == "array"
    for layer in record.layers:
        got = layer.routes.expert_ids
        want = forced[:, :, layer.layer, :].reshape(-1, forced.shape[-1])
        if family == "switch_transformers":  # encoder and decoder both route BATCH x SEQ tokens
            kept = layer.routes.kept[:, 0]
            np.testing.assert_array_equal(got[kept], want[kept])
            assert kept.any()
        else:
            np.testing.assert_array_equal(got, want)
    with torch.no_grad():  # detached: the model routes itself again
        routes, _ = _own_routing(model, family, inputs)
    assert not np.array_equal(routes, forced)


def test_replay_inside_a_session_tags_the_block():
    model = _model("mixtral")
    inputs = _inputs("mixtral")
    forced = _other_routing(model)
    memory = InMemoryExporter()
    with torch.no_grad(), probe.attach(model, [memory], routes=True, window=1) as session:
        model(**inputs)
        with moescope.replay(model, forced, session=session):
            model(**inputs)
        session.flush()
    plain, replayed = memory.records[0], memory.records[-1]
    assert "replay" not in plain.tags and replayed.tags["replay"] == "array"
    np.testing.assert_array_equal(replayed.layers[1].routes.expert_ids, forced[:, :, 1].reshape(-1, 2))


def test_a_trust_gate_and_a_replay_are_not_both_taken():
    model = _model("mixtral")
    with pytest.raises(ValueError, match="not both"):
        moescope.attach(model, trust_gate="manual", replay=_other_routing(model))
