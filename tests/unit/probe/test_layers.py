"""`layers=`: watching some of a model's MoE blocks, by name, by a list of names or by a predicate.

Oracles: the model's own module tree (which blocks exist, in which order), a plain hook written
here on every experts module (the ids each block really used), and parameter counts taken by
hand from the modules. What the probe reports when only some layers are watched (probe.attach's
docstring): each block keeps its index among all the model's MoE layers, and an unwatched
layer's experts count as k experts per token (an estimate: its routing is not seen).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moescope
from moescope import probe
from moescope.core.exporters import InMemoryExporter
from moescope.store import Store
from tests.support.zoo import tiny_model

BLOCKS = [f"model.layers.{i}.mlp" for i in range(3)]  # the model's MoE blocks, in module order


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (2, 6), generator=g), torch.randint(0, 128, (3, 4), generator=g)]


def _experts_of(model, block: str):
    return model.get_submodule(block).experts


def _hand_count(model, used_by_block: dict[str, list[np.ndarray]], forward: int) -> tuple[float, float]:
    """(active parameters per token, total parameters) of one forward, counted from the modules.

    Every parameter outside the experts modules counts for every token; a watched block's expert
    counts for a token when that token used it; an unwatched block counts as k experts per token.
    """
    total = sum(p.numel() for p in model.parameters())
    k = model.config.num_experts_per_tok
    active = float(total)
    for block in BLOCKS:
        experts = _experts_of(model, block)
        params = sum(p.numel() for p in experts.parameters())
        per_expert = params / model.config.num_local_experts
        active -= params
        if block in used_by_block:
            ids = used_by_block[block][forward]
            active += (ids < model.config.num_local_experts).sum(axis=1).mean() * per_expert
        else:
            active += k * per_expert
    return active, total


def _record(model, layers, tmp_path=None):
    """Attach with `layers`, run the batches with a hook of our own on every experts module."""
    seen: dict[str, list[np.ndarray]] = {block: [] for block in BLOCKS}
    handles = [_experts_of(model, block).register_forward_pre_hook(
        lambda m, args, b=block: seen[b].append(args[1].reshape(-1, args[1].shape[-1]).numpy().copy()))
        for block in BLOCKS]
    memory = InMemoryExporter()
    try:
        with moescope.attach(model, layers=layers, exporters=[memory], routes=True, window=1,
                          store=tmp_path) as session, torch.no_grad():
            for batch in _batches():
                model(batch)
    finally:
        for handle in handles:
            handle.remove()
    return session, memory.records, seen


@pytest.mark.parametrize("layers,watched", [
    ("model.layers.1.mlp", ["model.layers.1.mlp"]),
    (["model.layers.2.mlp", "model.layers.0.mlp"], ["model.layers.0.mlp", "model.layers.2.mlp"]),
    (lambda name: name.endswith((".0.mlp", ".2.mlp")), ["model.layers.0.mlp", "model.layers.2.mlp"]),
], ids=["string", "list", "predicate"])
def test_watched_blocks_keep_their_index_and_the_fraction_is_counted_by_hand(layers, watched, tmp_path):
    model = tiny_model("mixtral", num_hidden_layers=3)
    session, records, seen = _record(model, layers, tmp_path)
    indices = [BLOCKS.index(name) for name in watched]
    assert [layer.name for layer in session.layers] == watched
    assert [layer.index for layer in session.layers] == indices
    assert [info.layer for info in session.run.layers] == indices
    assert len(records) == len(_batches())
    for forward, record in enumerate(records):
        assert [ls.layer for ls in record.layers] == indices
        for block, ls in zip(watched, record.layers):  # each row is the block it says it is
            np.testing.assert_array_equal(ls.routes.expert_ids, seen[block][forward])
        active, total = _hand_count(model, {b: seen[b] for b in watched}, forward)
        assert record.total_params == total
        assert record.active_params == pytest.approx(active, rel=1e-12)
        assert record.active_param_fraction == pytest.approx(active / total, rel=1e-12)
    # Mixtral drops nothing and always uses k experts: the estimate for unwatched layers is then
    # exact, so watching some layers gives the fraction that watching all of them gives.
    full_session, full_records, _ = _record(tiny_model("mixtral", num_hidden_layers=3), None)
    assert [r.active_param_fraction for r in records] == pytest.approx(
        [r.active_param_fraction for r in full_records], rel=1e-12)
    assert 0 < records[0].active_param_fraction < 1
    # the store says the same: layer numbers are the model's, in every table
    store = Store(tmp_path)
    assert sorted(store.sql("SELECT DISTINCT layer FROM layer_steps").layer) == indices
    assert sorted(store.sql("SELECT DISTINCT layer FROM routes").layer) == indices
    assert store.sql("SELECT layer, module FROM layers ORDER BY layer").values.tolist() == [
        [i, n] for i, n in zip(indices, watched)]


def test_a_predicate_is_asked_about_every_block_and_its_answer_is_obeyed():
    model = tiny_model("mixtral", num_hidden_layers=3)
    asked = []

    def only_the_middle(name: str) -> bool:
        asked.append(name)
        return name == "model.layers.1.mlp"

    session, records, seen = _record(model, only_the_middle)
    assert asked == BLOCKS
    assert [layer.name for layer in session.layers] == ["model.layers.1.mlp"]
    assert all([ls.layer for ls in record.layers] == [1] for record in records)
    # nothing of the other blocks is hooked: their experts ran, the probe recorded none of it
    assert len(seen["model.layers.0.mlp"]) == len(records) == 2
    assert {ls.layer for record in records for ls in record.layers} == {1}


def test_a_predicate_matching_nothing_is_refused_with_the_names():
    model = tiny_model("mixtral", num_hidden_layers=3)
    with pytest.raises(probe.NoMoELayersError, match="matches none.*model.layers.0.mlp, model.layers.1.mlp"):
        probe.attach(model, layers=lambda name: False)
    with pytest.raises(TypeError, match="module name, a list of names or a predicate"):
        probe.attach(model, layers=3)


def test_unwatched_layers_are_estimated_at_k_experts_even_where_tokens_are_dropped():
    """Switch drops tokens at capacity: the watched layer counts what it really kept, the unwatched
    one k = 1 expert per token (the documented estimate), so the figure differs from a full attach."""
    model = tiny_model("switch_transformers", expert_capacity=2)
    names = [layer.name for layer in probe.find_moe_layers(model)]
    g = torch.Generator().manual_seed(1)
    inputs = dict(input_ids=torch.randint(0, 128, (3, 7), generator=g),
                  decoder_input_ids=torch.randint(0, 128, (3, 7), generator=g))
    memory = InMemoryExporter()
    with probe.attach(model, layers=names[1], exporters=[memory], routes=True) as session, torch.no_grad():
        model(**inputs)
    [record] = memory.records
    [ls] = record.layers
    assert ls.layer == 1 and session.run.layers[0].layer == 1
    total = sum(p.numel() for p in model.parameters())
    experts = [layer.experts for layer in probe.find_moe_layers(model)]
    per_expert = [sum(p.numel() for p in e.parameters()) / 8 for e in experts]
    kept = ls.routes.kept.sum(axis=1).mean()
    assert kept < 1  # some tokens of the watched layer were dropped
    active = total - sum(per_expert) * 8 + per_expert[0] * 1 + per_expert[1] * kept
    assert record.active_params == pytest.approx(active, rel=1e-12)
