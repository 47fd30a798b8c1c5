"""The Expert health page's figures: one expert's score and its components over the run, and the trust
gate's weights."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from moescope.dashboard.figures.layout import PALETTE, empty_figure, layout


def health_trend(health: pd.DataFrame, columns: Sequence[str], layer: int, expert: int,
                 steps: tuple[int, int] | None = None) -> go.Figure:
    """Score and its components over the run for one expert, at the last step of each window
    (`expert_health` rows of the run: every expert's, the layer's decide what a window measured);
    the x axis spans `steps` (the run's first and last step) when given.

    A component not measured in a window is a gap in its line. So is the score of a window where the
    layer measured none of one of the components it measures elsewhere in the run (too few tokens
    reached the layer to judge load and confidence, say): that score is made of fewer parts, and
    drawn beside the others a dead expert's 0 and its 100 from weights alone read as flapping."""
    rows = health[(health.layer == layer) & (health.expert == expert)].sort_values("step_end")
    if rows.empty:
        return empty_figure(f"no health score for layer {layer}, expert {expert}")
    components = [c for c in columns if c != "score"]
    whole_layer = health[health.layer == layer]
    measured = whole_layer.groupby("step_end")[components].agg(lambda v: v.notna().any())
    measured = measured[[c for c in components if measured[c].any()]]
    partial = ~measured.all(axis=1).reindex(rows.step_end).fillna(False).to_numpy(dtype=bool)
    missing = [", ".join(c for c in measured.columns if not measured.loc[end, c]) if end in measured.index else ""
               for end in rows.step_end]
    fig = go.Figure()
    for i, c in enumerate(columns):
        y = rows[c].to_numpy(dtype=np.float64)
        if c == "score":
            y = np.where(partial, np.nan, y)
        fig.add_trace(go.Scatter(x=rows["step_end"], y=y, mode="lines+markers", name=c, connectgaps=False,
                                 line={"color": PALETTE[i % len(PALETTE)], "width": 3 if c == "score" else 1.5},
                                 hovertemplate=f"{c}, window ending step %{{x}}: %{{y:.1f}}<extra></extra>"))
    if partial.any():
        # Where the score is left out, say why on hover (at the bottom edge, out of the lines' way).
        fig.add_trace(go.Scatter(
            x=rows.step_end[partial], y=np.full(int(partial.sum()), -1.0), mode="markers", name="score left out",
            marker={"symbol": "line-ns-open", "size": 8, "color": "#888888"},
            customdata=[m for m, p in zip(missing, partial) if p],
            hovertemplate="window ending step %{x}: no score drawn, the layer measured no %{customdata} "
                          "here<extra></extra>"))
    fig.update_xaxes(title="last step of the health window",
                     **({"range": [steps[0] - 0.5, steps[1] + 0.5]} if steps else {}))
    fig.update_yaxes(title="0-100 (100 = healthy)", range=[-4, 102])
    return layout(fig, f"Layer {layer}, expert {expert}: health score and components")


def gate_history(events: pd.DataFrame, steps: tuple[int, int]) -> go.Figure:
    """Trust weight of each (layer, expert) the gate ever changed, as a step line over the whole run
    (`steps`: its first and last step): 1 until the first change, then each change's new weight,
    held to the run's last step. Each line is named by its layer and expert."""
    if events.empty:
        return empty_figure("the trust gate has not changed any weight")
    first, last = steps
    fig = go.Figure()
    for i, ((layer, expert), rows) in enumerate(events.sort_values("step").groupby(["layer", "expert"])):
        x = [min(first, int(rows.step.min())), *rows.step.astype(int), max(last, int(rows.step.max()))]
        y = [float(rows.old_weight.iloc[0]), *rows.new_weight.astype(float), float(rows.new_weight.iloc[-1])]
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", line_shape="hv",
                                 name=f"layer {layer}, expert {expert}", line={"color": PALETTE[i % len(PALETTE)]},
                                 hovertemplate=f"layer {layer}, expert {expert}: weight %{{y:.2f}} from step "
                                               "%{x}<extra></extra>"))
    names = ", ".join(f"layer {layer} expert {expert}" for layer, expert in
                      events[["layer", "expert"]].drop_duplicates().itertuples(index=False))
    fig.update_xaxes(title="step", range=[first - 0.5, last + 0.5])
    fig.update_yaxes(title="trust weight", range=[-0.05, 1.05])
    return layout(fig, f"Trust-gate weight: {names}")

