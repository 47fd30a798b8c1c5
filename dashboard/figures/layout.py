"""What every figure shares: its size, its colours, its title and margins, the empty figure that says
why there is nothing to draw, and the transparent layer that makes a heatmap's cells clickable.

Plotly heatmaps do not report selections, scatter points do: a clickable heatmap carries a scatter
trace of invisible markers over its cells (`click_layer`), each point's `customdata` saying which
cell it is.
"""

from __future__ import annotations

import plotly.graph_objects as go

HEIGHT = 380
PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6",
           "#9D755D", "#BAB0AC")


def layout(fig: go.Figure, title: str, **kwargs) -> go.Figure:
    """`fig` with its title at the top left, the house height (`height=` to change it) and narrow
    margins; other keywords go to `update_layout`."""
    fig.update_layout(title={"text": title, "x": 0, "xanchor": "left"}, height=kwargs.pop("height", HEIGHT),
                      margin={"l": 10, "r": 10, "t": 50, "b": 10}, **kwargs)
    return fig


def legend_above(fig: go.Figure) -> go.Figure:
    """The legend in a row between the title and the plot: a legend at the right takes half the width
    of a chart in a third of the page."""
    # The title pinned to the top: a legend wrapped onto a second row grows up towards it.
    fig.update_layout(legend={"orientation": "h", "x": 0, "xanchor": "left", "y": 1.0, "yanchor": "bottom"},
                      title={"y": 1.0, "yref": "container", "yanchor": "top", "pad": {"t": 12}}, margin_t=100)
    return fig


def empty_figure(message: str) -> go.Figure:
    """A blank figure that says why there is nothing to draw."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return layout(fig, "", height=200)


def click_layer(x, y, customdata, hovertemplate: str) -> go.Scatter:
    """Invisible square markers on a heatmap's cell centres (`x`, `y`): they receive its clicks."""
    return go.Scatter(x=x, y=y, mode="markers", customdata=customdata, showlegend=False,
                      marker={"symbol": "square", "size": 14, "opacity": 0.0, "color": "black"},
                      hovertemplate=hovertemplate)
