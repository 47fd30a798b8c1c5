"""The expert-cache what-if over a recorded run: `moescope whatif cache` and the dashboard's page.

The cache simulation itself (LRU, LFU, Belady over one layer's routes) is pure and lives in
`moescope.metrics.expert_cache`; this report reads a run's routes from a store, layer by layer, and
replays them through it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from moescope.metrics.expert_cache import (
    DEFAULT_MAX_TOKENS,
    MAX_EXPERTS,
    POLICIES,
    REPORT_COLUMNS,
    capacity_grid,
    check_policy,
    replay_routes,
)

__all__ = ["cache_report"]


def cache_report(store, run_id: str | None = None, layer: int | None = None, tags: dict[str, str] | None = None,
                 policies: Iterable[str] = POLICIES, max_tokens: int | None = DEFAULT_MAX_TOKENS,
                 capacities: Iterable[int] | None = None, max_experts: int | None = None):
    """Hit rates of every MoE layer of a run (or one layer) at each capacity, as a long DataFrame.

    The run's recorded routes are replayed through a cache of resident experts per layer, under
    each policy. Layers without routes have no rows, so a run that recorded none gives an empty frame.

    Args:
        store (Store): an open `Store`.
        run_id: the run; None (default): the latest run.
        layer: only this MoE layer; None: every layer.
        tags: keep the steps carrying every given tag (that traffic alone goes through the cache).
        policies: eviction policies, of "lru", "lfu" and "belady" (default: all three).
        max_tokens: the most routed tokens replayed per layer (default 200000); None: all.
        capacities: experts resident per layer to evaluate; None (default): every one from 1 to the
            layer's routed experts E.
        max_experts: refuse a layer with more routed experts than this (default MAX_EXPERTS, 4096:
            the work grows with tokens x experts).

    Returns:
        (pandas.DataFrame): one row per layer, policy and capacity, with columns layer, policy,
            capacity (experts resident per layer), hit_rate (hits / accesses), hits, accesses, tokens
            (replayed tokens with an access), truncated (more routes were recorded than `max_tokens`).

    Raises:
        ValueError: for a run the store does not hold, a layer the run does not have, a layer with
            more routed experts than `max_experts`, an unknown policy or a capacity below 1.
        EmptyStoreError: for a store without runs.
    """
    import pandas as pd

    policies = tuple(policies)
    for policy in policies:
        check_policy(policy)
    if capacities is not None:
        capacities = capacity_grid(capacities, 1)
    bound = MAX_EXPERTS if max_experts is None else max_experts
    run_id = store.check_run(run_id)
    layers = store.layers(run_id)
    if layer is not None:
        if int(layer) not in set(layers.layer.astype(int)):
            raise ValueError(f"run {run_id!r} has no MoE layer {layer}; its layers are "
                             f"{', '.join(map(str, layers.layer.astype(int))) or 'none'}")
        layers = layers[layers.layer == int(layer)]
    for info in layers.itertuples():  # before any replay: a bad layer fails fast, not after the others
        if int(info.num_experts) > bound:
            raise ValueError(f"layer {int(info.layer)} of run {run_id!r} has {int(info.num_experts):,} routed experts, "
                             f"more than the cache replay takes ({bound:,}; the work grows with tokens x experts). "
                             "An expert id out of range in an import makes a layer look this large: check it, "
                             "replay other layers with --layer, or raise the bound (--max-experts, max_experts=)")
    rows = []
    for info in layers.itertuples():
        curves, truncated = replay_routes(store.routes_in_order(run_id, int(info.layer), tags=tags),
                                          int(info.num_experts), policies, max_tokens, capacities, bound)
        for policy, curve in curves.items():
            if curve.tokens == 0:
                continue
            capacities = np.arange(1, len(curve.hits) + 1) if curve.capacities is None else curve.capacities
            for capacity, hits, rate in zip(capacities, curve.hits, curve.hit_rate):
                rows.append((int(info.layer), policy, int(capacity), float(rate), int(hits), curve.accesses,
                             curve.tokens, truncated))
    return pd.DataFrame(rows, columns=REPORT_COLUMNS)
