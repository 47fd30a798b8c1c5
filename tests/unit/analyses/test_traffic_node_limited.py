"""Node-limited routing on a real DeepSeek-V3 (random-initialised, 16 experts in 4 groups, top-4),
recorded through `moescope.attach` with its router logits; the oracle is the model itself: its
router's own choice under `topk_group` = M, with nodes holding its groups."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import moescope
from moescope.analyses.traffic import Wire, node_layout, traffic_report
from moescope.metrics.placement import Placement
from moescope.metrics.traffic import LIMIT_RULES
from moescope.store import Store
from tests.support.zoo import tiny_model

EXPERTS, GROUPS, TOP_K, RANKS, PER_NODE = 16, 4, 4, 8, 2  # contiguous layout: node g holds group g
BATCH, LENGTH, FORWARDS = 4, 12, 2


def record(tmp_path, topk_group: int, logits: bool = True):
    """The model's store and, per MoE layer, its router's (weights, ids) of every token, in order."""
    model = tiny_model("deepseek_v3", seed=3, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
                       n_group=GROUPS, topk_group=topk_group)
    inputs = [torch.randint(0, 128, (BATCH, LENGTH), generator=torch.Generator().manual_seed(s))
              for s in range(FORWARDS)]
    store = tmp_path / f"store-{topk_group}-{logits}"
    with moescope.attach(model, store=store, routes=True, router_logits=logits), torch.no_grad():
        for x in inputs:
            model(x)
    return model, inputs, str(store)


def choices(model, inputs, topk_group: int | None = None) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{MoE layer: (weights, ids)} of the model's own routers over `inputs`; with `topk_group`, of a
    copy of each router with that limit, run on the very hidden states the model's router saw (a
    limit in an earlier layer must not change a later layer's input)."""
    seen: dict[int, list] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "topk_group"):
            continue
        router = gate
        if topk_group is not None:
            router = copy.deepcopy(gate)
            router.topk_group = topk_group

        def hook(module, args, out, i=i, router=router):
            out = router(*args) if router is not module else out
            seen.setdefault(i, []).append((out[1].numpy(), out[2].numpy()))
        hooks.append(gate.register_forward_hook(hook))
    with torch.no_grad():
        for x in inputs:
            model(x)
    for h in hooks:
        h.remove()
    # the store numbers MoE layers in order (the dense first layer is not one)
    return {n: (np.concatenate([w for w, _ in v]), np.concatenate([d for _, d in v]))
            for n, v in enumerate(seen.values())}


def oracle(before, after):
    """(changed share, moved weight per token, remote nodes per token, rank matrix) from the model's
    two routings: experts e sits on rank e // 2 (contiguous), tokens' homes are their batch row mod R."""
    weights, ids = before
    _, limited = after
    rank_of = np.arange(EXPERTS) // (EXPERTS // RANKS)
    tokens = len(ids)
    home = np.arange(tokens) % (BATCH * LENGTH) // LENGTH % RANKS  # home: sequence mod R
    changed = moved = remote = 0.0
    matrix = np.zeros((RANKS, RANKS), dtype=np.int64)
    for t in range(tokens):
        kept = set(limited[t].tolist())
        changed += set(ids[t].tolist()) != kept
        moved += sum(w for e, w in zip(ids[t], weights[t]) if e not in kept) / weights[t].sum()
        remote += len({rank_of[e] // PER_NODE for e in kept} - {home[t] // PER_NODE})
        for r in {rank_of[e] for e in kept}:
            matrix[home[t], r] += 1
    return changed / tokens, moved / tokens, remote / tokens, matrix


def report(store: str, max_nodes: int):
    setup = Wire(node_layout(RANKS, PER_NODE), "sequence", max_nodes=max_nodes)
    with Store(store) as s:
        return traffic_report(s, s.latest_run(), Placement.contiguous(RANKS), setup).layers


def test_a_model_that_routes_node_limited_moves_nothing(tmp_path):
    model, inputs, store = record(tmp_path, topk_group=2)
    own = choices(model, inputs)
    frame = report(store, 2)
    assert sorted(frame.layer) == sorted(own)
    for row in frame.itertuples():
        changed, moved, remote, matrix = oracle(own[row.layer], own[row.layer])
        assert row.limited_rule == LIMIT_RULES["scores"]
        assert row.limited_changed_share == 0 and row.limited_moved_weight == 0.0
        assert row.limited_moved_weight_changed == 0.0  # nothing changes: 0, not a blank
        assert row.limited_remote_nodes_mean == pytest.approx(remote)
        np.testing.assert_array_equal(row.limited_rank_matrix, matrix)
        np.testing.assert_array_equal(row.limited_rank_matrix, row.rank_matrix)


@pytest.mark.parametrize("max_nodes", [1, 2, 3])
def test_the_limit_on_an_unlimited_model_is_the_model_rerun_with_it(tmp_path, max_nodes):
    model, inputs, store = record(tmp_path, topk_group=GROUPS)
    unlimited, limited = choices(model, inputs), choices(model, inputs, topk_group=max_nodes)
    frame = report(store, max_nodes)
    for row in frame.itertuples():
        changed, moved, remote, matrix = oracle(unlimited[row.layer], limited[row.layer])
        sends = matrix - np.diag(np.diag(matrix))
        assert changed > 0
        assert row.limited_rule == LIMIT_RULES["scores"]
        assert row.limited_changed_share == pytest.approx(changed)
        assert row.limited_moved_weight == pytest.approx(moved, rel=1e-5)
        assert row.limited_remote_nodes_mean == pytest.approx(remote)
        np.testing.assert_array_equal(row.limited_rank_matrix, matrix)
        assert row.limited_remote_ranks_mean == pytest.approx(sends.sum() / len(limited[row.layer][1]))
        assert row.limited_busiest_link_tokens == sends.max()


def test_without_logits_the_approximation_says_so(tmp_path):
    _, _, store = record(tmp_path, topk_group=GROUPS, logits=False)
    frame = report(store, 2)
    assert (frame.limited_rule == LIMIT_RULES["kept"]).all()
    assert (frame.limited_changed_share > 0).all()
