"""`moescope placement STORE --ranks R | --placement FILE [--whatif]`: load per expert-parallel rank,
per layer, and what other placements would have done.

The figures come from `moescope.analyses.placement` (the store's `rank_loads`, the routes rows and
the signals' `balancedness` and `imbalance`; `moescope.analyses.placement_whatif` and
`moescope.metrics.eplb` for the what-if); this module only reads the arguments and prints. A `.pt`
file is an SGLang recorder dump: its `last_physical_to_logical_map` is the placement (torch is
imported for that file only).
"""

from __future__ import annotations

import argparse
import math
import sys

from moescope.cli import command_help
from moescope.cli.arguments import add_format_argument, add_store_arguments, positive_int, store_epilog, store_location

EXAMPLES = """\
examples:
  moescope placement runs/ --ranks 8                      experts 0..E/8-1 on rank 0, and so on
  moescope placement runs/ --placement eplb.yaml --window 100 --tag phase=decode
  moescope placement runs/ --placement expert_distribution_recorder_1700000000.pt --ranks 8

  moescope placement runs/ --placement moe_load_balancer.yaml --ranks 36 --dispatch trtllm
  moescope placement runs/ --ranks 32 --whatif --window 100 --redundant 32 --nodes 4 --groups 8 --save
  moescope placement runs/ --ranks 8 --whatif --window 100 --rebalance-every 10 --export eplb.json
  moescope placement runs/ --ranks 8 --format json | jq '.layers[] | {layer, balancedness}'

slots are kept top-k assignments (a token routed to k experts fills k); tokens count a token once per
rank it reaches (from the routes rows, where the run kept them). A redundant expert's slots are split
as the engine splits them (--dispatch; default: the engine that recorded the run). balancedness is
mean/max over ranks (vLLM's name; 1 is even), imbalance is (max - mean)/mean (TensorRT-LLM's; 0 is
even). --whatif fits the default layout, DeepSeek's EPLB and the seeds' load-aware mapping on one
window and evaluates them on every later one. See docs/placement.md.
"""


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "placement", help=command_help("placement"),
        description="Print, per MoE layer (and window), the slots each expert-parallel rank serves under a "
                    "placement of experts on ranks, both balancedness figures, and the hottest rank with the "
                    "experts that make it so.\n\n" + EXAMPLES,
        epilog=store_epilog("moescope placement STORE --ranks 8"), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_placement_arguments(p)
    p.add_argument("--window", type=positive_int, metavar="N", help="a row per window of N steps (default: the run)")
    p.add_argument("--tag", action="append", default=[], metavar="K=V",
                   help="only the steps with this tag (repeatable: all must hold)")
    p.add_argument("--top", type=positive_int, default=3, help="experts listed for the hottest rank (default 3)")
    add_format_argument(p)
    p.add_argument("--dispatch", choices=list(DISPATCH_NAMES),
                   help="how a redundant expert's copy is picked: the engine's rule (default: the run's engine, "
                        "else even)")
    what = p.add_argument_group("what-if (--whatif)")
    what.add_argument("--whatif", action="store_true",
                      help="evaluate the default layout, EPLB and the load-aware mapping (and the placement "
                           "given) on every --window (default 100 steps)")
    what.add_argument("--fit-window", type=int, default=0, metavar="I",
                      help="the window the placements are fitted on (0: the first)")
    what.add_argument("--rebalance-every", type=positive_int, metavar="N",
                      help="also refit EPLB every N windows on the window before (against never)")
    what.add_argument("--redundant", type=int, default=0, metavar="S", help="extra slots EPLB may fill (default 0)")
    what.add_argument("--nodes", type=positive_int, default=1, help="server nodes (EPLB's hierarchical policy)")
    what.add_argument("--groups", type=positive_int, default=1, help="expert groups of the model (DeepSeek-V3: 8)")
    what.add_argument("--save", action="store_true", help="write the what-if into the store (the dashboard shows it)")
    what.add_argument("--export", metavar="FILE",
                      help="write the EPLB placement fitted last as a placement file (JSON or YAML)")
    p.set_defaults(func=_placement_command)


DISPATCH_NAMES = ("even", "vllm", "sglang-static", "sglang-dynamic", "trtllm", "trtllm-tp")  # metrics.dispatch


def add_placement_arguments(p: argparse.ArgumentParser) -> None:
    """The store, the run and the placement (`--ranks` or `--placement`): what `placement` and `traffic` read."""
    add_store_arguments(p, what="the store: a folder or a URL (s3://BUCKET/PREFIX, gs://..., az://...)")
    p.add_argument("--run", help="run id (default: the most recently started run)")
    p.add_argument("--ranks", type=positive_int, metavar="R",
                   help="expert-parallel ranks: the contiguous layout, or the ranks of an SGLang dump's map")
    p.add_argument("--placement", metavar="FILE",
                   help="a placement file (JSON or YAML, see docs/placement.md) or an SGLang recorder dump (.pt)")


def load_placement(path: str | None, ranks: int | None):
    """The placement the arguments name. Raises PlacementError (a ValueError) for a missing or bad one."""
    from moescope.analyses.placement import read_placement
    from moescope.metrics.placement import Placement, PlacementError

    if path is None:
        if ranks is None:
            raise PlacementError("give --ranks R (the contiguous layout) or --placement FILE")
        return Placement.contiguous(ranks)
    if path.endswith(".pt"):
        from moescope.ingest.importers.sglang import load_pt
        from moescope.ingest.importers.tables import SourceFormatError

        if ranks is None:
            raise PlacementError(f"{path}: an SGLang dump does not say the expert-parallel size; give --ranks R")
        try:
            payload = load_pt(path)
            mapping = payload["last_physical_to_logical_map"]
        except (SourceFormatError, KeyError) as e:
            raise PlacementError(f"{path}: no physical-to-logical map (a per_pass or per_token dump has "
                                 f"last_physical_to_logical_map): {e}") from e
        return Placement.from_physical_to_logical(mapping.numpy(), ranks, source=path)
    return read_placement(path, ranks)


def _number(value: float) -> str:
    return f"{value:,.1f}".rstrip("0").rstrip(".") if math.isfinite(value) else "-"


def format_report(report, run_id: str) -> str:
    """The report as text: per layer and window, rank slots, both balancedness figures, the hottest rank."""
    import pandas as pd

    lines = [f"run {run_id}: {report.ranks} ranks ({report.source}); redundant copies split as {report.dispatch}"]
    if report.layers.empty:
        return "\n".join([*lines, "no layer steps recorded (under these tags)"])
    for row in report.layers.itertuples():
        span = "" if pd.isna(row.window_start) else f", steps {int(row.window_start)}-{int(row.window_end) - 1}"
        lines.append(f"\nlayer {row.layer}{span}: {row.tokens:,} tokens, {row.slots:,} slots")
        lines.append("  slots   " + "  ".join(f"rank {r}: {_number(s)}" for r, s in enumerate(row.rank_slots)))
        if row.rank_tokens is not None:
            lines.append("  tokens  " + "  ".join(f"rank {r}: {_number(t)}" for r, t in enumerate(row.rank_tokens)))
        lines.append(f"  balancedness (vLLM, mean/max) {row.balancedness:.3f}   "
                     f"imbalance (TensorRT-LLM, (max-mean)/mean) {row.imbalance:.3f}")
        experts = ", ".join(f"expert {e} ({_number(s)})" for e, s in zip(row.hottest_experts, row.hottest_expert_slots))
        lines.append(f"  hottest rank {row.hottest_rank}: {experts or 'no load'}")
    return "\n".join(lines)


def format_whatif(report, run_id: str) -> str:
    """The what-if as text: per candidate, balancedness on the fit window, later, last, decay and gain."""
    setup = report.setup
    figures = report.figures()
    starts = sorted(set(report.summary.window_start))
    fit = starts[setup.fit_window]
    lines = [f"\nwhat-if for run {run_id}: {setup.ranks} ranks, {setup.nodes} node(s), {setup.groups} group(s), "
             f"{setup.redundant} redundant slot(s); windows of {report.window_steps} steps, fitted on steps "
             f"{fit}-{fit + report.window_steps - 1}, evaluated on {len(starts) - setup.fit_window - 1} later "
             "window(s); "
             f"balancedness of the whole forward (mean/max rank, summed over layers)",
             f"  {'placement':<18}{'fit':>8}{'later':>8}{'last':>8}{'decay':>8}{'gain':>8}"]
    for row in figures.itertuples():
        lines.append(f"  {row.candidate:<18}" + "".join(f"{v:>8.3f}" if math.isfinite(v) else f"{'-':>8}"
                                                         for v in (row.fit, row.later, row.last, row.decay, row.gain)))
    lines.append("  decay: fit - later (what traffic shifts cost the placement); gain: later - the default layout's")
    rebalanced = [c for c in figures.candidate if c.startswith("eplb-every-")]
    if rebalanced:
        never = figures.set_index("candidate").later.get("eplb", float("nan"))
        again = figures.set_index("candidate").later[rebalanced[0]]
        lines.append(f"  rebalancing every {setup.rebalance_every} window(s) against never: "
                     f"{again:.3f} vs {never:.3f} ({again - never:+.3f})")
    return "\n".join(lines)


def _placement_command(args: argparse.Namespace) -> int:
    from moescope.analyses.placement import placement_report
    from moescope.analyses.placement_whatif import WhatIfSetup, placement_whatif, write_whatif
    from moescope.cli.output import notes, placement_document, wants_json, write_document
    from moescope.ingest.importers.tables import parse_tags
    from moescope.metrics.placement import PlacementError
    from moescope.store import Store

    tags = parse_tags(args.tag) or None
    if args.whatif and args.ranks is None and args.placement is None:
        raise PlacementError("--whatif places experts on --ranks R (or on the ranks of --placement FILE)")
    placement = load_placement(args.placement, args.ranks)
    location = store_location(args)
    with Store(location) as store:
        run_id = store.check_run(args.run)
        report = placement_report(store, run_id, placement, args.window, tags, args.top, args.dispatch,
                                  progress=sys.stderr.isatty())
        whatif = None
        if args.whatif:
            setup = WhatIfSetup(ranks=placement.ranks, nodes=args.nodes, groups=args.groups,
                                redundant=args.redundant, fit_window=args.fit_window,
                                rebalance_every=args.rebalance_every)
            current = placement if args.placement is not None else None
            whatif = placement_whatif(store, run_id, args.window or 100, setup, current, tags, args.dispatch)
    if wants_json(args):
        write_document("placement", placement_document(report, run_id, whatif))
    else:
        print(format_report(report, run_id))
        if whatif is not None:
            print(format_whatif(whatif, run_id))
    if whatif is None:
        return 0
    if args.save:
        rows = write_whatif(location, run_id, whatif)
        print(f"\nwrote {rows} rows to the store's placement_whatif table (the dashboard's Placement page shows them)",
              file=notes(args))
    if args.export:
        _export(args.export, whatif, args.rebalance_every, notes(args))
    return 0


def _export(path: str, whatif, rebalance_every: int | None, stream=None) -> None:
    name = f"eplb-every-{rebalance_every}" if rebalance_every else "eplb"
    write_placement(path, whatif.placements[name], name, stream)


def write_placement(path: str, placement, label: str, stream=None) -> None:
    """Write `placement` to `path` in the format `--placement FILE` reads (JSON for a .json name, else
    YAML), and say so on `stream` (stdout), naming it `label`."""
    import json

    import yaml

    document = placement.document()
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(document) if path.lower().endswith(".json") else yaml.safe_dump(document, sort_keys=False))
    print(f"wrote the {label} placement to {path} (moescope's placement format, docs/placement.md)",
          file=stream or sys.stdout)
