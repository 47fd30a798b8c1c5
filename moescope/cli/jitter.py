"""`moescope jitter MODEL`: the routing-jitter check (`moescope.analyses.jitter`) from the command line.

MODEL is what a user has offline: `demo` (the shipped demo model, `moescope/demo/model`) or a
local folder that transformers' `from_pretrained` reads (config, weights, tokenizer). Nothing is
ever downloaded. Inputs are `--text` strings and `--file` lines, tokenized with the folder's
tokenizer; the demo model plays held-out texts of its three domains when none are given.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np

from moescope.analyses.jitter import (
    CONDITION_KINDS,
    DEFAULT_DTYPES,
    MARGIN_EDGES,
    JitterError,
    JitterReport,
    expert_change,
    jitter,
)
from moescope.analyses.tokens import context_parts
from moescope.cli import command_help
from moescope.cli.arguments import add_store_arguments, store_location

DEMO = "demo"
DEMO_TEXTS_PER_DOMAIN = 4
SHOW_TOKENS = 8

EXAMPLES = """\
examples:
  moescope jitter demo                                   the demo model on held-out texts
  moescope jitter demo --store runs/jitter               ... and keep the results (dashboard page "Routing jitter")
  moescope jitter ./my-moe --text "The cat sat." --text "def f(x): return x"
  moescope jitter ./my-moe --file prompts.txt --condition dtype --dtype bfloat16
  moescope jitter ./my-moe --file prompts.txt --condition batched --condition left_padding --batch-size 16

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
    p.add_argument("--max-listed", type=int, default=1000,
                   help="flipped tokens kept per condition and layer (default 1000)")
    p.add_argument("--show", type=int, default=SHOW_TOKENS, help=f"flipped tokens printed (default {SHOW_TOKENS})")
    add_store_arguments(p, option=True, required=False,
                        what="also write the results to this store (a folder or a URL) as a run of their own")
    p.add_argument("--run-id", help="the run id in the store (default: a new one)")
    p.add_argument("--tag", action="append", default=[], metavar="K=V", help="a tag on the run (repeatable)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_jitter)


def load_model(name: str) -> tuple[Any, Any, bool]:
    """(model in eval mode on the CPU in float32, tokenizer or None, whether it is the demo model)
    for MODEL: `demo` or a local folder. Raises JitterError when there is nothing to load there."""
    from moescope.demo.data import demo_model_path, load_demo_model

    model: Any
    tokenizer: Any
    if name == DEMO:
        model, tokenizer = load_demo_model()
        return model, tokenizer, True
    folder = os.path.abspath(os.path.expanduser(name))
    if not os.path.isdir(folder):
        raise JitterError(f"no model folder at {name!r}: give `demo` or a local folder saved with transformers' "
                          "save_pretrained (moescope never downloads; fetch the model first, e.g. with "
                          "`huggingface-cli download ORG/NAME --local-dir DIR`)")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise JitterError(f"{name!r} holds no config.json: give the folder transformers' save_pretrained wrote")
    if os.path.realpath(folder) == os.path.realpath(demo_model_path()):
        model, tokenizer = load_demo_model(folder)
        return model, tokenizer, True
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    if config.get("capacity_factor") is not None and config.get("model_type") == "mixtral":
        model, tokenizer = load_demo_model(folder)  # a `moescope train-demo` checkpoint: run it with its capacity
        return model, tokenizer, True
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise JitterError(f"transformers cannot load a causal LM from {name!r}: {str(e).splitlines()[0]}") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError):
        tokenizer = None
    return model.eval(), tokenizer, False


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
    for flag in ("batch_size", "other_batch_size", "max_tokens"):
        if getattr(args, flag) < 1:
            raise JitterError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.max_listed < 0 or args.show < 0:
        raise JitterError("--max-listed and --show must be 0 or more")
    import torch

    from moescope.ingest.importers.tables import parse_tags

    for name in args.dtype or ():
        if not isinstance(getattr(torch, name, None), torch.dtype):
            raise JitterError(f"unknown dtype {name!r}; use a torch dtype name such as bfloat16 or float16")
    tags = parse_tags(args.tag)
    location = store_location(args) if args.store else None
    if location is not None and location.is_local and os.path.isfile(location.url):
        raise JitterError(f"the store {location.url!r} is a file: give a folder (it is created if missing)")
    if args.texts < 1:
        raise JitterError(f"--texts must be at least 1, got {args.texts}")
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
    print(format_report(report, tokenizer, len(texts), args.show))
    if location is not None:
        print(f"\nwritten to {location.redacted} as run {report.run_id}; see it with "
              f"`{_program()} dashboard {location.redacted}` (page \"Routing jitter\")")
    return 0


def _program() -> str:
    """How to call moescope so that the printed command runs as printed (`moescope.cli.program_name`
    where this installation has it)."""
    from moescope import cli

    program_name = getattr(cli, "program_name", None)
    return program_name() if callable(program_name) else "moescope"


def _edge(value: float) -> str:
    return f"{value:g}"


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
        bins = [f">={_edge(lo)}" for lo in MARGIN_EDGES]
        width = max(map(len, bins)) + 1
        lines.append(f"{'':<22} {'':<9}" + "".join(f"{b:>{width}}" for b in bins))
        for condition, rows in frame.groupby("condition", sort=False):
            for label, column in (("flipped", "changed_by_margin"), ("kept", "unchanged_by_margin")):
                counts = np.sum(np.stack(rows[column].to_numpy()), axis=0)
                lines.append(f"{condition if label == 'flipped' else '':<22} {label:<9}"
                             + "".join(f"{int(c):>{width}}" for c in counts))
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


def context(row: Any, tokenizer: Any) -> str:
    """The tokens around a listed token, the token itself in [brackets]: decoded with `tokenizer`
    (a character cut across tokens whole, never a replacement character: `analyses.tokens.context_parts`),
    as ids without one."""
    ids = list(row.context_ids)
    at = int(row.position) - int(row.context_start)
    if tokenizer is None:
        return " ".join(f"[{t}]" if i == at else str(t) for i, t in enumerate(ids))
    before, token, after = context_parts(tokenizer, ids, at)
    return repr(f"{before}[{token}]{after}")[1:-1]
