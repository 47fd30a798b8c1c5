"""The Semantic clusters page's figures: the UMAP scatter of router inputs, and how much the experts
specialise by a tag (`moescope.metrics.signals.specialisation_by_layer`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from moescope.dashboard.figures.layout import PALETTE, empty_figure, layout
from moescope.metrics import signals

# NMI(expert; tag) over every kept top-k slot (`signals.specialisation_by_layer`). Not the demo model
# card's "top-1 specialisation" (the router's first choice per token, before any capacity): one name each.
SLOT_SPECIALISATION = "kept-slot specialisation"


def cluster_scatter(points: pd.DataFrame, colour: str, title: str) -> go.Figure:
    """UMAP scatter: columns x, y, the `colour` column (categories) and `hover` (text).

    SVG, not WebGL: at most a few thousand points, and it draws without a GPU (headless too)."""
    if points.empty:
        return empty_figure("no router inputs sampled")
    fig = go.Figure()
    for i, (value, rows) in enumerate(points.groupby(points[colour].astype(str), sort=True)):
        fig.add_trace(go.Scatter(
            x=rows.x, y=rows.y, mode="markers", name=f"{colour} {value}", text=rows.hover,
            marker={"size": 6, "color": PALETTE[i % len(PALETTE)], "opacity": 0.8},
            hovertemplate="%{text}<extra></extra>"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return layout(fig, title, height=520, legend={"itemsizing": "constant"})


def specialisation_figure(counts: np.ndarray, experts: Sequence[int], values: Sequence[str], key: str,
                          layer: int) -> go.Figure:
    """Experts x tag values (`signals.expert_tag_contingency`): each tag value's share of slots per
    expert (columns sum to 1), with the layer's kept-slot specialisation, NMI(expert; tag)
    (`signals.normalized_mutual_information`), in the subtitle: a short title and a subtitle fit a
    half-width column where one long title was cut before its value."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.size == 0 or counts.sum() <= 0:
        return empty_figure(f"no step carries the tag {key!r}")
    share = counts / np.where(counts.sum(axis=0, keepdims=True) > 0, counts.sum(axis=0, keepdims=True), np.nan)
    nmi = signals.normalized_mutual_information(counts)
    fig = go.Figure(go.Heatmap(
        z=share, x=list(values), y=[str(e) for e in experts], colorscale="Blues", colorbar={"title": "share"},
        zmin=0, customdata=counts,
        hovertemplate=f"{key}=%{{x}}, expert %{{y}}: %{{customdata:.0f}} tokens "
                      "(%{z:.1%} of the tag's slots)<extra></extra>"))
    fig.update_xaxes(title=key, type="category")
    fig.update_yaxes(title="expert", type="category")
    fig = layout(fig, f"Layer {layer}: {key} share per expert")
    fig.update_layout(title_subtitle_text=f"{SLOT_SPECIALISATION} NMI(expert; {key}) = {nmi:.3f}", margin_t=70)
    return fig


def specialisation_figure_by_layer(per_layer: pd.DataFrame, key: str) -> go.Figure:
    """Bar per layer of the kept-slot specialisation NMI(expert; tag), from `signals.specialisation_by_layer`."""
    if per_layer.empty:
        return empty_figure(f"no step carries the tag {key!r}")
    fig = go.Figure(go.Bar(x=per_layer.layer.astype(str), y=per_layer.nmi, marker_color=PALETTE[2],
                           customdata=per_layer.tokens,
                           hovertemplate="layer %{x}: NMI %{y:.3f} over %{customdata} slots<extra></extra>"))
    fig.update_xaxes(title="MoE layer", type="category")
    fig.update_yaxes(title=f"NMI(expert; {key}) over kept slots", range=[0, 1])
    fig = layout(fig, f"{SLOT_SPECIALISATION.capitalize()} per layer")
    fig.update_layout(title_subtitle_text=f"how much the expert a slot went to tells about {key}", margin_t=70)
    return fig

