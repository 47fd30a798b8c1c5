"""`moescope mismatch STORE --run ENGINE_RUN --model MODEL`: engine vs reference routing
(`moescope.analyses.mismatch`) from the command line, judged by alerts/mismatch_rules.yaml, and the
engine's routing exported for replay (`moescope.analyses.mismatch_replay`)."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from moescope.cli import command_help
from moescope.cli.arguments import add_format_argument, add_store_arguments, store_location
from moescope.cli.routing_checks import (
    SHOW_TOKENS,
    add_run_arguments,
    check_counts,
    context,
    load_model,
    margin_table,
    torch_dtype,
    written_line,
)

FORMATS = ("npy", "parquet")

EXAMPLES = """\
examples:
  moescope import vllm responses.jsonl --store runs/ --run-id rollout-7
  moescope mismatch runs/ --run rollout-7 --model ./my-moe
  moescope mismatch runs/ --run rollout-7 --model ./my-moe --dtype bfloat16 --batch-size 16
  moescope mismatch runs/ --run rollout-7 --model ./my-moe --export replay/      .npy + Parquet for replay
  moescope mismatch runs/ --run rollout-7 --export replay/                       the engine's routing only
  moescope import sglang generate.jsonl --store runs/ --run-id sg --num-layers 48 --top-k 8
  moescope mismatch runs/ --run sg --model ./my-moe --token-ids sent.jsonl       SGLang: the ids sent
  moescope mismatch runs/ --run rollout-7 --model ./my-moe --per-layer           which layers carry the log-prob gap
  moescope mismatch runs/ --run rollout-7 --model ./my-moe --format json | jq .decision_share

What is compared: every (token, layer) the engine routed, against the reference model (MODEL,
the trainer's) run on the same token ids with the same position ids (0 at each sequence's first
prompt token). A pair's expert SET changed when the k experts differ, its TOP-1 when the engine's
slot 0 is not the reference's chosen expert of highest logit; the reference's top-k margin (k-th
largest router logit minus the (k+1)-th) tells rounding (tiny margins) from different hidden
states (wide ones). "Tokens differing in >= 1 layer" is the R3 paper's figure (94% on
Qwen3-30B-A3B, with ~10% of decisions differing).

Token ids: vLLM responses carry them; SGLang's /generate does not carry the prompt's, so give
--token-ids FILE, JSON Lines of {"step": S, "sequence": N, "token_ids": [prompt..., generated...]}
(S: the response's step in the import, 0-based in file order; N: its sequence, 0 for one request).

Log-probs: where the engine returned them (vLLM `logprobs`, SGLang `return_logprob`; or --logprobs
FILE), the check also measures the rollout/training log-prob gap of every generated token, Δ =
reference − engine log-prob, with the reference's own routing and with the engine's routing replayed
(moescope.replay): AReaL's figures (mean k3 KL, mean |Δ|, mean Δ², shares with |Δ| > ln 2 and ln 5)
overall, per count of layers whose expert set differs (0, 1, 2-3, 4+), per position bucket and tag,
and the share of the k3 KL replay removes. Two forwards; --per-layer adds one per MoE layer.

The results are a run of their own (dashboard page "Engine vs reference"); the rules of
alerts/mismatch_rules.yaml (or --rules FILE) judge each layer, and a rule that holds is written
to the store's alerts table and printed.
"""


def add_subcommands(subparsers) -> None:
    p = subparsers.add_parser(
        "mismatch", help=command_help("mismatch"),
        description="Re-run an engine run's tokens (vLLM, SGLang: `moescope import`, `moescope proxy`) through the "
                    "reference model and report, per MoE layer, position bucket and tag, the share of (token, layer) "
                    "pairs whose expert set and top-1 differ, how many of the k experts, the share of tokens that "
                    "differ in at least one layer, and the reference's top-k margin of flipped and unchanged pairs; "
                    "export the engine's routing as [tokens, layers, top_k] for routing replay in training.\n\n"
                    "MODEL is a local folder transformers' from_pretrained reads, or `demo`; nothing is "
                    "downloaded.\n\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_arguments(p, what="the store holding the engine run; the results are written there as a run")
    p.add_argument("--run", required=True, metavar="ENGINE_RUN", help="the engine run's id (`moescope summary STORE` "
                   "lists runs)")
    p.add_argument("--model", metavar="MODEL", help="the reference: a local model folder or `demo` (leave out with "
                   "--export to export the engine's routing alone)")
    p.add_argument("--dtype", help="cast the reference to this torch dtype first (default: float32, as loaded)")
    p.add_argument("--token-ids", metavar="FILE", help="JSON Lines of {\"step\", \"sequence\", \"token_ids\"}: ids "
                   "the routes do not carry (SGLang responses)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per reference forward, right-padded "
                   "(default 8)")
    p.add_argument("--max-sequences", type=int, help="compare the first N sequences (default: all)")
    p.add_argument("--layer-axis", choices=("auto", "moe", "hidden"), default="auto",
                   help="how the engine numbers layers: among MoE layers, or every hidden layer (SGLang); "
                        "default auto")
    p.add_argument("--export", metavar="DIR", help="write the engine's routing per sequence for replay to DIR")
    p.add_argument("--export-format", action="append", choices=FORMATS,
                   help="export format (repeatable; default both)")
    p.add_argument("--rules", metavar="FILE", help="rules to judge the results with (default "
                   "alerts/mismatch_rules.yaml)")
    p.add_argument("--no-write", action="store_true", help="do not write the results to the store")
    add_gap_arguments(p)
    add_run_arguments(p, "differing pairs", "layer")
    add_format_argument(p)
    p.set_defaults(func=_mismatch)


def add_gap_arguments(p: argparse.ArgumentParser) -> None:
    """The log-prob gap's options (`moescope.analyses.logprob_gap`)."""
    p.add_argument("--logprobs", metavar="FILE", help="JSON Lines of {\"step\", \"sequence\", \"position\", "
                   "\"logprobs\": [...]}: the engine's log-probs of each sequence's generated tokens from position "
                   "P (its prompt's length), for engines whose responses the import did not read them from")
    p.add_argument("--per-layer", action="store_true", help="with log-probs: replay the engine's routing in every "
                   "MoE layer but one, in turn, and say which layers carry the gap (L + 1 forwards more than the "
                   "reference's own for L MoE layers, instead of 1)")


def read_token_ids(path: str) -> dict[tuple[int, ...], list[int]]:
    """--token-ids FILE: {(step, sequence) or (step, rank, sequence): ids}. Raises ValueError naming
    the line for anything else."""
    from moescope.core.sequence_file import read_sequence_file

    def value_of(record: dict) -> list[int]:
        ids = record["token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise TypeError("token_ids must be a list of integers")
        return ids

    given = read_sequence_file(path, "--token-ids", '{"step": S, "sequence": N, "token_ids": [...]}', value_of)
    return {key: ids for key, ids in given.items()}  # keyed as mismatch() takes them


def _mismatch(args: argparse.Namespace) -> int:
    from moescope.analyses.mismatch_engine import MismatchError

    check_counts(args, MismatchError, ("batch_size", "max_sequences"))
    if args.model is None and not args.export:
        raise MismatchError("give --model MODEL (the reference to compare with), or --export DIR to export the "
                            "engine's routing alone")
    from moescope.ingest.importers.tables import parse_tags

    tags = parse_tags(args.tag)
    location = store_location(args)
    token_ids = read_token_ids(args.token_ids) if args.token_ids else None
    formats = tuple(dict.fromkeys(args.export_format or FORMATS))
    pack = _rules(args.rules)
    if args.model is None:
        return _export_only(args, location, token_ids, formats)
    from moescope.analyses.mismatch import mismatch

    dtype = torch_dtype(args.dtype, MismatchError) if args.dtype else None
    model, tokenizer, _ = load_model(args.model)
    if dtype is not None:
        model = model.to(dtype)
    report = mismatch(model, store=location, run=args.run, token_ids=token_ids, batch_size=args.batch_size,
                      max_sequences=args.max_sequences, max_listed=args.max_listed, layer_axis=args.layer_axis,
                      write=not args.no_write, run_id=args.run_id, tags=tags, progress=not args.quiet,
                      logprobs=_logprobs_file(args.logprobs), per_layer=args.per_layer)
    from moescope.cli.output import mismatch_document, notes, wants_json, write_document

    fired = judge(report, pack) + judge_gap(report, pack)
    if not wants_json(args):
        print(format_report(report, tokenizer, args.show))
        if report.gap is not None:
            print("\n" + format_gap(report.gap))
        for line in fired_lines(fired):
            print(line)
    if fired and report.run_id is not None:
        write_alerts(location, fired)
    replay = None
    if args.export:
        from moescope.analyses.mismatch_replay import export_replay

        written = export_replay(report.replay, args.export, formats, layers=report.layers)
        replay = dict(sequences=len(report.replay), layers=report.layers, folder=written)
        print(f"\nreplay: {len(report.replay)} sequences written to {written}", file=notes(args))
    if wants_json(args):
        write_document("mismatch", mismatch_document(report, fired, replay))
    if report.run_id is not None:
        print(f"\n{written_line(location, report.run_id, 'Engine vs reference')}", file=notes(args))
    return 0


def _export_only(args: argparse.Namespace, location: Any, token_ids: Any, formats: tuple[str, ...]) -> int:
    from moescope.analyses.mismatch_replay import engine_replay, export_replay

    replay, layers = engine_replay(location, args.run, token_ids, args.max_sequences)
    from moescope.cli.output import mismatch_document, notes, wants_json, write_document

    written = export_replay(replay, args.export, formats, layers=layers)
    print(f"replay: the engine's routing of {len(replay)} sequences ({len(layers)} layers, as the engine numbers "
          f"them) written to {written}", file=notes(args))
    if wants_json(args):
        write_document("mismatch", mismatch_document(None, (), dict(sequences=len(replay), layers=list(layers),
                                                                     folder=written), args.run))
    return 0


def _rules(path: str | None):
    from moescope.alerts.rules import load_rules, mismatch_rules

    return load_rules(path) if path else mismatch_rules()


# -- judging -----------------------------------------------------------------------------------

def rule_values(report: Any) -> dict[int, dict[str, float]]:
    """Per reference MoE layer, the mismatch signals (alerts.rules.SIGNALS) a rule reads."""
    rows = report.groups[(report.groups.grouping == "all")]
    token_share = report.token_share
    return {int(row.layer): {"mismatch_decision_share": float(row.set_changed_fraction),
                             "mismatch_token_share": token_share, "mismatch_pairs": float(row.pairs)}
            for row in rows.itertuples() if not _missing(row.layer)}


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and np.isnan(value)) or str(value) == "<NA>"


def judge(report: Any, pack: Any) -> list[Any]:
    """The alert transitions (firing, source "mismatch") of the rules in `pack` that hold for a
    layer of `report`; a rule that reads any signal the check does not measure is left out."""
    from moescope.alerts.engine import fire_once

    run_id = report.run_id or report.engine_run
    return [t for layer, values in sorted(rule_values(report).items())
            for t in fire_once(pack, values, run_id=run_id, layer=layer, source="mismatch",
                               labels={"engine_run": report.engine_run})]


def fired_lines(fired: list[Any]) -> list[str]:
    if not fired:
        return []
    return ["", *(f"ALERT {t.alertname} firing on {'the whole check' if t.layer is None else f'layer {t.layer}'} "
                  f"({t.severity}): " + ", ".join(
        f"{name} {value:.4g}" for name, value in t.values.items()) for t in fired)]


def write_alerts(location: Any, fired: list[Any]) -> None:
    """Write the firing transitions to the results run's alerts table. Raises OSError when the store
    refused them."""
    from moescope.alerts.storage import AlertTableWriter

    writer = AlertTableWriter(location)
    try:
        writer.handle(fired)
        if not writer.flush():
            raise OSError(f"the store did not take the alerts rows ({writer.last_error or 'see the log'})")
    finally:
        writer.close()


def _logprobs_file(path: str | None) -> Any:
    if path is None:
        return None
    from moescope.analyses.logprob_gap import read_logprobs_file

    return read_logprobs_file(path)


def gap_values(report: Any) -> dict[str, float]:
    """The log-prob gap signals (alerts.rules.SIGNALS) of the whole check; empty without log-probs."""
    gap = report.gap
    own = None if gap is None else gap.figures("reference")
    if own is None:
        return {}
    replay = gap.figures("replay")
    return {"mismatch_logprob_k3": float(own.k3_mean), "mismatch_logprob_tokens": float(own.tokens),
            "mismatch_logprob_k3_replay": float("nan") if replay is None else float(replay.k3_mean),
            "mismatch_logprob_removed": gap.removed_share}


def judge_gap(report: Any, pack: Any) -> list[Any]:
    """The firing transitions of the rules in `pack` that read only log-prob gap signals and hold
    for the check (once, layer None: the gap is one figure of the whole run)."""
    from moescope.alerts.engine import fire_once

    return fire_once(pack, gap_values(report), run_id=report.run_id or report.engine_run, layer=None,
                     source="mismatch", labels={"engine_run": report.engine_run})


def format_gap(gap: Any) -> str:
    """The log-prob gap as text: its line, a table per routing and group, and with --per-layer the
    layers that carry it."""
    lines = [gap.line(), ""]
    header = (f"{'routing':<18} {'group':<20} {'tokens':>8} {'k3 KL':>10} {'mean |Δ|':>10} {'mean Δ²':>10} "
              f"{'|Δ|>ln2':>8} {'|Δ|>ln5':>8}")
    lines += [header, "-" * len(header)]
    for row in gap.rows.itertuples():
        if row.routing == "replay-but-layer":
            continue
        name = "all" if row.grouping == "all" else f"{'flips' if row.grouping == 'flips' else row.grouping} " \
            f"{row.group_name}"
        lines.append(f"{row.routing:<18} {name:<20} {int(row.tokens):>8,} {row.k3_mean:>10.3g} {row.abs_mean:>10.3g} "
                     f"{row.sq_mean:>10.3g} {_pct(row.extreme_2):>8} {_pct(row.extreme_5):>8}")
    lines.append("(flips N: tokens predicted where N layers chose another expert set than the reference)")
    carried = gap.carried()
    if not carried.empty:
        lines += ["", "layers that carry the gap (k3 KL with every layer but it replayed, minus full replay's):"]
        lines += [f"  layer {int(r.layer):>3}  k3 {r.k3_mean:.3g}  carried {r.carried_k3:.3g}  "
                  f"({_pct(r.carried_share)} of what replay removes)" for r in carried.itertuples()]
    for reason, n in gap.skipped.items():
        lines.append(f"left out {n} tokens: {reason}")
    return "\n".join(lines)


# -- printing ----------------------------------------------------------------------------------

def _pct(value: Any) -> str:
    return "-" if _missing(value) else f"{float(value):.2%}"


def format_report(report: Any, tokenizer: Any = None, show: int = SHOW_TOKENS) -> str:
    """The report as text: the overall line, a table per layer, per position bucket and per tag
    (every layer together), the margin histograms, the differing pairs of narrowest margin with
    their context, and what was skipped."""
    from moescope.analyses.jitter import expert_change

    groups = report.groups
    lines = [report.line(), ""]
    header = (f"{'group':<22} {'layer':>5} {'pairs':>9} {'set changed':>12} {'top-1 changed':>14} "
              f"{'slots changed':>14} {'tokens':>8} {'tokens >=1 layer':>17}")
    lines += [header, "-" * len(header)]
    for row in groups.itertuples():
        if row.grouping != "all" and not _missing(row.layer):
            continue  # per layer only for the whole run; groups show every layer together
        name = "all" if row.grouping == "all" else f"{row.grouping} {row.group_name}"
        layer = "every" if _missing(row.layer) else str(int(row.layer))
        any_layer = _pct(row.tokens_set_changed_fraction) if _missing(row.layer) else ""
        lines.append(f"{name:<22} {layer:>5} {int(row.pairs):>9,} {_pct(row.set_changed_fraction):>12} "
                     f"{_pct(row.top1_changed_fraction):>14} {_pct(row.slots_changed_fraction):>14} "
                     f"{int(row.tokens):>8,} {any_layer:>17}")
    overall = report.overall()
    lines += ["", "reference top-k margin (router logits: k-th largest minus (k+1)-th), pairs per bin, every layer:",
              *margin_table([("flipped", overall.changed_by_margin), ("unchanged", overall.unchanged_by_margin)],
                            width=10)]
    counts = ", ".join(f"{n} differ: {int(c):,}" for n, c in enumerate(overall.changed_by_count))
    lines.append(f"experts of k={report.top_k} that differ, pairs: {counts}")
    tokens = report.tokens
    if show and not tokens.empty:
        shown = tokens.sort_values("topk_margin", kind="stable").head(show)
        lines += ["", f"differing pairs, narrowest reference margin first ({len(shown)} of {len(tokens)} listed):"]
        for row in shown.itertuples():
            change = expert_change(row.reference_ids, row.engine_ids)
            lines.append(f"  layer {row.layer}  step {row.step} seq {row.sequence} pos {row.position}  margin "
                         f"{row.topk_margin:.3g}  reference -> engine {change}  {context(row, tokenizer)}")
    for reason, n in report.skipped.items():
        lines.append(f"skipped {n} sequences: {reason}")
    return "\n".join(lines)

