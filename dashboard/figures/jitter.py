"""The Routing jitter page's figures (`Store.jitter_layers`): a condition x layer heatmap of one of
its figures; where the flips sit is `flips.margin_figure`, shared with the Engine vs reference page."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from moescope.dashboard.figures.flips import layer_heatmap, margin_figure
from moescope.dashboard.figures.layout import empty_figure

JITTER_FIGURES = {  # `Store.jitter_layers` column -> what it shows
    "set_changed_fraction": "expert set changed (% of tokens)",
    "top1_changed_fraction": "top-1 expert changed (% of tokens)",
    "kept_changed_fraction": "experts that ran changed (% of tokens)",
    "max_weight_change": "largest gate-weight change",
}


def jitter_heatmap(rows: pd.DataFrame, column: str = "set_changed_fraction") -> go.Figure:
    """Condition x layer heatmap of one `Store.jitter_layers` figure (JITTER_FIGURES: a fraction drawn
    in percent, or the largest gate-weight change as it is), conditions in the order they ran; the
    hover adds the tokens compared, the condition's baseline and its description."""
    if rows.empty:
        return empty_figure("no routing jitter measured in this run")
    percent = column.endswith("_fraction")
    layers = sorted(int(v) for v in rows.layer.unique())
    cells = ((row.condition, str(int(row.layer)), getattr(row, column) * (100 if percent else 1),
              f"{int(row.tokens):,} tokens vs {row.baseline}: {row.description}") for row in rows.itertuples())
    return layer_heatmap(cells, list(dict.fromkeys(rows.condition)), [str(v) for v in layers],
                         title=f"Routing jitter: {JITTER_FIGURES.get(column, column)}", y_title="condition",
                         unit="%" if percent else "|Δw|", row_px=32)


jitter_margin_figure = margin_figure  # its name before the Engine vs reference page drew it too
