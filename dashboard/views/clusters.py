"""Semantic clusters: UMAP of sampled router inputs, and how much experts specialise by tag."""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import streamlit as st

from moescope.dashboard import common, data
from moescope.dashboard import figures as fg
from moescope.dashboard.embedding import cached_umap_2d, embedding_key
from moescope.metrics import signals

st.title("Semantic clusters")
ctx = common.page_context()
if ctx is None:
    st.stop()


@st.cache_data(max_entries=16, show_spinner="Embedding router inputs with UMAP (once per run, layer and sample)…")
def embedding(root: str, run_id: str, layer: int, size: int, data_version: str) -> pd.DataFrame:
    """2-D UMAP coordinates (x, y) of the sample, plus the sample's columns except `hidden`."""
    sample = data.router_input_sample(root, run_id, layer, size, data_version)
    points = sample.drop(columns=["hidden"])
    if len(sample) < 4:
        return points.assign(x=np.nan, y=np.nan)
    hidden = np.stack([np.asarray(h, dtype=np.float32) for h in sample.hidden])
    xy = cached_umap_2d(hidden, embedding_key(hidden))
    return points.assign(x=xy[:, 0], y=xy[:, 1])


with common.guard():
    tags = data.tag_values(ctx.root, ctx.version, ctx.run_id)
    keys = sorted(set(tags.key))
    left, mid, right = st.columns(3)
    with left:
        layer = common.layer_picker(ctx, "cl_layer")
    if layer is None:
        st.stop()
    size = mid.select_slider("Sampled tokens", [250, 500, 1000, 2000, 5000], value=1000, key="cl_size")
    colour = right.selectbox("Colour by", ["top-1 expert", *keys], key="cl_colour")

    points = embedding(ctx.root, ctx.run_id, layer, size, ctx.version)
    if points.empty and common.run_source(ctx) != "probe":
        st.info(common.not_recorded("Router inputs", ctx) + ": the engine hands out only the experts it chose.")
    elif points.empty:
        st.info("No router inputs recorded for this layer. Attach the probe with `router_inputs=N` to "
                "sample N router inputs per layer and forward.")
    elif points.x.isna().all():
        st.info(f"Only {len(points)} router inputs sampled: too few to embed.")
    else:
        tokens = data.token_texts(points.token_id, ctx.settings.tokenizer)
        contexts = [data.context_text(i, p, c, ctx.settings.tokenizer)
                    for i, p, c in zip(points.context_ids, points.context_positions, points.position)]
        hover = [f"<b>{html.escape(t)}</b> · expert {e} · {html.escape(common.tags_text(g))}<br>"
                 f"{html.escape(c)}" for t, e, g, c in zip(tokens, points.top1_expert, points.tags, contexts)]
        if colour == "top-1 expert":
            frame, by = points.assign(expert=points.top1_expert, hover=hover), "expert"
        else:
            values = [dict(t.items() if isinstance(t, dict) else t).get(colour, "—") for t in points.tags]
            frame, by = points.assign(**{colour: values}, hover=hover), colour
        st.plotly_chart(fg.cluster_scatter(frame, by, f"Layer {layer}: UMAP of {len(points)} router inputs"),
                        key="cl_umap_chart")
        st.caption("Each point is one sampled token's input to the router; hover shows the token and its "
                   "neighbours in the sequence, the token itself in [brackets].")

    st.subheader("Kept-slot specialisation")
    if not keys:
        st.info("No step carries a tag, so there is nothing to specialise on: tag traffic with "
                "`session.tag(domain=...)`.")
        st.stop()
    default = "domain" if "domain" in keys else keys[0]
    key = st.selectbox("Tag", keys, index=keys.index(default), key="cl_tag")
    common.filter_caption(ctx)
    load = data.expert_tag_load(ctx.root, ctx.version, ctx.run_id, key, ctx.tag)
    a, b = st.columns(2)
    a.plotly_chart(fg.specialisation_figure_by_layer(signals.specialisation_by_layer(load), key), key="cl_mi_chart")
    counts, experts, values = (signals.expert_tag_contingency(load, layer) if not load.empty
                               else (np.zeros((0, 0)), [], []))
    b.plotly_chart(fg.specialisation_figure(counts, experts, values, key, layer), key="cl_spec_chart")
    st.caption(f"Kept-slot specialisation is the normalised mutual information NMI(expert; {key}) between the "
               f"expert a slot went to (every top-k slot an expert kept counts; slots dropped at capacity do not) "
               f"and the step's `{key}` tag, from the exact expert loads of every step "
               "(`alerts.signals.specialisation_by_layer`, the figure `moescope demo` prints): 0 means the experts "
               "see every tag value alike, 1 that each value has experts of its own. It is not the *top-1 "
               "specialisation* of the demo model's card (NMI between the domain and the expert the router ranks "
               "first, every token, before any capacity): second choices are less tied to a domain than first ones, "
               "and a capacity caps a domain's favourite expert, so this figure is usually the lower of the two "
               "(under 0.1 per layer on the demo model, against 0.17–0.61 top-1).")
