"""Expert capacity with token dropping (`moescope.demo.capacity`) and the probe's reading of it.

Oracles: the model's own router logits (`output_router_logits`) turned into kept slots by a plain
loop written here (first choices before second choices, earlier positions first, a capacity of
ceil(factor * seq_len * k / E) per expert and sequence, padding never dispatched), and each MoE
block's output recomputed expert by expert from its input.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moescope import probe
from moescope.core.exporters import InMemoryExporter
from moescope.demo.capacity import CapacityInstallError, CapacityMoeBlock, capacity_blocks, install_capacity
from tests.support.zoo import tiny_model

BATCH, SEQ = 3, 24


def _capacity_model(factor: float, implementation: str = "eager", **overrides):
    model = tiny_model("mixtral", **overrides)
    model.set_experts_implementation(implementation)
    return install_capacity(model, factor)


def _inputs(seed: int = 1, padded: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Few distinct tokens, so tokens crowd onto a few experts and the capacity bites.
    ids = torch.randint(0, 12, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if padded:
        mask[1, SEQ - 7:] = 0  # right padding
        mask[2, :5] = 0  # left padding
    return dict(input_ids=ids, attention_mask=mask)


def _brute_force_kept(logits: torch.Tensor, mask: torch.Tensor, factor: float, k: int = 2):
    """(ids (tokens, k), kept (tokens, k), capacity per sequence) from one layer's router logits."""
    experts = logits.shape[-1]
    batch, seq = mask.shape
    capacity = math.ceil(factor * seq * k / experts)
    probs = torch.softmax(logits.double(), dim=-1).numpy()
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    kept = np.zeros(ids.shape, dtype=bool)
    for row in range(batch):
        taken = [0] * experts
        for slot in range(k):  # every first choice of the row before any second choice
            for position in range(seq):  # within a choice rank, earlier positions first
                token = row * seq + position
                if not mask[row, position]:
                    continue  # padding is never dispatched and takes no capacity
                expert = ids[token, slot]
                if taken[expert] < capacity:
                    taken[expert] += 1
                    kept[token, slot] = True
    return ids, kept, capacity


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_probe_records_exactly_the_kept_slots(factor, implementation):
    model = _capacity_model(factor, implementation)
    inputs = _inputs()
    memory = InMemoryExporter()
    with probe.attach(model, exporters=[memory], routes=True, window=1) as session:
        assert {layer.routing for layer in session.layers} == {"capacity per sequence (GShard/Megatron token dropping)"}
        with torch.no_grad():
            output = model(**inputs, output_router_logits=True)
    assert session.hook_errors == 0
    record = memory.records[0]
    total = sum(p.numel() for p in model.parameters())
    per_expert = sum(p.numel() for p in model.model.layers[0].mlp.experts.parameters()) // 8
    active = float(total - per_expert * 8 * len(session.layers))
    dropped_somewhere = 0
    for layer, ls, logits in zip(session.layers, record.layers, output.router_logits):
        ids, kept, capacity = _brute_force_kept(logits, inputs["attention_mask"], factor)
        np.testing.assert_array_equal(ls.routes.expert_ids, ids)
        np.testing.assert_array_equal(ls.routes.kept, kept)
        load = np.zeros(8, dtype=np.int64)
        np.add.at(load, ids[kept], 1)
        np.testing.assert_array_equal(ls.expert_load, load)
        assert ls.dropped_assignments == int((~kept).sum())
        assert ls.dropped_tokens == int((~kept).all(axis=1).sum())
        assert ls.capacity == capacity * BATCH  # the forward's slots per expert: per sequence x sequences
        assert ls.capacity_use == pytest.approx(load.max() / (capacity * BATCH))
        # the weights the experts got: the router's top-k weights where kept, 0 where dropped
        probs = torch.softmax(logits.double(), dim=-1).numpy()
        top = np.take_along_axis(probs, ids, axis=1)
        np.testing.assert_allclose(ls.routes.gate_weights, np.where(kept, top / top.sum(1, keepdims=True), 0),
                                   rtol=1e-5, atol=1e-7)
        active += kept.sum(axis=1).mean() * per_expert
        dropped_somewhere += int((~kept).sum()) - 2 * int((inputs["attention_mask"] == 0).sum())
    assert record.active_param_fraction == pytest.approx(active / total, rel=1e-9)
    assert dropped_somewhere > 0, "the inputs should overflow some expert beyond the padding"


def test_dropped_slots_contribute_nothing_to_the_block_output():
    model = _capacity_model(0.5)
    inputs = _inputs(seed=3)
    seen: dict[int, tuple] = {}
    handles = [layer.mlp.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, (a[0], o)))
               for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        output = model(**inputs, output_router_logits=True)
    for handle in handles:
        handle.remove()
    for index, logits in enumerate(output.router_logits):
        block = model.model.layers[index].mlp
        hidden, out = seen[index]
        x = hidden.reshape(-1, hidden.shape[-1]).double()
        ids, kept, _ = _brute_force_kept(logits, inputs["attention_mask"], 0.5)
        probs = torch.softmax(logits.double(), dim=-1).numpy()
        top = np.take_along_axis(probs, ids, axis=1)
        weights = top / top.sum(1, keepdims=True)
        expected = torch.zeros_like(x)
        for token in range(x.shape[0]):
            for slot in range(2):
                if not kept[token, slot]:
                    continue
                e = int(ids[token, slot])
                gate, up = (block.experts.gate_up_proj[e].double() @ x[token]).chunk(2)
                expected[token] += weights[token, slot] * (block.experts.down_proj[e].double()
                                                           @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out.reshape(-1, x.shape[-1]).double(), expected, rtol=1e-4, atol=1e-5)
        padded = (inputs["attention_mask"] == 0).reshape(-1)
        assert torch.all(out.reshape(-1, x.shape[-1])[padded] == 0), "padding is never dispatched"


def test_decode_one_token_at_a_time_never_drops():
    model = _capacity_model(0.25)
    memory = InMemoryExporter()
    prompt = _inputs(seed=4, padded=False)
    with probe.attach(model, exporters=[memory], window=1):
        with torch.no_grad():
            model.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    prefill, *decode = memory.records
    assert prefill.tokens == BATCH * SEQ and len(decode) == 4
    assert sum(ls.dropped_assignments for ls in prefill.layers) > 0
    for record in decode:
        assert record.tokens == BATCH
        assert all(ls.dropped_assignments == 0 and ls.capacity == BATCH for ls in record.layers)


def test_a_masked_expert_is_never_chosen_and_the_capacity_applies_to_the_gated_choice():
    model = _capacity_model(0.5)
    inputs = _inputs(seed=5, padded=False)
    memory = InMemoryExporter()
    gated: dict[int, torch.Tensor] = {}
    with probe.attach(model, exporters=[memory], routes=True, window=1, gate=True) as session:
        session.gate.set(0, 3, 0.0, "test")
        handles = [layer.router.register_forward_hook(lambda m, a, o, i=layer.index: gated.__setitem__(i, o[0]))
                   for layer in session.layers]
        with torch.no_grad():
            model(**inputs)
        for handle in handles:
            handle.remove()
    ls = memory.records[0].layers[0]
    assert 3 not in ls.routes.expert_ids
    ids, kept, _ = _brute_force_kept(gated[0], inputs["attention_mask"], 0.5)
    np.testing.assert_array_equal(ls.routes.expert_ids, ids)
    np.testing.assert_array_equal(ls.routes.kept, kept)
    assert ls.dropped_assignments == int((~kept).sum()) > 0


def test_the_factor_travels_with_the_checkpoint_and_plain_loading_is_dropless(tmp_path):
    from transformers import MixtralForCausalLM

    model = _capacity_model(0.75)
    assert len(capacity_blocks(model)) == 2
    model.save_pretrained(tmp_path)
    plain = MixtralForCausalLM.from_pretrained(tmp_path).eval()
    assert plain.config.capacity_factor == 0.75
    assert not capacity_blocks(plain)
    inputs = _inputs(seed=6, padded=False)
    with torch.no_grad():
        expected = model(**inputs).logits
        dropless = plain(**inputs).logits
        install_capacity(plain)  # the factor the config recorded
        again = plain(**inputs).logits
    assert all(isinstance(b, CapacityMoeBlock) and b.capacity_factor == 0.75 for b in capacity_blocks(plain))
    torch.testing.assert_close(again, expected)
    assert not torch.allclose(dropless, expected), "capacity 0.75 should change the output of these inputs"


def test_bad_input_says_what_to_do():
    with pytest.raises(CapacityInstallError, match="pass capacity_factor"):
        install_capacity(tiny_model("mixtral"))
    with pytest.raises(CapacityInstallError, match="positive"):
        install_capacity(tiny_model("mixtral"), 0.0)
    model = _capacity_model(1.0)
    with pytest.raises(CapacityInstallError, match="already"):
        install_capacity(model, 1.0)
    with pytest.raises(CapacityInstallError, match="Mixtral"):
        install_capacity(tiny_model("qwen2_moe"), 1.0)
