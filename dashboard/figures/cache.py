"""The Expert cache page's figure: the hit rate of each cache policy against the experts resident."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from moescope.dashboard.figures.layout import PALETTE, empty_figure, layout


def cache_hit_figure(report: pd.DataFrame, title: str = "") -> go.Figure:
    """Expert-cache hit rate (percent) against experts resident, a line per (layer, policy).

    `report` is `moescope.analyses.expert_cache.cache_report`'s frame: layer, policy, capacity, hit_rate, ...
    Each policy keeps one colour; layers differ by dash when several are drawn.
    """
    if report.empty:
        return empty_figure("no routes recorded: attach the probe with routes=True to replay them")
    dashes = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
    policies = list(dict.fromkeys(report.policy))
    layers = sorted(report.layer.unique())
    fig = go.Figure()
    for li, layer in enumerate(layers):
        for pi, policy in enumerate(policies):
            line = report[(report.layer == layer) & (report.policy == policy)].sort_values("capacity")
            if line.empty:
                continue
            name = policy if len(layers) == 1 else f"layer {layer} {policy}"
            fig.add_trace(go.Scatter(
                x=line.capacity, y=line.hit_rate * 100, mode="lines+markers", name=name,
                line={"color": PALETTE[pi % len(PALETTE)], "dash": dashes[li % len(dashes)]},
                hovertemplate=f"{name}: %{{x}} experts resident, %{{y:.1f}}% hits<extra></extra>"))
    fig.update_xaxes(title="experts resident per layer (C)", dtick=1 if report.capacity.max() <= 16 else None)
    fig.update_yaxes(title="hit rate (% of expert accesses)", range=[0, 100])
    return layout(fig, title or "Expert-cache hit rate")

