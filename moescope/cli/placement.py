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
  moescope placement runs/ --placement eplb.json --rebalance --policy vllm:1000:3000 --policy every:500
  moescope placement runs/ --ranks 8 --format json | jq '.layers[] | {layer, balancedness}'

slots are kept top-k assignments (a token routed to k experts fills k); tokens count a token once per
rank it reaches (from the routes rows, where the run kept them). A redundant expert's slots are split
as the engine splits them (--dispatch; default: the engine that recorded the run). balancedness is
mean/max over ranks (vLLM's name; 1 is even), imbalance is (max - mean)/mean (TensorRT-LLM's; 0 is
even). --whatif fits the default layout, DeepSeek's EPLB and the seeds' load-aware mapping on one
window and evaluates them on every later one. --rebalance replays the engines' rebalancing policies
(--policy, knobs in steps) over the run and prints, per policy, the balancedness kept against the
expert bytes moved, and how stale the live map is. See docs/placement.md.
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
    what.add_argument("--save", action="store_true",
                      help="write the what-if into the store (the dashboard shows it); with --rebalance, the "
                           "staleness alerts that fire")
    what.add_argument("--export", metavar="FILE",
                      help="write the EPLB placement fitted last as a placement file (JSON or YAML)")
    again = p.add_argument_group("rebalance policies (--rebalance)")
    again.add_argument("--rebalance", action="store_true",
                       help="replay the engines' rebalancing policies over the run (each refit DeepSeek's EPLB) "
                            "from the live map (--placement, else the layout of --ranks) and say how stale it is")
    again.add_argument("--policy", action="append", default=[], metavar="SPEC",
                       help="vllm:WINDOW:INTERVAL, sglang:ITERATIONS[:BUFFER[:MIN_UTILIZATION]], every:N or never "
                            "(repeatable; knobs in steps; default: vllm:1000:3000, sglang:1000 and never)")
    again.add_argument("--expert-bytes", type=float, metavar="B",
                       help="bytes of one expert's parameters (default: --model-config, else the run's recorded "
                            "parameters x --bytes-per-param)")
    again.add_argument("--model-config", metavar="FILE",
                       help="a transformers config.json: an expert is 3 x hidden_size x moe_intermediate_size "
                            "parameters of torch_dtype")
    again.add_argument("--bytes-per-param", type=float, default=2.0,
                       help="bytes per parameter with the run's recorded parameters (default 2: bf16)")
    again.add_argument("--rules", metavar="FILE",
                       help="rules to judge the live map's staleness with (default alerts/placement_rules.yaml: "
                            "PlacementStale above 0.1); with --save a rule that holds goes to the store's alerts")
    again.add_argument("--staleness-window", type=positive_int, default=1000, metavar="STEPS",
                       help="the latest steps a fresh fit reads for the staleness figure (default 1000: vLLM's "
                            "window)")
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
    from moescope.metrics.placement import Placement, PlacementError

    if path is None:
        if ranks is None:
            raise PlacementError("give --ranks R (the contiguous layout) or --placement FILE")
        return Placement.contiguous(ranks)
    return load_recorded_map(path, ranks).placement


def load_recorded_map(path: str, ranks: int | None):
    """An engine's map file (`moescope.analyses.placement.read_recorded_map`) or SGLang recorder dump
    (.pt: its `last_physical_to_logical_map`, and the `global_physical_count` of its records summed,
    the load it recorded per physical slot) as a `moescope.metrics.placement.RecordedMap`.
    Raises PlacementError (a ValueError) for a missing or bad one."""
    from moescope.analyses.placement import read_recorded_map
    from moescope.metrics.placement import Placement, PlacementError, RecordedMap

    if not path.endswith(".pt"):
        return read_recorded_map(path, ranks)
    import numpy as np

    from moescope.ingest.importers.sglang import load_pt
    from moescope.ingest.importers.tables import SourceFormatError

    if ranks is None:
        raise PlacementError(f"{path}: an SGLang dump does not say the expert-parallel size; give --ranks R")
    try:
        payload = load_pt(path)
        mapping = payload["last_physical_to_logical_map"].numpy()
    except (SourceFormatError, KeyError) as e:
        raise PlacementError(f"{path}: no physical-to-logical map (a per_pass or per_token dump has "
                             f"last_physical_to_logical_map): {e}") from e
    placement = Placement.from_physical_to_logical(mapping, ranks, source=path)
    records = [r.get("global_physical_count") for r in payload.get("records") or [] if isinstance(r, dict)]
    counts: list[np.ndarray] = [c.numpy() for c in records if c is not None and tuple(c.shape) == mapping.shape]
    return RecordedMap(placement, np.sum(counts, axis=0).astype(np.float64) if counts else None, "physical")


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
    from moescope.cli.output import notes, placement_document, rebalance_document, wants_json, write_document
    from moescope.ingest.importers.tables import parse_tags
    from moescope.metrics.placement import PlacementError
    from moescope.store import Store

    tags = parse_tags(args.tag) or None
    if (args.whatif or args.rebalance) and args.ranks is None and args.placement is None:
        flag = "--whatif" if args.whatif else "--rebalance"
        raise PlacementError(f"{flag} places experts on --ranks R (or on the ranks of --placement FILE)")
    placement = load_placement(args.placement, args.ranks)
    location = store_location(args)
    with Store(location) as store:
        run_id = store.check_run(args.run)
        if args.rebalance:
            report = _rebalance(store, run_id, placement, args, tags)
            from moescope.cli.mismatch import fired_lines, write_alerts

            fired = judge_staleness(report, _placement_rules(args.rules))
            if wants_json(args):
                write_document("placement rebalance", rebalance_document(report, fired))
            else:
                print(format_rebalance(report))
                for line in fired_lines(fired):
                    print(line)
            if fired and args.save:
                write_alerts(location, fired)
                print(f"\nwrote {len(fired)} alert(s) to the store's alerts table (source placement)",
                      file=notes(args))
            return 0
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


def _rebalance(store, run_id: str, placement, args: argparse.Namespace, tags):
    from moescope.analyses.rebalance import (
        DEFAULT_POLICIES,
        RebalanceSetup,
        expert_bytes_from_config,
        rebalance_report,
    )
    from moescope.metrics.placement import PlacementError
    from moescope.metrics.rebalance import parse_policy

    try:
        policies = [parse_policy(spec) for spec in args.policy] or list(DEFAULT_POLICIES)
    except ValueError as e:
        raise PlacementError(f"--policy: {e}") from e
    expert_bytes = args.expert_bytes
    if expert_bytes is None and args.model_config:
        expert_bytes = expert_bytes_from_config(args.model_config)
    setup = RebalanceSetup(ranks=placement.ranks, nodes=args.nodes, groups=args.groups, redundant=args.redundant,
                           window_steps=args.window or 1, expert_bytes=expert_bytes,
                           bytes_per_param=args.bytes_per_param, staleness_steps=args.staleness_window)
    current = placement if args.placement is not None else None
    return rebalance_report(store, run_id, setup, policies, current, tags, args.dispatch)


def _placement_rules(path: str | None):
    from moescope.alerts.rules import load_rules, placement_rules

    return load_rules(path) if path else placement_rules()


def judge_staleness(report, pack) -> list:
    """The alert transitions (firing, source "placement") of the rules in `pack` that hold for a layer's
    staleness in `report` (a `RebalanceReport`); a rule reading any other signal is left out."""
    from moescope.alerts.engine import fire_once

    stale = report.staleness
    return [t for layer, value in zip(stale.layers, stale.layer_staleness)
            for t in fire_once(pack, {"placement_staleness": float(value)}, run_id=report.run_id, layer=int(layer),
                               source="placement", step=int(stale.window_end) - 1)]


def _bytes(value: float) -> str:
    if not math.isfinite(value):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:,.1f} TiB"


def format_rebalance(report) -> str:
    """The rebalance replay as text: per policy, the balancedness kept and the bytes moved, then the
    live map's staleness."""
    setup = report.setup
    lines = [f"rebalance policies over run {report.run_id}: {setup.ranks} ranks, {setup.nodes} node(s), "
             f"{setup.groups} group(s), {setup.redundant} redundant slot(s); {len(report.steps)} replayed step(s) "
             f"of {setup.window_steps} recorded step(s); every refit DeepSeek's EPLB; an expert is "
             f"{_bytes(report.expert_bytes)}; redundant copies split as {report.dispatch}",
             f"  {'policy':<44}{'refits':>7}{'balanced':>9}{'worst':>7}{'overload':>9}{'nodes':>7}"
             f"{'in-node':>8}{'moved':>12}{'sent':>12}{'per hour':>12}"]
    for p in report.policies:
        lines.append(f"  {p.policy:<44}{p.rearrangements:>7}{p.mean_balancedness:>9.3f}{p.min_balancedness:>7.3f}"
                     f"{p.mean_overload:>9.3f}{p.mean_node_balancedness:>7.3f}{p.mean_in_node_balancedness:>8.3f}"
                     f"{_bytes(p.moved_bytes):>12}{_bytes(p.sent_bytes):>12}{_bytes(p.moved_bytes_per_hour):>12}")
        if p.skipped:
            lines.append(f"    ({p.skipped} rebalance(s) skipped: utilisation above the threshold)")
    lines.append("  balanced: mean over steps of mean/max rank (layers summed); worst: the lowest step; overload: "
                 "busiest/mean rank per layer and step, averaged (Megatron's); nodes / in-node: mean/max across "
                 "nodes / within them; moved: slots that loaded another expert x its bytes; sent: those whose "
                 "GPU held no copy; per hour: moved over the run's span")
    stale = report.staleness
    lines.append(f"\nstaleness of the live map ({stale.source}) on steps {stale.window_start}-{stale.window_end - 1}: "
                 f"{stale.staleness:.3f} (balancedness {stale.current_balancedness:.3f} now, "
                 f"{stale.fresh_balancedness:.3f} with a fresh EPLB fit: a rearrangement now wins back "
                 f"{max(stale.staleness, 0.0):.1%} of the MoE time)")
    return "\n".join(lines)


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
