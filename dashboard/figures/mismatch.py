"""The Engine vs reference page's figures (`moescope.analyses.mismatch`, `Store.mismatch_layers`): a
group x layer heatmap of one share of decisions that differ; where they sit is `flips.margin_figure`,
shared with the Routing jitter page. The log-prob gap (`moescope.analyses.logprob_gap`,
`Store.mismatch_logprob_gap`): its k3 KL per flip bucket with and without the engine's routing
replayed, and the layers that carry it."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from moescope.dashboard.figures.flips import layer_heatmap
from moescope.dashboard.figures.layout import PALETTE, empty_figure, layout, legend_above

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


GAP_ROUTINGS = {"reference": "the reference's own routing", "replay": "the engine's routing replayed"}


def logprob_gap_figure(rows: pd.DataFrame, column: str = "k3_mean") -> go.Figure:
    """Bars of one `Store.mismatch_logprob_gap` figure (k3_mean by default) for the whole run and
    each flip bucket (layers whose expert set differs where the token was predicted), one series
    with the reference's own routing and one with the engine's replayed; the hover adds the tokens."""
    picked = rows[rows.routing.isin(list(GAP_ROUTINGS)) & rows.grouping.isin(["all", "flips"])]
    if picked.empty:
        return empty_figure("no log-prob gap measured in this run (the engine returned no log-probs)")
    fig = go.Figure()
    for index, (routing, label) in enumerate(GAP_ROUTINGS.items()):
        part = picked[picked.routing == routing]
        names = ["whole run" if g == "all" else f"{n} flipped" for g, n in zip(part.grouping, part.group_name)]
        fig.add_trace(go.Bar(x=names, y=part[column], name=label, marker_color=PALETTE[index],
                             customdata=part.tokens, hovertemplate="%{x}: %{y:.3g} over %{customdata:,} tokens"
                                                                   "<extra>" + label + "</extra>"))
    layout(fig, "Log-prob gap (k3 KL per generated token) by layers flipped, without and with replay",
           barmode="group", yaxis_title="mean k3 KL (nats)" if column == "k3_mean" else column)
    return legend_above(fig)


def gap_layers_figure(rows: pd.DataFrame) -> go.Figure:
    """Bars of the k3 KL each MoE layer carries (--per-layer): the k3 KL with every layer but it
    replayed, minus the k3 KL with every layer replayed."""
    full = rows[(rows.routing == "replay") & (rows.grouping == "all")]
    but = rows[(rows.routing == "replay-but-layer") & (rows.grouping == "all")]
    if but.empty or full.empty:
        return empty_figure("measured with --per-layer only")
    carried = but.k3_mean - float(full.k3_mean.iloc[0])
    fig = go.Figure(go.Bar(x=[str(int(v)) for v in but.left_out_layer], y=carried, marker_color=PALETTE[3],
                           hovertemplate="layer %{x}: %{y:.3g} nats<extra></extra>"))
    return layout(fig, "Where the gap sits: k3 KL that returns when one layer routes itself", xaxis_title="MoE layer",
                  yaxis_title="k3 KL carried (nats)")
