"""Routing jitter: did the same tokens go to the same experts when the run was batched, padded, cast
or repeated? The results of `moescope jitter` / `moescope.jitter(..., store=...)`, a run of their
own (`Store.jitter_layers`, `Store.jitter_tokens`)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from moescope.analyses.jitter import expert_change
from moescope.dashboard import common, data
from moescope.dashboard import figures as fg
from moescope.store.store import Store

FIGURE, CONDITION, LAYER = "jit_figure", "jit_condition", "jit_layer"  # page-only session keys
EVERY_LAYER = "every layer"
TOKENS_SHOWN = 200

st.title("Routing jitter")
ctx = common.page_context()
if ctx is None:
    st.stop()


@st.cache_data(ttl=data.TTL_S, max_entries=64, show_spinner=False)
def jitter_layers(root: str, version: str, run_id: str) -> pd.DataFrame:
    return data.with_store(root, version, Store.jitter_layers, run_id)


@st.cache_data(ttl=data.TTL_S, max_entries=64, show_spinner=False)
def jitter_tokens(root: str, version: str, run_id: str, condition: str, layer: int | None) -> pd.DataFrame:
    return data.with_store(root, version, lambda store: store.jitter_tokens(run_id, condition, layer, TOKENS_SHOWN))


with common.guard():
    rows = jitter_layers(ctx.root, ctx.version, ctx.run_id)
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
    layers = [EVERY_LAYER, *sorted(int(v) for v in rows.layer.unique())]
    if st.session_state.get(LAYER) not in layers:
        st.session_state[LAYER] = EVERY_LAYER
    chosen = right.selectbox("MoE layer", layers, key=LAYER)
    layer = None if chosen == EVERY_LAYER or chosen is None else int(chosen)
    picked = rows[(rows.condition == condition) & ((rows.layer == layer) if layer is not None else True)]
    st.plotly_chart(fg.jitter_margin_figure(picked, f"{condition}, {chosen if layer is None else f'layer {layer}'}: "
                                                    "top-k margin of flipped and unchanged tokens"),
                    key="jit_margin_chart")
    st.caption("The margin is the baseline's k-th largest router logit minus the (k+1)-th (for a softmax router, "
               "ln(p_k / p_k+1)). Flips at tiny margins are rounding; a flip at a wide margin means the "
               "condition changed the token's hidden state (an earlier layer's flip or capacity drop, padding "
               "that leaks).")

    st.subheader("Flipped tokens")
    tokens = jitter_tokens(ctx.root, ctx.version, ctx.run_id, condition, layer)
    listed = int(picked.listed.sum())
    if tokens.empty:
        st.info(f"No token changed its expert set or top-1 under {condition}"
                + ("" if layer is None else f" in layer {layer}") + ".")
        st.stop()
    tokenizer = ctx.settings.tokenizer
    texts = data.token_texts(tokens.token_id, tokenizer)
    contexts = [data.context_text(ids, list(range(int(start), int(start) + len(ids))), int(position), tokenizer)
                for ids, start, position in zip(tokens.context_ids, tokens.context_start, tokens.position)]
    st.dataframe(pd.DataFrame({
        "layer": tokens.layer, "input": tokens.sequence, "position": tokens.position, "token": texts,
        "in context": contexts, "top-k margin": tokens.topk_margin, "set changed": tokens.set_changed,
        "top-1 changed": tokens.top1_changed,
        "experts before → after": [expert_change(a, b, "→") for a, b in zip(tokens.baseline_ids,
                                                                             tokens.condition_ids)]}),
        hide_index=True, key="jit_tokens")
    st.caption(f"Narrowest margin first: {len(tokens)} of the {listed:,} tokens the check listed for this choice "
               "(it keeps a bounded number per condition and layer). The token is in [brackets]"
               + ("." if tokenizer else "; start the dashboard with `--tokenizer DIR` to see text instead of ids."))
