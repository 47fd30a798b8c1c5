"""Placement: which GPU runs hot under a placement of experts on expert-parallel ranks, which experts
put it there, and what another placement would have done with the same loads.

Sections (each a function below; a new section is one more function called at the end):
load per rank (rank x layer heatmap of `moescope.analyses.placement.placement_report`), balancedness
over time per candidate placement and before/after for one
(`moescope.analyses.placement.placement_whatif`: the rows `moescope placement --whatif --save` wrote,
or computed here with the page's settings), when to rebalance (`moescope.analyses.rebalance`: the
policies' curve of balancedness against bytes moved), and traffic on the wire
(`moescope.analyses.traffic.traffic_report`). Every frame comes through `moescope.dashboard.data`.
The sections that read only the expert loads are drawn at once; traffic, a pass over one layer's routes
rows, is computed off the page's run and drawn on the run after (`moescope.dashboard.common.after_first_render`).
"""

from __future__ import annotations

import streamlit as st

from moescope.analyses.placement import DISPATCH, ENGINE_OF_SOURCE, PlacementError, default_ranks
from moescope.dashboard import common, data
from moescope.dashboard import figures as fg

RANKS, WINDOW, DISPATCH_KEY, CANDIDATE, LAYER = "pl_ranks", "pl_window", "pl_dispatch", "pl_candidate", "pl_layer"
NODE_KEY, TRAFFIC_LAYER = "pl_traffic_per_node", "pl_traffic_layer"
WINDOWS = (8, 16, 32, 64, 128, 256, 512, 1024)


def load_per_rank(ctx: common.PageContext, ranks: int, dispatch: str) -> None:
    st.subheader("Load per rank")
    layers = data.placement_report(ctx.root, ctx.version, ctx.run_id, ranks, None, dispatch, ctx.tag)
    st.plotly_chart(fg.rank_layer_heatmap(layers, ranks), key="pl_heatmap")
    if not layers.empty:
        worst = layers.sort_values("balancedness").iloc[0]
        st.caption(f"Default layout over {ranks} ranks (contiguous experts). Lowest balancedness: layer "
                   f"{int(worst.layer)}, {worst.balancedness:.3f} (vLLM's mean/max; TensorRT-LLM's imbalance "
                   f"(max-mean)/mean {worst.imbalance:.3f}), hottest rank {int(worst.hottest_rank)}. A rank at 1.5x "
                   "makes every rank of that layer wait a third of its time. For an engine's own map: "
                   "`moescope placement STORE --placement FILE`.")


def over_time_and_before_after(ctx: common.PageContext, ranks: int, window: int, dispatch: str) -> None:
    rows, summary, origin, coincide = data.placement_whatif(ctx.root, ctx.version, ctx.run_id, ranks, window,
                                                            dispatch, ctx.tag)
    st.subheader("Balancedness over time")
    st.plotly_chart(fg.balancedness_over_time_figure(summary), key="pl_over_time")
    st.caption(f"What-if {origin}. Each line is a placement evaluated on every window of recorded loads; "
               "a fitted one falls off as traffic moves away from the window it was fitted on.")
    per_window = summary.groupby("window_start").balancedness
    if summary.candidate.nunique() > 1 and (per_window.max() - per_window.min() < 1e-9).all():
        st.info(f"Every placement gives the same balancedness here: "
                f"{coincide or 'the recorded loads are even enough that no placement beats another'}. "
                "Fewer ranks (two or more experts each) or redundant slots "
                "(`moescope placement STORE --whatif --redundant S --save`) give the what-if a choice.")
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


def when_to_rebalance(ctx: common.PageContext, ranks: int, window: int, dispatch: str) -> None:
    """The rebalance replay (`moescope.analyses.rebalance`): a point per policy, bytes moved per hour
    against the mean balancedness it kept, from the default layout."""
    st.subheader("When to rebalance")
    curve, stale = data.rebalance_curve(ctx.root, ctx.version, ctx.run_id, ranks, window, dispatch, ctx.tag)
    st.plotly_chart(fg.rebalance_curve_figure(curve), key="pl_rebalance_curve")
    st.caption(f"Each policy replayed over the run from the default layout, every refit DeepSeek's EPLB, a step of "
               f"the replay a window of {window} steps: every N windows, vLLM's and SGLang's schedules (knobs in "
               f"windows of this page) and never. Up and left is balance bought with few moves. A fresh fit on the "
               f"last 1000 steps would win back {stale:.1%} of the MoE time from the default layout (the "
               "`PlacementStale` rule fires above 10%). An engine's own knobs and map, the bytes of its experts: "
               "`moescope placement STORE --placement FILE --rebalance --policy vllm:1000:3000`.")


def traffic(ctx: common.PageContext, ranks: int) -> None:
    """What the placement costs on the wire (docs/traffic.md): the tokens each home rank sends each
    other rank, and the tokens by the remote ranks and nodes they reach, of one layer."""
    st.subheader("Traffic on the wire")
    if st.session_state.get(NODE_KEY, 8) > ranks:  # 8 GPUs a node, or every rank on one node when fewer
        st.session_state[NODE_KEY] = min(8, ranks)
    left, right = st.columns(2)
    per_node = int(left.number_input("Ranks per node", min_value=1, max_value=max(1, ranks), key=NODE_KEY,
                                     help="Consecutive ranks share a node (NVLink); between nodes, RDMA."))
    # one layer's traffic at a time: each is a pass over that layer's routes rows
    layers = ctx.layer_ids()
    if st.session_state.get(TRAFFIC_LAYER) not in layers:
        st.session_state[TRAFFIC_LAYER] = layers[0]
    layer = int(right.selectbox("MoE layer", layers, key=TRAFFIC_LAYER) or layers[0])
    # the only section that reads the routes rows (and checks their files): computed off the page's first run
    frame = common.after_first_render(data.traffic, ctx.root, ctx.version, ctx.run_id, ranks, per_node, layer,
                                      ctx.tag, what=f"Counting layer {layer}'s routes for its traffic on the wire…")
    if frame is None:
        return
    row = frame.iloc[0] if not frame.empty else None
    st.plotly_chart(fg.rank_matrix_heatmap(row), key="pl_traffic_matrix")
    st.plotly_chart(fg.fanout_histogram(row), key="pl_traffic_fanout")
    st.caption("A token is sent once to each GPU other than its home that holds any of its experts (DeepEP), "
               "once to each other node over RDMA. Home: the rank that recorded it, or its row in its forward "
               "modulo the ranks for a one-process run (as every view counts it). `moescope traffic STORE --ranks R "
               "--compare default,coselection` for bytes, node-limited routing and other placements (docs/traffic.md).")


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
    st.session_state.setdefault(RANKS, default_ranks(experts))
    ranks = int(a.number_input("Expert-parallel ranks", min_value=1, max_value=max(1, experts), key=RANKS,
                               help="GPUs the experts are spread over (the default layout: contiguous experts). "
                                    "It starts at the most ranks, up to 8, that hold two or more experts each, "
                                    "so that the placements compared below can differ."))
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
        when_to_rebalance(ctx, ranks, window, dispatch)
    except PlacementError as e:  # a run this placement cannot describe: say what, draw what was drawn
        st.warning(f"The placement does not fit this run: {e}")
    traffic(ctx, ranks)
