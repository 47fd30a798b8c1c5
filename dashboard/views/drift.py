"""Drift and alerts: divergence of each window's load from a baseline, and the alert history."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from moescope.dashboard import common, data
from moescope.dashboard import figures as fg
from moescope.metrics import signals

st.title("Drift and alerts")
ctx = common.page_context()
if ctx is None:
    st.stop()

DIVERGENCES = ("kl_baseline", "js_baseline")


def drift_rules(alerts: pd.DataFrame) -> pd.DataFrame:
    """The baseline-divergence rules that made this run's alerts: alertname, signal ("kl"/"js"),
    threshold, window_steps, baseline_steps (as the engine recorded them with each transition)."""
    from moescope.alerts.rules import parse_expr

    rows = []
    for rule in alerts.drop_duplicates("alertname").itertuples() if not alerts.empty else ():
        try:
            conditions = parse_expr(str(rule.expr))
        except ValueError:
            continue  # not a rule expression (an expert-health or trust-gate alert)
        for cond in conditions:
            if cond.signal in DIVERGENCES and cond.op in (">", ">="):
                rows.append({"alertname": rule.alertname, "signal": cond.signal[:2], "threshold": cond.threshold,
                             "window_steps": rule.window_steps, "baseline_steps": rule.baseline_steps})
    return pd.DataFrame(rows, columns=["alertname", "signal", "threshold", "window_steps", "baseline_steps"])


def default_steps(rules: pd.DataFrame, column: str, fallback: int) -> int:
    values = rules[column].dropna()
    return int(values.iloc[0]) if len(values) else fallback


with common.guard():
    if ctx.tag:
        st.caption("Drift is measured over all steps of the run; the tag filter does not apply here.")
    totals = data.step_totals(ctx.root, ctx.version, ctx.run_id, None)
    steps = int(totals.get("steps") or 0)
    if not steps:
        st.info("This run has no step recorded yet.")
        st.stop()
    span = (int(totals["first_step"]), int(totals["last_step"]))
    alerts = data.table_rows(ctx.root, ctx.version, "alerts", ctx.run_id, "ts")
    rules = drift_rules(alerts)
    runs = data.runs(ctx.root, ctx.version)
    left, mid, right = st.columns(3)
    this_run = ctx.run_id
    baseline_run = left.selectbox(
        "Baseline", list(runs.run_id), index=list(runs.run_id).index(this_run), key="dr_baseline_run",
        format_func=lambda r: "this run's first steps" if r == this_run else common.run_label(runs, r))
    rule_names = ", ".join(rules.alertname.unique())
    source = f"as the rules that alerted on this run ({rule_names}) use" if len(rules) else "no drift rule alerted yet"
    first = mid.number_input("Baseline: first steps", min_value=1, max_value=100_000,
                             value=default_steps(rules, "baseline_steps", max(1, min(32, steps // 4))),
                             key="dr_first_steps", help=f"Default: {source}.")
    window = right.number_input("Window (steps)", min_value=1, max_value=100_000,
                                value=default_steps(rules, "window_steps", max(1, min(64, steps // 8))),
                                key="dr_window",
                                help=f"Loads are summed over windows of this many steps before comparing. "
                                     f"Default: {source}.")
    drift = data.drift_from_first_steps(ctx.root, ctx.version, ctx.run_id, int(window),
                                        None if baseline_run == ctx.run_id else baseline_run, int(first))
    divergence = signals.divergence_over_time(drift)
    a, b = st.columns(2)
    for column, measure in ((a, "kl"), (b, "js")):
        chosen = rules[rules.signal == measure]
        column.plotly_chart(fg.divergence_figure(divergence, measure, list(zip(chosen.alertname, chosen.threshold)),
                                                 span), key=f"dr_{measure}_chart")
    st.caption("KL uses 0.5 pseudo-tokens of smoothing per expert, "
               "as the alert rules do (moescope/metrics/signals.py); "
               "dashed lines are the thresholds of the rules that alerted on this run. A rule's window ends at "
               "each step; these windows are aligned to multiples of the window, so a value here can differ "
               "from the one an alert recorded at a step between two of them.")

    st.subheader("Alert timeline")
    if alerts.empty:
        st.success("No alert transition recorded for this run.")
    else:
        st.plotly_chart(fg.alert_timeline(alerts, span), key="dr_alert_chart")
        latest = data.latest_alert_states(alerts)
        st.markdown("**Current state of each alert**")
        st.dataframe(latest.assign(alert=fg.alert_label(latest))[
            ["alert", "state", "step", "ts", "source", "severity", "reason", "expr"]], hide_index=True)
        with st.expander(f"All {len(alerts)} transitions (with deliveries where recorded)"):
            st.dataframe(alerts, hide_index=True)
        deliveries = data.outbox_deliveries(ctx.root, tuple(sorted(set(alerts.fingerprint))))
        if deliveries is None:
            st.caption("No alerts outbox in this store: transitions were recorded but not sent to receivers.")
        else:
            st.markdown(f"**Deliveries** ({len(deliveries)} notifications of these alerts in the outbox)")
            st.dataframe(deliveries, hide_index=True)
            st.caption("Receivers are shown by name: a token, password or query in a receiver's URL (`***`) "
                       "is never stored.")
