"""The Compare page's figures: two selections side by side, per layer and as headline numbers."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from moescope.dashboard.figures.layout import PALETTE, empty_figure, layout

COMPARE_COLUMNS = 3  # panels a row of the headline numbers


def compare_layers_figure(sides: dict[str, pd.DataFrame], metric: str, title: str) -> go.Figure:
    """Grouped bars per layer of `metric`, one bar group per side (name -> per-layer frame)."""
    frames = {name: df for name, df in sides.items() if not df.empty}
    if not frames:
        return empty_figure("nothing recorded on either side")
    fig = go.Figure([go.Bar(x=df.layer.astype(str), y=df[metric], name=name, marker_color=PALETTE[i],
                            hovertemplate=f"{name}, layer %{{x}}: %{{y:.4g}}<extra></extra>")
                     for i, (name, df) in enumerate(frames.items())])
    fig.update_xaxes(title="MoE layer", type="category")
    return layout(fig, title, barmode="group")


def compare_scalars_figure(values: pd.DataFrame) -> go.Figure:
    """Small bar panels, one per metric (rows: side, metric, value), sides side by side."""
    if values.empty:
        return empty_figure("nothing recorded on either side")
    from plotly.subplots import make_subplots

    metrics = list(dict.fromkeys(values.metric))
    # At most COMPARE_COLUMNS panels a row, titles wrapped: six panels in one row of a 1500 px window
    # left each title wider than its panel, and neighbours overlapped.
    cols = min(COMPARE_COLUMNS, len(metrics))
    rows_n = -(-len(metrics) // cols)
    fig = make_subplots(rows=rows_n, cols=cols, subplot_titles=[_wrap(m, 24) for m in metrics],
                        horizontal_spacing=0.1, vertical_spacing=0.25 if rows_n > 1 else 0.0)
    for i, metric in enumerate(metrics):
        row, col = divmod(i, cols)
        rows = values[values.metric == metric]
        fig.add_trace(go.Bar(x=rows.side, y=rows.value, marker_color=[PALETTE[i] for i in range(len(rows))],
                             showlegend=False, hovertemplate="%{x}: %{y:.4g}<extra></extra>"), row=row + 1, col=col + 1)
        top = float(rows.value.max()) if len(rows) else 0.0
        if (rows.value >= 0).all():  # counts, rates and shares start at 0, and a panel of zeros reads 0 to 1
            fig.update_yaxes(range=[0, top * 1.1 if top > 0 else 1], row=row + 1, col=col + 1)
    fig.update_annotations(font_size=13)
    fig = layout(fig, "Side by side", height=300 * rows_n + 60)
    fig.update_layout(margin_t=100)  # room for the title above the first row's two-line panel titles
    return fig




def _wrap(text: str, width: int) -> str:
    """`text` broken at spaces into lines of at most `width` characters (a longer word keeps its
    own line), joined with Plotly's <br>."""
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "<br>".join(lines)

