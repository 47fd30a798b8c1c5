"""What the Routing jitter and Engine vs reference pages draw alike: a share of changed routing
decisions as a heatmap, a row per condition or group and a column per MoE layer, and where the
changes sit on the reference's top-k margin (`margin_figure`). Each page says what its rows, its
counts and its reference are."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from moescope.dashboard.figures.layout import HEIGHT, PALETTE, empty_figure, layout


def layer_heatmap(cells: Iterable[tuple[str, str, float, str]], rows: list[str], columns: list[str], *, title: str,
                  y_title: str, unit: str, row_px: int) -> go.Figure:
    """Row x layer heatmap of `cells` (row, column, value, hover note), rows and columns in the order
    given, a blank where no cell is; `unit` follows each value and titles the colour bar, and each row
    is `row_px` pixels high (the figure at least the house height)."""
    z = np.full((len(rows), len(columns)), np.nan)
    notes = np.full(z.shape, "", dtype=object)
    for row, column, value, note in cells:
        i, j = rows.index(row), columns.index(column)
        z[i, j], notes[i, j] = value, note
    fig = go.Figure(go.Heatmap(
        z=z, x=columns, y=rows, colorscale="Reds", zmin=0, customdata=notes, colorbar={"title": unit},
        hovertemplate="%{y}, layer %{x}: %{z:.3g}" + ("%" if unit == "%" else "")
                      + "<br>%{customdata}<extra></extra>"))
    fig.update_xaxes(title="MoE layer", type="category")
    fig.update_yaxes(title=y_title, autorange="reversed", type="category")
    return layout(fig, title, height=max(HEIGHT, 60 + row_px * len(rows)))


def margin_figure(rows: pd.DataFrame, title: str = "", counted: str = "tokens",
                  reference: str = "the baseline") -> go.Figure:
    """The reference's top-k margin of the decisions whose expert set changed and of the rest, summed
    over `rows` (`Store.jitter_layers` rows of one condition, or `Store.mismatch_layers` rows of one
    group; one or every layer), each group as a share of its own count per bin of `margin_edges`,
    counts in the hover. Flips at rounding noise sit left. `counted` names what a count counts and
    `reference` whose logits the margin is of (the mismatch page: "pairs" of "the reference")."""
    if rows.empty:
        return empty_figure("nothing compared")
    edges = list(rows.margin_edges.iloc[0])
    labels = [f"≥{edge:g}" for edge in edges]
    kind = str(rows.margin_kind.iloc[0])
    fig = go.Figure()
    for name, column, colour in (("expert set changed", "changed_by_margin", PALETTE[3]),
                                 ("unchanged", "unchanged_by_margin", PALETTE[0])):
        counts = np.sum(np.stack([np.asarray(v, dtype=np.int64) for v in rows[column]]), axis=0)
        total = int(counts.sum())
        share = counts / total * 100 if total else np.zeros(len(counts))
        fig.add_trace(go.Bar(
            x=labels, y=share, name=f"{name} ({total:,} {counted})", marker_color=colour, customdata=counts,
            hovertemplate=f"{name}, margin %{{x}}: %{{customdata}} {counted} (%{{y:.1f}}%)<extra></extra>"))
    fig.update_xaxes(title=f"top-k margin in {reference} (k-th minus (k+1)-th router {kind}), bin's lower edge",
                     type="category")
    fig.update_yaxes(title=f"% of the group's {counted}", range=[0, 100])
    return layout(fig, title or "Where the flips sit: top-k margin", barmode="group")
