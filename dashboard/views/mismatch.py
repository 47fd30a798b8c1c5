"""Engine vs reference: did the trainer's model route an engine's tokens the way the engine did? The
results of `moescope mismatch` / `moescope.mismatch(model, store=..., run=...)`, a run of their own
(`Store.mismatch_layers`, `Store.mismatch_tokens`)."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from moescope.dashboard import common, data, flips
from moescope.dashboard import figures as fg
from moescope.metrics.logprob_gap import removed_share

FIGURE, LAYER, ONLY_SETS = "mm_figure", "mm_layer", "mm_only_sets"  # page-only session keys

st.title("Engine vs reference")
ctx = common.page_context()
if ctx is None:
    st.stop()


def show_trace_findings(root: str, version: Any, run_id: str) -> None:
    """What the trace checks found in the engine's trace (`Store.trace_findings`): an error box, a
    row per check; nothing when they found nothing."""
    findings = data.trace_findings(root, version, run_id)
    if findings.empty:
        return
    st.error(f"The engine's trace (run `{run_id}`) failed {len(findings)} trace check"
             f"{'s' if len(findings) != 1 else ''}: read them before comparing, replaying or training on it "
             f"(`moescope check STORE --run {run_id}`).")
    st.dataframe(pd.DataFrame({
        "check": findings.check_name, "count": findings["count"], "of": findings.checked,
        "honest router": findings.expected.round(3), "where (first rows)": ["; ".join(r) for r in findings.rows],
        "what it means": findings.detail, "checked by": findings.origins}), hide_index=True, key="mm_trace_findings")


def gap_section(ctx) -> None:
    """The log-prob gap: is it the routing? (`moescope.analyses.logprob_gap`)"""
    st.subheader("Log-prob gap: is it the routing?")
    gap = data.mismatch_logprob_gap(ctx.root, ctx.version, ctx.run_id)
    if gap.empty:
        st.caption("No log-prob gap in this check: the engine returned no log-probs. Request them (vLLM `logprobs`, "
                   "SGLang `return_logprob`) or give them with `moescope mismatch ... --logprobs FILE`.")
        return
    own = gap[(gap.routing == "reference") & (gap.grouping == "all")].iloc[0]
    replay = gap[(gap.routing == "replay") & (gap.grouping == "all")]
    first, second, third, fourth = st.columns(4)
    first.metric("k3 KL, reference's routing", f"{own.k3_mean:.3g}",
                 help="mean k3 KL per generated token between the reference's log-probs and the engine's "
                      "(AReaL's estimator; AReaL's Moonlight R3 run: 0.00958 without replay)")
    if not replay.empty:
        after = replay.iloc[0]
        second.metric("k3 KL, engine's routing replayed", f"{after.k3_mean:.3g}",
                      help="the same with the engine's experts forced in every MoE layer (AReaL with R3: 0.000373)")
        third.metric("Removed by replay", f"{removed_share(float(own.k3_mean), float(after.k3_mean)):.1%}",
                     help="the share of the k3 KL that comes from routing; the rest is kernels, precision, batch shape")
    fourth.metric("|Δ| > ln 2", f"{own.extreme_2:.2%}", help=f"of {int(own.tokens):,} generated tokens, reference's "
                  "own routing: importance weights outside [1/2, 2]")
    st.plotly_chart(fg.logprob_gap_figure(gap), key="mm_gap_chart")
    if (gap.routing == "replay-but-layer").any():
        st.plotly_chart(fg.gap_layers_figure(gap), key="mm_gap_layers")
    st.caption("Δ = reference − engine log-prob of each generated token. A token is counted under the layers whose "
               "expert set differs at the position that predicted it. What replay removes comes from routing (R3 "
               "fixes it); what is left comes from kernels and precision (a precision fix, TIS/IcePop correct it).")


with common.guard():
    rows = data.mismatch_layers(ctx.root, ctx.version, ctx.run_id)
    show_trace_findings(ctx.root, ctx.version, ctx.run_id if rows.empty else str(rows.engine_run.iloc[0]))
    if rows.empty:
        st.info("No engine-vs-reference mismatch measured in this run. Measure it with `moescope mismatch STORE "
                "--run ENGINE_RUN --model MODEL` or `moescope.mismatch(model, store=..., run=...)` on a run of an "
                "engine (`moescope import vllm|sglang`, `moescope proxy`); each check is a run of its own: pick it "
                "in the sidebar.")
        st.stop()
    overall = rows[(rows.grouping == "all") & rows.layer.isna()].iloc[0]
    engine_run = str(overall.engine_run)
    st.caption(f"Engine run `{engine_run}` re-run through the reference model ({overall.reference_dtype}); "
               f"top-{int(overall.top_k)}.")
    first, second, third, fourth = st.columns(4)
    first.metric("Decisions that differ", f"{overall.set_changed_fraction:.2%}",
                 help="(token, layer) pairs whose expert set differs, of every pair compared (R3: about 10%)")
    second.metric("Tokens differing in ≥ 1 layer", f"{overall.tokens_set_changed_fraction:.2%}",
                  help="tokens whose expert set differs in at least one MoE layer (R3's figure: 94%)")
    third.metric("Top-1 differs", f"{overall.top1_changed_fraction:.2%}", help="of the pairs compared")
    fourth.metric("Compared", f"{int(overall.tokens):,} tokens",
                  help=f"{int(overall.pairs):,} (token, layer) pairs")

    figure = st.selectbox("Figure", list(fg.MISMATCH_FIGURES), format_func=lambda name: fg.MISMATCH_FIGURES[name],
                          key=FIGURE)
    st.plotly_chart(fg.mismatch_heatmap(rows, str(figure)), key="mm_heatmap")
    every = rows[rows.layer.isna()]
    st.dataframe(pd.DataFrame({
        "group": [n if g == "all" else f"{g}: {n}" for g, n in zip(every.grouping, every.group_name)],
        "tokens": every.tokens, "pairs": every.pairs,
        "set differs %": (every.set_changed_fraction * 100).round(3),
        "top-1 differs %": (every.top1_changed_fraction * 100).round(3),
        "experts differ %": (every.slots_changed_fraction * 100).round(3),
        "tokens differing in ≥1 layer %": (every.tokens_set_changed_fraction * 100).round(3)}),
        hide_index=True, key="mm_groups")
    st.caption("A (token, layer) pair is the engine's routing of one token in one MoE layer, compared with the "
               "reference's on the same token ids and position ids. Its *set* differs when the k experts differ, "
               "its *top-1* when the engine's first slot is not the reference's chosen expert of highest router "
               "logit; *experts differ* counts the engine's experts the reference did not choose, of k per pair. "
               "Position buckets group tokens by their position in the sequence; tags are the engine's.")

    gap_section(ctx)

    st.subheader("Where the flips sit")
    layer = flips.layer_choice(rows.layer.dropna().unique(), LAYER)
    picked = rows[(rows.grouping == "all") & (rows.layer.isna() if layer is None else rows.layer == layer)]
    st.plotly_chart(fg.margin_figure(picked, f"{flips.EVERY_LAYER if layer is None else f'layer {layer}'}: "
                                             "the reference's top-k margin of (token, layer) pairs whose set differs "
                                             "and of the rest", counted="pairs", reference="the reference"),
                    key="mm_margin_chart")
    st.caption("The margin is the reference's k-th largest router logit minus its (k+1)-th. Pairs that differ at "
               "tiny margins are rounding (another dtype or kernel); pairs that differ at wide margins mean the two "
               "stacks computed different hidden states (an earlier layer's flip, another attention kernel, "
               "positions fed differently).")

    st.subheader("Tokens that differ")
    only_sets = st.checkbox("Expert set differs (leave out pairs where only the top-1 differs)", key=ONLY_SETS)
    tokens = data.mismatch_tokens(ctx.root, ctx.version, ctx.run_id, layer, flips.TOKENS_SHOWN,
                                  True if only_sets else None)
    if tokens.empty:
        st.info("No token routed differently" + ("" if layer is None else f" in layer {layer}") + ".")
        st.stop()
    tokenizer = ctx.settings.tokenizer
    st.dataframe(flips.listed_table(
        tokens, tokenizer, {"layer": "layer", "step": "step", "sequence": "sequence", "position": "position"},
        {"reference top-k margin": "topk_margin", "set differs": "set_changed", "top-1 differs": "top1_changed",
         "experts differ": "slots_changed"}, ("reference → engine", "reference_ids", "engine_ids")),
        hide_index=True, key="mm_tokens")
    st.caption(flips.listed_caption(len(tokens), int(overall.listed), "pairs", "layer", tokenizer,
                                    "; step and sequence name the engine's request"))
