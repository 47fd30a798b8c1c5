"""Routing replay under torch.compile (CPU): the model's own routing, replayed in a compiled model,
gives the compiled model's own logits and loss bit for bit, without a graph break of its own.

Oracles: the compiled model without replay (same backend), the routing its experts really received
(read here from transformers' calls), dynamo's graph-break counters. Every family replay covers
compiles with dynamo's eager backend (the graph traced, hooks included, and run with eager kernels);
Mixtral also with inductor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import moescope
from moescope import probe
from moescope.probe.adapters import experts_arguments
from moescope.probe.trust_gate import RULES
from tests.support.zoo import FAMILIES, tiny_model

BATCH, SEQ = 2, 6
ROUTER_CHOICE = ("llama4", "switch_transformers")
CASES = [(family, "eager") for family in sorted(set(FAMILIES) & set(RULES))] + [("mixtral", "inductor")]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _inputs(family: str) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=g)
    inputs = dict(input_ids=ids, labels=ids)
    if family == "switch_transformers":
        inputs["decoder_input_ids"] = torch.randint(0, 128, (BATCH, SEQ), generator=g)
    return inputs


def _own_routing(model, family: str, inputs: dict) -> np.ndarray:
    layers = probe.find_moe_layers(model)
    ids: dict[int, torch.Tensor] = {}
    handles = []
    for layer in layers:
        if family in ROUTER_CHOICE:
            def router(m, a, o, i=layer.index, k=layer.top_k):
                raw = o[1] if family == "llama4" else o[2]
                ids[i] = torch.topk(raw.reshape(-1, raw.shape[-1]), k, dim=-1).indices
            handles.append(layer.router.register_forward_hook(router))
        else:
            handles.append(layer.experts.register_forward_pre_hook(
                lambda m, a, kw, i=layer.index, k=layer.top_k: ids.__setitem__(
                    i, experts_arguments(a, kw)[0].reshape(-1, k).clone()), with_kwargs=True))
    with torch.no_grad():
        model(**inputs)
    for handle in handles:
        handle.remove()
    return np.stack([ids[i].reshape(BATCH, SEQ, -1).numpy() for i in range(len(layers))], axis=2)


@pytest.mark.parametrize("family, backend", CASES)
def test_replaying_the_own_routing_in_a_compiled_model_changes_no_bit(family, backend):
    model = tiny_model(family, correction_bias=0.2 if family == "deepseek_v3" else None)
    inputs = _inputs(family)
    routes = _own_routing(model, family, inputs)
    with torch.no_grad():
        bare = torch.compile(model, backend=backend)(**inputs)
    bare_breaks = set(counters["graph_break"])  # some families break the graph themselves (DBRX: nonzero)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), moescope.replay(model, routes):
        replayed = torch.compile(model, backend=backend)(**inputs)
    assert set(counters["graph_break"]) <= bare_breaks, "replay must not break the compiled graph"
    assert torch.equal(bare.logits, replayed.logits) and torch.equal(bare.loss, replayed.loss)
