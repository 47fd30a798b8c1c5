"""Expert-health sampling against independent computations.

Oracles: each expert's output computed here by hand from its weights (Mixtral's SwiGLU, Switch's
own per-expert submodules, Llama4's batched formula), weight norms taken directly with torch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moescope import probe
from moescope.core.exporters import InMemoryExporter
from moescope.probe.health_sampling import HealthSampler, _expert_tensors, expert_outputs
from tests.support.zoo import tiny_model

torch.set_num_threads(1)


def _mixtral_expert(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, experts.down_proj[e])


def test_expert_outputs_match_each_family_by_hand():
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    experts_ids = torch.arange(8)
    layer = probe.find_moe_layers(tiny_model("mixtral"))[0]
    got = expert_outputs(layer, x, experts_ids)
    want = torch.stack([_mixtral_expert(layer.experts, e, x) for e in range(8)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    layer = probe.find_moe_layers(tiny_model("switch_transformers"))[0]
    got = expert_outputs(layer, x, torch.tensor([2, 5]))
    want = torch.stack([layer.experts[f"expert_{e}"](x) for e in (2, 5)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    layer = probe.find_moe_layers(tiny_model("llama4"))[0]
    experts = layer.experts
    got = expert_outputs(layer, x, experts_ids)
    want = []
    for e in range(8):
        gate, up = (x @ experts.gate_up_proj[e]).chunk(2, dim=-1)
        want.append((up * torch.nn.functional.silu(gate)) @ experts.down_proj[e])
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=1e-6)


def test_sampled_norms_nonfinite_counts_and_weight_checks():
    model = tiny_model("mixtral")
    memory = InMemoryExporter()
    captured = {}
    layer = probe.find_moe_layers(model)[0]
    def keep_input(module, args, output):
        captured.setdefault("x", args[0].detach().clone())

    handle = layer.router.register_forward_hook(keep_input)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    with probe.attach(model, exporters=[memory], health=True, window=1,
                      health_options=dict(tokens_per_expert=6, experts_per_forward=None, weight_every=1,
                                          sample_every=1)) as session, torch.no_grad():
        model(ids)  # every token sampled: the sums are exact
        views = [p.view(8, -1)[3] for p, _ in _expert_tensors(session.layers[0])[3]]
        for view in views:
            view.mul_(1000.0)
        model(ids)
        views[0][0] = float("nan")
        model(ids)
        session.flush()
    handle.remove()
    assert len(memory.records) == 3, [r.step for r in memory.records]
    first, scaled, poisoned = (record.layers[0] for record in memory.records)
    x = captured["x"].reshape(-1, 32)
    want = [float(_mixtral_expert(layer.experts, e, x).norm(dim=-1).sum()) for e in range(8) if e != 3]
    got = np.delete(first.expert_output_norm_sum, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert first.expert_output_samples.tolist() == [6] * 8 and first.expert_output_nonfinite.tolist() == [0] * 8
    np.testing.assert_allclose(first.expert_weight_cosine, 1.0, rtol=1e-6)
    np.testing.assert_allclose(first.expert_weight_norm_ratio, 1.0, rtol=1e-6)
    np.testing.assert_allclose(scaled.expert_weight_norm_ratio[3], 1000.0, rtol=1e-4)
    np.testing.assert_allclose(scaled.expert_weight_cosine[3], 1.0, rtol=1e-5)  # scaling keeps the direction
    assert scaled.expert_output_norm_sum[3] > 1e6 * first.expert_output_norm_sum[3]
    assert poisoned.expert_output_nonfinite.tolist() == [0, 0, 0, 6, 0, 0, 0, 0]
    assert np.isnan(poisoned.expert_weight_norm_ratio[3]) and poisoned.nonfinite_input_tokens == 0


def test_reinitialised_expert_loses_its_fingerprint_and_upstream_nan_is_not_blamed():
    model = tiny_model("mixtral")
    layer = probe.find_moe_layers(model)[0]
    sampler = HealthSampler([layer], tokens_per_expert=2, weight_every=1)
    with torch.no_grad():
        for param, row in _expert_tensors(layer)[5]:
            param.view(8, -1)[row].copy_(torch.randn(param.view(8, -1)[row].shape) * 0.02)
        out = sampler.sample(layer, torch.randn(4, 32))
    assert out["weight_cosine"][5] < 0.5 and (out["weight_cosine"][torch.arange(8) != 5] > 0.999).all()
    hidden = torch.full((4, 32), float("nan"))
    out = sampler.sample(layer, hidden)
    assert out["health_samples"].sum() == 0 and out["health_nonfinite"].sum() == 0
    assert int(out["health_input_nonfinite"][0]) == 4


def test_health_off_leaves_records_as_they_were():
    model = tiny_model("qwen3_moe")
    memory = InMemoryExporter()
    with probe.attach(model, exporters=[memory]) as session, torch.no_grad():
        model(torch.randint(0, 128, (1, 5)))
        session.flush()
        assert session.health is None and session.gate is None and session.trust is None
    step = memory.records[0].layers[0]
    assert step.expert_output_samples is None and step.trust_weight is None and step.expert_weight_cosine is None


def test_rotation_bounds_the_experts_per_forward():
    layer = probe.find_moe_layers(tiny_model("mixtral"))[0]
    sampler = HealthSampler([layer], tokens_per_expert=1, experts_per_forward=3, weight_every=100)
    seen = [sampler.sample(layer, torch.randn(4, 32))["health_samples"].nonzero().flatten().tolist() for _ in range(3)]
    assert seen == [[0, 1, 2], [3, 4, 5], [0, 6, 7]]
    with pytest.raises(ValueError):
        HealthSampler([layer], tokens_per_expert=0)


def test_layers_take_turns_spending_one_expert_per_layer_in_one_call():
    """The default budget (one expert per layer per sampled forward) is spent in one layer at a time:
    4 layers of 8 experts run 4 experts of one layer in one experts call per sampled forward, and
    every (layer, expert) is visited exactly once in 8 sampled forwards. Oracle: the experts
    modules' own calls, counted beside the model's, and the records' per-expert sample counts."""
    model = tiny_model("mixtral", num_hidden_layers=4)
    layers = probe.find_moe_layers(model)
    calls = {layer.index: 0 for layer in layers}
    for layer in layers:
        forward = layer.experts.forward

        def counted(*args, _forward=forward, _index=layer.index, **kwargs):
            calls[_index] += 1
            return _forward(*args, **kwargs)
        layer.experts.forward = counted
    memory = InMemoryExporter()
    per_forward = []
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    with probe.attach(model, exporters=[memory], health=True, window=1, window_s=None,
                      health_options=dict(sample_every=2, tokens_per_expert=3)) as session, torch.no_grad():
        for _ in range(16):
            before = dict(calls)
            model(ids)
            per_forward.append({i: calls[i] - before[i] - 1 for i in calls})  # minus the model's own call
        session.flush()
    assert len(memory.records) == 16
    visited = set()
    for step, (record, extra) in enumerate(zip(memory.records, per_forward)):
        sampled = {(row.layer, e) for row in record.layers for e in np.flatnonzero(row.expert_output_samples)}
        if step % 2:
            assert not sampled and sum(extra.values()) == 0
            continue
        assert len(sampled) == 4 and len({layer for layer, _ in sampled}) == 1
        assert sum(extra.values()) == 1  # one call of one layer's experts module
        assert all(row.expert_output_samples.sum() in (0, 4 * 3) for row in record.layers)
        assert not visited & sampled
        visited |= sampled
    assert visited == {(layer.index, e) for layer in layers for e in range(8)}


def test_weight_checks_rotate_over_the_layers():
    """Each layer's fingerprint is checked every `weight_every` sampled forwards, the layers spread
    over them (not all at once); a scaled expert shows at its layer's next check."""
    model = tiny_model("mixtral", num_hidden_layers=4)
    memory = InMemoryExporter()
    ids = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(3))
    with probe.attach(model, exporters=[memory], health=True, window=1, window_s=None,
                      health_options=dict(sample_every=1, weight_every=4)) as session, torch.no_grad():
        for _ in range(8):
            model(ids)
        layer = session.layers[2]
        for param, row in _expert_tensors(layer)[1]:
            param.view(8, -1)[row].mul_(3.0)
        for _ in range(4):
            model(ids)
        session.flush()
    def was_checked(row) -> bool:  # a record carries a weight check only where the window took one
        return row.expert_weight_norm_ratio is not None and not np.isnan(row.expert_weight_norm_ratio).all()
    checked = [[row.layer for row in record.layers if was_checked(row)] for record in memory.records]
    assert checked[:8] == [[0], [1], [2], [3], [0], [1], [2], [3]]
    ratios = [record.layers[2].expert_weight_norm_ratio for record in memory.records[8:]]
    assert [was_checked(record.layers[2]) for record in memory.records[8:]] == [False, False, True, False]
    np.testing.assert_allclose(ratios[2][1], 3.0, rtol=1e-5)
