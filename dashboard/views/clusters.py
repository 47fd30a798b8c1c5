"""Semantic clusters: UMAP of sampled router inputs, and how much experts specialise by tag."""

from __future__ import annotations

import concurrent.futures
import html

import numpy as np
import pandas as pd
import streamlit as st

from moescope.dashboard import common, data
from moescope.dashboard import figures as fg
from moescope.dashboard.embedding import embedding_jobs, embedding_key
from moescope.metrics import signals

st.title("Semantic clusters")
ctx = common.page_context()
if ctx is None:
    st.stop()


WAIT_S = 2.0  # an embedding read from disk, or a quick fit, is drawn in the same run


def embedded_points(points: pd.DataFrame, hidden: np.ndarray, layer: int) -> pd.DataFrame | None:
    """`points` with the UMAP coordinates (x, y) of `hidden`, NaN for fewer than 4 points; None while
    the embedding is computed (the page then says what it computes and re-runs once it is there)."""
    if len(points) < 4:
        return points.assign(x=np.nan, y=np.nan)
    job = embedding_jobs().submit(hidden, embedding_key(hidden))
    try:
        xy = job.future.result(timeout=WAIT_S)
    except concurrent.futures.TimeoutError:
        # Not `with st.status(...)`: leaving the block would mark it complete while the fit runs on.
        status = st.status(f"Computing the UMAP embedding of {len(points):,} router inputs of layer {layer}…",
                           state="running", expanded=True)
        status.write("Once per run, layer and sample: the points are kept on disk and drawn at once next time. "
                     "The first embedding after a dashboard starts also loads UMAP, and the first on this machine "
                     "compiles it (numba): up to a minute on two busy cores. The rest of the page is below.")
        common.rerun_when_done(job.future, lambda: f"{job.elapsed_s:.0f} s so far")
        return None
    except Exception as e:  # the worker died (out of memory, say) or UMAP refused the sample: asked again next run
        st.error(f"The UMAP embedding of layer {layer} failed: {type(e).__name__}: {e}. Reload the page to try "
                 "again; the rest of the page is below.")
        return None
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

    points, hidden = data.router_input_points(ctx.root, ctx.version, ctx.run_id, layer, size)
    if not points.empty:
        points = embedded_points(points, hidden, layer)
    if points is None:
        pass  # the embedding is under way or failed: its box says so
    elif points.empty and common.run_source(ctx) != "probe":
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
               "(`moescope.metrics.signals.specialisation_by_layer`, the figure `moescope demo` prints): 0 means "
               "the experts see every tag value alike, 1 that each value has experts of its own. It is not the *top-1 "
               "specialisation* of the demo model's card (NMI between the domain and the expert the router ranks "
               "first, every token, before any capacity): second choices are less tied to a domain than first ones, "
               "and a capacity caps a domain's favourite expert, so this figure is usually the lower of the two "
               "(under 0.1 per layer on the demo model, against 0.17–0.61 top-1).")
