"""Overview: what the run did, in headline numbers and a few figures; by host where several recorded it."""

from __future__ import annotations

import math

import pandas as pd
import streamlit as st

from moescope.dashboard import common, data
from moescope.dashboard import figures as fg
from moescope.metrics import signals

POSITION_BUCKETS = 8  # position buckets of the by-position chart
HOST_KEY = "ov_host"  # the host filter of the By host section

st.title("Overview")
ctx = common.page_context()
if ctx is None:
    st.stop()

with common.guard():
    common.filter_caption(ctx)
    totals = data.step_totals(ctx.root, ctx.version, ctx.run_id, ctx.tag)
    if not totals.get("steps"):
        if common.run_source(ctx) == "jitter":  # `moescope jitter` records its comparisons, not traffic
            st.info("This run is a routing-jitter measurement (`moescope jitter`): it compared the router's "
                    "choices under repeats, batch sizes and dtypes, and recorded no forward pass of traffic "
                    "for this page. Its results are on the Routing jitter page.")
            st.page_link("views/jitter.py", label="Open Routing jitter →")
        elif common.run_source(ctx) == "mismatch":  # `moescope mismatch` records its comparisons, not traffic
            st.info("This run is an engine-vs-reference comparison (`moescope mismatch`): it re-ran an engine "
                    "run's tokens through the reference model and recorded where the two routed differently, "
                    "not forward passes of traffic for this page. Its results are on the Engine vs reference page.")
            st.page_link("views/mismatch.py", label="Open Engine vs reference →")
        elif ctx.tag:
            st.info(f"No step of this run is tagged {ctx.tag[0]}={ctx.tag[1]}: choose another value in the "
                    "sidebar, or all steps.")
        else:
            st.info("This run has no step recorded yet. Forward passes appear here once the probe has "
                    "flushed them.")
        st.stop()
    layer_totals = data.layer_totals(ctx.root, ctx.version, ctx.run_id, ctx.tag)
    layers = signals.layer_figures_of(layer_totals.itertuples())
    run = signals.run_figures(layers)
    alerts = data.table_rows(ctx.root, ctx.version, "alerts", ctx.run_id, "ts")
    firing = data.firing_now(alerts)

    # An imported run (vLLM, SGLang, ...) has loads but no logits, drops or parameter counts: null, not 0.
    has_active = pd.notna(totals.get("active_fraction"))
    has_entropy = pd.notna(run.entropy.nats)
    has_dropped = layer_totals.empty or layer_totals.dropped_tokens.notna().any()

    stats = data.probe_stats(ctx.root, ctx.version, ctx.run_id)
    lost = stats[stats.reason.notna() & (stats.dropped_rows > 0)]

    cols = st.columns(4) + st.columns(4)
    counts = signals.run_counts(totals)  # forwards and tokens in one unit: over all ranks
    cols[0].metric("Tokens", f"{counts.tokens:,}", help="Tokens the forwards routed, summed over the ranks.")
    cols[1].metric("Forwards", f"{counts.forwards:,}", help="Forward passes recorded, summed over the ranks.")
    if counts.ranks > 1:
        cols[0].caption(counts.over_ranks)
        cols[1].caption(f"{counts.over_ranks} ({counts.forwards_per_rank:,.0f} per rank)")
    cols[2].metric("Active parameters / token", f"{totals['active_fraction']:.2%}" if has_active else "—",
                   help="Parameters each token really used (shared + the experts it was routed to), "
                        "token-weighted over the run, as a share of all parameters.")
    cols[3].metric("Load spread (CV)", f"{run.load_cv:.3f}" if layers else "—",
                   help="Coefficient of variation of tokens per routed expert (zero experts left out), "
                        "token-weighted mean over layers; 0 is perfectly even.")
    # The second figure of a tile goes in a caption under it: st.metric's delta draws an up-arrow
    # chip, which reads as a change since some earlier time, and these are not changes.
    cols[4].metric("Router entropy", f"{run.entropy.nats:.3f} nats" if has_entropy else "—",
                   help="Mean per-token entropy of the router's softmax, token-weighted over layers and steps. "
                        "H / ln E divides by the log of the router's choices (experts + zero experts): 0 is "
                        "always one expert, 1 is no preference, comparable across models.")
    if has_entropy:
        cols[4].caption(f"H / ln E = {run.entropy.normalized:.3f}")
    cols[5].metric("Dropped tokens", f"{run.dropped_tokens:,}" if has_dropped else "—",
                   help="Tokens no expert processed because every chosen expert was at capacity, summed over "
                        "layers; the rate is over the tokens every layer routed (dropped / tokens).")
    if has_dropped and run.layer_tokens:
        cols[5].caption(f"{run.dropped_token_rate:.2%} of layer-tokens")
    cols[6].metric("Alerts firing now", str(len(firing)),
                   help="Alerts whose latest transition is firing: rules, expert health and the trust gate. "
                        "A finished run has resolved them all (reason: run ended).")
    cols[7].metric("Rows not recorded", f"{int(lost.dropped_rows.sum()):,}",
                   help="Rows the probe recorded but could not keep (a full queue, a failed write), over all "
                        "tables and writers of the run, as of the writers' last probe_stats on disk.")
    if len(lost):
        by_reason = ", ".join(f"{int(r.dropped_rows):,} rows of {r.table_name} ({r.reason})" for r in lost.itertuples())
        st.warning(f"The probe could not record everything: {by_reason}. `write_failed`: the disk refused a write "
                   "(full or read-only); `queue_full` / `queue_bytes_full`: the writer fell behind under "
                   "policy=\"drop\". The numbers on this page leave those rows out.")

    missing = [what for what, has in (("active parameters", has_active), ("router entropy", has_entropy),
                                      ("dropped tokens", has_dropped)) if not has]
    if missing:
        st.caption(common.not_recorded(", ".join(missing).capitalize(), ctx)
                   + ": the engine hands out which experts it chose, not router logits, drops or parameter counts.")
    total_params = totals.get("total_params")
    if has_active and pd.notna(total_params) and total_params:
        used = totals["active_fraction"] * total_params
        st.markdown(f"**This model used {totals['active_fraction']:.2%} of its parameters per token** "
                    f"({used:,.0f} of {total_params:,.0f}).")
        st.caption(f"By batch it ranged from {totals['active_min']:.2%} to {totals['active_max']:.2%} "
                   f"(5th–95th percentile {totals['active_p5']:.2%}–{totals['active_p95']:.2%}).")

    hot = run.hottest
    if hot is not None:
        left, right = st.columns([3, 1])
        left.markdown(f"Hottest expert: **layer {hot.layer}, expert {hot.spread.hottest}**, chosen by "
                      f"{hot.spread.hottest_token_share:.1%} of the layer's tokens "
                      f"({hot.spread.hottest_load:,} of {hot.tokens:,}), "
                      f"{hot.spread.hottest_slot_share:.1%} of its routing slots (max/mean "
                      f"{hot.spread.max_mean:.2f}).")
        right.page_link("views/heatmaps.py", label="Which tokens go there? →")
        st.caption("A token routed to k experts fills k slots: token shares of a layer's experts add up to k, "
                   "slot shares to 100%.")

    over_time = data.active_fraction_buckets(ctx.root, ctx.version, ctx.run_id, ctx.tag)
    left, right = st.columns(2)
    left.plotly_chart(fg.active_fraction_figure(over_time) if has_active else
                      fg.empty_figure(common.not_recorded("active parameters", ctx)), key="ov_active_chart")
    tags = data.tag_values(ctx.root, ctx.version, ctx.run_id)
    keys = sorted(set(tags.key))
    with right:
        if keys:
            default = "domain" if "domain" in keys else keys[0]
            key = st.selectbox("Swing by tag", keys, index=keys.index(default), key="ov_tag_key")
            by_tag = data.active_fraction_by_tag(ctx.root, ctx.version, ctx.run_id, key, 100, ctx.tag)
            st.plotly_chart(fg.active_by_tag_figure(by_tag, key), key="ov_tag_chart")
        else:
            st.info("No step carries a tag: tag traffic with `session.tag(domain=...)` to compare.")

    if has_active:
        by_position = data.active_fraction_by_position(ctx.root, ctx.version, ctx.run_id, POSITION_BUCKETS, ctx.tag)
        if not by_position.empty and float(by_position.dropped_slots.max()) > 0:
            # Only a model whose experts have a capacity loses slots; a dropless one is flat by construction.
            st.plotly_chart(fg.active_by_position_figure(by_position), key="ov_position_chart")
            st.caption("From the recorded routes: a token's share of the parameters by where it sits in its input. "
                       "Under a capacity (GShard, Switch, Megatron's position policy) later tokens lose their slots "
                       "first. A decode step's one new token is position 0: filter by a phase tag to compare "
                       "like with like.")

    buckets = data.layer_buckets(ctx.root, ctx.version, ctx.run_id, ctx.tag)
    a, b, c = st.columns(3)
    a.plotly_chart(fg.layer_spread_figure(layers), key="ov_spread_chart")
    b.plotly_chart(fg.entropy_figure(buckets) if has_entropy else
                   fg.empty_figure(common.not_recorded("router entropy", ctx)), key="ov_entropy_chart")
    c.plotly_chart(fg.dropped_figure(buckets) if has_dropped else
                   fg.empty_figure(common.not_recorded("dropped tokens", ctx)), key="ov_dropped_chart")

    hosts = data.host_totals(ctx.root, ctx.version, ctx.run_id, ctx.tag)
    if len(hosts) > 1:
        st.subheader("By host")
        per_layer = data.host_layer_totals(ctx.root, ctx.version, ctx.run_id, ctx.tag)
        by_host = {str(h): signals.layer_figures_of(per_layer[per_layer.host == h].itertuples()) for h in hosts.host}
        names = list(by_host)
        if st.session_state.get(HOST_KEY) not in [None, *names]:
            st.session_state[HOST_KEY] = None
        host = st.selectbox("Host", [None, *names], key=HOST_KEY,
                            format_func=lambda h: "— all hosts —" if h is None else h,
                            help="The hosts that recorded this run: a rank's rows belong to the host its `runs` "
                                 "row names (MOESCOPE_HOST, else the hostname).")
        shown = names if host is None else [host]
        rows = []
        for name in shown:
            run_h = signals.run_figures(by_host[name])
            spreads = [f.spread.max_mean for f in by_host[name] if not math.isnan(f.spread.max_mean)]
            totals_h = hosts[hosts.host == name].iloc[0]
            rows.append({"host": name, "ranks": int(totals_h.ranks), "forwards": int(totals_h.forwards),
                         "tokens": int(totals_h.tokens or 0), "load CV": run_h.load_cv,
                         "max/mean (most uneven layer)": max(spreads) if spreads else math.nan,
                         "dropped %": 100 * run_h.dropped_token_rate})
        st.dataframe(pd.DataFrame(rows), hide_index=True,
                     column_config={"load CV": st.column_config.NumberColumn(format="%.3f"),
                                    "max/mean (most uneven layer)": st.column_config.NumberColumn(format="%.2f"),
                                    "dropped %": st.column_config.NumberColumn(format="%.2f")})
        st.plotly_chart(fg.host_load_figure({name: by_host[name] for name in shown}), key="ov_host_chart")
        st.caption("Forwards per rank; load CV token-weighted over layers, max/mean and drops over each host's "
                   "own ranks' tokens.")

    st.subheader("Alerts firing now")
    if firing.empty:
        st.success("No alert is firing.")
    else:
        st.dataframe(firing, hide_index=True)
