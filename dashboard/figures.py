"""Plotly figure builders: pure functions from data frames (or arrays) to figures.

Only drawing: the numbers come in computed (store queries, `alerts.signals`, frames shaped by
dashboard/data.py), and a figure reshapes them only to lay them out (a pivot into a grid, a share
of its own column). Nothing here reads the store or Streamlit state, so every figure is tested by
building it from a frame and reading the numbers back out of its traces. Heatmaps that can be
clicked carry a transparent scatter trace over their cells: Plotly heatmaps do not report
selections, scatter points do, and each point's `customdata` says which cell it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from moescope.metrics import signals

HEIGHT = 380
PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6",
           "#9D755D", "#BAB0AC")
STATE_COLOURS = {"inactive": "#BAB0AC", "pending": "#EECA3B", "resolved": "#54A24B", "firing": "#E45756"}
# NMI(expert; tag) over every kept top-k slot (`signals.specialisation_by_layer`). Not the demo model
# card's "top-1 specialisation" (the router's first choice per token, before any capacity): one name each.
SLOT_SPECIALISATION = "kept-slot specialisation"


def _layout(fig: go.Figure, title: str, **kwargs) -> go.Figure:
    fig.update_layout(title={"text": title, "x": 0, "xanchor": "left"}, height=kwargs.pop("height", HEIGHT),
                      margin={"l": 10, "r": 10, "t": 50, "b": 10}, **kwargs)
    return fig


def _legend_above(fig: go.Figure) -> go.Figure:
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
    return _layout(fig, "", height=200)


# -- overview --------------------------------------------------------------------------------

def active_fraction_figure(over_time: pd.DataFrame) -> go.Figure:
    """Active-parameter fraction per step bucket (percent), with the min-max band of its steps."""
    if over_time.empty:
        return empty_figure("no steps recorded")
    x = over_time.step_start
    # Percent, rounded to 6 decimals: a fraction that is constant up to float noise (every token uses
    # k experts) must draw as a flat line, not as swings in the 17th digit.
    pct = {c: (over_time[c] * 100).round(6) for c in ("active_max", "active_min", "active_fraction")}
    fig = go.Figure([
        go.Scatter(x=x, y=pct["active_max"], mode="lines", line={"width": 0}, showlegend=False,
                   hoverinfo="skip"),
        go.Scatter(x=x, y=pct["active_min"], mode="lines", line={"width": 0}, fill="tonexty",
                   fillcolor="rgba(76,120,168,0.2)", name="min-max of steps", hoverinfo="skip"),
        go.Scatter(x=x, y=pct["active_fraction"], mode="lines+markers", name="active %",
                   line={"color": PALETTE[0]},
                   hovertemplate="steps %{x}: %{y:.3f}% of parameters per token<extra></extra>"),
    ])
    lo, hi = float(pct["active_min"].min()), float(pct["active_max"].max())
    pad = max((hi - lo) * 0.1, 0.5)  # at least half a percentage point either side: a flat line looks flat
    fig.update_xaxes(title="step", range=[float(x.min()) - 0.5, float(over_time.step_end.max()) + 0.5])
    fig.update_yaxes(title="% of parameters used per token", range=[lo - pad, hi + pad], tickformat=".2f")
    return _layout(fig, "Active-parameter fraction per batch")


def active_by_tag_figure(by_tag: pd.DataFrame, key: str) -> go.Figure:
    """Token-weighted active-parameter fraction per tag value, with min-max whiskers."""
    if by_tag.empty:
        return empty_figure(f"no step carries the tag {key!r}")
    pct = by_tag.active_fraction * 100
    fig = go.Figure(go.Bar(
        x=by_tag.value.astype(str), y=pct, marker_color=PALETTE[1],
        error_y={"type": "data", "symmetric": False, "array": by_tag.active_max * 100 - pct,
                     "arrayminus": pct - by_tag.active_min * 100},
        customdata=np.stack([by_tag.tokens, by_tag.steps], axis=1),
        hovertemplate="%{x}: %{y:.3f}%<br>%{customdata[0]} tokens in %{customdata[1]} steps<extra></extra>"))
    fig.update_xaxes(title=key)
    fig.update_yaxes(title="% of parameters per token")
    return _layout(fig, f"Active-parameter fraction by {key}")


def active_by_position_figure(by_position: pd.DataFrame) -> go.Figure:
    """Active-parameter fraction (percent) per position bucket, with the slots dropped per token.

    `by_position` is `Store.active_fraction_by_position`'s frame.
    """
    if by_position.empty:
        return empty_figure("no routes recorded: attach the probe with routes=True to see positions")
    labels = [f"{int(a)}–{int(b) - 1}" for a, b in zip(by_position.position_start, by_position.position_end)]
    pct = (by_position.active_fraction * 100).round(6)
    fig = go.Figure(go.Bar(
        x=labels, y=pct, marker_color=PALETTE[2],
        customdata=np.stack([by_position.tokens, by_position.dropped_slots, by_position.kept_slots], axis=1),
        hovertemplate="positions %{x}: %{y:.3f}% of parameters per token<br>%{customdata[0]} tokens; "
                      "%{customdata[1]:.2f} slots dropped, %{customdata[2]:.2f} kept per token<extra></extra>"))
    # Bars start at 0: a bar's length is its value, so a cut axis would make a small drift look large.
    top = float(pct.max())
    fig.update_xaxes(title="position in the input", type="category")
    fig.update_yaxes(title="% of parameters per token", range=[0.0, top * 1.1 if top > 0 else 1.0])
    return _layout(fig, "Active-parameter fraction by position")


def cache_hit_figure(report: pd.DataFrame, title: str = "") -> go.Figure:
    """Expert-cache hit rate (percent) against experts resident, a line per (layer, policy).

    `report` is `moescope.cli.whatif.cache_report`'s frame: layer, policy, capacity, hit_rate, ...
    Each policy keeps one colour; layers differ by dash when several are drawn.
    """
    if report.empty:
        return empty_figure("no routes recorded: attach the probe with routes=True to replay them")
    dashes = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
    policies = list(dict.fromkeys(report.policy))
    layers = sorted(report.layer.unique())
    fig = go.Figure()
    for li, layer in enumerate(layers):
        for pi, policy in enumerate(policies):
            line = report[(report.layer == layer) & (report.policy == policy)].sort_values("capacity")
            if line.empty:
                continue
            name = policy if len(layers) == 1 else f"layer {layer} {policy}"
            fig.add_trace(go.Scatter(
                x=line.capacity, y=line.hit_rate * 100, mode="lines+markers", name=name,
                line={"color": PALETTE[pi % len(PALETTE)], "dash": dashes[li % len(dashes)]},
                hovertemplate=f"{name}: %{{x}} experts resident, %{{y:.1f}}% hits<extra></extra>"))
    fig.update_xaxes(title="experts resident per layer (C)", dtick=1 if report.capacity.max() <= 16 else None)
    fig.update_yaxes(title="hit rate (% of expert accesses)", range=[0, 100])
    return _layout(fig, title or "Expert-cache hit rate")


def layer_spread_figure(layers: Sequence[signals.LayerFigures]) -> go.Figure:
    """Per layer: coefficient of variation and max/mean of the routed experts' load (`signals.load_spread`)."""
    if not layers:
        return empty_figure("no layer steps recorded")
    names = [str(f.layer) for f in layers]
    fig = go.Figure([
        go.Bar(x=names, y=[f.spread.cv for f in layers], name="coefficient of variation", marker_color=PALETTE[0],
               hovertemplate="layer %{x}: CV %{y:.3f}<extra></extra>"),
        go.Bar(x=names, y=[f.spread.max_mean for f in layers], name="max / mean", marker_color=PALETTE[3],
               hovertemplate="layer %{x}: max/mean %{y:.3f}<extra></extra>"),
    ])
    fig.update_xaxes(title="MoE layer", type="category")
    fig.update_yaxes(title="load spread (CV 0, max/mean 1 = even)", rangemode="tozero")
    return _legend_above(_layout(fig, "Load spread per layer", barmode="group"))


def host_load_figure(per_host: dict[str, Sequence[signals.LayerFigures]]) -> go.Figure:
    """Per layer, a bar per host: max/mean of the routed experts' load over that host's ranks."""
    if not per_host:
        return empty_figure("no layer steps recorded")
    fig = go.Figure([
        go.Bar(x=[str(f.layer) for f in layers], y=[f.spread.max_mean for f in layers], name=host,
               marker_color=PALETTE[i % len(PALETTE)],
               hovertemplate=f"{host}, layer %{{x}}: max/mean %{{y:.3f}}<extra></extra>")
        for i, (host, layers) in enumerate(per_host.items())])
    fig.update_xaxes(title="MoE layer", type="category")
    fig.update_yaxes(title="load max / mean (1 = perfectly even)", rangemode="tozero")
    return _layout(fig, "Load spread per layer, by host", barmode="group")


def entropy_figure(entropy: pd.DataFrame) -> go.Figure:
    """Mean per-token router entropy (nats, token-weighted in each bucket) over the step buckets of
    `Store.layer_buckets`: a small panel per layer, one above the other on a shared step axis (one
    line per layer in one panel was a tangle), each panel's y axis its own; past
    `ENTROPY_PANELS` layers, a layer x step heatmap."""
    if entropy.empty:
        return empty_figure("no layer steps recorded")
    from plotly.subplots import make_subplots

    groups = list(entropy.groupby("layer"))
    if len(groups) > ENTROPY_PANELS:
        grid = entropy.pivot_table(index="layer", columns="step_start", values="router_entropy", aggfunc="mean")
        fig = go.Figure(go.Heatmap(
            z=grid.to_numpy(), x=grid.columns.to_numpy(), y=[str(v) for v in grid.index], colorscale="Viridis",
            colorbar={"title": "nats"}, hovertemplate="layer %{y}, step %{x}: %{z:.4f} nats<extra></extra>"))
        fig.update_xaxes(title="step")
        fig.update_yaxes(title="MoE layer", type="category", autorange="reversed")
        return _layout(fig, "Router entropy (nats)")
    fig = make_subplots(rows=len(groups), cols=1, shared_xaxes=True, vertical_spacing=0.04)
    for i, (layer, rows) in enumerate(groups):
        fig.add_trace(go.Scatter(x=rows.step_start, y=rows.router_entropy, mode="lines", name=f"layer {layer}",
                                 line={"color": PALETTE[i % len(PALETTE)], "width": 1.2}, showlegend=False,
                                 hovertemplate=f"layer {layer}, step %{{x}}: %{{y:.4f}} nats<extra></extra>"),
                      row=i + 1, col=1)
        fig.update_yaxes(title={"text": f"layer {layer}", "font": {"size": 11}}, nticks=3, row=i + 1, col=1)
    fig.update_xaxes(title="step", row=len(groups), col=1)
    return _layout(fig, "Router entropy (nats), per layer", height=max(HEIGHT, 60 + 80 * len(groups)))


ENTROPY_PANELS = 8  # layers drawn as panels of the router-entropy figure; more: one heatmap


def dropped_figure(entropy: pd.DataFrame) -> go.Figure:
    """Tokens dropped at capacity per layer over the step buckets (from `Store.layer_buckets`)."""
    if entropy.empty:
        return empty_figure("no layer steps recorded")
    fig = go.Figure([
        go.Bar(x=rows.step_start, y=rows.dropped_tokens, name=f"layer {layer}",
               marker_color=PALETTE[i % len(PALETTE)],
               hovertemplate=f"layer {layer}, step %{{x}}: %{{y}} dropped<extra></extra>")
        for i, (layer, rows) in enumerate(entropy.groupby("layer"))])
    fig.update_xaxes(title="step")
    fig.update_yaxes(title="dropped tokens", rangemode="tozero")
    return _legend_above(_layout(fig, "Dropped tokens", barmode="stack", legend_traceorder="normal"))


# -- heatmaps --------------------------------------------------------------------------------

def _click_layer(x, y, customdata, hovertemplate: str) -> go.Scatter:
    # Invisible square markers on the cell centres: they receive the clicks for the heatmap.
    return go.Scatter(x=x, y=y, mode="markers", customdata=customdata, showlegend=False,
                      marker={"symbol": "square", "size": 14, "opacity": 0.0, "color": "black"},
                      hovertemplate=hovertemplate)


def load_heatmap(matrix: pd.DataFrame, layer: int) -> go.Figure:
    """Time x expert heatmap of one layer: each step bucket's share of tokens per expert.

    Cells carry customdata (expert, step_start, step_end, tokens) for click selection."""
    if matrix.empty:
        return empty_figure(f"no load recorded for layer {layer}")
    load = matrix.pivot_table(index="expert", columns="step_start", values="load", aggfunc="sum", fill_value=0)
    ends = matrix.groupby("step_start").step_end.max().reindex(load.columns)
    totals = load.sum(axis=0).replace(0, np.nan)
    share = load / totals
    experts, starts = load.index.to_numpy(), load.columns.to_numpy()
    fig = go.Figure(go.Heatmap(
        z=share.to_numpy(), x=[str(s) for s in starts], y=[str(e) for e in experts], colorscale="Viridis",
        colorbar={"title": "share of slots"}, hoverinfo="skip", zmin=0))
    gx, gy = np.meshgrid(starts, experts)
    gend = np.broadcast_to(ends.to_numpy(), gx.shape)
    custom = np.stack([gy.ravel(), gx.ravel(), gend.ravel(), load.to_numpy().ravel(),
                       share.to_numpy().ravel()], axis=1)
    fig.add_trace(_click_layer(
        [str(s) for s in gx.ravel()], [str(e) for e in gy.ravel()], custom,
        "expert %{customdata[0]}, steps %{customdata[1]}-%{customdata[2]}<br>"
        "%{customdata[3]} tokens chose it (%{customdata[4]:.1%} of the bucket's slots)<br>"
        "click to list them<extra></extra>"))
    fig.update_xaxes(title="first step of bucket", type="category")
    fig.update_yaxes(title="expert", type="category")
    return _layout(fig, f"Layer {layer}: share of routing slots per expert over time")


def layer_share_heatmap(layer_expert: pd.DataFrame, layer_tokens: dict[int, int]) -> go.Figure:
    """Layer x expert heatmap of each layer's share of routing slots per expert over the run, from
    `Store.expert_share` rows; `layer_tokens` ({layer: tokens it routed}) gives each expert's share
    of the layer's *tokens* in the hover (a token fills k slots, so token shares add up to k).

    Cells carry customdata (layer, expert, tokens that chose it, token share, slot share)."""
    if layer_expert.empty:
        return empty_figure("no load recorded")
    load = layer_expert.pivot_table(index="layer", columns="expert", values="load", aggfunc="sum", fill_value=0)
    share = load.div(load.sum(axis=1).replace(0, np.nan), axis=0)
    tokens = pd.Series({int(k): v for k, v in layer_tokens.items()}, dtype=np.float64).reindex(load.index)
    token_share = load.div(tokens.replace(0, np.nan), axis=0)
    layers, experts = load.index.to_numpy(), load.columns.to_numpy()
    fig = go.Figure(go.Heatmap(z=share.to_numpy(), x=[str(e) for e in experts], y=[str(v) for v in layers],
                               colorscale="Viridis", colorbar={"title": "share of slots"}, hoverinfo="skip",
                               zmin=0))
    gx, gy = np.meshgrid(experts, layers)
    custom = np.stack([gy.ravel(), gx.ravel(), load.to_numpy().ravel(), token_share.to_numpy().ravel(),
                       share.to_numpy().ravel()], axis=1)
    fig.add_trace(_click_layer(
        [str(e) for e in gx.ravel()], [str(v) for v in gy.ravel()], custom,
        "layer %{customdata[0]}, expert %{customdata[1]}<br>%{customdata[2]} tokens chose it: "
        "%{customdata[3]:.1%} of the layer's tokens, %{customdata[4]:.1%} of its slots<br>"
        "click to list them<extra></extra>"))
    fig.update_xaxes(title="expert", type="category")
    fig.update_yaxes(title="MoE layer", type="category", autorange="reversed")
    return _layout(fig, "Share of each layer's routing slots per expert")


def coselection_heatmap(matrix: np.ndarray | None, layer: int) -> go.Figure:
    """Expert affinity of one layer: P(j chosen | i chosen) from co-selection counts, diagonal
    left blank (it is the expert's own load)."""
    if matrix is None or matrix.size == 0:
        return empty_figure(f"no co-selection recorded for layer {layer} (top-1 routers have none)")
    counts = np.asarray(matrix, dtype=np.float64)
    own = np.diag(counts).copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        affinity = counts / own[:, None]
    np.fill_diagonal(affinity, np.nan)
    labels = [str(i) for i in range(counts.shape[0])]
    fig = go.Figure(go.Heatmap(
        # The scale is fixed at [0, 1] (a probability) and starts light: a near-zero cell reads as 0.
        z=affinity, x=labels, y=labels, colorscale="Blues", zmin=0, zmax=1, colorbar={"title": "P(j | i)"},
        customdata=counts, hovertemplate="i=%{y}, j=%{x}: %{customdata:.0f} tokens chose both<br>"
                                         "P(j | i) = %{z:.3f}<extra></extra>"))
    fig.update_xaxes(title="expert j", type="category")
    fig.update_yaxes(title="expert i", type="category", autorange="reversed")
    return _layout(fig, f"Layer {layer}: co-selection affinity")


# -- semantic clusters ----------------------------------------------------------------------

def cluster_scatter(points: pd.DataFrame, colour: str, title: str) -> go.Figure:
    """UMAP scatter: columns x, y, the `colour` column (categories) and `hover` (text).

    SVG, not WebGL: at most a few thousand points, and it draws without a GPU (headless too)."""
    if points.empty:
        return empty_figure("no router inputs sampled")
    fig = go.Figure()
    for i, (value, rows) in enumerate(points.groupby(points[colour].astype(str), sort=True)):
        fig.add_trace(go.Scatter(
            x=rows.x, y=rows.y, mode="markers", name=f"{colour} {value}", text=rows.hover,
            marker={"size": 6, "color": PALETTE[i % len(PALETTE)], "opacity": 0.8},
            hovertemplate="%{text}<extra></extra>"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, title, height=520, legend={"itemsizing": "constant"})


def specialisation_figure(counts: np.ndarray, experts: Sequence[int], values: Sequence[str], key: str,
                          layer: int) -> go.Figure:
    """Experts x tag values (`signals.expert_tag_contingency`): each tag value's share of slots per
    expert (columns sum to 1), with the layer's kept-slot specialisation, NMI(expert; tag)
    (`signals.normalized_mutual_information`), in the subtitle: a short title and a subtitle fit a
    half-width column where one long title was cut before its value."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.size == 0 or counts.sum() <= 0:
        return empty_figure(f"no step carries the tag {key!r}")
    share = counts / np.where(counts.sum(axis=0, keepdims=True) > 0, counts.sum(axis=0, keepdims=True), np.nan)
    nmi = signals.normalized_mutual_information(counts)
    fig = go.Figure(go.Heatmap(
        z=share, x=list(values), y=[str(e) for e in experts], colorscale="Blues", colorbar={"title": "share"},
        zmin=0, customdata=counts,
        hovertemplate=f"{key}=%{{x}}, expert %{{y}}: %{{customdata:.0f}} tokens "
                      "(%{z:.1%} of the tag's slots)<extra></extra>"))
    fig.update_xaxes(title=key, type="category")
    fig.update_yaxes(title="expert", type="category")
    fig = _layout(fig, f"Layer {layer}: {key} share per expert")
    fig.update_layout(title_subtitle_text=f"{SLOT_SPECIALISATION} NMI(expert; {key}) = {nmi:.3f}", margin_t=70)
    return fig


def specialisation_figure_by_layer(per_layer: pd.DataFrame, key: str) -> go.Figure:
    """Bar per layer of the kept-slot specialisation NMI(expert; tag), from `signals.specialisation_by_layer`."""
    if per_layer.empty:
        return empty_figure(f"no step carries the tag {key!r}")
    fig = go.Figure(go.Bar(x=per_layer.layer.astype(str), y=per_layer.nmi, marker_color=PALETTE[2],
                           customdata=per_layer.tokens,
                           hovertemplate="layer %{x}: NMI %{y:.3f} over %{customdata} slots<extra></extra>"))
    fig.update_xaxes(title="MoE layer", type="category")
    fig.update_yaxes(title=f"NMI(expert; {key}) over kept slots", range=[0, 1])
    fig = _layout(fig, f"{SLOT_SPECIALISATION.capitalize()} per layer")
    fig.update_layout(title_subtitle_text=f"how much the expert a slot went to tells about {key}", margin_t=70)
    return fig


# -- drift and alerts ------------------------------------------------------------------------

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
    fig = _layout(fig, name)
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
    return _layout(fig, "Alert transitions", height=max(HEIGHT, 40 * label.nunique() + 120))


# -- expert health ---------------------------------------------------------------------------

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
    return _layout(fig, f"Layer {layer}, expert {expert}: health score and components")


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
    return _layout(fig, f"Trust-gate weight: {names}")


# -- compare ---------------------------------------------------------------------------------

def compare_layers_figure(sides: dict[str, pd.DataFrame], metric: str, title: str) -> go.Figure:
    """Grouped bars per layer of `metric`, one bar group per side (name -> per-layer frame)."""
    frames = {name: df for name, df in sides.items() if not df.empty}
    if not frames:
        return empty_figure("nothing recorded on either side")
    fig = go.Figure([go.Bar(x=df.layer.astype(str), y=df[metric], name=name, marker_color=PALETTE[i],
                            hovertemplate=f"{name}, layer %{{x}}: %{{y:.4g}}<extra></extra>")
                     for i, (name, df) in enumerate(frames.items())])
    fig.update_xaxes(title="MoE layer", type="category")
    return _layout(fig, title, barmode="group")


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
    fig = _layout(fig, "Side by side", height=300 * rows_n + 60)
    fig.update_layout(margin_t=100)  # room for the title above the first row's two-line panel titles
    return fig


COMPARE_COLUMNS = 3


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


# -- training (the frames of `alerts.training.training_report`) ------------------------------

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
    return _layout(fig, title)


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
    return _layout(fig, f"Layer {layer}: expert gradient norms per optimizer step")


# -- routing jitter ------------------------------------------------------------------------------

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
    conditions = list(dict.fromkeys(rows.condition))
    layers = sorted(int(v) for v in rows.layer.unique())
    z = np.full((len(conditions), len(layers)), np.nan)
    text = np.full(z.shape, "", dtype=object)
    for row in rows.itertuples():
        i, j = conditions.index(row.condition), layers.index(int(row.layer))
        value = getattr(row, column)
        z[i, j] = value * 100 if percent else value
        text[i, j] = f"{int(row.tokens):,} tokens vs {row.baseline}: {row.description}"
    fig = go.Figure(go.Heatmap(
        z=z, x=[str(v) for v in layers], y=conditions, colorscale="Reds", zmin=0, customdata=text,
        colorbar={"title": "%" if percent else "|Δw|"},
        hovertemplate="%{y}, layer %{x}: %{z:.3g}" + ("%" if percent else "") + "<br>%{customdata}<extra></extra>"))
    fig.update_xaxes(title="MoE layer", type="category")
    fig.update_yaxes(title="condition", autorange="reversed", type="category")
    return _layout(fig, f"Routing jitter: {JITTER_FIGURES.get(column, column)}",
                   height=max(HEIGHT, 60 + 32 * len(conditions)))


def jitter_margin_figure(rows: pd.DataFrame, title: str = "", counted: str = "tokens",
                         reference: str = "the baseline") -> go.Figure:
    """The baseline's top-k margin of the tokens whose expert set changed and of the rest, summed over
    `rows` (`Store.jitter_layers` rows: one condition, one or every layer), each group as a share of
    its own tokens per bin of margin_edges, counts in the hover. Flips at rounding noise sit left.
    `counted` names what a count counts and `reference` whose logits the margin is of (the mismatch
    page: "(token, layer) pairs" of "the reference")."""
    if rows.empty:
        return empty_figure("no routing jitter measured")
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
    return _layout(fig, title or "Where the flips sit: top-k margin", barmode="group")


# -- engine vs reference (moescope.analyses.mismatch) --------------------------------------------

MISMATCH_FIGURES = {  # `Store.mismatch_layers` column -> what it shows
    "set_changed_fraction": "expert set differs (% of (token, layer) pairs)",
    "top1_changed_fraction": "top-1 expert differs (% of pairs)",
    "slots_changed_fraction": "experts that differ (% of the pairs' k slots)",
}


def mismatch_heatmap(rows: pd.DataFrame, column: str = "set_changed_fraction") -> go.Figure:
    """Group x layer heatmap of one `Store.mismatch_layers` fraction (MISMATCH_FIGURES), in percent:
    a row per group (the whole run, each position bucket, each tag) in the query's order, a column per
    MoE layer and one for every layer together; the hover adds the pairs compared and, on the
    every-layer column, the share of tokens that differ in at least one layer."""
    if rows.empty:
        return empty_figure("no engine-vs-reference mismatch measured in this run")
    names = [f"{g}: {n}" if g != "all" else "whole run" for g, n in zip(rows.grouping, rows.group_name)]
    groups = list(dict.fromkeys(names))
    layers = sorted(int(v) for v in rows.layer.dropna().unique())
    columns = [str(v) for v in layers] + ["every layer"]
    z = np.full((len(groups), len(columns)), np.nan)
    text = np.full(z.shape, "", dtype=object)
    for name, row in zip(names, rows.itertuples()):
        every = pd.isna(row.layer)
        i, j = groups.index(name), len(columns) - 1 if every else layers.index(int(row.layer))
        z[i, j] = getattr(row, column) * 100
        share = f"; {row.tokens_set_changed_fraction:.2%} of {int(row.tokens):,} tokens differ in ≥1 layer"
        text[i, j] = f"{int(row.pairs):,} pairs" + (share if every else "")
    fig = go.Figure(go.Heatmap(
        z=z, x=columns, y=groups, colorscale="Reds", zmin=0, customdata=text, colorbar={"title": "%"},
        hovertemplate="%{y}, layer %{x}: %{z:.3g}%<br>%{customdata}<extra></extra>"))
    fig.update_xaxes(title="MoE layer", type="category")
    fig.update_yaxes(title="group", autorange="reversed", type="category")
    return _layout(fig, f"Engine vs reference: {MISMATCH_FIGURES.get(column, column)}",
                   height=max(HEIGHT, 60 + 28 * len(groups)))


# -- placement (moescope.analyses.placement) ---------------------------------------------------

def rank_layer_heatmap(layers: pd.DataFrame, ranks: int) -> go.Figure:
    """Rank x layer heatmap of a placement report's rows (one per layer): each rank's slots over the
    layer's mean rank (1 is even; the hottest rank of a layer sets its pace). Hover: the slots, the
    layer's balancedness and, on its hottest rank, the experts that make it so."""
    if layers.empty:
        return empty_figure("no layer steps recorded")
    rows = layers.sort_values("layer")
    slots = np.stack([np.asarray(v, dtype=np.float64) for v in rows.rank_slots])  # (layers, ranks)
    mean = slots.mean(axis=1, keepdims=True)
    ratio = np.divide(slots, mean, out=np.full_like(slots, np.nan), where=mean > 0)
    hot = [", ".join(f"{e} ({s:,.0f})" for e, s in zip(r.hottest_experts, r.hottest_expert_slots))
           for r in rows.itertuples()]
    text = [[f"layer {r.layer}, rank {k}: {slots[i, k]:,.1f} slots, {ratio[i, k]:.2f}x the mean rank"
             f"<br>layer balancedness {r.balancedness:.3f}"
             + (f"<br>hottest rank; its experts: {hot[i]}" if k == r.hottest_rank else "")
             for k in range(ranks)] for i, r in enumerate(rows.itertuples())]
    fig = go.Figure(go.Heatmap(
        z=ratio.T, x=[str(v) for v in rows.layer], y=[str(k) for k in range(ranks)], colorscale="RdBu_r", zmid=1.0,
        colorbar={"title": "x mean rank"}, text=np.array(text, dtype=object).T, hovertemplate="%{text}<extra></extra>"))
    fig.update_xaxes(title="MoE layer", type="category")
    fig.update_yaxes(title="rank", type="category")
    return _layout(fig, "Slots per rank, over the layer's mean rank")


def balancedness_over_time_figure(summary: pd.DataFrame) -> go.Figure:
    """Balancedness of the whole forward (`signals.balancedness_over_layers`) per window, a line per
    candidate placement of a what-if summary; a marker shows where each line's placement was fitted."""
    if summary.empty:
        return empty_figure("no windows to evaluate")
    fig = go.Figure()
    for i, (candidate, line) in enumerate(summary.groupby("candidate", sort=False)):
        line = line.sort_values("window_start")
        fig.add_trace(go.Scatter(
            x=line.window_start, y=line.balancedness, mode="lines+markers", name=str(candidate),
            line={"color": PALETTE[i % len(PALETTE)]},
            hovertemplate=f"{candidate}: steps %{{x}}+, balancedness %{{y:.3f}}<extra></extra>"))
    fig.update_xaxes(title="first step of the window")
    fig.update_yaxes(title="balancedness (mean / max rank, all layers)", range=[0, 1.02])
    return _legend_above(_layout(fig, "Balancedness over time, per placement"))


def before_after_figure(before: np.ndarray, after: np.ndarray, labels: tuple[str, str], title: str) -> go.Figure:
    """Slots per rank under two placements of the same loads, side by side, with each one's mean."""
    fig = go.Figure()
    for i, (values, label) in enumerate(zip((before, after), labels)):
        values = np.asarray(values, dtype=np.float64)
        fig.add_trace(go.Bar(x=[str(k) for k in range(values.size)], y=values, name=label,
                             marker_color=PALETTE[i], hovertemplate=f"{label}: rank %{{x}}, %{{y:,.1f}} slots"
                                                                    "<extra></extra>"))
    mean = float(np.mean(before)) if np.size(before) else 0.0
    fig.add_hline(y=mean, line_dash="dot", annotation_text="mean rank")
    fig.update_xaxes(title="rank", type="category")
    fig.update_yaxes(title="slots")
    return _legend_above(_layout(fig, title, barmode="group"))
