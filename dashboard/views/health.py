"""Expert health: scores and their components, and the trust gate that acts on them."""

from __future__ import annotations

import streamlit as st

from moescope.alerts.health_score import COMPONENTS, HealthConfig
from moescope.dashboard import common, data
from moescope.dashboard import figures as fg
from moescope.dashboard.gate_requests import REQUESTS_TABLE, GateRequestError, write_request

# COMPONENTS: the score's components, on its 0-100 scale, as the health score defines them; the other
# numeric columns of `expert_health` (store/schema.py) are the raw measurements behind them and go in
# the table only.
MEASURED = ("load_share_ratio", "gate_weight_mean", "output_norm_mean", "output_nonfinite_fraction",
            "weight_cosine", "weight_norm_ratio", "grad_norm", "trust_weight", "reasons")

st.title("Expert health")
ctx = common.page_context()
if ctx is None:
    st.stop()

with common.guard():
    totals = data.step_totals(ctx.root, ctx.version, ctx.run_id, None)
    span = (int(totals["first_step"]), int(totals["last_step"])) if totals.get("steps") else (0, 0)
    health = data.table_rows(ctx.root, ctx.version, "expert_health", ctx.run_id, "step_end")
    st.subheader("Health scores")
    if health.empty:
        st.info("No expert-health score recorded for this run. Scores are computed while the model runs: "
                "attach with `moescope.attach(model, store=..., health=True)` (or `trust_gate='auto'`, which "
                "also gates unhealthy experts) and they are written to the `expert_health` table.")
    else:
        components = [c for c in COMPONENTS if health[c].notna().any()]
        latest = health.groupby(["layer", "expert"], sort=True).tail(1)
        st.caption("Latest window of each expert, worst first: the score (0-100) and its components, then the "
                   "raw measurements behind them.")
        st.dataframe(latest.sort_values("score")[["layer", "expert", "score", *components, *MEASURED,
                                                  "step_start", "step_end"]],
                     hide_index=True, key="he_scores")
        worst = latest.sort_values("score").iloc[0]
        a, b = st.columns(2)
        layers = sorted(int(v) for v in latest.layer.unique())
        layer = a.selectbox("Layer", layers, index=layers.index(int(worst.layer)), key="he_layer")
        assert layer is not None  # a layer with scores (an index is given)
        experts = sorted(int(v) for v in latest[latest.layer == layer].expert.unique())
        expert = b.selectbox("Expert", experts, key="he_expert",
                             index=experts.index(int(worst.expert)) if int(worst.expert) in experts else 0)
        assert expert is not None  # an expert with scores (an index is given)
        st.plotly_chart(fg.health_trend(health, ["score", *components], layer, expert, span),
                        key="he_trend_chart")
        weights = HealthConfig().weights
        st.caption(
            "What the score is made of: the weighted geometric mean of the components measured in the window, "
            "each 0-100 (default weights: " + ", ".join(f"{c} {weights[c]:g}" for c in COMPONENTS)
            + "; grad only in training), the weights re-scaled over the components present, so one component at "
            "0 takes the score to 0. Load: the expert's share of the layer's assignments against its peers and "
            "its own baseline; confidence: its mean gate weight when chosen; output: its outputs' norm (0 for a "
            "NaN or inf); weight: its weights against the fingerprint taken at attach. Load and confidence need "
            "enough tokens in the layer's window: in a window where the layer did not measure a component it "
            "measures elsewhere in the run, the score is left out (a gap) rather than drawn from fewer parts. Under "
            "the trust gate (weight below 1) an expert is judged by its outputs and weights alone. See "
            "docs/health.md.")

    st.subheader("Trust gate")
    events = data.table_rows(ctx.root, ctx.version, "trust_gate_events", ctx.run_id, "step")
    if events.empty:
        st.info("The trust gate has recorded no change for this run: every expert is at full weight.")
    else:
        latest = events.groupby(["layer", "expert"]).tail(1)
        st.markdown("**Current state** (experts whose weight was ever changed)")
        st.dataframe(latest, hide_index=True, key="he_gate_state")
        st.plotly_chart(fg.gate_history(events, span), key="he_gate_chart")
        with st.expander(f"History: {len(events)} changes"):
            st.dataframe(events, hide_index=True)

    if ctx.settings.allow_writes:
        st.subheader("Manual gate control")
        st.caption("Writes a request into the store's `trust_gate_requests` table. The running model applies "
                   "it only if its owner opted in too (`moescope.attach(..., trust_gate='manual' or 'auto', "
                   "trust_policy=TrustPolicy(accept_requests=True))`), through the gate's API, which records "
                   "it as a change above. A finished run applies nothing.")
        layers = ctx.layer_ids()
        if not layers:  # the run's layers are not in the store yet: no expert to name
            st.info("This run has no MoE layer recorded yet; a change can be requested once it has.")
        else:
            with st.form("he_gate_form"):
                a, b, c = st.columns(3)
                layer = a.selectbox("Layer", layers, key="he_req_layer")
                assert layer is not None  # the first layer unless another is chosen
                expert = b.number_input("Expert", min_value=0, max_value=max(ctx.num_experts(layer) - 1, 0),
                                        step=1, key="he_req_expert")
                weight = c.slider("Trust weight", 0.0, 1.0, 1.0, 0.05, key="he_req_weight",
                                  help="0 masks the expert (its tokens go to the next choice), 1 restores it.")
                action = st.radio("Action", ["override", "release"], horizontal=True, key="he_req_action",
                                  format_func=lambda a: {
                                      "override": "pin this weight",
                                      "release": "release the pin (back to the automatic policy)"}[a])
                reason = st.text_input("Reason", key="he_req_reason", placeholder="why this change")
                if st.form_submit_button("Request change"):
                    assert action is not None  # "override" unless "release" is chosen
                    try:
                        row = write_request(ctx.root, ctx.run_id, layer, int(expert), weight, reason, action)
                        st.success(f"Requested weight {row['weight']:g} for layer {row['layer']}, expert "
                                   f"{row['expert']} (request {row['request_id'][:8]}).")
                    except GateRequestError as e:
                        st.warning(str(e))
        requests = data.table_rows(ctx.root, data.store_version(ctx.root), REQUESTS_TABLE, ctx.run_id,
                                   "requested_at", 50)
        if not requests.empty:
            st.markdown("**Recent requests**")
            st.dataframe(requests, hide_index=True)
