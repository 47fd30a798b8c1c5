"""Heatmaps: where the tokens went, and which tokens they were.

Click a cell of either heatmap to list the tokens routed there; the layer and expert pickers
below do the same by hand. On first load the hottest expert of the run is selected.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from moescope.dashboard import common, data
from moescope.dashboard import figures as fg
from moescope.metrics import signals

LAYER, EXPERT, STEPS = "hm_layer", "hm_expert", "hm_steps"  # page-only session keys

st.title("Heatmaps")
ctx = common.page_context()
if ctx is None:
    st.stop()


def _clicked_cell(chart_key: str) -> list[int] | None:
    """The customdata of the clicked cell (see `moescope.dashboard.figures.layout.click_layer`), or None."""
    state: Any = st.session_state.get(chart_key)  # the chart's selection event, or None: read in the try
    try:
        for point in state["selection"]["points"]:
            custom = point.get("customdata")
            if isinstance(custom, dict):  # the frontend may send an array as {"0": .., "1": ..}
                custom = [custom[k] for k in sorted(custom, key=int)]
            if custom:
                return [int(v) for v in custom[:3]]
    except (KeyError, TypeError, ValueError):
        pass
    return None


def _on_share_click() -> None:
    cell = _clicked_cell("hm_share_chart")
    if cell:
        st.session_state[LAYER], st.session_state[EXPERT], st.session_state[STEPS] = cell[0], cell[1], None


def _on_time_click() -> None:
    cell = _clicked_cell("hm_time_chart")
    if cell:
        st.session_state[EXPERT], st.session_state[STEPS] = cell[0], (cell[1], cell[2])


with common.guard():
    common.filter_caption(ctx)
    share = data.expert_share(ctx.root, ctx.version, ctx.run_id, None, None, data.tags(ctx.tag))
    layer_totals = data.layer_totals(ctx.root, ctx.version, ctx.run_id, ctx.tag)
    layers = ctx.layer_ids()
    if share.empty or not layers:
        st.info("No expert load recorded for this run yet (or none with the chosen tag).")
        st.stop()

    if st.session_state.get(LAYER) not in layers:
        # Start where a newcomer wants to look: the Overview's hottest expert (`signals.run_figures`).
        hot = signals.run_figures(signals.layer_figures_of(layer_totals.itertuples())).hottest
        if hot is not None:
            st.session_state[LAYER], st.session_state[EXPERT] = hot.layer, hot.spread.hottest
        st.session_state[STEPS] = None

    st.plotly_chart(fg.layer_share_heatmap(share, dict(zip(layer_totals.layer, layer_totals.tokens))),
                    key="hm_share_chart", on_select=_on_share_click, selection_mode="points")
    st.caption("Colour: each expert's share of its layer's routing slots (a token routed to k experts fills k "
               "slots); the hover adds its share of the layer's tokens. Click a cell to list the tokens.")

    left, right = st.columns([1, 1])
    layer = left.selectbox("MoE layer", layers, key=LAYER, on_change=lambda: st.session_state.update({STEPS: None}))
    assert layer is not None  # `layers` is not empty (checked above)
    experts = list(range(ctx.num_experts(layer) or int(share[share.layer == layer].expert.max()) + 1))
    if st.session_state.get(EXPERT) not in experts:
        st.session_state[EXPERT] = experts[0]
    expert = right.selectbox("Expert", experts, key=EXPERT)
    assert expert is not None  # `experts` is not empty

    matrix = data.load_heatmap(ctx.root, ctx.version, ctx.run_id, layer, ctx.tag)
    st.plotly_chart(fg.load_heatmap(matrix, layer), key="hm_time_chart", on_select=_on_time_click,
                    selection_mode="points")

    steps = st.session_state.get(STEPS)
    head, clear = st.columns([4, 1])
    where = f", steps {steps[0]}–{steps[1]}" if steps else ""
    head.subheader(f"Tokens routed to expert {expert} of layer {layer}{where}")
    if steps and clear.button("All steps", key="hm_clear_steps"):
        st.session_state[STEPS] = None
        st.rerun()
    limit = st.select_slider("Tokens to list", [50, 100, 200, 500], value=200, key="hm_limit")
    tokens = data.expert_tokens(ctx.root, ctx.version, ctx.run_id, layer, expert,
                                tuple(steps) if steps else None, limit, ctx.tag)
    if tokens.empty:
        st.info("No routed token recorded for this cell. Per-token routes are only kept when the probe "
                "was attached with `routes=True`.")
    else:
        texts = data.token_texts(tokens.token_id, ctx.settings.tokenizer)
        table = pd.DataFrame({
            "token": [data.visible_token(t) for t in texts],
            "context": [data.context_text(i, p, c, ctx.settings.tokenizer) for i, p, c in
                        zip(tokens.context_ids, tokens.context_positions, tokens.position)],
            "token id": tokens.token_id, "step": tokens.step, "sequence": tokens.sequence,
            "position": tokens.position, "slot": tokens.slot, "gate weight": tokens.gate_weight,
            "kept": tokens.kept, "tags": [common.tags_text(t) for t in tokens.tags],
        })
        st.dataframe(table, hide_index=True, key="hm_tokens_table", column_config={
            "token": st.column_config.TextColumn(help="The token's text; ␣ is a space, ↵ a line break, ⇥ a tab."),
            "context": st.column_config.TextColumn(help="Its neighbours in the input, the token itself between « »."),
            "gate weight": st.column_config.NumberColumn(format="%.4f"),
        })
        if tokens.gate_weight.isna().all() and tokens.kept.isna().all():
            st.caption(common.not_recorded("Gate weights and capacity drops (kept)", ctx) + ".")
        st.caption(f"{len(table)} tokens shown (at most {limit}); slot 0 is the expert's first choice."
                   + ("" if ctx.settings.tokenizer else " Token ids only: start the dashboard with "
                      "`--tokenizer PATH` to see their text."))

    st.subheader("Co-selection")
    st.plotly_chart(fg.coselection_heatmap(data.coselection(ctx.root, ctx.version, ctx.run_id, layer, ctx.tag),
                                           layer), key="hm_cosel_chart")
