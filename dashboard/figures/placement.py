"""The Placement page's figures (`moescope.analyses.placement`, `moescope.analyses.traffic`): slots per
rank and layer, balancedness over time per candidate placement, one placement before and after, and
what the placement costs on the wire (tokens per link, fan-out; docs/traffic.md)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from moescope.dashboard.figures.layout import PALETTE, empty_figure, layout, legend_above


def rank_layer_heatmap(layers: pd.DataFrame, ranks: int) -> go.Figure:
    """Rank x layer heatmap of a placement report's rows (one per layer): each rank's slots over the
    layer's mean rank (1 is even; the hottest rank of a layer sets its pace). Hover: the slots, the
    layer's balancedness and, on its hottest rank, the experts that make it so."""
    if layers.empty:
        return empty_figure("no layer steps recorded")
    rows = layers.sort_values("layer")
    slots = np.stack([np.asarray(v, dtype=np.float64) for v in rows.rank_slots])  # (layers, ranks)
    mean = slots.mean(axis=1, keepdims=True)
    ratio = np.divide(slots, mean, out=np.full_like(slots, np.nan), where=mean > 0)
    hot = [", ".join(f"{e} ({s:,.0f})" for e, s in zip(r.hottest_experts, r.hottest_expert_slots))
           for r in rows.itertuples()]
    text = [[f"layer {r.layer}, rank {k}: {slots[i, k]:,.1f} slots, {ratio[i, k]:.2f}x the mean rank"
             f"<br>layer balancedness {r.balancedness:.3f}"
             + (f"<br>hottest rank; its experts: {hot[i]}" if k == r.hottest_rank else "")
             for k in range(ranks)] for i, r in enumerate(rows.itertuples())]
    fig = go.Figure(go.Heatmap(
        z=ratio.T, x=[str(v) for v in rows.layer], y=[str(k) for k in range(ranks)], colorscale="RdBu_r", zmid=1.0,
        colorbar={"title": "x mean rank"}, text=np.array(text, dtype=object).T, hovertemplate="%{text}<extra></extra>"))
    fig.update_xaxes(title="MoE layer", type="category")
    fig.update_yaxes(title="rank", type="category")
    return layout(fig, "Slots per rank, over the layer's mean rank")


def balancedness_over_time_figure(summary: pd.DataFrame) -> go.Figure:
    """Balancedness of the whole forward (`signals.balancedness_over_layers`) per window, a line per
    candidate placement of a what-if summary; a marker shows where each line's placement was fitted."""
    if summary.empty:
        return empty_figure("no windows to evaluate")
    fig = go.Figure()
    for i, (candidate, line) in enumerate(summary.groupby("candidate", sort=False)):
        line = line.sort_values("window_start")
        fig.add_trace(go.Scatter(
            x=line.window_start, y=line.balancedness, mode="lines+markers", name=str(candidate),
            line={"color": PALETTE[i % len(PALETTE)]},
            hovertemplate=f"{candidate}: steps %{{x}}+, balancedness %{{y:.3f}}<extra></extra>"))
    fig.update_xaxes(title="first step of the window")
    fig.update_yaxes(title="balancedness (mean / max rank, all layers)", range=[0, 1.02])
    return legend_above(layout(fig, "Balancedness over time, per placement"))


def before_after_figure(before: np.ndarray, after: np.ndarray, labels: tuple[str, str], title: str) -> go.Figure:
    """Slots per rank under two placements of the same loads, side by side, with each one's mean."""
    fig = go.Figure()
    for i, (values, label) in enumerate(zip((before, after), labels)):
        values = np.asarray(values, dtype=np.float64)
        fig.add_trace(go.Bar(x=[str(k) for k in range(values.size)], y=values, name=label,
                             marker_color=PALETTE[i], hovertemplate=f"{label}: rank %{{x}}, %{{y:,.1f}} slots"
                                                                    "<extra></extra>"))
    mean = float(np.mean(before)) if np.size(before) else 0.0
    fig.add_hline(y=mean, line_dash="dot", annotation_text="mean rank")
    fig.update_xaxes(title="rank", type="category")
    fig.update_yaxes(title="slots")
    return legend_above(layout(fig, title, barmode="group"))


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
    return layout(fig, f"Layer {row['layer']}: tokens sent per link (busiest {h} -> {r}, "
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
    return layout(fig, f"Fan-out: {row['remote_ranks_mean']:.2f} remote ranks per token (floor "
                        f"{row['floor_remote_ranks']:.2f}), {row['remote_nodes_mean']:.2f} remote nodes "
                        f"(floor {row['floor_remote_nodes']:.2f})", barmode="group")




def rebalance_curve_figure(curve: pd.DataFrame) -> go.Figure:
    """The operator's curve of a rebalance replay (`moescope.analyses.rebalance.RebalanceReport.curve`):
    a point per policy, the expert bytes it moved per hour of the run's traffic across, the mean
    balancedness it kept up; the policies up and to the left are the ones worth their moves."""
    if curve.empty:
        return empty_figure("no policy replayed")
    fig = go.Figure(go.Scatter(
        x=curve.moved_bytes_per_hour, y=curve.mean_balancedness, mode="markers+text", text=list(curve.policy),
        textposition="top center", marker={"color": PALETTE[0], "size": 10},
        customdata=np.asarray(curve.rearrangements),
        hovertemplate="%{text}: %{y:.3f} mean balancedness, %{x:.3s}B moved per hour, "
                      "%{customdata} rearrangement(s)<extra></extra>"))
    fig.update_xaxes(title="expert bytes moved per hour of traffic")
    fig.update_yaxes(title="mean balancedness (mean / max rank, all layers)")
    return layout(fig, "Balancedness kept against bytes moved, per policy")
