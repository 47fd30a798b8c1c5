"""The Engine vs reference page's figures (`moescope.analyses.mismatch`, `Store.mismatch_layers`): a
group x layer heatmap of one share of decisions that differ; where they sit is `flips.margin_figure`,
shared with the Routing jitter page."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from moescope.dashboard.figures.flips import layer_heatmap
from moescope.dashboard.figures.layout import empty_figure

MISMATCH_FIGURES = {  # `Store.mismatch_layers` column -> what it shows
    "set_changed_fraction": "expert set differs (% of (token, layer) pairs)",
    "top1_changed_fraction": "top-1 expert differs (% of pairs)",
    "slots_changed_fraction": "experts that differ (% of the pairs' k slots)",
}
EVERY_LAYER = "every layer"


def mismatch_heatmap(rows: pd.DataFrame, column: str = "set_changed_fraction") -> go.Figure:
    """Group x layer heatmap of one `Store.mismatch_layers` fraction (MISMATCH_FIGURES), in percent:
    a row per group (the whole run, each position bucket, each tag) in the query's order, a column per
    MoE layer and one for every layer together; the hover adds the pairs compared and, on the
    every-layer column, the share of tokens that differ in at least one layer."""
    if rows.empty:
        return empty_figure("no engine-vs-reference mismatch measured in this run")
    names = [f"{g}: {n}" if g != "all" else "whole run" for g, n in zip(rows.grouping, rows.group_name)]
    layers = sorted(int(v) for v in rows.layer.dropna().unique())
    cells = []
    for name, row in zip(names, rows.itertuples()):
        every = pd.isna(row.layer)
        share = f"; {row.tokens_set_changed_fraction:.2%} of {int(row.tokens):,} tokens differ in ≥1 layer"
        cells.append((name, EVERY_LAYER if every else str(int(row.layer)), getattr(row, column) * 100,
                      f"{int(row.pairs):,} pairs" + (share if every else "")))
    return layer_heatmap(cells, list(dict.fromkeys(names)), [str(v) for v in layers] + [EVERY_LAYER],
                         title=f"Engine vs reference: {MISMATCH_FIGURES.get(column, column)}", y_title="group",
                         unit="%", row_px=28)
