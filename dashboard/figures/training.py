"""The Training page's figures, from the frames of `moescope.analyses.training_report.training_report`:
a signal per optimizer step and layer, and a layer's expert gradient norms, with the routing cooldowns
shaded where they cooled a layer's router."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from moescope.dashboard.figures.layout import PALETTE, empty_figure, layout


def _layer_colours(layers: Sequence[int] | pd.Series) -> dict[int, str]:
    return {int(layer): PALETTE[i % len(PALETTE)] for i, layer in enumerate(sorted(set(int(v) for v in layers)))}


def _cooldown_bands(fig: go.Figure, cooldowns: pd.DataFrame | None, colours: dict[int, str],
                    outline: bool = False) -> go.Figure:
    """Shade what each cooldown of a layer in `colours` cooled: the updates start_step+1..end_step,
    i.e. optimizer steps start_step + 0.5 to end_step + 0.5 on the x axis. `outline` draws a dashed
    frame instead of a fill (over a heatmap, whose cells a fill would hide)."""
    if cooldowns is None or cooldowns.empty:
        return fig
    for i, span in enumerate(cooldowns[cooldowns.layer.isin(list(colours))].itertuples(index=False)):
        if span.end_step <= span.start_step:  # ended before any update used it
            continue
        colour = colours[int(span.layer)]
        style = ({"line": {"color": colour, "dash": "dash", "width": 2}, "fillcolor": "rgba(0,0,0,0)",
                  "layer": "above"} if outline else
                 {"fillcolor": colour, "opacity": 0.15, "line_width": 0, "layer": "below"})
        fig.add_vrect(x0=span.start_step + 0.5, x1=span.end_step + 0.5, **style)
        fig.add_annotation(x=span.start_step + 0.5, y=1 - 0.08 * (i % 6), xref="x", yref="paper", xanchor="left",
                           yanchor="top", showarrow=False, font={"size": 10, "color": colour},
                           text=f"cooldown, layer {span.layer}" + ("" if span.ended else " (still on)"))
    return fig


def training_figure(per_layer: pd.DataFrame, column: str, title: str, y_title: str,
                    pooled: pd.DataFrame | None = None, cooldowns: pd.DataFrame | None = None,
                    log_y: bool = False, y_range: tuple[float, float] | None = None) -> go.Figure:
    """`column` per optimizer step, a line per MoE layer of `per_layer` (the report's `layers`
    frame, or its rows of one layer) named "layer <i>", plus `pooled[column]` (the report's `steps`
    frame: all layers pooled) as "all layers (pooled)" when given; each drawn layer's cooldowns
    shaded over the updates they cooled (`_cooldown_bands`)."""
    if per_layer.empty:
        return empty_figure("no training step recorded")
    colours = _layer_colours(per_layer.layer)
    fig = go.Figure()
    for layer, rows in per_layer.groupby("layer", sort=True):
        rows = rows.sort_values("optimizer_step")
        fig.add_trace(go.Scatter(
            x=rows.optimizer_step.to_numpy(), y=rows[column].to_numpy(dtype=np.float64), name=f"layer {layer}",
            mode="lines+markers" if len(rows) <= 200 else "lines", line={"color": colours[int(layer)]},
            customdata=np.stack([rows.step, rows.step_end], axis=1),
            hovertemplate=f"layer {layer}, optimizer step %{{x}} (forwards %{{customdata[0]}}-%{{customdata[1]}}): "
                          "%{y:.5g}<extra></extra>"))
    if pooled is not None and not pooled.empty:
        rows = pooled.sort_values("optimizer_step")
        fig.add_trace(go.Scatter(
            x=rows.optimizer_step.to_numpy(), y=rows[column].to_numpy(dtype=np.float64), name="all layers (pooled)",
            mode="lines+markers" if len(rows) <= 200 else "lines", line={"color": "#333333", "width": 3, "dash": "dot"},
            hovertemplate="all layers, optimizer step %{x}: %{y:.5g}<extra></extra>"))
    _cooldown_bands(fig, cooldowns, colours)
    fig.update_xaxes(title="optimizer step")
    axis: dict = {"type": "log"} if log_y else {}
    if y_range is not None:  # in the axis's units (log10 of the value on a log axis)
        axis["range"] = list(y_range)
    fig.update_yaxes(title=y_title, **axis)
    return layout(fig, title)


def expert_grad_heatmap(per_layer: pd.DataFrame, layer: int, cooldowns: pd.DataFrame | None = None) -> go.Figure:
    """Optimizer step x expert heatmap of one layer's expert gradient norms (L2 norm of each routed
    expert's weight gradients, the report's `expert_grad_norm`), blank where none was taken; the
    layer's cooldowns framed by dashed lines."""
    rows = per_layer[per_layer.layer == layer].sort_values("optimizer_step")
    norms = [v for v in rows.expert_grad_norm if v is not None]
    if not norms:
        return empty_figure(f"no expert gradient norm recorded for layer {layer}: moescope.training takes them "
                            "unless grad_norms=False")
    width = max(len(v) for v in norms)
    z = np.full((width, len(rows)), np.nan)
    for j, v in enumerate(rows.expert_grad_norm):
        if v is not None:
            z[: len(v), j] = v
    fig = go.Figure(go.Heatmap(
        z=z, x=rows.optimizer_step.to_numpy(), y=np.arange(width), colorscale="Viridis", zmin=0,
        colorbar={"title": "L2 norm"},
        hovertemplate="optimizer step %{x}, expert %{y}: gradient norm %{z:.4g}<extra></extra>"))
    _cooldown_bands(fig, cooldowns, {int(layer): "#E45756"}, outline=True)
    fig.update_xaxes(title="optimizer step")
    fig.update_yaxes(title="expert", dtick=1 if width <= 32 else None, autorange="reversed")
    return layout(fig, f"Layer {layer}: expert gradient norms per optimizer step")

