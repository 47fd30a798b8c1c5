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

from moescope import probe
from moescope.core.exporters import InMemoryExporter
from moescope.metrics import signals
from moescope.probe.accumulate import ENTROPY_BINS
from tests.support.zoo import FAMILIES, tiny_model

# DeepSeek-V3 routes by scores plus a correction bias: a non-zero one makes the final choice differ from a
# top-k of the scores, and the probe must record what the experts really got.
CORRECTION_BIAS = {"deepseek_v3": 0.5}

BATCH, SEQ = 3, 7
ENCODER_DECODER = {"switch_transformers", "nllb_moe"}


def _inputs(family: str, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=g)
    if family in ENCODER_DECODER:
        return dict(input_ids=ids, decoder_input_ids=torch.randint(0, 128, (BATCH, SEQ), generator=g))
    return dict(input_ids=ids)




class _Oracle:
    """Independent capture: the raw router outputs and the raw experts inputs, per MoE layer."""

    def __init__(self, layers):
        self.router_out: dict[int, object] = {}
        self.router_in: dict[int, list[torch.Tensor]] = {}  # per forward: what the router was called with
        self.experts_in: dict[int, tuple] = {}
        self.handles = []
        for layer in layers:
            self.handles.append(layer.router.register_forward_hook(
                lambda m, a, o, i=layer.index: self.router_out.__setitem__(i, o)))
            self.handles.append(layer.router.register_forward_pre_hook(self._keep_input(layer.index)))
            if layer.experts is not None:
                self.handles.append(layer.experts.register_forward_pre_hook(
                    lambda m, a, kw, i=layer.index: self.experts_in.__setitem__(i, (a, kw)), with_kwargs=True))

    def _keep_input(self, index: int):
        def hook(module, args):
            self.router_in.setdefault(index, []).append(args[0].detach().reshape(-1, args[0].shape[-1]).clone())
        return hook

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
    if family == "nllb_moe":
        # The experts got the kept first choice as a one-hot mask and the combine weights; decode
        # both token by token, the second choice by NLLB's rule (best logit after the first).
        args, _ = oracle.experts_in[layer.index]
        mask, combine, logits = args[1], args[2], out[2]
        ids, weights, kept = [], [], []
        for t in range(logits.shape[0]):
            row = logits[t].tolist()
            first = int(np.argmax(row)) if mask[t].sum() == 0 else int(mask[t].tolist().index(1))
            second = max((e for e in range(len(row)) if e != first), key=lambda e: row[e])
            ids.append([first, second])
            weights.append([float(combine[t, first]), float(combine[t, second])])
            kept.append([bool(mask[t, first]), float(combine[t, second]) > 0])
        return np.array(ids), np.array(weights, dtype=np.float32), np.array(kept)
    if family == "jetmoe":
        # The router hands the experts (token, slot) pairs sorted by expert, with run lengths per
        # expert: walk the runs and put each pair back at its token and slot.
        order, batch_index, gates, per_expert, logits = out
        k = layer.top_k
        ids = np.full((logits.shape[0], k), -1)
        weights = np.zeros((logits.shape[0], k), dtype=np.float32)
        position = 0
        for expert, count in enumerate(per_expert):
            for _ in range(count):
                token, slot = divmod(int(order[position]), k)
                assert token == int(batch_index[position])
                ids[token, slot], weights[token, slot] = expert, float(gates[position])
                position += 1
        assert (ids >= 0).all()
        np.testing.assert_array_equal(ids, logits.topk(k, dim=1).indices.numpy())  # JetMoE's own rule
        return ids, weights, np.ones(ids.shape, bool)
    # Every other family: the router returns (logits, weights, ids) and the experts got exactly those.
    _, weights, ids = out
    args, kwargs = oracle.experts_in[layer.index]
    assert torch.equal(args[1], ids) and torch.equal(args[2], weights)
    return ids.numpy(), weights.detach().numpy(), np.ones(ids.shape, bool)


def _model_router_logits(family: str, output) -> list[torch.Tensor]:
    """The model's own router logits, in the probe's layer order (module order)."""
    if family in ENCODER_DECODER:
        logits = list(output.encoder_router_logits) + list(output.decoder_router_logits)
    else:
        logits = list(output.router_logits)
    logits = [t.reshape(-1, t.shape[-1]) for t in logits if t is not None and t.numel()]
    if family == "jetmoe":
        # Output order is call order, attention (MoA) before MLP (MoE) in each layer; the decoder
        # layer declares its MLP first, so module order swaps each pair.
        logits = [t for pair in zip(logits[1::2], logits[0::2]) for t in pair]
    return logits


def _real_expert_params(family: str, layer) -> float:
    """Parameters of one routed expert, counted by hand from the family's own layout."""
    if family == "jetmoe":
        return layer.block.input_linear.weight[0].numel() + layer.block.output_linear.weight[0].numel()
    if family == "longcat_flash":  # gate_up_proj also has rows for the zero experts, never read
        return layer.experts.gate_up_proj[0].numel() + layer.experts.down_proj[0].numel()
    return sum(p.numel() for p in layer.experts.parameters()) / layer.num_experts


def _experts_params(family: str, layer) -> int:
    if family == "jetmoe":
        return layer.block.input_linear.weight.numel() + layer.block.output_linear.weight.numel()
    return sum(p.numel() for p in layer.experts.parameters())


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def recorded(request):
    family = request.param
    model = tiny_model(family, correction_bias=CORRECTION_BIAS.get(family))
    memory = InMemoryExporter()
    session = probe.attach(model, exporters=[memory], routes=True, router_logits=True, router_inputs=True)
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


def test_router_inputs_are_what_each_router_was_called_with(recorded):
    family, model, session, oracle, output, record = recorded
    for layer, ls in zip(session.layers, record.layers):
        [expected] = oracle.router_in[layer.index]
        np.testing.assert_array_equal(ls.router_inputs.values, expected.float().numpy())
        np.testing.assert_array_equal(ls.router_inputs.token, np.arange(expected.shape[0]))
        ids, _, _ = _expected_choice(family, layer, oracle, model)
        np.testing.assert_array_equal(ls.router_inputs.top1_expert, ids[:, 0])


SAMPLED = ("mixtral", "deepseek_v3", "switch_transformers", "llama4", "jetmoe", "longcat_flash")


@pytest.mark.parametrize("family", SAMPLED)
def test_sampled_logits_and_inputs_are_the_model_tensors_at_the_recorded_token(family):
    """router_logits=n / router_inputs=n keep n tokens per layer and forward, chosen on the device by
    a hash: whichever they are, each kept row must be the model's own tensor at the token it names."""
    model = tiny_model(family, correction_bias=CORRECTION_BIAS.get(family))
    memory = InMemoryExporter()
    session = probe.attach(model, exporters=[memory], routes=True, router_logits=5, router_inputs=3, window=2,
                           window_s=None)
    oracle = _Oracle(session.layers)
    logits_seen: dict[int, list[torch.Tensor]] = {}
    handles = [layer.router.register_forward_hook(
        lambda m, a, o, layer=layer: logits_seen.setdefault(layer.index, []).append(layer.read_logits(o).clone()))
        for layer in session.layers]
    inputs = [_inputs(family, seed) for seed in (1, 2)]
    with torch.no_grad():
        for batch in inputs:
            model(**batch)
    session.close()
    oracle.close()
    for handle in handles:
        handle.remove()
    [record] = memory.records
    assert (record.step, record.forwards) == (0, 2)
    for layer, ls in zip(session.layers, record.layers):
        key = "decoder_input_ids" if "decoder" in layer.name else "input_ids"
        for sample, seen, n in ((ls.router_logits, logits_seen[layer.index], 5),
                                (ls.router_inputs, oracle.router_in[layer.index], 3)):
            assert sample.step.tolist() == [0] * n + [1] * n  # n tokens of each forward
            for row, (forward, token) in enumerate(zip(sample.step, sample.token)):
                np.testing.assert_array_equal(sample.values[row], seen[forward][token].float().numpy())
                assert sample.token_ids[row] == inputs[forward][key].reshape(-1)[token]
            forward_of_route = ls.routes.step
            for row, (forward, token) in enumerate(zip(sample.step, sample.token)):
                route = np.flatnonzero((forward_of_route == forward) & (ls.routes.token == token))
                assert sample.top1_expert[row] == ls.routes.expert_ids[route[0], 0]


def test_load_is_a_bincount_of_kept_ids(recorded):
    family, model, session, oracle, output, record = recorded
    for layer, ls in zip(session.layers, record.layers):
        ids, weights, kept = _expected_choice(family, layer, oracle, model)
        slots = layer.num_experts + layer.zero_experts  # zero experts' load is recorded after the real ones
        expected = np.bincount(ids[kept], minlength=slots)
        np.testing.assert_array_equal(ls.expert_load, expected)
        gate_sum = np.zeros(slots)
        for t in range(ids.shape[0]):
            for s in range(ids.shape[1]):
                if kept[t, s]:
                    gate_sum[ids[t, s]] += float(weights[t, s])
        np.testing.assert_allclose(ls.gate_weight_sum, gate_sum, rtol=1e-6, atol=1e-7)
        assert ls.dropped_tokens == int((~kept).all(axis=1).sum())
        assert ls.dropped_assignments == int((~kept).sum())


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
        # The p95 comes from a 128-bin histogram over [0, ln E]: within half a bin of the exact one.
        half_bin = np.log(rows.shape[1]) / (2 * ENTROPY_BINS)
        assert abs(ls.router_entropy_p95 - np.percentile(entropies, 95)) <= half_bin + 1e-9
        assert ls.top1_margin_mean == pytest.approx(np.mean(margins), rel=1e-5, abs=1e-7)


def test_coselection_counts_pairs(recorded):
    family, model, session, oracle, output, record = recorded
    for layer, ls in zip(session.layers, record.layers):
        if layer.top_k < 2:
            assert ls.coselection is None
            continue
        ids, _, kept = _expected_choice(family, layer, oracle, model)
        slots = layer.num_experts + layer.zero_experts
        expected = np.zeros((slots, slots), dtype=np.int64)
        for row, keep in zip(ids, kept):
            chosen = [e for e, k in zip(row, keep) if k]
            for i in chosen:
                for j in chosen:
                    expected[i, j] += 1
        np.testing.assert_array_equal(ls.coselection, expected)


def _loss_oracle(family: str, model=None):
    """The family's own load-balancing loss in transformers: ("top-k", func) for the Mixtral-style
    `load_balancing_loss_func(gate_logits, num_experts, top_k)`, ("switch", func) for Switch's
    `load_balancing_loss_func(router_probs, expert_indices)`, None where transformers has none."""
    import transformers

    module = importlib.import_module(getattr(transformers, FAMILIES[family][1]).__module__)
    loss_func = getattr(module, "load_balancing_loss_func", None)
    if loss_func is None:
        return None
    parameters = inspect.signature(loss_func).parameters
    if "gate_logits" in parameters:
        return "top-k", loss_func
    if list(parameters) == ["router_probs", "expert_indices"]:
        return "switch", loss_func
    return None


# Families whose loss transformers defines today (25 top-k ones and Switch): a transformers
# upgrade that renames or drops them turns these checks into skips, and this floor into a failure.
LOSS_FAMILIES_TODAY = 26


def test_the_load_balancing_loss_is_checked_for_as_many_families_as_today():
    checked = sorted(f for f in FAMILIES if _loss_oracle(f) is not None)
    assert len(checked) >= LOSS_FAMILIES_TODAY, checked
    assert "switch_transformers" in checked and "mixtral" in checked


def test_load_balancing_loss_matches_transformers(recorded):
    family, model, session, oracle, output, record = recorded
    found = _loss_oracle(family)
    if found is None:
        pytest.skip(f"{family} has no load_balancing_loss_func in transformers")
    kind, loss_func = found
    if kind == "switch":
        _check_switch_loss(loss_func, session, output, record)
        return
    layer = session.layers[0]
    expected = loss_func(tuple(_model_router_logits(family, output)), layer.num_experts, layer.top_k)
    # From the records alone: loss = E * sum_e f_e * P_e, where f_e is the share of all
    # (token, slot) assignments over all layers and P_e the mean router probability. The loss
    # counts choices before any capacity drop, so the per-token routes (kept or not) give f_e.
    if any(layer.expert_capacity is not None for layer in session.layers):
        load = sum(np.bincount(ls.routes.expert_ids.ravel(), minlength=layer.num_experts)
                   for ls in record.layers).astype(np.float64)
    else:
        load = sum(ls.expert_load for ls in record.layers).astype(np.float64)
    prob = sum(ls.router_prob_sum for ls in record.layers)
    tokens = sum(ls.tokens for ls in record.layers)
    recomputed = layer.num_experts * float(np.sum(load / tokens * prob / tokens))
    assert recomputed == pytest.approx(float(expected), rel=1e-5)
    # The recorded selection counts (top-k of the router's probabilities, before bias correction
    # or drops) through the one definition the training monitor and its scalars use.
    topk = sum(ls.router_topk_load[: layer.num_experts] for ls in record.layers)
    assert signals.load_balancing_loss(topk, prob[: layer.num_experts], tokens) == pytest.approx(
        float(expected), rel=1e-5)


def test_router_z_loss_matches_transformers(recorded):
    """The router z-loss (ST-MoE, transformers' `router_z_loss_func`: the mean over tokens of
    logsumexp(logits)^2) from the recorded per-layer sums, over all layers' tokens pooled."""
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

    family, model, session, oracle, output, record = recorded
    logits = torch.cat([t.double() for t in _model_router_logits(family, output)])
    expected = float(router_z_loss_func(logits.unsqueeze(0)))
    recorded_z = signals.router_z_loss(sum(ls.router_z_sum for ls in record.layers),
                                       sum(ls.tokens for ls in record.layers))
    assert recorded_z == pytest.approx(expected, rel=1e-5)


def _check_switch_loss(loss_func, session, output, record) -> None:
    """Switch's loss, per stack as the model computes it: its layers' logits side by side along the
    sequence, each batch row a group: E^2 * mean over (row, expert) of (share of the row's tokens whose
    top-1 is the expert, before capacity) * (mean router probability in the row)."""
    for stack, logits in (("encoder", output.encoder_router_logits), ("decoder", output.decoder_router_logits)):
        logits = torch.cat([t for t in logits if t is not None and t.numel()], dim=1)
        expected = float(loss_func(torch.softmax(logits, dim=-1), logits.argmax(dim=-1)))
        mine = [ls for layer, ls in zip(session.layers, record.layers) if layer.name.startswith(stack)]
        experts = session.layers[0].num_experts
        share = np.zeros((BATCH, experts))
        prob = np.zeros((BATCH, experts))
        for ls in mine:
            values = ls.router_logits.values.astype(np.float64)
            p = np.exp(values - values.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            for token, row in enumerate(ls.routes.sequence):
                share[row, ls.routes.expert_ids[token, 0]] += 1
                prob[row] += p[ls.router_logits.token.tolist().index(token)]
        per_row = SEQ * len(mine)
        recomputed = experts ** 2 * float(np.mean(share / per_row * prob / per_row))
        assert recomputed == pytest.approx(expected, rel=1e-5)


def test_active_parameter_fraction_counted_by_hand(recorded):
    family, model, session, oracle, output, record = recorded
    total = sum(p.numel() for p in model.parameters())
    # Every parameter outside the experts modules counts for every token; an expert's parameters
    # count for a token only when it processed that token; zero experts and a slot dropped at
    # capacity count nothing, and neither do weight rows stacked for zero experts (LongCat).
    per_token = float(total - sum(_experts_params(family, layer) for layer in session.layers))
    for layer in session.layers:
        ids, _, kept = _expected_choice(family, layer, oracle, model)
        used = [sum(1 for e, k in zip(row, keep) if k and e < layer.num_experts) for row, keep in zip(ids, kept)]
        per_token += np.mean(used) * _real_expert_params(family, layer)
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
    model = tiny_model("deepseek_v3", correction_bias=CORRECTION_BIAS.get("deepseek_v3"))
    memory = InMemoryExporter()
    with probe.attach(model, exporters=[memory], routes=True):
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


@pytest.mark.parametrize("fraction", [0.2, 0.35])
def test_nllb_top2_capacity_drops_counted_by_brute_force(fraction):
    model = tiny_model("nllb_moe", moe_eval_capacity_token_fraction=fraction)
    memory = InMemoryExporter()
    with probe.attach(model, exporters=[memory], routes=True, router_logits=True) as session:
        with torch.no_grad():
            model(**_inputs("nllb_moe"))
    tokens = BATCH * SEQ
    capacity = int(np.ceil(fraction * tokens))  # eval mode: a share of all the batch's tokens
    for layer, ls in zip(session.layers, memory.records[0].layers):
        logits = ls.router_logits.values.astype(np.float64)
        first = [int(np.argmax(row)) for row in logits]
        second = [max((e for e in range(layer.num_experts) if e != f), key=lambda e: row[e])
                  for f, row in zip(first, logits)]
        # Fairseq's order: every first choice is placed (token order) before any second choice.
        placed = np.zeros(layer.num_experts, dtype=int)
        kept = np.zeros((tokens, 2), dtype=bool)
        for t, e in enumerate(first):
            kept[t, 0] = placed[e] < capacity
            placed[e] += 1
        for t, e in enumerate(second):
            kept[t, 1] = placed[e] < capacity
            placed[e] += 1
        load = np.zeros(layer.num_experts, dtype=int)
        for t in range(tokens):
            for s, e in enumerate((first[t], second[t])):
                load[e] += kept[t, s]
        np.testing.assert_array_equal(ls.routes.expert_ids, np.array([first, second]).T)
        np.testing.assert_array_equal(ls.routes.kept, kept)
        np.testing.assert_array_equal(ls.expert_load, load)
        assert ls.dropped_assignments == int((~kept).sum())
        assert ls.dropped_tokens == int((~kept).all(axis=1).sum())
        assert ls.capacity == capacity
        assert ls.capacity_use == pytest.approx(load.max() / capacity)
    assert sum(ls.dropped_assignments for ls in memory.records[0].layers) > 0, "inputs should overflow capacity"


def test_longcat_zero_experts_take_load_but_no_parameters():
    model = tiny_model("longcat_flash")
    memory = InMemoryExporter()
    with probe.attach(model, exporters=[memory], routes=True) as session, torch.no_grad():
        model(**_inputs("longcat_flash"))
    for layer, info, ls in zip(session.layers, session.run.layers, memory.records[0].layers):
        assert (info.num_experts, info.zero_experts) == (8, 2)
        assert ls.expert_load.shape == (10,)
        assert ls.expert_load[8:].sum() == (ls.routes.expert_ids >= 8).sum() > 0
        used = (ls.routes.expert_ids < 8).sum(axis=1).mean()
        assert ls.active_params_per_token == pytest.approx(used * info.params_per_expert)
        # The zero experts' rows of the fused gate_up_proj exist but are never used.
        assert layer.unused_params == 2 * layer.experts.gate_up_proj[0].numel()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_window_of_two_forwards_is_the_sum_of_its_forwards(family):
    """Windowed records carry exactly the per-forward figures (checked above against the model)
    summed, or token-weighted where they are means, for every family."""
    model = tiny_model(family, correction_bias=CORRECTION_BIAS.get(family))
    inputs = [_inputs(family, seed=1), _inputs(family, seed=2)]
    per_forward, windowed = InMemoryExporter(), InMemoryExporter()
    for exporter, window in ((per_forward, 1), (windowed, 2)):
        with probe.attach(model, [exporter], routes=True, window=window, window_s=None), torch.no_grad():
            for batch in inputs:
                model(**batch)
    assert len(per_forward.records) == 2 and len(windowed.records) == 1
    record = windowed.records[0]
    assert (record.step, record.step_end, record.forwards) == (0, 1, 2)
    assert record.tokens == sum(r.tokens for r in per_forward.records)
    assert record.active_params == pytest.approx(
        sum(r.active_params * r.tokens for r in per_forward.records) / record.tokens, rel=1e-9)
    for ls, parts in zip(record.layers, zip(*(r.layers for r in per_forward.records))):
        tokens = sum(p.tokens for p in parts)
        assert ls.tokens == tokens and ls.forwards == 2
        np.testing.assert_array_equal(ls.expert_load, sum(p.expert_load for p in parts))
        np.testing.assert_allclose(ls.gate_weight_sum, sum(p.gate_weight_sum for p in parts), rtol=1e-12)
        np.testing.assert_allclose(ls.router_prob_sum, sum(p.router_prob_sum for p in parts), rtol=1e-12)
        for name in ("router_entropy_mean", "top1_margin_mean", "active_params_per_token"):
            expected = sum(getattr(p, name) * p.tokens for p in parts) / tokens
            assert getattr(ls, name) == pytest.approx(expected, rel=1e-9, abs=1e-12), name
        assert ls.dropped_tokens == sum(p.dropped_tokens for p in parts)
        assert ls.dropped_assignments == sum(p.dropped_assignments for p in parts)
        if ls.capacity_use is not None:
            assert ls.capacity_use == max(p.capacity_use for p in parts)
        if ls.coselection is not None:
            np.testing.assert_array_equal(ls.coselection, sum(p.coselection for p in parts))
        np.testing.assert_array_equal(ls.routes.expert_ids, np.concatenate([p.routes.expert_ids for p in parts]))
        np.testing.assert_array_equal(ls.routes.step, np.repeat([0, 1], [len(p.routes.expert_ids) for p in parts]))
        for name in ("gate_weights", "kept", "token_ids", "sequence", "position", "token"):
            if getattr(ls.routes, name) is None:
                assert all(getattr(p.routes, name) is None for p in parts), name
                continue
            np.testing.assert_array_equal(getattr(ls.routes, name),
                                          np.concatenate([getattr(p.routes, name) for p in parts]), err_msg=name)


@pytest.mark.parametrize("family", ["mixtral", "switch_transformers", "nllb_moe", "qwen3_moe"])
def test_deferred_and_immediate_reductions_record_the_same(family):
    """Forwards on a CPU, in inference and in training, are reduced together when their window
    closes (one stacked pass, on the writer's thread); on CUDA and under torch.compile they are
    reduced one by one as they end. The same three forwards through each give the same records:
    aggregates, capacity use and every route row."""
    model = tiny_model(family, correction_bias=CORRECTION_BIAS.get(family))
    inputs = [_inputs(family, seed) for seed in (1, 2, 3)]
    records = {}
    for grad, immediate in ((False, False), (True, False), (False, True)):
        memory = InMemoryExporter()
        session = probe.attach(model, [memory], routes=True, window=3, window_s=None)
        session._may_defer = not immediate  # the path of CUDA and torch.compile, on a CPU
        with session, torch.set_grad_enabled(grad):
            for batch in inputs:
                model(**batch)
        [records[grad, immediate]] = memory.records
    # training (autograd on) defers as inference does
    for deferred in (records[False, False], records[True, False]):
        _same_window(deferred, records[False, True])


def _same_window(deferred, immediate):
    """Two records of the same forwards, reduced by different paths, hold the same figures."""
    assert deferred.forwards == immediate.forwards == 3
    for a, b in zip(deferred.layers, immediate.layers):
        assert a.tokens == b.tokens
        for name in ("expert_load", "gate_weight_sum", "router_prob_sum", "router_topk_load"):
            np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-12, err_msg=name)
        for name in ("router_entropy_mean", "top1_margin_mean", "router_z_sum", "dropped_tokens", "capacity_use"):
            if getattr(b, name) is None:
                assert getattr(a, name) is None, name
                continue
            assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-12, abs=1e-15), name
        for name in ("expert_ids", "gate_weights", "kept", "step", "token", "sequence", "position"):
            np.testing.assert_array_equal(getattr(a.routes, name), getattr(b.routes, name), err_msg=name)


@pytest.mark.parametrize("family", ["mixtral", "nllb_moe"])
@pytest.mark.parametrize("ring_tokens", [80, 16])
def test_forwards_reduced_on_either_thread_record_as_reduced_one_by_one(family, ring_tokens):
    """A window whose forwards change batch size is reduced in two parts: the forwards before the
    change on the model thread, the last ones into the window's snapshot on the writer's thread.
    With a sample of router logits, and a routes ring that holds the window (80 rows) or not even
    one forward (16: a forward writes its first 16 rows, the rest counted as dropped, and gets a
    window of its own), the records and the drop counts equal those of forwards reduced one by one
    as they end (the path of CUDA and torch.compile)."""
    model = tiny_model(family, correction_bias=CORRECTION_BIAS.get(family))
    g = torch.Generator().manual_seed(5)
    inputs = []
    for batch in (3, 3, 2, 2):
        ids = torch.randint(0, 128, (batch, SEQ), generator=g)
        inputs.append(dict(input_ids=ids, decoder_input_ids=ids.flip(1)) if family in ENCODER_DECODER
                      else dict(input_ids=ids))
    records, drops = {}, {}
    for immediate in (False, True):
        memory = InMemoryExporter()
        session = probe.attach(model, [memory], routes=True, router_logits=5, window=4, window_s=None,
                               ring_tokens=ring_tokens)
        session._may_defer = not immediate  # the path of CUDA and torch.compile, on a CPU
        with session, torch.no_grad():
            for batch in inputs:
                model(**batch)
        records[immediate] = memory.records
        drops[immediate] = dict(session.processor.dropped_rows)
    # a forward of more tokens than the ring writes its first ring_tokens rows; the rest are counted
    lost = sum(max(batch * SEQ - ring_tokens, 0) for batch in (3, 3, 2, 2)) * len(session.layers)
    assert drops[False] == drops[True] == ({("routes", "ring_full"): lost} if lost else {}), drops
    assert [r.forwards for r in records[False]] == [r.forwards for r in records[True]] == (
        [4] if ring_tokens == 80 else [1, 1, 1, 1])
    for deferred, immediate in zip(records[False], records[True]):
        for a, b in zip(deferred.layers, immediate.layers):
            assert a.tokens == b.tokens
            for name in ("expert_load", "gate_weight_sum", "router_prob_sum", "router_topk_load"):
                np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-12, err_msg=name)
            assert a.router_entropy_mean == pytest.approx(b.router_entropy_mean, rel=1e-12)
            assert a.capacity_use == b.capacity_use
            for name in ("expert_ids", "gate_weights", "kept", "step", "token", "sequence", "position"):
                np.testing.assert_array_equal(getattr(a.routes, name), getattr(b.routes, name), err_msg=name)
            for name in ("token", "step", "values", "top1_expert"):
                np.testing.assert_array_equal(getattr(a.router_logits, name), getattr(b.router_logits, name),
                                              err_msg=name)
