"""Compare: two runs, or two values of one tag (router version A/B), side by side."""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from moescope.dashboard import common, data
from moescope.dashboard import figures as fg
from moescope.metrics import signals

st.title("Compare")
ctx = common.page_context()
if ctx is None:
    st.stop()


def per_layer(layers: list[signals.LayerFigures]) -> pd.DataFrame:
    """Per-layer comparison columns of one side's `signals.layer_figures`."""
    return pd.DataFrame([{"layer": f.layer, "cv": f.spread.cv, "max_mean": f.spread.max_mean,
                          "router_entropy": f.entropy.nats, "router_entropy_norm": f.entropy.normalized,
                          "dropped_rate": f.dropped_token_rate} for f in layers],
                        columns=["layer", "cv", "max_mean", "router_entropy", "router_entropy_norm", "dropped_rate"])


with common.guard():
    runs = data.runs(ctx.root, ctx.version)
    mode = st.radio("Compare", ["two runs", "two tag values"], horizontal=True, key="cp_mode",
                    index=0 if len(runs) >= 2 else 1)
    sides: dict[str, tuple[str, object]] = {}
    if mode == "two runs":
        ids = list(runs.run_id)
        if len(ids) < 2:
            st.info("The store holds one run: record another (e.g. a new router version), or compare two "
                    "tag values of this run.")
            st.stop()
        a, b = st.columns(2)
        first = a.selectbox("Run A", ids, index=0, key="cp_run_a", format_func=lambda r: common.run_label(runs, r))
        second = b.selectbox("Run B", ids, index=1, key="cp_run_b", format_func=lambda r: common.run_label(runs, r))
        sides = {f"A: {first[-8:]}": (first, None), f"B: {second[-8:]}": (second, None)}
    else:
        tags = data.tag_values(ctx.root, ctx.version, ctx.run_id)
        keys = [k for k in sorted(set(tags.key)) if (tags.key == k).sum() >= 2]
        if not keys:
            st.info("No tag of this run has two values to compare: tag traffic with "
                    "`session.tag(router='A')` / `session.tag(router='B')`.")
            st.stop()
        key = st.selectbox("Tag", keys, key="cp_tag")
        values = sorted(tags[tags.key == key].value)
        a, b = st.columns(2)  # below the tag they are values of
        first = a.selectbox("Value A", values, index=0, key="cp_value_a")
        second = b.selectbox("Value B", values, index=1, key="cp_value_b")
        sides = {f"A: {key}={first}": (ctx.run_id, (key, first)),
                 f"B: {key}={second}": (ctx.run_id, (key, second))}

    rows, layer_frames = [], {}
    for name, (run_id, tag) in sides.items():
        steps = data.step_totals(ctx.root, ctx.version, run_id, tag)
        layers = signals.layer_figures_of(data.layer_totals(ctx.root, ctx.version, run_id, tag).itertuples())
        run = signals.run_figures(layers)
        layer_frames[name] = per_layer(layers)
        active = 100 * steps["active_fraction"] if pd.notna(steps["active_fraction"]) else np.nan
        latency = steps["seconds_per_token"]
        rows += [
            {"side": name, "metric": "active params / token (%)", "value": active},
            {"side": name, "metric": "load CV (token-weighted over layers)", "value": run.load_cv},
            {"side": name, "metric": "router entropy (nats)", "value": run.entropy.nats},
            {"side": name, "metric": "router entropy H / ln E", "value": run.entropy.normalized},
            {"side": name, "metric": "dropped tokens (% of layer-tokens)", "value": 100 * run.dropped_token_rate},
            {"side": name, "metric": "latency / token (ms)", "value": 1000 * latency if pd.notna(latency) else np.nan},
        ]
    values = pd.DataFrame(rows)
    table = values.pivot(index="metric", columns="side", values="value").reindex(list(dict.fromkeys(values.metric)))
    st.dataframe(table, key="cp_table")
    missing = values[values.value.isna()]
    if not missing.empty:  # an imported run has loads only: say so rather than show blanks as zeros
        sides_missing = missing.groupby("side", sort=False)
        st.caption("; ".join(f"{side}: {', '.join(group.metric)}" for side, group in sides_missing)
                   + f" — {common.NOT_RECORDED}.")
    st.plotly_chart(fg.compare_scalars_figure(values.dropna(subset=["value"])), key="cp_scalars_chart")
    st.caption("Latency per token is the forward's host wall time (hooks included) over its tokens, as "
               "the probe recorded it.")
    left, right = st.columns(2)
    left.plotly_chart(fg.compare_layers_figure(layer_frames, "cv", "Load spread (CV) per layer"), key="cp_cv_chart")
    has_entropy = any(df.router_entropy.notna().any() for df in layer_frames.values())
    right.plotly_chart(fg.compare_layers_figure(layer_frames, "router_entropy_norm",
                                                 "Router entropy per layer, H / ln E (comparable across models)")
                       if has_entropy else fg.empty_figure(f"router entropy: {common.NOT_RECORDED}"),
                       key="cp_entropy_chart")
