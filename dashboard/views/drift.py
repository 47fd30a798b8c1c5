"""Drift and alerts: divergence of each window's load from a baseline, and the alert history."""

from __future__ import annotations

import streamlit as st

from dashboard import common, data
from dashboard import figures as fg

st.title("Drift and alerts")
ctx = common.page_context()
if ctx is None:
    st.stop()


@st.cache_data(show_spinner=False)
def rule_thresholds() -> dict[str, list[tuple[str, float]]]:
    """Thresholds of the default rule pack on the baseline divergences: {"kl": [(rule, value)], ...}."""
    from alerts.rules import default_rules

    out: dict[str, list[tuple[str, float]]] = {"kl": [], "js": []}
    for rule in default_rules().rules:
        for cond in rule.conditions:
            if cond.signal in ("kl_baseline", "js_baseline") and cond.op in (">", ">="):
                out[cond.signal[:2]].append((rule.name, cond.threshold))
    return out


with common.guard():
    if ctx.tag:
        st.caption("Drift is measured over all steps of the run; the tag filter does not apply here.")
    totals = data.step_totals(ctx.root, ctx.version, ctx.run_id)
    steps = int(totals.get("steps") or 0)
    if not steps:
        st.info("This run has no step recorded yet.")
        st.stop()
    runs = data.runs(ctx.root, ctx.version)
    left, mid, right = st.columns(3)
    baseline_run = left.selectbox(
        "Baseline", list(runs.run_id), index=list(runs.run_id).index(ctx.run_id), key="dr_baseline_run",
        format_func=lambda r: "this run's first steps" if r == ctx.run_id else common.run_label(runs, r))
    first = mid.number_input("Baseline: first steps", min_value=1, max_value=100_000,
                             value=max(1, min(32, steps // 4)), key="dr_first_steps",
                             help="The default rules pin the baseline to each run's first 32 steps.")
    window = right.number_input("Window (steps)", min_value=1, max_value=100_000,
                                value=max(1, min(64, steps // 8)), key="dr_window",
                                help="Loads are summed over windows of this many steps before comparing; "
                                     "the drift rule uses 64.")
    drift = data.drift_windows(ctx.root, ctx.version, ctx.run_id, int(window),
                               None if baseline_run == ctx.run_id else baseline_run, int(first))
    divergence = fg.divergence_over_time(drift)
    thresholds = rule_thresholds()
    a, b = st.columns(2)
    a.plotly_chart(fg.divergence_figure(divergence, "kl", thresholds["kl"]), key="dr_kl_chart")
    b.plotly_chart(fg.divergence_figure(divergence, "js", thresholds["js"]), key="dr_js_chart")
    st.caption("KL uses 0.5 pseudo-tokens of smoothing per expert, as the alert rules do (alerts/signals.py); "
               "dashed lines are the default rule pack's thresholds.")

    st.subheader("Alert timeline")
    alerts = data.run_rows(ctx.root, ctx.version, "alerts", ctx.run_id, fg.ALERT_TIME)
    if alerts is None:
        st.info("This store has no alerts table yet: run the rules engine over it "
                "(`moescope alerts run STORE`) or attach it live, and transitions appear here.")
    elif alerts.empty:
        st.success("No alert transition recorded for this run.")
    else:
        time_col = fg.pick_column(alerts.columns, fg.ALERT_TIME)
        name_col = fg.pick_column(alerts.columns, fg.ALERT_NAME)
        if time_col and name_col and "state" in alerts:
            st.plotly_chart(fg.alert_timeline(alerts, time_col, name_col), key="dr_alert_chart")
        latest = fg.latest_alert_states(alerts)
        st.markdown("**Current state of each alert**")
        st.dataframe(latest, hide_index=True)
        with st.expander(f"All {len(alerts)} transitions (with deliveries where recorded)"):
            st.dataframe(alerts, hide_index=True)
        deliveries = data.outbox_deliveries(ctx.root, tuple(sorted(set(alerts.get("fingerprint", [])))))
        if deliveries is None:
            st.caption("No alerts outbox in this store: transitions were recorded but not sent to receivers.")
        else:
            st.markdown(f"**Deliveries** ({len(deliveries)} notifications of these alerts in the outbox)")
            st.dataframe(deliveries, hide_index=True)
            st.caption("Receivers are shown by name: a token, password or query in a receiver's URL (`***`) "
                       "is never stored.")
