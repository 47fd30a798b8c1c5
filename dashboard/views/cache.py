"""Expert cache: with C experts of a layer resident in device memory, how often is a token's
chosen expert already there? LRU, LFU and the offline optimum (Belady), replayed from the run's
recorded routes (`moescope.analyses.expert_cache`; the same numbers as `moescope whatif cache`).
"""

from __future__ import annotations

import streamlit as st

from moescope.dashboard import common, data
from moescope.dashboard import figures as fg

LAYER, TOKENS = "cache_layer", "cache_tokens"  # page-only session keys

st.title("Expert cache")
ctx = common.page_context()
if ctx is None:
    st.stop()

with common.guard():
    common.filter_caption(ctx)
    left, right = st.columns([1, 1])
    with left:
        layer = common.layer_picker(ctx, LAYER)
    if layer is None:
        st.stop()
    limit = right.select_slider("Tokens replayed (the first recorded)", [5_000, 20_000, 50_000, 200_000],
                                value=20_000, key=TOKENS,
                                help="One pass over the routes per policy gives every cache size; the "
                                     "work grows with tokens x experts: more tokens, more waiting.")
    report = data.cache_report(ctx.root, ctx.version, ctx.run_id, layer, limit, ctx.tag)
    if report.empty:
        st.info("No routes recorded for this layer (or none with the chosen tag): the cache is replayed from "
                "per-token routes, kept only when the probe was attached with `routes=True`.")
        st.stop()
    st.plotly_chart(fg.cache_hit_figure(report, f"Expert-cache hit rate, layer {layer}"), key="cache_chart")
    first = report.iloc[0]
    table = report.pivot(index="capacity", columns="policy", values="hit_rate").mul(100).round(1)
    table = table[[p for p in ("lru", "lfu", "belady") if p in table.columns]]
    st.dataframe(table.rename_axis("experts resident").add_suffix(" %"), key="cache_table")
    st.caption(
        (f"Replayed the first {limit:,} tokens recorded (of more); {int(first.tokens):,} of them reached a routed "
         "expert (the others were dropped at capacity or went to zero experts)" if first.truncated else
         f"{int(first.tokens):,} tokens reached a routed expert")
        + f", {int(first.accesses):,} expert accesses. "
        "A hit is an access (a token's kept slot on a routed expert; zero experts and drops are none) whose "
        "expert was resident before the token; a token's experts are needed at once, so a cache smaller than "
        "k holds only part of them. The cache starts empty (first uses miss) and each rank has its own. "
        "Belady knows the future: no server reaches it, it bounds what any policy could.")
