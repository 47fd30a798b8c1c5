"""An independent implementation of DeepSeek's EPLB placement, for the tests only.

Written from the published description (deepseek-ai/EPLB's README), not from moescope's code, in a
different shape: positions of a flat physical-slot array instead of lists of packs. Greedy packing
takes the items heaviest first (ties: lower index first) onto the pack of least load that still has
room (ties: lower pack first); replication gives each extra slot to the largest load per copy
(ties: lower expert first).
"""

from __future__ import annotations

import numpy as np


def _pack(weight: np.ndarray, packs: int) -> np.ndarray:
    """pack[i] for each item, and the order items entered their pack (as a second array)."""
    n = weight.size
    cap = n // packs
    pack_of = np.full(n, -1)
    order_in = np.full(n, -1)
    load = np.zeros(packs)
    count = np.zeros(packs, dtype=int)
    for item in np.lexsort((np.arange(n), -weight)):
        best = -1
        for p in range(packs):
            if count[p] < cap and (best < 0 or load[p] < load[best]):
                best = p
        pack_of[item] = best
        order_in[item] = count[best]
        load[best] += weight[item]
        count[best] += 1
    return np.stack([pack_of, order_in])


def reference_eplb(load: np.ndarray, ranks: int, nodes: int, groups: int, redundant: int) -> list[list[int]]:
    """One layer's placement: per rank, the logical expert of each slot in slot order."""
    load = np.asarray(load, dtype=float)
    experts = load.size
    if groups % nodes:
        nodes, groups = 1, 1
    size = experts // groups
    group_pack = _pack(load.reshape(groups, size).sum(axis=1), nodes)
    gpus = ranks // nodes
    slots_node = (experts + redundant) // nodes
    result: list[list[int]] = [[] for _ in range(ranks)]
    for node in range(nodes):
        members = [g for g in range(groups) if group_pack[0, g] == node]
        members.sort(key=lambda g: group_pack[1, g])
        node_experts = np.concatenate([np.arange(g * size, (g + 1) * size) for g in members])
        copies = np.ones(node_experts.size, dtype=int)
        w = load[node_experts]
        while copies.sum() < slots_node:
            ratio = w / copies
            copies[int(np.flatnonzero(ratio == ratio.max())[0])] += 1
        phys = np.repeat(node_experts, copies)
        phys_w = np.repeat(w / copies, copies)
        gpu_pack = _pack(phys_w, gpus)
        for gpu in range(gpus):
            mine = [i for i in range(phys.size) if gpu_pack[0, i] == gpu]
            mine.sort(key=lambda i: gpu_pack[1, i])
            result[node * gpus + gpu] = [int(phys[i]) for i in mine]
    return result
