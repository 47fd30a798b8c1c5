"""`moescope jitter MODEL`: the routing-jitter check (`moescope.analyses.jitter`) from the command line.

MODEL is what a user has offline: `demo` (the shipped demo model, `moescope/demo/model`) or a
local folder that transformers' `from_pretrained` reads (config, weights, tokenizer). Nothing is
ever downloaded. Inputs are `--text` strings and `--file` lines, tokenized with the folder's
tokenizer; the demo model plays held-out texts of its three domains when none are given.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from moescope.analyses.jitter import CONDITION_KINDS, DEFAULT_DTYPES, JitterError, JitterReport, expert_change, jitter
from moescope.cli import command_help
from moescope.cli.arguments import add_format_argument, add_store_arguments, store_location
from moescope.cli.routing_checks import DEMO as DEMO  # where it was before `moescope mismatch` shared it
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

DEMO_TEXTS_PER_DOMAIN = 4

EXAMPLES = """\
examples:
  moescope jitter demo                                   the demo model on held-out texts
  moescope jitter demo --store runs/jitter               ... and keep the results (dashboard page "Routing jitter")
  moescope jitter ./my-moe --text "The cat sat." --text "def f(x): return x"
  moescope jitter ./my-moe --file prompts.txt --condition dtype --dtype bfloat16
  moescope jitter ./my-moe --file prompts.txt --condition batched --condition left_padding --batch-size 16
  moescope jitter demo --format json | jq '.layers[] | {condition, layer, set_changed, tokens}'

conditions (--condition, repeatable; default all):
  repeat        each input alone, run again (non-determinism)
  batched       inputs batched --batch-size at a time, right-padded, vs alone
  left_padding  the same batches left-padded, vs right-padded
  batch_size    batches of --other-batch-size, vs alone
  dtype         the model cast to each --dtype (default bfloat16 and float16), vs alone; one the
                device cannot run is skipped and named
  attention     transformers' other attention implementation (eager <-> sdpa), vs alone

A flip is a (token, layer) whose set of chosen experts changed. Its margin is the baseline's k-th
largest router logit minus the (k+1)-th: flips should sit at tiny margins (rounding); a flip at a
wide margin means the condition changed the hidden states themselves.
"""


def add_subcommands(subparsers) -> None:
    p = subparsers.add_parser(
        "jitter", help=command_help("jitter"),
        description="Run the same inputs again under conditions a server varies (alone or batched, left or "
                    "right padding, another batch size, bf16/fp16, another attention implementation, plain "
                    "repeats) and report per MoE layer the share of (token, layer) pairs whose expert set and "
                    "top-1 changed, the largest gate-weight change, and the flipped tokens with their top-k "
                    "margin.\n\n"
                    "MODEL is `demo` (the shipped demo model) or a local model folder (transformers "
                    "save_pretrained: config.json, weights, tokenizer); nothing is downloaded.\n\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="`demo`, or a local folder holding a transformers MoE model")
    p.add_argument("--text", action="append", default=[], help="an input text (repeatable)")
    p.add_argument("--file", help="a text file: one input per non-empty line")
    p.add_argument("--texts", type=int, default=DEMO_TEXTS_PER_DOMAIN,
                   help=f"demo model without inputs: held-out texts per domain (default {DEMO_TEXTS_PER_DOMAIN})")
    p.add_argument("--condition", action="append", choices=CONDITION_KINDS,
                   help="a condition to run (repeatable; default all)")
    p.add_argument("--dtype", action="append", help="a dtype for the dtype condition (repeatable; default "
                   f"{' and '.join(DEFAULT_DTYPES)})")
    p.add_argument("--batch-size", type=int, default=8, help="inputs per batch for batched and left_padding "
                   "(default 8)")
    p.add_argument("--other-batch-size", type=int, default=3, help="inputs per batch for batch_size (default 3)")
    p.add_argument("--max-tokens", type=int, default=128, help="cut each input to this many tokens (default 128)")
    add_store_arguments(p, option=True, required=False,
                        what="also write the results to this store (a folder or a URL) as a run of their own")
    add_run_arguments(p, "flipped tokens", "condition and layer")
    add_format_argument(p)
    p.set_defaults(func=_jitter)


def read_inputs(args: argparse.Namespace) -> list[str]:
    """The texts the user gave: --text, then --file's non-empty lines (maybe none). Raises JitterError
    for a file that cannot be read."""
    texts = list(args.text)
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as fh:
                texts += [line.rstrip("\n") for line in fh if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise JitterError(f"cannot read --file {args.file!r}: {reason}") from e
    return texts


def demo_texts(per_domain: int) -> list[str]:
    """The demo's held-out texts, `per_domain` of each domain (the same every time)."""
    from moescope.demo.data import DOMAINS, domain_texts

    return [text for domain in DOMAINS for text in domain_texts(domain, per_domain, seed=0)]


def _jitter(args: argparse.Namespace) -> int:
    check_counts(args, JitterError, ("batch_size", "other_batch_size", "max_tokens", "texts"))
    from moescope.ingest.importers.tables import parse_tags

    for name in args.dtype or ():
        torch_dtype(name, JitterError)
    tags = parse_tags(args.tag)
    location = store_location(args) if args.store else None
    if location is not None and location.is_local and os.path.isfile(location.url):
        raise JitterError(f"the store {location.url!r} is a file: give a folder (it is created if missing)")
    # everything a user typed is checked before the model loads (seconds, and a progress bar of its own)
    texts = read_inputs(args)
    model, tokenizer, demo = load_model(args.model)
    if not texts and demo:
        texts = demo_texts(args.texts)
    if not texts:
        raise JitterError("no inputs: give --text \"...\" (repeatable) or --file FILE (one input per line)")
    if tokenizer is None:
        raise JitterError(f"{args.model!r} has no tokenizer that transformers can load: save one beside the model "
                          "(tokenizer.save_pretrained(folder))")
    conditions = tuple(dict.fromkeys(args.condition or CONDITION_KINDS))
    report = jitter(model, texts, tokenizer=tokenizer, conditions=conditions,
                    batch_size=args.batch_size, other_batch_size=args.other_batch_size,
                    dtypes=tuple(args.dtype or DEFAULT_DTYPES), max_tokens=args.max_tokens,
                    max_listed=args.max_listed, store=location, run_id=args.run_id, tags=tags,
                    progress=not args.quiet)
    from moescope.cli.output import jitter_document, notes, wants_json, write_document

    if wants_json(args):
        write_document("jitter", jitter_document(report, len(texts)))
    else:
        print(format_report(report, tokenizer, len(texts), args.show))
    if location is not None:
        print(f"\n{written_line(location, str(report.run_id), 'Routing jitter')}", file=notes(args))
    return 0


def format_report(report: JitterReport, tokenizer: Any = None, inputs: int | None = None,
                  show: int = SHOW_TOKENS) -> str:
    """The report as text: a table per condition and layer, the margin histograms of flipped and
    kept tokens, the flipped tokens of narrowest margin with their context, and what was skipped."""
    frame = report.layers
    lines = []
    if frame.empty:
        lines.append("nothing compared")
    else:
        first = frame.iloc[0]
        lines.append(f"{report.model_class}: {inputs if inputs is not None else '?'} inputs, "
                     f"{int(frame[frame.condition == first.condition].tokens.iloc[0]):,} tokens per layer, "
                     f"{frame.layer.nunique()} MoE layers; the baseline runs each input alone")
        header = (f"{'condition':<22} {'vs':<10} {'layer':>5} {'set changed':>12} {'top-1 changed':>14} "
                  f"{'experts run changed':>20} {'max Δ gate weight':>18}")
        lines += ["", header, "-" * len(header)]
        for row in frame.itertuples():
            lines.append(f"{row.condition:<22} {row.baseline:<10} {row.layer:>5} {row.set_changed_fraction:>12.2%} "
                         f"{row.top1_changed_fraction:>14.2%} {row.kept_changed_fraction:>20.2%} "
                         f"{row.max_weight_change:>18.3g}")
        lines += ["", "top-k margin (baseline router logits: the k-th largest minus the (k+1)-th), tokens per bin "
                      "from each lower edge to the next, every layer:"]
        groups = (("flipped", "changed_by_margin"), ("kept", "unchanged_by_margin"))
        lines += margin_table([(f"{condition if label == 'flipped' else '':<22} {label}",
                                np.sum(np.stack(rows[column].to_numpy()), axis=0))
                               for condition, rows in frame.groupby("condition", sort=False)
                               for label, column in groups], width=32)
    tokens = report.tokens
    flipped = tokens[tokens.set_changed].sort_values("topk_margin", kind="stable") if not tokens.empty else tokens
    if show and len(flipped):
        lines += ["", f"flipped tokens, narrowest margin first ({min(show, len(flipped))} of {len(flipped)} listed):"]
        for row in flipped.head(show).itertuples():
            lines.append(f"  {row.condition:<20} layer {row.layer}  input {row.sequence} token {row.position}  "
                         f"margin {row.topk_margin:.3g}  experts {expert_change(row.baseline_ids, row.condition_ids)}  "
                         f"{context(row, tokenizer)}")
    elif not frame.empty:
        lines += ["", "no token changed its expert set under any condition"]
    for name, reason in report.skipped.items():
        lines.append(f"skipped {name}: {reason}")
    return "\n".join(lines)

