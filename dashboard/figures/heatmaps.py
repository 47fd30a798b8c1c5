"""The Heatmaps page's figures: each expert's share of a layer's slots over time and over the run, and
the co-selection affinity of a layer's experts. The first two are clickable (`layout.click_layer`):
a click lists the tokens of the cell."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from moescope.dashboard.figures.layout import click_layer, empty_figure, layout


def load_heatmap(matrix: pd.DataFrame, layer: int) -> go.Figure:
    """Time x expert heatmap of one layer: each step bucket's share of tokens per expert.

    Cells carry customdata (expert, step_start, step_end, tokens) for click selection."""
    if matrix.empty:
        return empty_figure(f"no load recorded for layer {layer}")
    load = matrix.pivot_table(index="expert", columns="step_start", values="load", aggfunc="sum", fill_value=0)
    ends = matrix.groupby("step_start").step_end.max().reindex(load.columns)
    totals = load.sum(axis=0).replace(0, np.nan)
    share = load / totals
    experts, starts = load.index.to_numpy(), load.columns.to_numpy()
    fig = go.Figure(go.Heatmap(
        z=share.to_numpy(), x=[str(s) for s in starts], y=[str(e) for e in experts], colorscale="Viridis",
        colorbar={"title": "share of slots"}, hoverinfo="skip", zmin=0))
    gx, gy = np.meshgrid(starts, experts)
    gend = np.broadcast_to(ends.to_numpy(), gx.shape)
    custom = np.stack([gy.ravel(), gx.ravel(), gend.ravel(), load.to_numpy().ravel(),
                       share.to_numpy().ravel()], axis=1)
    fig.add_trace(click_layer(
        [str(s) for s in gx.ravel()], [str(e) for e in gy.ravel()], custom,
        "expert %{customdata[0]}, steps %{customdata[1]}-%{customdata[2]}<br>"
        "%{customdata[3]} tokens chose it (%{customdata[4]:.1%} of the bucket's slots)<br>"
        "click to list them<extra></extra>"))
    fig.update_xaxes(title="first step of bucket", type="category")
    fig.update_yaxes(title="expert", type="category")
    return layout(fig, f"Layer {layer}: share of routing slots per expert over time")


def layer_share_heatmap(layer_expert: pd.DataFrame, layer_tokens: dict[int, int]) -> go.Figure:
    """Layer x expert heatmap of each layer's share of routing slots per expert over the run, from
    `Store.expert_share` rows; `layer_tokens` ({layer: tokens it routed}) gives each expert's share
    of the layer's *tokens* in the hover (a token fills k slots, so token shares add up to k).

    Cells carry customdata (layer, expert, tokens that chose it, token share, slot share)."""
    if layer_expert.empty:
        return empty_figure("no load recorded")
    load = layer_expert.pivot_table(index="layer", columns="expert", values="load", aggfunc="sum", fill_value=0)
    share = load.div(load.sum(axis=1).replace(0, np.nan), axis=0)
    tokens = pd.Series({int(k): v for k, v in layer_tokens.items()}, dtype=np.float64).reindex(load.index)
    token_share = load.div(tokens.replace(0, np.nan), axis=0)
    layers, experts = load.index.to_numpy(), load.columns.to_numpy()
    fig = go.Figure(go.Heatmap(z=share.to_numpy(), x=[str(e) for e in experts], y=[str(v) for v in layers],
                               colorscale="Viridis", colorbar={"title": "share of slots"}, hoverinfo="skip",
                               zmin=0))
    gx, gy = np.meshgrid(experts, layers)
    custom = np.stack([gy.ravel(), gx.ravel(), load.to_numpy().ravel(), token_share.to_numpy().ravel(),
                       share.to_numpy().ravel()], axis=1)
    fig.add_trace(click_layer(
        [str(e) for e in gx.ravel()], [str(v) for v in gy.ravel()], custom,
        "layer %{customdata[0]}, expert %{customdata[1]}<br>%{customdata[2]} tokens chose it: "
        "%{customdata[3]:.1%} of the layer's tokens, %{customdata[4]:.1%} of its slots<br>"
        "click to list them<extra></extra>"))
    fig.update_xaxes(title="expert", type="category")
    fig.update_yaxes(title="MoE layer", type="category", autorange="reversed")
    return layout(fig, "Share of each layer's routing slots per expert")


def coselection_heatmap(matrix: np.ndarray | None, layer: int) -> go.Figure:
    """Expert affinity of one layer: P(j chosen | i chosen) from co-selection counts, diagonal
    left blank (it is the expert's own load)."""
    if matrix is None or matrix.size == 0:
        return empty_figure(f"no co-selection recorded for layer {layer} (top-1 routers have none)")
    counts = np.asarray(matrix, dtype=np.float64)
    own = np.diag(counts).copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        affinity = counts / own[:, None]
    np.fill_diagonal(affinity, np.nan)
    labels = [str(i) for i in range(counts.shape[0])]
    fig = go.Figure(go.Heatmap(
        # The scale is fixed at [0, 1] (a probability) and starts light: a near-zero cell reads as 0.
        z=affinity, x=labels, y=labels, colorscale="Blues", zmin=0, zmax=1, colorbar={"title": "P(j | i)"},
        customdata=counts, hovertemplate="i=%{y}, j=%{x}: %{customdata:.0f} tokens chose both<br>"
                                         "P(j | i) = %{z:.3f}<extra></extra>"))
    fig.update_xaxes(title="expert j", type="category")
    fig.update_yaxes(title="expert i", type="category", autorange="reversed")
    return layout(fig, f"Layer {layer}: co-selection affinity")

