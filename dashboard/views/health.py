"""Expert health: scores and their components, and the trust gate that acts on them."""

from __future__ import annotations

import streamlit as st

from dashboard import common, data
from dashboard import figures as fg
from dashboard.gate_requests import REQUESTS_TABLE, GateRequestError, write_request

HEALTH_TIME = ("ts", "at", "window_end", "step", "window")
GATE_TIME = ("ts", "at", "time")
# The score's components, on its 0-100 scale (alerts' health score); other numeric columns are the
# raw measurements behind them and go in the table only.
COMPONENTS = ("load", "confidence", "output", "weight", "grad")
KEYS = {"run_id", "layer", "expert", "rank", "step", "ts", "at", "window", "window_start", "window_end",
        "window_steps", "step_start", "step_end", "pid", "score"}

st.title("Expert health")
ctx = common.page_context()
if ctx is None:
    st.stop()

with common.guard():
    health = data.run_rows(ctx.root, ctx.version, "expert_health", ctx.run_id, HEALTH_TIME)
    st.subheader("Health scores")
    if health is None or health.empty:
        st.info("No expert-health score recorded for this run yet: the health score is computed by the "
                "alerts side (`moescope health` or the live policy) and written to `expert_health`.")
    elif not {"layer", "expert", "score"} <= set(health.columns):
        st.warning(f"The expert_health table has unexpected columns {list(health.columns)}.")
        st.dataframe(health, hide_index=True)
    else:
        time_col = fg.pick_column(health.columns, HEALTH_TIME)
        components = [c for c in COMPONENTS if c in health.columns and health[c].notna().any()]
        measured = [c for c in health.columns if c not in KEYS and c not in COMPONENTS]
        latest = health.groupby(["layer", "expert"], sort=True).tail(1)
        st.caption("Latest window of each expert, worst first: the score (0-100) and its components, then the "
                   "raw measurements behind them.")
        st.dataframe(latest.sort_values("score")[["layer", "expert", "score", *components, *measured]
                                                 + ([time_col] if time_col else [])],
                     hide_index=True, key="he_scores")
        worst = latest.sort_values("score").iloc[0]
        a, b = st.columns(2)
        layers = sorted(int(v) for v in latest.layer.unique())
        layer = a.selectbox("Layer", layers, index=layers.index(int(worst.layer)), key="he_layer")
        experts = sorted(int(v) for v in latest[latest.layer == layer].expert.unique())
        expert = b.selectbox("Expert", experts, key="he_expert",
                             index=experts.index(int(worst.expert)) if int(worst.expert) in experts else 0)
        if time_col:
            st.plotly_chart(fg.health_trend(health, time_col, ["score", *components], layer, expert),
                            key="he_trend_chart")

    st.subheader("Trust gate")
    events = data.run_rows(ctx.root, ctx.version, "trust_gate_events", ctx.run_id, GATE_TIME)
    if events is None or events.empty:
        st.info("The trust gate has recorded no change for this run: every expert is at full weight.")
    else:
        time_col = fg.pick_column(events.columns, GATE_TIME)
        weight_col = fg.pick_column(events.columns, ("new_weight", "weight"))
        latest = events.groupby(["layer", "expert"]).tail(1)
        st.markdown("**Current state** (experts whose weight was ever changed)")
        st.dataframe(latest, hide_index=True, key="he_gate_state")
        if time_col and weight_col:
            st.plotly_chart(fg.gate_history(events, time_col, weight_col), key="he_gate_chart")
        with st.expander(f"History: {len(events)} changes"):
            st.dataframe(events, hide_index=True)

    if ctx.settings.allow_writes:
        st.subheader("Manual gate control")
        st.caption("Writes a request into the store's `trust_gate_requests` table. The running model applies "
                   "it only if its owner opted in too (`probe.attach(..., trust_gate='manual' or 'auto', "
                   "trust_policy=TrustPolicy(accept_requests=True))`), through the gate's API, which records "
                   "it as a change above. A finished run applies nothing.")
        layers = ctx.layer_ids()
        with st.form("he_gate_form"):
            a, b, c = st.columns(3)
            layer = a.selectbox("Layer", layers, key="he_req_layer")
            expert = b.number_input("Expert", min_value=0, max_value=max(ctx.num_experts(layer) - 1, 0),
                                    step=1, key="he_req_expert")
            weight = c.slider("Trust weight", 0.0, 1.0, 1.0, 0.05, key="he_req_weight",
                              help="0 masks the expert (its tokens go to the next choice), 1 restores it.")
            action = st.radio("Action", ["override", "release"], horizontal=True, key="he_req_action",
                              format_func=lambda a: {"override": "pin this weight",
                                                     "release": "release the pin (back to the automatic policy)"}[a])
            reason = st.text_input("Reason", key="he_req_reason", placeholder="why this change")
            if st.form_submit_button("Request change"):
                try:
                    row = write_request(ctx.root, ctx.run_id, layer, int(expert), weight, reason, action)
                    st.success(f"Requested weight {row['weight']:g} for layer {row['layer']}, expert "
                               f"{row['expert']} (request {row['request_id'][:8]}).")
                except GateRequestError as e:
                    st.warning(str(e))
        requests = data.run_rows(ctx.root, data.store_version(ctx.root), REQUESTS_TABLE, ctx.run_id,
                                 ("requested_at",), 50)
        if requests is not None and not requests.empty:
            st.markdown("**Recent requests**")
            st.dataframe(requests, hide_index=True)
