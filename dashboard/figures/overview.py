"""The Overview page's figures: the active-parameter fraction over steps, by tag and by position, the
load spread per layer (and per host), router entropy and dropped tokens over the step buckets."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from moescope.dashboard.figures.layout import HEIGHT, PALETTE, empty_figure, layout, legend_above
from moescope.metrics import signals

ENTROPY_PANELS = 8  # layers drawn as panels of the router-entropy figure; more: one heatmap


def active_fraction_figure(over_time: pd.DataFrame) -> go.Figure:
    """Active-parameter fraction per step bucket (percent), with the min-max band of its steps."""
    if over_time.empty:
        return empty_figure("no steps recorded")
    x = over_time.step_start
    # Percent, rounded to 6 decimals: a fraction that is constant up to float noise (every token uses
    # k experts) must draw as a flat line, not as swings in the 17th digit.
    pct = {c: (over_time[c] * 100).round(6) for c in ("active_max", "active_min", "active_fraction")}
    fig = go.Figure([
        go.Scatter(x=x, y=pct["active_max"], mode="lines", line={"width": 0}, showlegend=False,
                   hoverinfo="skip"),
        go.Scatter(x=x, y=pct["active_min"], mode="lines", line={"width": 0}, fill="tonexty",
                   fillcolor="rgba(76,120,168,0.2)", name="min-max of steps", hoverinfo="skip"),
        go.Scatter(x=x, y=pct["active_fraction"], mode="lines+markers", name="active %",
                   line={"color": PALETTE[0]},
                   hovertemplate="steps %{x}: %{y:.3f}% of parameters per token<extra></extra>"),
    ])
    lo, hi = float(pct["active_min"].min()), float(pct["active_max"].max())
    pad = max((hi - lo) * 0.1, 0.5)  # at least half a percentage point either side: a flat line looks flat
    fig.update_xaxes(title="step", range=[float(x.min()) - 0.5, float(over_time.step_end.max()) + 0.5])
    fig.update_yaxes(title="% of parameters used per token", range=[lo - pad, hi + pad], tickformat=".2f")
    return layout(fig, "Active-parameter fraction per batch")


def active_by_tag_figure(by_tag: pd.DataFrame, key: str) -> go.Figure:
    """Token-weighted active-parameter fraction per tag value, with min-max whiskers."""
    if by_tag.empty:
        return empty_figure(f"no step carries the tag {key!r}")
    pct = by_tag.active_fraction * 100
    fig = go.Figure(go.Bar(
        x=by_tag.value.astype(str), y=pct, marker_color=PALETTE[1],
        error_y={"type": "data", "symmetric": False, "array": by_tag.active_max * 100 - pct,
                     "arrayminus": pct - by_tag.active_min * 100},
        customdata=np.stack([by_tag.tokens, by_tag.steps], axis=1),
        hovertemplate="%{x}: %{y:.3f}%<br>%{customdata[0]} tokens in %{customdata[1]} steps<extra></extra>"))
    fig.update_xaxes(title=key)
    fig.update_yaxes(title="% of parameters per token")
    return layout(fig, f"Active-parameter fraction by {key}")


def active_by_position_figure(by_position: pd.DataFrame) -> go.Figure:
    """Active-parameter fraction (percent) per position bucket, with the slots dropped per token.

    `by_position` is `Store.active_fraction_by_position`'s frame.
    """
    if by_position.empty:
        return empty_figure("no routes recorded: attach the probe with routes=True to see positions")
    labels = [f"{int(a)}–{int(b) - 1}" for a, b in zip(by_position.position_start, by_position.position_end)]
    pct = (by_position.active_fraction * 100).round(6)
    fig = go.Figure(go.Bar(
        x=labels, y=pct, marker_color=PALETTE[2],
        customdata=np.stack([by_position.tokens, by_position.dropped_slots, by_position.kept_slots], axis=1),
        hovertemplate="positions %{x}: %{y:.3f}% of parameters per token<br>%{customdata[0]} tokens; "
                      "%{customdata[1]:.2f} slots dropped, %{customdata[2]:.2f} kept per token<extra></extra>"))
    # Bars start at 0: a bar's length is its value, so a cut axis would make a small drift look large.
    top = float(pct.max())
    fig.update_xaxes(title="position in the input", type="category")
    fig.update_yaxes(title="% of parameters per token", range=[0.0, top * 1.1 if top > 0 else 1.0])
    return layout(fig, "Active-parameter fraction by position")



def layer_spread_figure(layers: Sequence[signals.LayerFigures]) -> go.Figure:
    """Per layer: coefficient of variation and max/mean of the routed experts' load (`signals.load_spread`)."""
    if not layers:
        return empty_figure("no layer steps recorded")
    names = [str(f.layer) for f in layers]
    fig = go.Figure([
        go.Bar(x=names, y=[f.spread.cv for f in layers], name="coefficient of variation", marker_color=PALETTE[0],
               hovertemplate="layer %{x}: CV %{y:.3f}<extra></extra>"),
        go.Bar(x=names, y=[f.spread.max_mean for f in layers], name="max / mean", marker_color=PALETTE[3],
               hovertemplate="layer %{x}: max/mean %{y:.3f}<extra></extra>"),
    ])
    fig.update_xaxes(title="MoE layer", type="category")
    fig.update_yaxes(title="load spread (CV 0, max/mean 1 = even)", rangemode="tozero")
    return legend_above(layout(fig, "Load spread per layer", barmode="group"))


def host_load_figure(per_host: dict[str, Sequence[signals.LayerFigures]]) -> go.Figure:
    """Per layer, a bar per host: max/mean of the routed experts' load over that host's ranks."""
    if not per_host:
        return empty_figure("no layer steps recorded")
    fig = go.Figure([
        go.Bar(x=[str(f.layer) for f in layers], y=[f.spread.max_mean for f in layers], name=host,
               marker_color=PALETTE[i % len(PALETTE)],
               hovertemplate=f"{host}, layer %{{x}}: max/mean %{{y:.3f}}<extra></extra>")
        for i, (host, layers) in enumerate(per_host.items())])
    fig.update_xaxes(title="MoE layer", type="category")
    fig.update_yaxes(title="load max / mean (1 = perfectly even)", rangemode="tozero")
    return layout(fig, "Load spread per layer, by host", barmode="group")


def entropy_figure(entropy: pd.DataFrame) -> go.Figure:
    """Mean per-token router entropy (nats, token-weighted in each bucket) over the step buckets of
    `Store.layer_buckets`: a small panel per layer, one above the other on a shared step axis (one
    line per layer in one panel was a tangle), each panel's y axis its own; past
    `ENTROPY_PANELS` layers, a layer x step heatmap."""
    if entropy.empty:
        return empty_figure("no layer steps recorded")
    from plotly.subplots import make_subplots

    groups = list(entropy.groupby("layer"))
    if len(groups) > ENTROPY_PANELS:
        grid = entropy.pivot_table(index="layer", columns="step_start", values="router_entropy", aggfunc="mean")
        fig = go.Figure(go.Heatmap(
            z=grid.to_numpy(), x=grid.columns.to_numpy(), y=[str(v) for v in grid.index], colorscale="Viridis",
            colorbar={"title": "nats"}, hovertemplate="layer %{y}, step %{x}: %{z:.4f} nats<extra></extra>"))
        fig.update_xaxes(title="step")
        fig.update_yaxes(title="MoE layer", type="category", autorange="reversed")
        return layout(fig, "Router entropy (nats)")
    fig = make_subplots(rows=len(groups), cols=1, shared_xaxes=True, vertical_spacing=0.04)
    for i, (layer, rows) in enumerate(groups):
        fig.add_trace(go.Scatter(x=rows.step_start, y=rows.router_entropy, mode="lines", name=f"layer {layer}",
                                 line={"color": PALETTE[i % len(PALETTE)], "width": 1.2}, showlegend=False,
                                 hovertemplate=f"layer {layer}, step %{{x}}: %{{y:.4f}} nats<extra></extra>"),
                      row=i + 1, col=1)
        fig.update_yaxes(title={"text": f"layer {layer}", "font": {"size": 11}}, nticks=3, row=i + 1, col=1)
    fig.update_xaxes(title="step", row=len(groups), col=1)
    return layout(fig, "Router entropy (nats), per layer", height=max(HEIGHT, 60 + 80 * len(groups)))




def dropped_figure(entropy: pd.DataFrame) -> go.Figure:
    """Tokens dropped at capacity per layer over the step buckets (from `Store.layer_buckets`)."""
    if entropy.empty:
        return empty_figure("no layer steps recorded")
    fig = go.Figure([
        go.Bar(x=rows.step_start, y=rows.dropped_tokens, name=f"layer {layer}",
               marker_color=PALETTE[i % len(PALETTE)],
               hovertemplate=f"layer {layer}, step %{{x}}: %{{y}} dropped<extra></extra>")
        for i, (layer, rows) in enumerate(entropy.groupby("layer"))])
    fig.update_xaxes(title="step")
    fig.update_yaxes(title="dropped tokens", rangemode="tozero")
    return legend_above(layout(fig, "Dropped tokens", barmode="stack", legend_traceorder="normal"))

