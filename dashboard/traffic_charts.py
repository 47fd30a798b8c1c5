"""The placement page's traffic section: what the placement costs on the wire (docs/traffic.md).

Figure builders are pure functions of `moescope.analyses.traffic.traffic_report`'s rows; `section`
draws them on the page (the rank x rank heatmap of tokens sent and the fan-out histogram of one
layer) with the page's ranks, contiguous layout and nodes of 8.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from moescope.dashboard import data
from moescope.dashboard.figures import _layout, empty_figure

NODE_KEY, LAYER_KEY = "pl_traffic_per_node", "pl_traffic_layer"


def rank_matrix_heatmap(row: pd.Series | None) -> go.Figure:
    """Tokens sent from home rank (rows) to rank (columns) of one layer (dispatch; combine is the
    transpose). The diagonal (tokens served at home, no wire) is left blank; hover: the tokens and
    whether the link stays inside a node."""
    if row is None:
        return empty_figure("no routes recorded: attach with routes=True")
    matrix = np.asarray(row["rank_matrix"], dtype=np.float64).copy()
    ranks = matrix.shape[0]
    np.fill_diagonal(matrix, np.nan)
    nodes = np.asarray(row["node_of_rank"])
    text = [[f"rank {h} -> rank {r}: {matrix[h, r]:,.0f} tokens"
             + (" (inside node %d)" % nodes[h] if nodes[h] == nodes[r] else f" (node {nodes[h]} -> {nodes[r]})")
             if h != r else f"rank {h}: {row['rank_matrix'][h][h]:,} tokens with an expert at home"
             for r in range(ranks)] for h in range(ranks)]
    fig = go.Figure(go.Heatmap(z=matrix, x=[str(r) for r in range(ranks)], y=[str(r) for r in range(ranks)],
                               colorscale="Viridis", colorbar={"title": "tokens"}, text=text,
                               hovertemplate="%{text}<extra></extra>"))
    fig.update_xaxes(title="to rank", type="category")
    fig.update_yaxes(title="from home rank", type="category", autorange="reversed")
    h, r = row["busiest_link"]
    return _layout(fig, f"Layer {row['layer']}: tokens sent per link (busiest {h} -> {r}, "
                        f"intra-node share {row['intra_node_share']:.2f})")


def fanout_histogram(row: pd.Series | None) -> go.Figure:
    """Tokens by the number of remote ranks (and remote nodes) their kept experts sit on, one layer,
    with the means and floors in the title."""
    if row is None:
        return empty_figure("no routes recorded: attach with routes=True")
    fig = go.Figure()
    for name, column in (("remote ranks", "remote_ranks_histogram"), ("remote nodes", "remote_nodes_histogram")):
        counts = np.asarray(row[column], dtype=np.int64)
        fig.add_bar(x=np.arange(counts.size), y=counts, name=name)
    fig.update_xaxes(title="remote ranks / nodes a token reaches", dtick=1)
    fig.update_yaxes(title="tokens")
    return _layout(fig, f"Fan-out: {row['remote_ranks_mean']:.2f} remote ranks per token (floor "
                        f"{row['floor_remote_ranks']:.2f}), {row['remote_nodes_mean']:.2f} remote nodes "
                        f"(floor {row['floor_remote_nodes']:.2f})", barmode="group")


def _traffic(store, run_id: str, ranks: int, per_node: int, tags: dict[str, str] | None) -> pd.DataFrame:
    from moescope.analyses.placement import Placement
    from moescope.analyses.traffic import Wire, default_home, node_layout, traffic_report

    nodes = node_layout(ranks, per_node)
    frame = traffic_report(store, run_id, Placement.contiguous(ranks), Wire(nodes, default_home(store, run_id)),
                           None, tags).layers
    return frame.assign(node_of_rank=[nodes] * len(frame))


@st.cache_data(ttl=data.TTL_S, max_entries=32, show_spinner=False)
def traffic(root: str, version: str, run_id: str, ranks: int, per_node: int, tag: data.TagFilter) -> pd.DataFrame:
    return data.with_store(root, version, _traffic, run_id, ranks, per_node, data.tags(tag))


def section(ctx, ranks: int) -> None:
    """Draw the traffic section for the page's run under the contiguous layout over `ranks` ranks."""
    st.subheader("Traffic on the wire")
    st.session_state.setdefault(NODE_KEY, 8)
    left, right = st.columns(2)
    per_node = int(left.number_input("Ranks per node", min_value=1, max_value=max(1, ranks), key=NODE_KEY,
                                     help="Consecutive ranks share a node (NVLink); between nodes, RDMA."))
    frame = traffic(ctx.root, ctx.version, ctx.run_id, ranks, per_node, ctx.tag)
    row = None
    if not frame.empty:
        layers = [int(v) for v in frame.layer]
        if st.session_state.get(LAYER_KEY) not in layers:
            st.session_state[LAYER_KEY] = layers[0]
        layer = right.selectbox("MoE layer", layers, key=LAYER_KEY)
        row = frame[frame.layer == layer].iloc[0]
    st.plotly_chart(rank_matrix_heatmap(row), key="pl_traffic_matrix")
    st.plotly_chart(fanout_histogram(row), key="pl_traffic_fanout")
    st.caption("A token is sent once to each GPU other than its home that holds any of its experts (DeepEP), "
               "once to each other node over RDMA. Home: the rank that recorded it, or its sequence modulo the "
               "ranks for a one-process run. `moescope traffic STORE --ranks R --compare default,coselection` "
               "for bytes, node-limited routing and other placements (docs/traffic.md).")
