"""The probe's numbers against the model's own outputs, for every supported family.

Oracles: a plain hook written here on each router captures what the router really returned, a
hook on each experts module what the experts really received; `output_router_logits`, the
family's own `load_balancing_loss_func`, and brute-force loops over tokens.
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest
import torch

import probe
from probe.zoo import FAMILIES, tiny_model
from store import InMemoryExporter

BATCH, SEQ = 3, 7


def _inputs(family: str, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=g)
    if family == "switch_transformers":
        return dict(input_ids=ids, decoder_input_ids=torch.randint(0, 128, (BATCH, SEQ), generator=g))
    return dict(input_ids=ids)


def _model(family: str):
    model = tiny_model(family)
    if family == "deepseek_v3":
        # A non-zero correction bias makes the final choice differ from a top-k of the logits:
        # the probe must record what the experts really got, not what the logits suggest.
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.linspace(-0.5, 0.5, buffer.numel())[torch.randperm(buffer.numel())])
    return model


class _Oracle:
    """Independent capture: the raw router outputs and the raw experts inputs, per MoE layer."""

    def __init__(self, layers):
        self.router_out: dict[int, object] = {}
        self.experts_in: dict[int, tuple] = {}
        self.handles = []
        for layer in layers:
            self.handles.append(layer.router.register_forward_hook(
                lambda m, a, o, i=layer.index: self.router_out.__setitem__(i, o)))
            if layer.experts is not None:
                self.handles.append(layer.experts.register_forward_pre_hook(
                    lambda m, a, kw, i=layer.index: self.experts_in.__setitem__(i, (a, kw)), with_kwargs=True))

    def close(self):
        for h in self.handles:
            h.remove()


def _expected_choice(family: str, layer, oracle: _Oracle, model) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, weights, kept) the experts really used, read per family from the raw captures."""
    out = oracle.router_out[layer.index]
    if family == "llama4":
        scores, logits = out
        ids = torch.topk(logits, layer.top_k, dim=-1).indices
        return ids.numpy(), scores.gather(1, ids).numpy(), np.ones(ids.shape, bool)
    if family == "switch_transformers":
        mask, probs, logits = out
        mask = mask.reshape(-1, mask.shape[-1])
        ids = logits.reshape(-1, logits.shape[-1]).argmax(-1, keepdim=True)
        kept = mask.gather(1, ids) > 0
        return ids.numpy(), probs.reshape(-1, 1).numpy(), kept.numpy()
    if family == "dbrx":
        weights, ids = layer.block.route_tokens_to_experts(out)
        return ids.numpy(), weights.numpy(), np.ones(ids.shape, bool)
    # Every other family: the router returns (logits, weights, ids) and the experts got exactly those.
    _, weights, ids = out
    args, kwargs = oracle.experts_in[layer.index]
    assert torch.equal(args[1], ids) and torch.equal(args[2], weights)
    return ids.numpy(), weights.detach().numpy(), np.ones(ids.shape, bool)


def _model_router_logits(family: str, output) -> list[torch.Tensor]:
    if family == "switch_transformers":
        logits = list(output.encoder_router_logits) + list(output.decoder_router_logits)
    else:
        logits = list(output.router_logits)
    return [t.reshape(-1, t.shape[-1]) for t in logits if t is not None and t.numel()]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def recorded(request):
    family = request.param
    model = _model(family)
    memory = InMemoryExporter()
    session = probe.attach(model, exporters=[memory], routes=True, router_logits=True)
    oracle = _Oracle(session.layers)
    with torch.no_grad():
        output = model(**_inputs(family), output_router_logits=True)
    session.close()
    oracle.close()
    assert session.hook_errors == 0
    assert len(memory.records) == 1
    return family, model, session, oracle, output, memory.records[0]


def test_every_moe_layer_found(recorded):
    family, model, session, oracle, output, record = recorded
    assert len(session.layers) == len(_model_router_logits(family, output)) > 0
    assert [ls.layer for ls in record.layers] == list(range(len(session.layers)))


def test_ids_and_weights_are_what_the_experts_received(recorded):
    family, model, session, oracle, output, record = recorded
    for layer, ls in zip(session.layers, record.layers):
        ids, weights, kept = _expected_choice(family, layer, oracle, model)
        np.testing.assert_array_equal(ls.routes.expert_ids, ids)
        np.testing.assert_allclose(ls.routes.gate_weights, weights, rtol=0, atol=0)
        np.testing.assert_array_equal(ls.routes.kept, kept)


def test_logits_equal_output_router_logits(recorded):
    family, model, session, oracle, output, record = recorded
    for ls, expected in zip(record.layers, _model_router_logits(family, output)):
        np.testing.assert_array_equal(ls.router_logits.values, expected.float().numpy())
        np.testing.assert_array_equal(ls.router_logits.token, np.arange(expected.shape[0]))


def test_load_is_a_bincount_of_kept_ids(recorded):
    family, model, session, oracle, output, record = recorded
    for layer, ls in zip(session.layers, record.layers):
        ids, weights, kept = _expected_choice(family, layer, oracle, model)
        expected = np.bincount(ids[kept], minlength=layer.num_experts)
        np.testing.assert_array_equal(ls.expert_load, expected)
        gate_sum = np.zeros(layer.num_experts)
        for t in range(ids.shape[0]):
            for s in range(ids.shape[1]):
                if kept[t, s]:
                    gate_sum[ids[t, s]] += float(weights[t, s])
        np.testing.assert_allclose(ls.gate_weight_sum, gate_sum, rtol=1e-6, atol=1e-7)
        assert ls.dropped_tokens == int((~kept).all(axis=1).sum())


def test_entropy_and_margin_by_brute_force(recorded):
    family, model, session, oracle, output, record = recorded
    for ls, logits in zip(record.layers, _model_router_logits(family, output)):
        rows = logits.double().numpy()
        entropies, margins = [], []
        for row in rows:
            p = np.exp(row - row.max())
            p /= p.sum()
            entropies.append(-sum(x * np.log(x) for x in p if x > 0))
            top = sorted(p, reverse=True)
            margins.append(top[0] - top[1])
        assert ls.router_entropy_mean == pytest.approx(np.mean(entropies), rel=1e-5)
        assert ls.router_entropy_p95 == pytest.approx(np.percentile(entropies, 95), rel=1e-5)
        assert ls.top1_margin_mean == pytest.approx(np.mean(margins), rel=1e-5, abs=1e-7)


def test_coselection_counts_pairs(recorded):
    family, model, session, oracle, output, record = recorded
    for layer, ls in zip(session.layers, record.layers):
        if layer.top_k < 2:
            assert ls.coselection is None
            continue
        ids, _, kept = _expected_choice(family, layer, oracle, model)
        expected = np.zeros((layer.num_experts, layer.num_experts), dtype=np.int64)
        for row, keep in zip(ids, kept):
            chosen = [e for e, k in zip(row, keep) if k]
            for i in chosen:
                for j in chosen:
                    expected[i, j] += 1
        np.testing.assert_array_equal(ls.coselection, expected)


def test_load_balancing_loss_matches_transformers(recorded):
    family, model, session, oracle, output, record = recorded
    modeling = importlib.import_module(type(model).__module__)
    loss_func = getattr(modeling, "load_balancing_loss_func", None)
    if loss_func is None or "gate_logits" not in inspect.signature(loss_func).parameters:
        pytest.skip(f"{family} has no top-k load_balancing_loss_func in transformers")
    if family == "deepseek_v3":
        pytest.skip("DeepSeek-V3 chooses with a bias; its loss function does not describe the choice")
    layer = session.layers[0]
    expected = loss_func(tuple(_model_router_logits(family, output)), layer.num_experts, layer.top_k)
    # From the records alone: loss = E * sum_e f_e * P_e, where f_e is the share of all
    # (token, slot) assignments over all layers and P_e the mean router probability.
    load = sum(ls.expert_load for ls in record.layers).astype(np.float64)
    prob = sum(ls.router_prob_sum for ls in record.layers)
    tokens = sum(ls.tokens for ls in record.layers)
    recomputed = layer.num_experts * float(np.sum(load / tokens * prob / tokens))
    assert recomputed == pytest.approx(float(expected), rel=1e-5)


def test_active_parameter_fraction_counted_by_hand(recorded):
    family, model, session, oracle, output, record = recorded
    total = sum(p.numel() for p in model.parameters())
    # Every parameter outside the routed experts counts for every token; an expert's parameters
    # count for a token only when it processed that token.
    expert_params = {layer.index: [sum(p.numel() for p in layer.experts.parameters()) / layer.num_experts]
                     for layer in session.layers}
    shared = total - sum(v[0] * layer.num_experts for layer, v in zip(session.layers, expert_params.values()))
    per_token = float(shared)
    for layer in session.layers:
        ids, _, kept = _expected_choice(family, layer, oracle, model)
        used = [sum(1 for e, k in zip(row, keep) if k and e < layer.num_experts) for row, keep in zip(ids, kept)]
        per_token += np.mean(used) * expert_params[layer.index][0]
    assert record.total_params == total
    assert record.active_params == pytest.approx(per_token, rel=1e-9)
    assert record.active_param_fraction == pytest.approx(per_token / total, rel=1e-9)
    assert 0 < record.active_param_fraction < 1


def test_route_rows_map_to_batch_rows(recorded):
    family, model, session, oracle, output, record = recorded
    inputs = _inputs(family)
    for layer, ls in zip(session.layers, record.layers):
        key = "decoder_input_ids" if "decoder" in layer.name else "input_ids"
        ids = inputs[key]
        np.testing.assert_array_equal(ls.routes.token_ids, ids.reshape(-1).numpy())
        t = np.arange(BATCH * SEQ)
        np.testing.assert_array_equal(ls.routes.sequence, t // SEQ)
        np.testing.assert_array_equal(ls.routes.position, t % SEQ)
    assert record.tokens == BATCH * SEQ and record.batch_size == BATCH and record.seq_len == SEQ


def test_deepseek_v3_records_the_biased_choice_not_the_logit_topk():
    model = _model("deepseek_v3")
    memory = InMemoryExporter()
    with probe.attach(model, exporters=[memory], routes=True) as session:
        with torch.no_grad():
            output = model(**_inputs("deepseek_v3"), output_router_logits=True)
    logits = _model_router_logits("deepseek_v3", output)
    differs = False
    for ls, lg in zip(memory.records[0].layers, logits):
        naive = torch.topk(lg.sigmoid(), 2, dim=-1).indices.sort(-1).values.numpy()
        differs |= not np.array_equal(np.sort(ls.routes.expert_ids, -1), naive)
    assert differs, "bias correction should change some choices; the test would not tell otherwise"


def test_switch_capacity_drops_counted_by_brute_force():
    model = tiny_model("switch_transformers", expert_capacity=2)
    memory = InMemoryExporter()
    inputs = _inputs("switch_transformers")
    with probe.attach(model, exporters=[memory], routes=True, router_logits=True) as session:
        with torch.no_grad():
            model(**inputs)
    for layer, ls in zip(session.layers, memory.records[0].layers):
        first_choice = ls.router_logits.values.argmax(-1).reshape(BATCH, SEQ)
        dropped = 0
        load = np.zeros(layer.num_experts, dtype=int)
        for row in first_choice:  # capacity is per sequence: first come, first served
            seen = np.zeros(layer.num_experts, dtype=int)
            for expert in row:
                seen[expert] += 1
                if seen[expert] > 2:
                    dropped += 1
                else:
                    load[expert] += 1
        assert ls.dropped_tokens == dropped
        np.testing.assert_array_equal(ls.expert_load, load)
        assert ls.capacity == 2 * BATCH
        assert ls.capacity_use == pytest.approx(load.max() / (2 * BATCH))
    assert sum(ls.dropped_tokens for ls in memory.records[0].layers) > 0, "inputs should overflow capacity"
