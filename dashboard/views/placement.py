"""Placement: which GPU runs hot under a placement of experts on expert-parallel ranks, which experts
put it there, and what another placement would have done with the same loads.

Sections (each a function below; a new section is one more function called at the end):
load per rank (rank x layer heatmap of `analyses.placement.placement_report`), balancedness over
time per candidate placement and before/after for one (`analyses.placement.placement_whatif`: the
rows `moescope placement --whatif --save` wrote, or computed here with the page's settings).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from moescope.analyses.placement import (
    DISPATCH,
    ENGINE_OF_SOURCE,
    Placement,
    PlacementError,
    WhatIfSetup,
    placement_report,
    placement_whatif,
)
from moescope.dashboard import common, data, traffic_charts
from moescope.dashboard import figures as fg
from moescope.metrics import signals
from moescope.store import Store

RANKS, WINDOW, DISPATCH_KEY, CANDIDATE, LAYER = "pl_ranks", "pl_window", "pl_dispatch", "pl_candidate", "pl_layer"
WINDOWS = (8, 16, 32, 64, 128, 256, 512, 1024)


def _report(store: Store, run_id: str, ranks: int, window: int | None, dispatch: str,
            tags: dict[str, str] | None = None) -> pd.DataFrame:
    return placement_report(store, run_id, Placement.contiguous(ranks), window, tags, dispatch=dispatch,
                            tokens=False).layers


def _whatif(store: Store, run_id: str, ranks: int, window: int, dispatch: str,
            tags: dict[str, str] | None = None) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """(rows, summary, where they came from): the stored what-if when the run has one, else computed."""
    stored = store.placement_whatif(run_id)
    if not stored.empty and not tags:
        rows = stored.copy()
        rows["rank_load"] = [np.asarray(v, dtype=np.float64) for v in rows.rank_load]
        summary = pd.DataFrame([dict(candidate=candidate, window_start=start, window_end=group.window_end.iloc[0],
                                     balancedness=signals.balancedness_over_layers(np.stack(list(group.rank_load))))
                                for (candidate, start), group in rows.groupby(["candidate", "window_start"],
                                                                               sort=False)])
        first = stored.iloc[0]
        return rows, summary, (f"stored by `moescope placement --whatif --save` ({int(first.ranks)} ranks, "
                               f"{int(first.redundant)} redundant, dispatch {first.dispatch})")
    totals = store.layer_totals(run_id, tags=tags)
    experts = max((int(r.num_experts) if pd.notna(r.num_experts) else len(r.expert_load)
                   for r in totals.itertuples()), default=ranks)
    redundant = -experts % ranks  # the fewest extra slots that split evenly over the ranks, as EPLB needs
    report = placement_whatif(store, run_id, window, WhatIfSetup(ranks=ranks, redundant=redundant, rebalance_every=1),
                              tags=tags, dispatch=dispatch)
    return report.rows, report.summary, (f"computed here: {ranks} ranks, {redundant} redundant slot(s), fitted on "
                                         f"the first window of {window} steps")


@st.cache_data(ttl=data.TTL_S, max_entries=64, show_spinner=False)
def report(root: str, version: str, run_id: str, ranks: int, window: int | None, dispatch: str,
           tag: data.TagFilter) -> pd.DataFrame:
    return data.with_store(root, version, _report, run_id, ranks, window, dispatch, data.tags(tag))


@st.cache_data(ttl=data.TTL_S, max_entries=64, show_spinner=False)
def whatif(root: str, version: str, run_id: str, ranks: int, window: int, dispatch: str,
           tag: data.TagFilter) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    return data.with_store(root, version, _whatif, run_id, ranks, window, dispatch, data.tags(tag))


def load_per_rank(ctx: common.PageContext, ranks: int, dispatch: str) -> None:
    st.subheader("Load per rank")
    layers = report(ctx.root, ctx.version, ctx.run_id, ranks, None, dispatch, ctx.tag)
    st.plotly_chart(fg.rank_layer_heatmap(layers, ranks), key="pl_heatmap")
    if not layers.empty:
        worst = layers.sort_values("balancedness").iloc[0]
        st.caption(f"Default layout over {ranks} ranks (contiguous experts). Lowest balancedness: layer "
                   f"{int(worst.layer)}, {worst.balancedness:.3f} (vLLM's mean/max; TensorRT-LLM's imbalance "
                   f"(max-mean)/mean {worst.imbalance:.3f}), hottest rank {int(worst.hottest_rank)}. A rank at 1.5x "
                   "makes every rank of that layer wait a third of its time. For an engine's own map: "
                   "`moescope placement STORE --placement FILE`.")


def over_time_and_before_after(ctx: common.PageContext, ranks: int, window: int, dispatch: str) -> None:
    rows, summary, origin = whatif(ctx.root, ctx.version, ctx.run_id, ranks, window, dispatch, ctx.tag)
    st.subheader("Balancedness over time")
    st.plotly_chart(fg.balancedness_over_time_figure(summary), key="pl_over_time")
    st.caption(f"What-if {origin}. Each line is a placement evaluated on every window of recorded loads; "
               "a fitted one falls off as traffic moves away from the window it was fitted on.")
    st.subheader("Before and after")
    candidates = [c for c in dict.fromkeys(rows.candidate) if c not in ("current", "default")]
    if not candidates:
        st.info("No fitted candidate in this what-if.")
        return
    left, right = st.columns(2)
    if st.session_state.get(CANDIDATE) not in candidates:
        st.session_state[CANDIDATE] = candidates[0]
    candidate = left.selectbox("Candidate placement", candidates, key=CANDIDATE)
    layers = sorted({int(v) for v in rows.layer})
    if st.session_state.get(LAYER) not in layers:
        st.session_state[LAYER] = layers[0]
    layer = right.selectbox("MoE layer", layers, key=LAYER)
    before_name = "current" if "current" in set(rows.candidate) else "default"
    last = rows.window_start.max()
    pick = rows[(rows.layer == layer) & (rows.window_start == last)]
    before = pick[pick.candidate == before_name].rank_load.iloc[0]
    after = pick[pick.candidate == candidate].rank_load.iloc[0]
    st.plotly_chart(fg.before_after_figure(before, after, (before_name, candidate),
                                           f"Layer {layer}, last window (steps {int(last)}+): slots per rank"),
                    key="pl_before_after")


st.title("Placement")
ctx = common.page_context()
if ctx is None:
    st.stop()

with common.guard():
    common.filter_caption(ctx)
    if not ctx.layer_ids():
        st.info("This run has no MoE layer recorded yet.")
        st.stop()
    experts = int(ctx.layers.num_experts.max())
    a, b, c = st.columns(3)
    st.session_state.setdefault(RANKS, max(1, min(8, experts)))
    ranks = int(a.number_input("Expert-parallel ranks", min_value=1, max_value=max(1, experts), key=RANKS,
                               help="GPUs the experts are spread over (the default layout: contiguous experts)."))
    st.session_state.setdefault(WINDOW, 32)
    window = int(b.selectbox("Window (steps)", WINDOWS, key=WINDOW,
                             help="The what-if fits on the first window and is evaluated on every one.") or 32)
    st.session_state.setdefault(DISPATCH_KEY, ENGINE_OF_SOURCE.get(common.run_source(ctx), "even"))
    dispatch = str(c.selectbox("Redundant copies split as", list(DISPATCH), key=DISPATCH_KEY,
                               help="How the engine picks a copy of a replicated expert (docs/placement.md).")
                   or "even")
    try:
        load_per_rank(ctx, ranks, dispatch)
        over_time_and_before_after(ctx, ranks, window, dispatch)
    except PlacementError as e:  # a run this placement cannot describe: say what, draw what was drawn
        st.warning(f"The placement does not fit this run: {e}")
    traffic_charts.section(ctx, ranks)  # what the placement costs on the wire (issue 43)
