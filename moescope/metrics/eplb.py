"""Placements fitted to recorded loads: DeepSeek's EPLB algorithm and the seeds' load-aware mapping.

Both take per-layer expert loads ([layers, experts], any window) and return a
`moescope.metrics.placement.Placement`, so the what-if (`moescope.analyses.placement_whatif`) can
evaluate them on other windows than the one they were fitted on.

`eplb` follows `rebalance_experts` of `deepseek-ai/EPLB` (`eplb.py`), read from its code; vLLM
(`vllm/distributed/eplb/policy/default.py`) and SGLang (`--eplb-algorithm auto`) run it as their
rebalance, so the placement here is the one the engine would lay out, slot for slot:

- *hierarchical* (`rebalance_experts_hierarchical`, whenever the node count divides the expert-group
  count, one node included): expert groups (contiguous experts, `groups` of them) are packed onto
  nodes, the same number on each; a node's experts, in the order its groups were packed, are
  replicated into the node's physical slots (`replicate_experts`: the node's experts once each, then
  every extra slot to the expert with the highest load per copy, in the order chosen); and those
  physical slots are packed onto the node's GPUs, the same number on each, by their load per copy;
- *global* (otherwise): the same with one node and one group.

Packing (`balanced_packing`): when every pack holds one item, item i goes into pack i whatever the
loads (nodes = groups; one slot per GPU); otherwise items in decreasing load, each onto the lightest
pack that still has room (the first such pack on a tie), and a pack's items keep the order they came
in. Like the engines, loads are float32 and each copy's load is float32 division; a pack's total is a
float64 sum, as in vLLM's port (DeepSeek's own code sums float32: the same below 2**24 per pack).

Ties: on equal loads this takes the lower index first. The engines' sorts are not stable (PyTorch's
CPU sort past 16 items, NumPy's quicksort in vLLM), so where two items of equal load tie they may
trade places in the engine's map; every pack's load, and so every balancedness figure, is the same.

`load_aware` is the hand rule the seeds use on their cards: the hottest experts alone on a card, the
middle ones in pairs, the cold ones together on what is left (see its docstring for the thresholds).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moescope.metrics.placement import Placement, PlacementError, RankExperts


def balanced_packing(weights: Sequence[float], packs: int) -> list[list[int]]:
    """Items into `packs` packs of len(weights) / packs items each, as DeepSeek's `balanced_packing`:
    with one item per pack, item i in pack i; otherwise heaviest first (the lower index on a tie)
    onto the lightest pack with room (the lowest-numbered on a tie). Returns each pack's items in the
    order they were put in. Raises PlacementError when the packs do not divide the items."""
    n = len(weights)
    if packs < 1 or n % packs:
        raise PlacementError(f"{n} items do not split evenly into {packs} packs")
    room = n // packs
    if room == 1:  # DeepSeek's code returns the identity here, whatever the weights
        return [[item] for item in range(n)]
    contents: list[list[int]] = [[] for _ in range(packs)]
    totals = [0.0] * packs
    for item in sorted(range(n), key=lambda i: (-float(weights[i]), i)):
        pack = min((p for p in range(packs) if len(contents[p]) < room), key=lambda p: (totals[p], p))
        contents[pack].append(item)
        totals[pack] += float(weights[item])
    return contents


def replicate(weights: Sequence[float], slots: int) -> list[int]:
    """The expert (an index into `weights`) of each of `slots` physical slots, as DeepSeek's
    `replicate_experts`: every expert once, in order, then each extra slot to the expert with the
    highest float32 load per copy (the lowest index on a tie), in the order chosen.
    Raises PlacementError when there are fewer slots than experts."""
    n = len(weights)
    if slots < n:
        raise PlacementError(f"{slots} slots cannot hold {n} experts")
    load = np.asarray(weights, dtype=np.float32)
    copies = np.ones(n, dtype=np.float32)
    physical = list(range(n))
    for _ in range(slots - n):
        best = int(np.argmax(load / copies))  # the first of equal maxima, as torch's max and np.argmax
        physical.append(best)
        copies[best] += 1
    return physical


def _eplb_layer(load: np.ndarray, ranks: int, nodes: int, groups: int, redundant: int) -> RankExperts:
    load = np.asarray(load, dtype=np.float32)
    experts = len(load)
    group_size = experts // groups
    node_groups = balanced_packing(load.reshape(groups, group_size).sum(axis=1), nodes)
    ranks_per_node, slots_per_node = ranks // nodes, (experts + redundant) // nodes
    per_rank: list[tuple[int, ...]] = []
    for groups_here in node_groups:  # each node's experts in the order its groups were packed
        node_experts = np.array([g * group_size + i for g in groups_here for i in range(group_size)])
        node_load = load[node_experts]
        physical = np.array(replicate(node_load, slots_per_node))
        copies = np.bincount(physical, minlength=len(node_experts)).astype(np.float32)
        per_copy = (node_load / copies)[physical]
        for pack in balanced_packing(per_copy, ranks_per_node):
            per_rank.append(tuple(int(e) for e in node_experts[physical[pack]]))
    return tuple(per_rank)


def eplb(loads: np.ndarray, ranks: int, nodes: int = 1, groups: int = 1, redundant: int = 0,
         layer_ids: Sequence[int] | None = None) -> Placement:
    """DeepSeek's EPLB placement for every layer of `loads` ([layers, experts]).

    Args:
        loads: load per (layer, logical expert) over the window to fit on (tokens or slots).
        ranks: GPUs (expert-parallel ranks), `ranks / nodes` on each node.
        nodes: server nodes; the hierarchical policy runs when it divides `groups`, else the global
            one (one node, one group), which asks nothing of the nodes.
        groups: expert groups (DeepSeek-V3's group-limited routing: 8); 1 when the model has none.
        redundant: extra physical slots (copies of hot experts); experts + redundant must split
            evenly over the ranks.
        layer_ids: the layer number of each row (default 0..layers-1).

    Returns:
        A Placement whose every listed layer holds (experts + redundant) / ranks slots per rank, each
        rank's slots in the engine's order.

    Raises:
        PlacementError: a shape that does not divide as the algorithm needs (named in the message).
    """
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2:
        raise PlacementError(f"loads must be [layers, experts], got shape {loads.shape}")
    layers, experts = loads.shape
    if ranks < 1 or nodes < 1 or groups < 1 or redundant < 0:
        raise PlacementError("ranks, nodes and groups must be at least 1, redundant at least 0")
    if (experts + redundant) % ranks:
        raise PlacementError(f"{experts} experts + {redundant} redundant slots do not split evenly over {ranks} "
                             "ranks; choose --redundant so that (experts + redundant) is a multiple of the ranks")
    if groups % nodes:  # DeepSeek's global policy: no groups, one node
        nodes, groups = 1, 1
    if ranks % nodes:
        raise PlacementError(f"{ranks} ranks do not split evenly over {nodes} nodes")
    if experts % groups:
        raise PlacementError(f"{experts} experts do not split into {groups} equal groups")
    ids = list(range(layers)) if layer_ids is None else [int(v) for v in layer_ids]
    if len(ids) != layers:
        raise PlacementError(f"{len(ids)} layer ids for {layers} rows of loads")
    placed = {layer: _eplb_layer(loads[i], ranks, nodes, groups, redundant) for i, layer in enumerate(ids)}
    policy = "global" if nodes == groups == 1 else "hierarchical"
    return Placement(ranks=ranks, layers=placed,
                     source=f"EPLB ({policy}, {ranks} ranks, {nodes} nodes, {groups} groups, {redundant} redundant)")


HOT_SHARE = 0.5  # an expert with at least half of a card's fair load runs alone
MID_SHARE = 0.25  # one with a quarter to a half of it shares its card with one other


def _load_aware_layer(load: np.ndarray, ranks: int) -> RankExperts:
    order = sorted(range(len(load)), key=lambda e: (-float(load[e]), e))
    fair = float(load.sum()) / ranks
    hot = [e for e in order if fair > 0 and load[e] >= HOT_SHARE * fair]
    mid = [e for e in order if fair > 0 and MID_SHARE * fair <= load[e] < HOT_SHARE * fair]
    cold = [e for e in order if e not in hot and e not in mid]
    cards: list[list[int]] = [[e] for e in hot[:ranks]]
    spill = hot[ranks:]
    while len(mid) >= 2 and len(cards) < ranks:  # the hottest mid expert with the coldest
        cards.append([mid.pop(0), mid.pop(-1)])
    spill += mid
    spare = list(range(len(cards), ranks))
    cards += [[] for _ in spare]
    totals = [float(sum(load[e] for e in card)) for card in cards]
    # the cold ones (and what did not fit a tier) together on the spare cards, heaviest first onto the lightest
    for e in spill + cold:
        targets = spare if spare and e in cold else range(ranks)
        card = min(targets, key=lambda c: (totals[c], c))
        cards[card].append(e)
        totals[card] += float(load[e])
    return tuple(tuple(card) for card in cards)


def load_aware(loads: np.ndarray, ranks: int, layer_ids: Sequence[int] | None = None) -> Placement:
    """The seeds' load-aware mapping for every layer of `loads` ([layers, experts]), one copy per expert.

    With a card's fair load F = layer load / ranks: experts of load >= F/2 are *hot* and get a card
    each (hottest first, as long as cards remain); experts of F/4 .. F/2 are *mid* and go in pairs,
    the hottest remaining with the coldest remaining, a card per pair; the rest (*cold*) go together
    onto the cards still empty (each onto the lightest of them). What did not fit its tier (more hot
    experts than cards, an odd mid one, no spare card left) goes onto the lightest card of all.
    Cards may then hold different numbers of experts: the seeds' rule, not an engine's, and a card's
    memory is not checked.

    Raises PlacementError for loads that are not [layers, experts] or ranks < 1.
    """
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2:
        raise PlacementError(f"loads must be [layers, experts], got shape {loads.shape}")
    if ranks < 1:
        raise PlacementError(f"ranks must be at least 1, not {ranks}")
    ids = list(range(loads.shape[0])) if layer_ids is None else [int(v) for v in layer_ids]
    placed = {layer: _load_aware_layer(loads[i], ranks) for i, layer in enumerate(ids)}
    return Placement(ranks=ranks, layers=placed, source=f"load-aware (hot alone, mid in pairs, cold together; "
                                                        f"{ranks} ranks)")
