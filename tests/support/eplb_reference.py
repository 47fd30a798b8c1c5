"""DeepSeek's EPLB as published (deepseek-ai/EPLB, `eplb.py`), re-derived in NumPy for the tests only.

The shape is the published code's, not moescope's: every layer at once as index arrays (a pack index
and a rank in pack per item, the physical-to-logical map of each node, inverse permutations), where
moescope builds lists of packs one layer at a time. What the published code does and this keeps:

- `balanced_packing`: with one item per pack, item i in pack i (the code returns the identity before
  looking at the weights); otherwise items by decreasing weight onto the pack of least weight among
  those with room (the first on a tie), rank in pack = the order items entered it;
- `replicate_experts`: physical slot i < n is logical i; each further slot takes the first argmax of
  weight / count, in the order chosen;
- `rebalance_experts_hierarchical`: groups packed onto nodes; node-local ("mlog") order = pack, then
  rank in pack, then the expert's place in its group; replicated per node; the node's physical slots
  packed onto its GPUs by weight / count; slot = GPU x slots per GPU + rank in pack;
- `rebalance_experts`: the hierarchical policy when nodes divide groups, else it with 1 group, 1 node;
  weights as float32 (`weight.float()`).

One choice the published code leaves to its sort: ties go to the lower index (a stable sort).
PyTorch's sort is stable up to 16 items and not beyond, so tests with ties stay at 16 items or fewer.
"""

from __future__ import annotations

import numpy as np


def balanced_packing(weight: np.ndarray, packs: int) -> tuple[np.ndarray, np.ndarray]:
    """(pack_index, rank_in_pack), each [X, n], for weights [X, n]."""
    layers, items = weight.shape
    assert items % packs == 0
    per_pack = items // packs
    if per_pack == 1:
        return np.tile(np.arange(items), (layers, 1)), np.zeros((layers, items), dtype=np.int64)
    pack_index = np.full((layers, items), -1, dtype=np.int64)
    rank_in_pack = np.full((layers, items), -1, dtype=np.int64)
    for x in range(layers):
        total = np.zeros(packs)
        count = np.zeros(packs, dtype=np.int64)
        for item in np.argsort(-weight[x], kind="stable"):
            candidates = np.flatnonzero(count < per_pack)
            pack = candidates[np.argmin(total[candidates])]
            pack_index[x, item] = pack
            rank_in_pack[x, item] = count[pack]
            total[pack] += weight[x, item]
            count[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, physical: int) -> tuple[np.ndarray, np.ndarray]:
    """(phy2log [X, physical], logcnt [X, n]) for weights [X, n]."""
    layers, logical = weight.shape
    phy2log = np.tile(np.arange(physical), (layers, 1))
    logcnt = np.ones((layers, logical), dtype=np.int64)
    rows = np.arange(layers)
    for slot in range(logical, physical):
        best = np.argmax(weight / logcnt.astype(np.float32), axis=1)
        phy2log[:, slot] = best
        logcnt[rows, best] += 1
    return phy2log, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.tile(np.arange(perm.shape[1]), (perm.shape[0], 1)), axis=1)
    return inv


def hierarchical(weight: np.ndarray, physical: int, groups: int, nodes: int, gpus: int) -> np.ndarray:
    """phy2log [layers, physical]: the logical expert of each physical slot (GPU g holds slots
    g * physical / gpus onwards)."""
    layers, logical = weight.shape
    group_size, groups_per_node = logical // groups, groups // nodes
    per_node, per_gpu = logical // nodes, physical // gpus
    group_pack, group_rank = balanced_packing(weight.reshape(layers, groups, group_size).sum(axis=2), nodes)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size)[:, :, None]
                + np.arange(group_size)).reshape(layers, logical)
    mlog2log = _inverse(log2mlog)
    # one row per (layer, node): that node's experts in node-local order
    node_weight = np.take_along_axis(weight, mlog2log, axis=1).reshape(layers * nodes, per_node)
    phy2mlog, mlogcnt = replicate_experts(node_weight, physical // nodes)
    per_copy = np.take_along_axis(node_weight / mlogcnt.astype(np.float32), phy2mlog, axis=1)
    gpu_pack, gpu_rank = balanced_packing(per_copy, gpus // nodes)
    pphy2phy = _inverse(gpu_pack * per_gpu + gpu_rank)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1).reshape(layers, nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(nodes) * per_node)[None, :, None]).reshape(layers, -1)
    return np.take_along_axis(mlog2log, pphy2mlog, axis=1)


def rebalance_experts(weight: np.ndarray, physical: int, groups: int, nodes: int, gpus: int) -> np.ndarray:
    """phy2log [layers, physical] of `rebalance_experts` for loads [layers, logical]."""
    weight = np.asarray(weight).astype(np.float32)
    if groups % nodes:
        groups, nodes = 1, 1
    return hierarchical(weight, physical, groups, nodes, gpus)


def reference_eplb(load: np.ndarray, ranks: int, nodes: int, groups: int, redundant: int) -> list[list[int]]:
    """One layer's placement: per rank, the logical expert of each slot in slot order."""
    load = np.asarray(load)
    phy2log = rebalance_experts(load[None, :], load.size + redundant, groups, nodes, ranks)[0]
    return [[int(e) for e in row] for row in phy2log.reshape(ranks, -1)]
