"""Plotly figure builders: pure functions from data frames (or arrays) to figures.

Nothing here reads the store or Streamlit state, so every figure is tested by building it from a
frame and reading the numbers back out of its traces. Heatmaps that can be clicked carry a
transparent scatter trace over their cells: Plotly heatmaps do not report selections, scatter
points do, and each point's `customdata` says which cell it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from alerts import signals

HEIGHT = 380
PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6",
           "#9D755D", "#BAB0AC")
STATE_COLOURS = {"inactive": "#BAB0AC", "pending": "#EECA3B", "resolved": "#54A24B", "firing": "#E45756"}


def _layout(fig: go.Figure, title: str, **kwargs) -> go.Figure:
    fig.update_layout(title={"text": title, "x": 0, "xanchor": "left"}, height=kwargs.pop("height", HEIGHT),
                      margin={"l": 10, "r": 10, "t": 50, "b": 10}, **kwargs)
    return fig


def empty_figure(message: str) -> go.Figure:
    """A blank figure that says why there is nothing to draw."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, "", height=200)


# -- numbers the figures show ----------------------------------------------------------------

def load_spread(expert_load: Sequence[int] | np.ndarray) -> dict[str, float]:
    """Load-spread numbers of one load vector: coefficient of variation, max/mean, share of the
    busiest expert, the busiest expert's index, and the fraction of experts with no token."""
    load = np.asarray(expert_load, dtype=np.float64)
    if load.size == 0 or load.sum() <= 0:
        nan = float("nan")
        return {"cv": nan, "max_mean": nan, "top_share": nan, "hottest": -1, "dead_fraction": nan}
    return {"cv": signals.coefficient_of_variation(load), "max_mean": signals.max_mean_ratio(load),
                "top_share": float(load.max() / load.sum()), "hottest": int(load.argmax()),
                "dead_fraction": signals.dead_expert_fraction(load)}


def mutual_information_bits(counts: np.ndarray) -> float:
    """I(expert; tag) in bits from a (experts, tag values) table of token counts; NaN if empty."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        return float("nan")
    joint = counts / total
    pe = joint.sum(axis=1, keepdims=True)
    pt = joint.sum(axis=0, keepdims=True)
    mask = joint > 0
    return float(np.sum(joint[mask] * np.log2(joint[mask] / (pe @ pt)[mask])))


def contingency(expert_tag_load: pd.DataFrame, layer: int) -> tuple[np.ndarray, list[int], list[str]]:
    """(experts x tag values) counts of one layer from `queries.expert_tag_load` rows."""
    rows = expert_tag_load[expert_tag_load.layer == layer]
    table = rows.pivot_table(index="expert", columns="value", values="load", aggfunc="sum", fill_value=0)
    return table.to_numpy(dtype=np.float64), [int(e) for e in table.index], [str(v) for v in table.columns]


def divergence_over_time(drift: pd.DataFrame) -> pd.DataFrame:
    """KL and JS divergence (nats, `alerts.signals`) of each window's load against its layer's
    baseline, from `Store.drift_windows` rows: columns layer, window_start, window_end
    (exclusive), step_end (last step), kl, js. Windows whose baseline is empty are left out."""
    rows = []
    for r in drift.itertuples():
        load = np.asarray(r.expert_load, dtype=np.float64)
        ref = np.asarray(r.baseline_load, dtype=np.float64)
        if ref.size != load.size or ref.sum() <= 0 or load.sum() <= 0:
            continue
        rows.append({"layer": int(r.layer), "window_start": int(r.window_start), "window_end": int(r.window_end),
                         "step_end": int(r.window_end) - 1, "kl": signals.kl_divergence(load, ref),
                         "js": signals.js_divergence(load, ref)})
    return pd.DataFrame(rows, columns=["layer", "window_start", "window_end", "step_end", "kl", "js"])


# -- overview --------------------------------------------------------------------------------

def active_fraction_figure(over_time: pd.DataFrame) -> go.Figure:
    """Active-parameter fraction per step bucket (percent), with the min-max band of its steps."""
    if over_time.empty:
        return empty_figure("no steps recorded")
    x = over_time.step_start
    fig = go.Figure([
        go.Scatter(x=x, y=over_time.active_max * 100, mode="lines", line={"width": 0}, showlegend=False,
                   hoverinfo="skip"),
        go.Scatter(x=x, y=over_time.active_min * 100, mode="lines", line={"width": 0}, fill="tonexty",
                   fillcolor="rgba(76,120,168,0.2)", name="min-max of steps", hoverinfo="skip"),
        go.Scatter(x=x, y=over_time.active_fraction * 100, mode="lines+markers", name="active %",
                   line={"color": PALETTE[0]},
                   hovertemplate="steps %{x}: %{y:.3f}% of parameters per token<extra></extra>"),
    ])
    fig.update_xaxes(title="step")
    fig.update_yaxes(title="% of parameters used per token")
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


def cache_hit_figure(report: pd.DataFrame, title: str = "") -> go.Figure:
    """Expert-cache hit rate (percent) against experts resident, a line per (layer, policy).

    `report` is `moescope.whatif.cache_report`'s frame: layer, policy, capacity, hit_rate, ...
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


def layer_spread_figure(layer_totals: pd.DataFrame) -> go.Figure:
    """Per layer: coefficient of variation and max/mean of the expert load over the run."""
    if layer_totals.empty:
        return empty_figure("no layer steps recorded")
    spread = pd.DataFrame([load_spread(v) for v in layer_totals.expert_load])
    layers = layer_totals.layer.astype(str)
    fig = go.Figure([
        go.Bar(x=layers, y=spread.cv, name="coefficient of variation", marker_color=PALETTE[0],
               hovertemplate="layer %{x}: CV %{y:.3f}<extra></extra>"),
        go.Bar(x=layers, y=spread.max_mean, name="max / mean", marker_color=PALETTE[3],
               hovertemplate="layer %{x}: max/mean %{y:.3f}<extra></extra>"),
    ])
    fig.update_xaxes(title="MoE layer", type="category")
    fig.update_yaxes(title="load spread (0 = perfectly even)")
    return _layout(fig, "Load spread per layer", barmode="group")


def entropy_figure(entropy: pd.DataFrame) -> go.Figure:
    """Mean per-token router entropy (nats) per layer over the step buckets."""
    if entropy.empty:
        return empty_figure("no layer steps recorded")
    fig = go.Figure([
        go.Scatter(x=rows.step_start, y=rows.router_entropy, mode="lines", name=f"layer {layer}",
                   line={"color": PALETTE[i % len(PALETTE)]},
                   hovertemplate=f"layer {layer}, step %{{x}}: %{{y:.4f}} nats<extra></extra>")
        for i, (layer, rows) in enumerate(entropy.groupby("layer"))])
    fig.update_xaxes(title="step")
    fig.update_yaxes(title="router entropy (nats)")
    return _layout(fig, "Router entropy")


def dropped_figure(entropy: pd.DataFrame) -> go.Figure:
    """Tokens dropped at capacity per layer over the step buckets (from `entropy_over_time`)."""
    if entropy.empty:
        return empty_figure("no layer steps recorded")
    fig = go.Figure([
        go.Bar(x=rows.step_start, y=rows.dropped_tokens, name=f"layer {layer}",
               marker_color=PALETTE[i % len(PALETTE)],
               hovertemplate=f"layer {layer}, step %{{x}}: %{{y}} dropped<extra></extra>")
        for i, (layer, rows) in enumerate(entropy.groupby("layer"))])
    fig.update_xaxes(title="step")
    fig.update_yaxes(title="dropped tokens", rangemode="tozero")
    return _layout(fig, "Dropped tokens", barmode="stack")


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
        colorbar={"title": "share"}, hoverinfo="skip"))
    gx, gy = np.meshgrid(starts, experts)
    gend = np.broadcast_to(ends.to_numpy(), gx.shape)
    custom = np.stack([gy.ravel(), gx.ravel(), gend.ravel(), load.to_numpy().ravel(),
                       share.to_numpy().ravel()], axis=1)
    fig.add_trace(_click_layer(
        [str(s) for s in gx.ravel()], [str(e) for e in gy.ravel()], custom,
        "expert %{customdata[0]}, steps %{customdata[1]}-%{customdata[2]}<br>"
        "%{customdata[3]} tokens (%{customdata[4]:.1%})<br>click to list them<extra></extra>"))
    fig.update_xaxes(title="first step of bucket", type="category")
    fig.update_yaxes(title="expert", type="category")
    return _layout(fig, f"Layer {layer}: share of tokens per expert over time")


def layer_share_heatmap(layer_expert: pd.DataFrame) -> go.Figure:
    """Layer x expert heatmap of each layer's share of tokens per expert over the run.

    Cells carry customdata (layer, expert, tokens, share) for click selection."""
    if layer_expert.empty:
        return empty_figure("no load recorded")
    load = layer_expert.pivot_table(index="layer", columns="expert", values="load", aggfunc="sum", fill_value=0)
    share = load.div(load.sum(axis=1).replace(0, np.nan), axis=0)
    layers, experts = load.index.to_numpy(), load.columns.to_numpy()
    fig = go.Figure(go.Heatmap(z=share.to_numpy(), x=[str(e) for e in experts], y=[str(v) for v in layers],
                               colorscale="Viridis", colorbar={"title": "share"}, hoverinfo="skip"))
    gx, gy = np.meshgrid(experts, layers)
    custom = np.stack([gy.ravel(), gx.ravel(), load.to_numpy().ravel(), share.to_numpy().ravel()], axis=1)
    fig.add_trace(_click_layer(
        [str(e) for e in gx.ravel()], [str(v) for v in gy.ravel()], custom,
        "layer %{customdata[0]}, expert %{customdata[1]}<br>%{customdata[2]} tokens "
        "(%{customdata[3]:.1%} of the layer)<br>click to list them<extra></extra>"))
    fig.update_xaxes(title="expert", type="category")
    fig.update_yaxes(title="MoE layer", type="category", autorange="reversed")
    return _layout(fig, "Share of each layer's tokens per expert")


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
        z=affinity, x=labels, y=labels, colorscale="Magma", colorbar={"title": "P(j | i)"},
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
    """Experts x tag values: each tag value's share of tokens per expert (columns sum to 1),
    titled with the mutual information I(expert; tag) in bits."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.size == 0 or counts.sum() <= 0:
        return empty_figure(f"no step carries the tag {key!r}")
    share = counts / np.where(counts.sum(axis=0, keepdims=True) > 0, counts.sum(axis=0, keepdims=True), np.nan)
    mi = mutual_information_bits(counts)
    fig = go.Figure(go.Heatmap(
        z=share, x=list(values), y=[str(e) for e in experts], colorscale="Blues", colorbar={"title": "share"},
        customdata=counts, hovertemplate=f"{key}=%{{x}}, expert %{{y}}: %{{customdata:.0f}} tokens "
                                         "(%{z:.1%} of the tag's)<extra></extra>"))
    fig.update_xaxes(title=key, type="category")
    fig.update_yaxes(title="expert", type="category")
    return _layout(fig, f"Layer {layer}: {key} share per expert · I(expert; {key}) = {mi:.4f} bits")


def mutual_information_figure(per_layer: pd.DataFrame, key: str) -> go.Figure:
    """Bar per layer of I(expert; tag) in bits (columns layer, mi_bits, max_bits)."""
    if per_layer.empty:
        return empty_figure(f"no step carries the tag {key!r}")
    fig = go.Figure(go.Bar(x=per_layer.layer.astype(str), y=per_layer.mi_bits, marker_color=PALETTE[2],
                           customdata=per_layer.max_bits,
                           hovertemplate="layer %{x}: %{y:.4f} bits of at most %{customdata:.3f}<extra></extra>"))
    fig.update_xaxes(title="MoE layer", type="category")
    fig.update_yaxes(title=f"I(expert; {key}) bits", rangemode="tozero")
    return _layout(fig, f"How much the expert choice tells about {key}")


# -- drift and alerts ------------------------------------------------------------------------

def divergence_figure(divergence: pd.DataFrame, measure: str, thresholds: Sequence[tuple[str, float]] = ()
                      ) -> go.Figure:
    """`measure` ("kl" or "js") per layer over windows, with rule thresholds as dashed lines."""
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
    fig.update_xaxes(title="last step of window")
    fig.update_yaxes(title=f"{measure.upper()} vs baseline (nats)", rangemode="tozero")
    return _layout(fig, f"{name} of each window's load against the baseline")


def alert_timeline(alerts: pd.DataFrame, time_col: str, name_col: str) -> go.Figure:
    """One row per alert (name and layer), a marker per state change coloured by the new state."""
    if alerts.empty:
        return empty_figure("no alert transition recorded")
    label = alerts[name_col].astype(str)
    if "layer" in alerts:
        label = label + " · layer " + alerts["layer"].astype(str)
    fig = go.Figure()
    frame = alerts.assign(_label=label, _state=alerts["state"].astype(str))
    order = list(STATE_COLOURS)  # later states drawn on top: a pending->firing at one instant shows firing
    for state in sorted(frame._state.unique(), key=lambda s: order.index(s) if s in order else -1):
        rows = frame[frame._state == state]
        fig.add_trace(go.Scatter(
            x=rows[time_col], y=rows["_label"], mode="markers", name=state,
            marker={"size": 12, "symbol": "square", "color": STATE_COLOURS.get(state, PALETTE[0])},
            hovertemplate=f"%{{y}}: {state} at %{{x}}<extra></extra>"))
    fig.update_yaxes(type="category", title="")
    fig.update_xaxes(title="event time")
    return _layout(fig, "Alert transitions", height=max(HEIGHT, 40 * label.nunique() + 120))


# -- expert health ---------------------------------------------------------------------------

def health_trend(health: pd.DataFrame, x: str, columns: Sequence[str], layer: int, expert: int) -> go.Figure:
    """Score and its components over time for one expert."""
    rows = health[(health.layer == layer) & (health.expert == expert)]
    if rows.empty:
        return empty_figure(f"no health score for layer {layer}, expert {expert}")
    fig = go.Figure([go.Scatter(x=rows[x], y=rows[c], mode="lines+markers", name=c,
                                line={"color": PALETTE[i % len(PALETTE)], "width": 3 if c == "score" else 1.5})
                     for i, c in enumerate(columns)])
    fig.update_xaxes(title=x)
    return _layout(fig, f"Layer {layer}, expert {expert}: health score and components")


def gate_history(events: pd.DataFrame, time_col: str, weight_col: str) -> go.Figure:
    """Trust weight of each (layer, expert) that the gate ever changed, as steps over time: at each
    change the line drops (or rises) from the old weight to the new one."""
    if events.empty:
        return empty_figure("the trust gate has not changed any weight")
    fig = go.Figure()
    for i, ((layer, expert), rows) in enumerate(events.groupby(["layer", "expert"])):
        x = np.repeat(rows[time_col].to_numpy(), 2)
        old = rows["old_weight"].to_numpy() if "old_weight" in rows else rows[weight_col].to_numpy()
        y = np.stack([old, rows[weight_col].to_numpy()], axis=1).reshape(-1)
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=f"layer {layer} · expert {expert}",
                                 line={"color": PALETTE[i % len(PALETTE)]},
                                 hovertemplate="%{x}: weight %{y:.2f}<extra></extra>"))
    fig.update_yaxes(title="trust weight", range=[-0.05, 1.05])
    return _layout(fig, "Trust-gate weights")


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
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=metrics)
    for col, metric in enumerate(metrics, start=1):
        rows = values[values.metric == metric]
        fig.add_trace(go.Bar(x=rows.side, y=rows.value, marker_color=[PALETTE[i] for i in range(len(rows))],
                             showlegend=False, hovertemplate="%{x}: %{y:.4g}<extra></extra>"), row=1, col=col)
    return _layout(fig, "Side by side")


# -- frames of optional tables ---------------------------------------------------------------

def pick_column(columns: Sequence[str], candidates: Sequence[str]) -> str | None:
    """The first of `candidates` present in `columns` (tables written by other components name
    their time and rule columns in one of a few ways)."""
    return next((c for c in candidates if c in columns), None)


ALERT_TIME = ("at", "ts", "time", "starts_at")
ALERT_NAME = ("alertname", "rule", "name")


def latest_alert_states(alerts: pd.DataFrame) -> pd.DataFrame:
    """The latest transition of each alert (by fingerprint, else name and layer).

    Several transitions of one alert can share a timestamp (pending and firing at once when a
    rule has no `for`); the latest of those is the end of their chain: the one whose state no
    other of them left from."""
    if alerts is None or alerts.empty:
        return pd.DataFrame()
    time_col = pick_column(alerts.columns, ALERT_TIME)
    name_col = pick_column(alerts.columns, ALERT_NAME)
    keys = ["fingerprint"] if "fingerprint" in alerts else [c for c in (name_col, "layer") if c in alerts]
    latest = []
    for _, rows in alerts.groupby(keys, sort=False):
        if time_col:
            rows = rows[rows[time_col] == rows[time_col].max()]
        if len(rows) > 1 and {"state", "previous_state"} <= set(rows.columns):
            left = set(rows.previous_state.astype(str))
            ends = rows[~rows.state.astype(str).isin(left)]
            rows = ends if not ends.empty else rows
        latest.append(rows.iloc[-1])
    return pd.DataFrame(latest).reset_index(drop=True)


def firing_now(alerts: pd.DataFrame) -> pd.DataFrame:
    """Alerts whose latest transition put them in the firing state."""
    latest = latest_alert_states(alerts)
    if latest.empty or "state" not in latest:
        return pd.DataFrame()
    return latest[latest.state.astype(str) == "firing"].reset_index(drop=True)
