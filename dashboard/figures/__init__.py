"""Plotly figure builders: pure functions from data frames (or arrays) to figures, a module per page
of `dashboard/views/` and the layout they share (`layout`: size, colours, titles, the empty figure).
`flips` holds what the Routing jitter and Engine vs reference pages draw alike.

Only drawing: the numbers come in computed (store queries, `moescope.metrics.signals`, the reports
of `moescope.analyses`, frames shaped by `moescope.dashboard.data`), and a figure reshapes them only
to lay them out (a pivot into a grid, a share of its own column). Nothing here reads the store or
Streamlit state, so every figure is tested by building it from a frame and reading the numbers back
out of its traces. Every builder is importable from here, as from the one module it was before
(`from moescope.dashboard.figures import load_heatmap`).
"""

from __future__ import annotations

from moescope.dashboard.figures.cache import cache_hit_figure as cache_hit_figure
from moescope.dashboard.figures.clusters import SLOT_SPECIALISATION as SLOT_SPECIALISATION
from moescope.dashboard.figures.clusters import cluster_scatter as cluster_scatter
from moescope.dashboard.figures.clusters import specialisation_figure as specialisation_figure
from moescope.dashboard.figures.clusters import specialisation_figure_by_layer as specialisation_figure_by_layer
from moescope.dashboard.figures.compare import COMPARE_COLUMNS as COMPARE_COLUMNS
from moescope.dashboard.figures.compare import compare_layers_figure as compare_layers_figure
from moescope.dashboard.figures.compare import compare_scalars_figure as compare_scalars_figure
from moescope.dashboard.figures.drift import STATE_COLOURS as STATE_COLOURS
from moescope.dashboard.figures.drift import alert_label as alert_label
from moescope.dashboard.figures.drift import alert_timeline as alert_timeline
from moescope.dashboard.figures.drift import divergence_figure as divergence_figure
from moescope.dashboard.figures.flips import layer_heatmap as layer_heatmap
from moescope.dashboard.figures.flips import margin_figure as margin_figure
from moescope.dashboard.figures.health import gate_history as gate_history
from moescope.dashboard.figures.health import health_trend as health_trend
from moescope.dashboard.figures.heatmaps import coselection_heatmap as coselection_heatmap
from moescope.dashboard.figures.heatmaps import layer_share_heatmap as layer_share_heatmap
from moescope.dashboard.figures.heatmaps import load_heatmap as load_heatmap
from moescope.dashboard.figures.jitter import JITTER_FIGURES as JITTER_FIGURES
from moescope.dashboard.figures.jitter import jitter_heatmap as jitter_heatmap
from moescope.dashboard.figures.jitter import jitter_margin_figure as jitter_margin_figure
from moescope.dashboard.figures.layout import HEIGHT as HEIGHT
from moescope.dashboard.figures.layout import PALETTE as PALETTE
from moescope.dashboard.figures.layout import empty_figure as empty_figure
from moescope.dashboard.figures.mismatch import MISMATCH_FIGURES as MISMATCH_FIGURES
from moescope.dashboard.figures.mismatch import gap_layers_figure as gap_layers_figure
from moescope.dashboard.figures.mismatch import logprob_gap_figure as logprob_gap_figure
from moescope.dashboard.figures.mismatch import mismatch_heatmap as mismatch_heatmap
from moescope.dashboard.figures.overview import ENTROPY_PANELS as ENTROPY_PANELS
from moescope.dashboard.figures.overview import active_by_position_figure as active_by_position_figure
from moescope.dashboard.figures.overview import active_by_tag_figure as active_by_tag_figure
from moescope.dashboard.figures.overview import active_fraction_figure as active_fraction_figure
from moescope.dashboard.figures.overview import dropped_figure as dropped_figure
from moescope.dashboard.figures.overview import entropy_figure as entropy_figure
from moescope.dashboard.figures.overview import host_load_figure as host_load_figure
from moescope.dashboard.figures.overview import layer_spread_figure as layer_spread_figure
from moescope.dashboard.figures.placement import balancedness_over_time_figure as balancedness_over_time_figure
from moescope.dashboard.figures.placement import before_after_figure as before_after_figure
from moescope.dashboard.figures.placement import fanout_histogram as fanout_histogram
from moescope.dashboard.figures.placement import rank_layer_heatmap as rank_layer_heatmap
from moescope.dashboard.figures.placement import rank_matrix_heatmap as rank_matrix_heatmap
from moescope.dashboard.figures.placement import rebalance_curve_figure as rebalance_curve_figure
from moescope.dashboard.figures.training import expert_grad_heatmap as expert_grad_heatmap
from moescope.dashboard.figures.training import training_figure as training_figure

__all__ = [
    "COMPARE_COLUMNS", "ENTROPY_PANELS", "HEIGHT", "JITTER_FIGURES", "MISMATCH_FIGURES", "PALETTE",
    "SLOT_SPECIALISATION", "STATE_COLOURS",
    "active_by_position_figure", "active_by_tag_figure", "active_fraction_figure", "alert_label", "alert_timeline",
    "balancedness_over_time_figure", "before_after_figure", "cache_hit_figure", "cluster_scatter",
    "compare_layers_figure", "compare_scalars_figure", "coselection_heatmap", "divergence_figure", "dropped_figure",
    "empty_figure", "entropy_figure", "expert_grad_heatmap", "fanout_histogram", "gap_layers_figure", "gate_history",
    "health_trend",
    "host_load_figure", "jitter_heatmap", "jitter_margin_figure", "layer_heatmap", "layer_share_heatmap",
    "layer_spread_figure", "load_heatmap", "logprob_gap_figure", "margin_figure", "mismatch_heatmap",
    "rank_layer_heatmap", "rank_matrix_heatmap", "rebalance_curve_figure", "specialisation_figure",
    "specialisation_figure_by_layer", "training_figure",
]
