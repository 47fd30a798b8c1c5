"""Routing jitter: did the same tokens go to the same experts when the run was batched, padded, cast
or repeated? The results of `moescope jitter` / `moescope.jitter(..., store=...)`, a run of their
own (`Store.jitter_layers`, `Store.jitter_tokens`)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from moescope.dashboard import common, data, flips
from moescope.dashboard import figures as fg

FIGURE, CONDITION, LAYER = "jit_figure", "jit_condition", "jit_layer"  # page-only session keys

st.title("Routing jitter")
ctx = common.page_context()
if ctx is None:
    st.stop()


with common.guard():
    rows = data.jitter_layers(ctx.root, ctx.version, ctx.run_id)
    if rows.empty:
        st.info("No routing jitter measured in this run. Measure it with `moescope jitter MODEL --store STORE` "
                "(MODEL: `demo` or a local model folder) or `moescope.jitter(model, inputs, store=...)`; each "
                "check is a run of its own: pick it in the sidebar.")
        st.stop()
    figure = st.selectbox("Figure", list(fg.JITTER_FIGURES), format_func=lambda name: fg.JITTER_FIGURES[name],
                          key=FIGURE)
    st.plotly_chart(fg.jitter_heatmap(rows, str(figure)), key="jit_heatmap")
    table = pd.DataFrame({
        "condition": rows.condition, "compared with": rows.baseline, "layer": rows.layer, "tokens": rows.tokens,
        "set changed %": (rows.set_changed_fraction * 100).round(3),
        "top-1 changed %": (rows.top1_changed_fraction * 100).round(3),
        "experts run changed %": (rows.kept_changed_fraction * 100).round(3),
        "max gate-weight change": rows.max_weight_change, "dtype": rows.dtype, "batch": rows.batch_size,
        "padding": rows.padding_side, "attention": rows.attn_implementation})
    st.dataframe(table, hide_index=True, key="jit_table")
    st.caption("A token is compared with itself in the condition's baseline (`alone`: each input in a batch of "
               "its own, in the model's dtype and attention). Its *expert set* is the k experts chosen, its "
               "*top-1* the chosen expert of highest router logit, *experts run* the ones that processed it "
               "(slots dropped at capacity do not); the gate-weight change is the largest over experts, a weight "
               "that appears or vanishes counting whole.")

    st.subheader("Where the flips sit")
    conditions = list(dict.fromkeys(rows.condition))
    if st.session_state.get(CONDITION) not in conditions:
        st.session_state[CONDITION] = conditions[-1] if "bfloat16" not in conditions else "bfloat16"
    left, right = st.columns(2)
    condition = left.selectbox("Condition", conditions, key=CONDITION)
    layer = flips.layer_choice(rows.layer.unique(), LAYER, right)
    picked = rows[(rows.condition == condition) & ((rows.layer == layer) if layer is not None else True)]
    where = flips.EVERY_LAYER if layer is None else f"layer {layer}"
    st.plotly_chart(fg.margin_figure(picked, f"{condition}, {where}: top-k margin of flipped and unchanged tokens"),
                    key="jit_margin_chart")
    st.caption("The margin is the baseline's k-th largest router logit minus the (k+1)-th (for a softmax router, "
               "ln(p_k / p_k+1)). Flips at tiny margins are rounding; a flip at a wide margin means the "
               "condition changed the token's hidden state (an earlier layer's flip or capacity drop, padding "
               "that leaks).")

    st.subheader("Flipped tokens")
    tokens = data.jitter_tokens(ctx.root, ctx.version, ctx.run_id, condition, layer, flips.TOKENS_SHOWN)
    listed = int(picked.listed.sum())
    if tokens.empty:
        st.info(f"No token changed its expert set or top-1 under {condition}"
                + ("" if layer is None else f" in layer {layer}") + ".")
        st.stop()
    tokenizer = ctx.settings.tokenizer
    st.dataframe(flips.listed_table(
        tokens, tokenizer, {"layer": "layer", "input": "sequence", "position": "position"},
        {"top-k margin": "topk_margin", "set changed": "set_changed", "top-1 changed": "top1_changed"},
        ("experts before → after", "baseline_ids", "condition_ids")), hide_index=True, key="jit_tokens")
    st.caption(flips.listed_caption(len(tokens), listed, "tokens", "condition and layer", tokenizer))
