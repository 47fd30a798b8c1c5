"""`moescope placement STORE --ranks R | --placement FILE`: load per expert-parallel rank, per layer.

The figures come from `moescope.analyses.placement` (the store's `rank_loads` and the signals'
`balancedness` and `imbalance`); this module only reads the arguments and prints. A `.pt` file is
an SGLang recorder dump: its `last_physical_to_logical_map` is the placement (torch is imported
for that file only).
"""

from __future__ import annotations

import argparse
import math

from moescope.cli import command_help
from moescope.cli.arguments import add_store_arguments, positive_int, store_epilog, store_location

EXAMPLES = """\
examples:
  moescope placement runs/ --ranks 8                      experts 0..E/8-1 on rank 0, and so on
  moescope placement runs/ --placement eplb.yaml --window 100 --tag phase=decode
  moescope placement runs/ --placement expert_distribution_recorder_1700000000.pt --ranks 8

slots are kept top-k assignments (a token routed to k experts fills k); a redundant expert's slots
are split evenly over its copies. balancedness is mean/max over ranks (vLLM's name; 1 is even),
imbalance is (max - mean)/mean (TensorRT-LLM's; 0 is even). See docs/placement.md.
"""


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "placement", help=command_help("placement"),
        description="Print, per MoE layer (and window), the slots each expert-parallel rank serves under a "
                    "placement of experts on ranks, both balancedness figures, and the hottest rank with the "
                    "experts that make it so.\n\n" + EXAMPLES,
        epilog=store_epilog("moescope placement STORE --ranks 8"), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_arguments(p, what="the store: a folder or a URL (s3://BUCKET/PREFIX, gs://..., az://...)")
    p.add_argument("--run", help="run id (default: the most recently started run)")
    p.add_argument("--ranks", type=positive_int, metavar="R",
                   help="expert-parallel ranks: the contiguous layout, or the ranks of an SGLang dump's map")
    p.add_argument("--placement", metavar="FILE",
                   help="a placement file (JSON or YAML, see docs/placement.md) or an SGLang recorder dump (.pt)")
    p.add_argument("--window", type=positive_int, metavar="N", help="a row per window of N steps (default: the run)")
    p.add_argument("--tag", action="append", default=[], metavar="K=V",
                   help="only the steps with this tag (repeatable: all must hold)")
    p.add_argument("--top", type=positive_int, default=3, help="experts listed for the hottest rank (default 3)")
    p.set_defaults(func=_placement_command)


def load_placement(path: str | None, ranks: int | None):
    """The placement the arguments name. Raises PlacementError (a ValueError) for a missing or bad one."""
    from moescope.analyses.placement import Placement, PlacementError, read_placement

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
    placement = read_placement(path)
    if ranks is not None and ranks != placement.ranks:
        raise PlacementError(f"{path} places experts on {placement.ranks} ranks, but --ranks is {ranks}")
    return placement


def _number(value: float) -> str:
    return f"{value:,.1f}".rstrip("0").rstrip(".") if math.isfinite(value) else "-"


def format_report(report, run_id: str) -> str:
    """The report as text: per layer and window, rank slots, both balancedness figures, the hottest rank."""
    import pandas as pd

    lines = [f"run {run_id}: {report.ranks} ranks ({report.source})"]
    if report.layers.empty:
        return "\n".join([*lines, "no layer steps recorded (under these tags)"])
    for row in report.layers.itertuples():
        span = "" if pd.isna(row.window_start) else f", steps {int(row.window_start)}-{int(row.window_end) - 1}"
        lines.append(f"\nlayer {row.layer}{span}: {row.tokens:,} tokens, {row.slots:,} slots")
        lines.append("  " + "  ".join(f"rank {r}: {_number(s)}" for r, s in enumerate(row.rank_slots)))
        lines.append(f"  balancedness (vLLM, mean/max) {row.balancedness:.3f}   "
                     f"imbalance (TensorRT-LLM, (max-mean)/mean) {row.imbalance:.3f}")
        experts = ", ".join(f"expert {e} ({_number(s)})" for e, s in zip(row.hottest_experts, row.hottest_expert_slots))
        lines.append(f"  hottest rank {row.hottest_rank}: {experts or 'no load'}")
    return "\n".join(lines)


def _placement_command(args: argparse.Namespace) -> int:
    from moescope.analyses.placement import placement_report
    from moescope.ingest.importers.tables import parse_tags
    from moescope.store import Store

    tags = parse_tags(args.tag) or None
    placement = load_placement(args.placement, args.ranks)
    with Store(store_location(args)) as store:
        run_id = store.check_run(args.run)
        report = placement_report(store, run_id, placement, args.window, tags, args.top)
    print(format_report(report, run_id))
    return 0
