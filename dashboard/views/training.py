"""Training: what `moescope.training` recorded per optimizer step (the auxiliary losses, router
entropy, the router's learning rate in force, dead experts, per-expert gradient norms), with the
routing cooldowns shaded where they cooled a layer's router. Every figure is
`moescope.analyses.training_report.training_report`'s: `moescope.metrics.signals` over the store's
`training_steps` query.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from moescope.dashboard import common, data
from moescope.dashboard import figures as fg

LAYER, GRAD_LAYER, DEAD_WINDOW = "tr_layer", "tr_grad_layer", "tr_dead_window"  # page-only session keys
ALL = "all"
MAX_STEPS = 2000  # optimizer steps drawn (the latest); the dead-expert window still reaches back before them
EVENT_COLUMNS = {"step": "optimizer step", "layer": "layer", "action": "action", "reason": "reason",
                 "lr_before": "lr before", "lr_after": "lr after", "lr_factor": "factor", "epsilon": "jitter ε",
                 "router_entropy": "router entropy", "capacity_use": "capacity use", "period_steps": "period (steps)",
                 "source": "source", "rank": "rank", "ts": "time (UTC)"}
NOT_RECORDED = (
    "This run has no training steps: it was not recorded with `moescope.training`. Record a training run with "
    "`monitor = moescope.training.watch(model, optimizer, store=...)` before a plain loop (and `monitor.close()` "
    "after it), `Trainer(..., callbacks=[moescope.training.MoescopeCallback(store=...)])` for Hugging Face, or "
    "`moescope.training.lightning.MoescopeLightningCallback(store=...)` for Lightning: each optimizer step then "
    "writes a `train_steps` row per MoE layer, and this page draws them.")

st.title("Training")
ctx = common.page_context()
if ctx is None:
    st.stop()

with common.guard():
    span = data.training_span(ctx.root, ctx.version, ctx.run_id)
    if span["optimizer_steps"] == 0:
        st.info(NOT_RECORDED)
        st.stop()
    left, right = st.columns([1, 2])
    dead_window = right.slider(
        "Dead-expert window (optimizer steps)", 1, 1024, 64, key=DEAD_WINDOW,
        help="An expert is dead at a step when no token was routed to it over this many optimizer steps up to it.")
    report = data.training_report(ctx.root, ctx.version, ctx.run_id, int(dead_window), MAX_STEPS)
    if report.steps.empty:
        st.info(f"This run has {report.optimizer_steps:,} optimizer steps in `train_steps`, but the routing records "
                "of their forwards (`layer_steps`) are not in the store (yet): the probe writes them at each flush, "
                "and counts any it had to drop in `probe_stats`. This page draws them as soon as they land.")
        st.stop()
    layers = sorted(int(v) for v in report.layers.layer.unique())
    if st.session_state.get(LAYER) not in [ALL, *layers]:
        st.session_state[LAYER] = ALL
    choice = left.selectbox("MoE layers", [ALL, *layers], key=LAYER,
                            format_func=lambda v: "all layers" if v == ALL else f"layer {v}")
    per_layer = report.layers if choice == ALL else report.layers[report.layers.layer == choice]

    shown = len(report.steps)
    st.caption(f"{report.optimizer_steps:,} optimizer steps recorded"
               + (f"; the latest {shown:,} drawn, from step {report.first_optimizer_step:,}"
                  if shown < report.optimizer_steps else "")
               + ". A point is one optimizer step: the forwards its update used (every micro-batch once).")
    if ctx.tag:
        st.caption("The sidebar's tag filter does not apply here: a training record covers all forwards of an "
                   "optimizer step.")
    latest = report.steps.iloc[-1]
    started = int((report.events.action == "start").sum()) if not report.events.empty else 0
    a, b, c, d = st.columns(4)
    a.metric("Optimizer steps", f"{report.optimizer_steps:,}")
    b.metric("Aux loss, all layers (latest)", "—" if pd.isna(latest.aux_loss) else f"{latest.aux_loss:.4f}")
    c.metric("Router z-loss, all layers (latest)", "—" if pd.isna(latest.z_loss) else f"{latest.z_loss:.4f}")
    d.metric("Routing cooldowns", f"{started}")

    cooldowns = report.cooldowns
    a, b = st.columns(2)
    a.plotly_chart(fg.training_figure(per_layer, "aux_loss", "Load-balancing aux loss",
                                      "aux loss (top-k when balanced)", pooled=report.steps, cooldowns=cooldowns),
                   key="tr_aux_chart")
    b.plotly_chart(fg.training_figure(per_layer, "z_loss", "Router z-loss", "mean logsumexp(logits)²",
                                      pooled=report.steps, cooldowns=cooldowns), key="tr_z_chart")
    a, b = st.columns(2)
    a.plotly_chart(fg.training_figure(per_layer, "router_entropy", "Router entropy", "H / ln E (1 = uniform)",
                                      cooldowns=cooldowns, y_range=(0, 1.02)), key="tr_entropy_chart")
    b.plotly_chart(fg.training_figure(per_layer, "router_lr", "Router learning rate in force", "lr (log scale)",
                                      cooldowns=cooldowns, log_y=True), key="tr_lr_chart")
    a, b = st.columns(2)
    a.plotly_chart(fg.training_figure(per_layer, "dead_expert_fraction",
                                      f"Dead experts over the last {report.dead_window} optimizer steps",
                                      "fraction of routed experts", cooldowns=cooldowns, y_range=(-0.02, 1.02)),
                   key="tr_dead_chart")
    with b:
        if choice == ALL:
            if st.session_state.get(GRAD_LAYER) not in layers:
                st.session_state[GRAD_LAYER] = layers[0]
            grad_layer = st.selectbox("Layer of the gradient heatmap", layers, key=GRAD_LAYER)
        else:
            grad_layer = choice
        assert isinstance(grad_layer, int)  # one of `layers`
        st.plotly_chart(fg.expert_grad_heatmap(report.layers, grad_layer, cooldowns), key="tr_grad_chart")
    st.caption(
        "Aux loss: E·Σ f_e·P_e per layer from the recorded top-k counts (before capacity drops) and router "
        "probabilities (top-k when perfectly balanced, up to E when one expert takes everything); 'all layers "
        "(pooled)' pools every layer's tokens as transformers does, which is the model's own `aux_loss` (before "
        "`router_aux_loss_coef`). Z-loss: the mean over tokens of "
        "logsumexp(router logits)². Router entropy: token-weighted mean per-token entropy over ln E. Dead: "
        "routed experts with no kept slot in the window. Gradient norms: L2 norm of each expert's weight "
        "gradients just before the update. Shaded: the updates a routing cooldown cooled.")

    st.subheader("Routing cooldowns")
    if report.events.empty:
        st.info("No routing cooldown recorded for this run. It is opt-in: "
                "`moescope.training.watch(model, optimizer, store=..., cooldown='auto')` cools a layer's router "
                "when its routing collapses (docs/cooldown.md).")
    else:
        events = report.events if choice == ALL else report.events[report.events.layer == choice]
        st.dataframe(events[list(EVENT_COLUMNS)].rename(columns=EVENT_COLUMNS), hide_index=True, key="tr_events")
        st.caption("step: optimizer steps done when the change was made, so a start at s and its end at e cooled "
                   "the updates s+1..e. lr before / after: the router's learning rate in force around the change "
                   "(both the lr in force for a blocked start, which names the guard rail that stopped it).")
