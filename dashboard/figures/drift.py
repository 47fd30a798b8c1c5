"""The Drift and alerts page's figures: each layer's divergence from its baseline over windows, with the
rules' thresholds, and the alerts' state changes."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go

from moescope.dashboard.figures.layout import HEIGHT, PALETTE, empty_figure, layout

STATE_COLOURS = {"inactive": "#BAB0AC", "pending": "#EECA3B", "resolved": "#54A24B", "firing": "#E45756"}


def divergence_figure(divergence: pd.DataFrame, measure: str, thresholds: Sequence[tuple[str, float]] = (),
                      steps: tuple[int, int] | None = None) -> go.Figure:
    """`measure` ("kl" or "js") per layer over windows (`signals.divergence_over_time`'s frame), with
    rule thresholds as dashed lines; the x axis spans `steps` (the run's first and last step) when
    given."""
    if divergence.empty:
        return empty_figure("no window with a baseline to compare against")
    name = {"kl": "KL divergence", "js": "Jensen-Shannon divergence"}[measure]
    fig = go.Figure([
        go.Scatter(x=rows.step_end, y=rows[measure], mode="lines+markers", name=f"layer {layer}",
                   line={"color": PALETTE[i % len(PALETTE)]},
                   hovertemplate=f"layer {layer}, window ending step %{{x}}: %{{y:.4f}} nats<extra></extra>")
        for i, (layer, rows) in enumerate(divergence.groupby("layer"))])
    for rule, value in thresholds:
        fig.add_hline(y=value, line_dash="dash", line_color="#E45756",
                      annotation_text=f"{rule} > {value:g}", annotation_position="top left")
    fig.update_xaxes(title="last step of window", **({"range": [steps[0] - 0.5, steps[1] + 0.5]} if steps else {}))
    fig.update_yaxes(title=f"{measure.upper()} vs baseline (nats)", rangemode="tozero")
    # A short title and a subtitle: the one long title was cut at the edge of a half-width column.
    fig = layout(fig, name)
    fig.update_layout(title_subtitle_text="each window's load against the baseline", margin_t=70)
    return fig


def alert_label(alerts: pd.DataFrame) -> pd.Series:
    """Each transition's alert as one readable label: name, layer and, for expert alerts, expert."""
    label = alerts["alertname"].astype(str) + " · layer " + alerts["layer"].astype(str)
    if "expert" in alerts:
        experts = alerts["expert"]
        label = label + [f" · expert {int(e)}" if pd.notna(e) else "" for e in experts]
    return label


def alert_timeline(alerts: pd.DataFrame, steps: tuple[int, int] | None = None) -> go.Figure:
    """One row per alert (name, layer, expert), a marker per state change at its step, coloured by
    the new state; the x axis spans `steps` (the run's first and last step) when given."""
    if alerts.empty:
        return empty_figure("no alert transition recorded")
    fig = go.Figure()
    label = alert_label(alerts)
    reason = alerts["reason"].fillna("") if "reason" in alerts else pd.Series("", index=alerts.index)
    frame = alerts.assign(_label=label, _state=alerts["state"].astype(str),
                          _why=[f" ({r})" if r else "" for r in reason])
    order = list(STATE_COLOURS)  # later states drawn on top: a pending->firing at one instant shows firing
    for state in sorted(frame._state.unique(), key=lambda s: order.index(s) if s in order else -1):
        rows = frame[frame._state == state]
        fig.add_trace(go.Scatter(
            x=rows["step"], y=rows["_label"], mode="markers", name=state, customdata=rows["_why"],
            marker={"size": 12, "symbol": "square", "color": STATE_COLOURS.get(state, PALETTE[0])},
            hovertemplate=f"%{{y}}: {state} at step %{{x}}%{{customdata}}<extra></extra>"))
    fig.update_yaxes(type="category", title="")
    fig.update_xaxes(title="step", **({"range": [steps[0] - 0.5, steps[1] + 0.5]} if steps else {}))
    return layout(fig, "Alert transitions", height=max(HEIGHT, 40 * label.nunique() + 120))

