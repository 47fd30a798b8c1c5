"""`moescope traffic STORE --ranks R | --placement FILE`: what a placement costs on the wire, per layer.

The figures come from `moescope.analyses.traffic` (counted by `moescope.metrics.traffic`); this
module reads the arguments, builds the placements to compare and prints.
"""

from __future__ import annotations

import argparse
import math

from moescope.cli import command_help
from moescope.cli.arguments import add_format_argument, positive_int, positive_number, store_epilog, store_location
from moescope.cli.placement import add_placement_arguments, load_placement, write_placement

EXAMPLES = """\
examples:
  moescope traffic runs/ --ranks 16                        16 ranks in 2 nodes of 8, contiguous layout
  moescope traffic runs/ --placement eplb.yaml --nodes 8,8,4 --config model/config.json
  moescope traffic runs/ --ranks 32 --max-nodes 4          what DeepSeek-V3's 4-node limit would change
  moescope traffic runs/ --ranks 16 --compare default,coselection,eplb --window 100 --tag phase=decode
  moescope traffic runs/ --ranks 16 --compare coselection --window 100 --export coselection.yaml
  moescope traffic runs/ --ranks 16 --format json | jq '.layers[] | {layer, remote_ranks_mean}'

per token: remote ranks are the GPUs other than its home that hold any of its kept experts (DeepEP
sends a token once to each), remote nodes the nodes other than its home's (once each over RDMA).
A token's home is the rank that recorded it (--home recorded, the default for a multi-rank run) or,
for a run recorded in one process, its row in its forward's batch modulo R (--home token, the default,
the rule the dashboard, the rules engine and the exporter use too: `moescope.metrics.traffic.default_home`)
or its sequence's batch row modulo R (--home sequence: data-parallel attention spreads a batch's sequences
round-robin; an imported run holds one request a step, so every token would be home 0).
The floor is the mean a perfect placement could reach for the same routing. With redundant experts,
a token uses the copy on its home rank, else on its node (lowest rank), else copy (home mod copies).
See docs/traffic.md.
"""


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "traffic", help=command_help("traffic"),
        description="Print, per MoE layer (and window), the dispatch traffic a placement of experts on ranks "
                    "causes: remote ranks and nodes per token against the floor, the busiest link, the "
                    "intra-node share, bytes per forward, the rank x rank and node x node matrices, and what "
                    "other placements or node-limited routing would change.\n\n" + EXAMPLES,
        epilog=store_epilog("moescope traffic STORE --ranks 16"), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_placement_arguments(p)
    p.add_argument("--ranks-per-node", type=positive_int, default=8, metavar="G",
                   help="consecutive ranks per node (default 8; the last node may hold fewer)")
    p.add_argument("--nodes", metavar="G0,G1,...", help="ranks of each node, for uneven nodes (e.g. 8,8,4)")
    p.add_argument("--home", choices=("recorded", "sequence", "token"),
                   help="how tokens get home ranks (default: recorded for a multi-rank run, else token)")
    p.add_argument("--hidden-size", type=positive_int, metavar="H", help="the model's hidden size, for bytes")
    p.add_argument("--config", metavar="CONFIG_JSON",
                   help="a transformers config.json: hidden_size and torch_dtype, for bytes")
    p.add_argument("--dispatch-bytes", type=positive_number, metavar="B",
                   help="bytes per element sent at dispatch (default: the config's dtype, else 2 for bf16; "
                        "1 for DeepEP's fp8 dispatch, counted with its float32 scale per 128 elements)")
    p.add_argument("--combine-bytes", type=positive_number, metavar="B",
                   help="bytes per element sent back at combine (default: the config's dtype, else 2 for bf16, "
                        "whatever --dispatch-bytes says: DeepEP combines in bf16)")
    p.add_argument("--mode", choices=("normal", "low-latency"), default="normal",
                   help="DeepEP's kernels: normal (prefill: a token once per remote GPU holding any of its experts, "
                        "once per remote node over RDMA) or low-latency (decode: once per remote top-k slot, each "
                        "its own message); default normal")
    p.add_argument("--max-nodes", type=positive_int, metavar="M",
                   help="also evaluate node-limited routing with at most M nodes per token (DeepSeek-V3: 4)")
    p.add_argument("--compare", metavar="NAMES",
                   help="also the whole run under other placements, comma-separated: default (the contiguous "
                        "layout), coselection (experts often chosen together co-located), eplb (DeepSeek's EPLB "
                        "fitted on the run's loads, see --groups, --redundant), or a placement FILE")
    p.add_argument("--groups", type=positive_int, default=1, metavar="G",
                   help="expert groups of the model, for --compare eplb (DeepSeek-V3: 8; default 1)")
    p.add_argument("--redundant", type=int, default=0, metavar="N",
                   help="redundant slots EPLB may fill with copies of hot experts, for --compare eplb (default 0)")
    p.add_argument("--window", type=positive_int, metavar="N", help="a row per window of N steps (default: the run)")
    p.add_argument("--tag", action="append", default=[], metavar="K=V",
                   help="only the steps with this tag (repeatable: all must hold)")
    p.add_argument("--matrix", action="store_true", help="print each row's rank x rank matrix")
    add_format_argument(p)
    p.add_argument("--export", metavar="FILE",
                   help="write the co-selection placement (fitted on the last --window, else on the whole run) as a "
                        "placement file (JSON or YAML) that --placement reads back")
    p.set_defaults(func=_traffic_command)


def _nodes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--nodes {text!r}: list the ranks of each node, like 8,8,4") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--nodes {text!r}: every node holds at least one rank")
    return sizes


def _number(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else "-"


def _histogram(counts) -> str:
    """Tokens per count, the counts no token has left out: `0:12 2:30`."""
    return " ".join(f"{n}:{c:,}" for n, c in enumerate(counts) if c)


def _figure_lines(figures: dict, indent: str, floor: bool = False) -> list[str]:
    """A row's fan-out, histograms, sends, links and bytes (the plain figures, or those under the limit)."""
    from moescope.analyses.traffic import bytes_text

    def against(name: str) -> str:
        return f" (floor {_number(figures[f'floor_{name}'])})" if floor else ""

    h, r = figures["busiest_link"]
    link = f"rank {h} -> {r} ({figures['busiest_link_tokens']:,} tokens)" if h >= 0 else "none"
    return [f"{indent}remote ranks per token {_number(figures['remote_ranks_mean'])}{against('remote_ranks')}   "
            f"remote nodes per token {_number(figures['remote_nodes_mean'])}{against('remote_nodes')}",
            f"{indent}tokens by remote ranks  {_histogram(figures['remote_ranks_histogram'])}   "
            f"by remote nodes  {_histogram(figures['remote_nodes_histogram'])}",
            f"{indent}GPU sends {figures['gpu_sends']:,}, RDMA sends {figures['rdma_sends']:,}, intra-node share "
            f"{_number(figures['intra_node_share'])}, busiest link {link}",
            f"{indent}per forward: dispatch {bytes_text(figures['dispatch_bytes_per_forward'])}, combine "
            f"{bytes_text(figures['combine_bytes_per_forward'])} (over RDMA: "
            f"{bytes_text(figures['rdma_dispatch_bytes_per_forward'])} / "
            f"{bytes_text(figures['rdma_combine_bytes_per_forward'])})"]


def format_report(report, run_id: str, matrix: bool = False) -> str:
    """The report as text: per layer and window, fan-out against the floor, links, bytes, node limit."""
    import pandas as pd

    from moescope.metrics.traffic import LIMITED_FIGURES

    lines = [f"run {run_id}: {report.ranks} ranks in {report.nodes} nodes ({report.source}); "
             f"home ranks: {report.home}; sends: DeepEP {report.mode}"
             + (" (one per remote top-k slot)" if report.mode == "low-latency" else
                " (one per remote GPU, one per remote node over RDMA)"),
             f"redundant experts: {report.replica_rule}"]
    if report.layers.empty:
        return "\n".join([*lines, "no routes recorded (under these tags): attach with routes=True"])
    for row in report.layers.itertuples():
        span = "" if pd.isna(row.window_start) else f", steps {int(row.window_start)}-{int(row.window_end) - 1}"
        lines.append(f"\nlayer {row.layer}{span}: {row.tokens:,} tokens over {row.forwards:,} forwards")
        figures = row._asdict()
        lines += _figure_lines(figures, "  ", floor=True)
        if math.isfinite(row.limited_changed_share):
            lines.append(f"  node-limited routing ({row.limited_rule}): {_number(100 * row.limited_changed_share, 1)}% "
                         f"of tokens would change, moving {_number(100 * row.limited_moved_weight_changed, 1)}% of "
                         "their top-k weight; under it:")
            lines += _figure_lines({name: figures[f"limited_{name}"] for name in LIMITED_FIGURES}, "    ")
        if matrix:
            lines.append("  tokens from home rank (rows) to rank (columns):")
            lines += ["    " + " ".join(f"{v:>7,}" for v in line) for line in row.rank_matrix]
            lines.append("  summed over nodes, from node (rows) to node (columns):")
            lines += ["    " + " ".join(f"{v:>7,}" for v in line) for line in row.node_matrix]
    return "\n".join(lines)


def format_comparison(frame) -> str:
    """Per layer, each placement's mean remote ranks and nodes per token and intra-node share."""
    lines = ["\nunder other placements (whole run):",
             f"  {'layer':>5}  {'placement':<28} {'remote ranks':>12} {'remote nodes':>12} {'intra-node':>10}"]
    for row in frame.sort_values(["layer"], kind="stable").itertuples():
        lines.append(f"  {row.layer:>5}  {row.placement:<28} {_number(row.remote_ranks_mean):>12} "
                     f"{_number(row.remote_nodes_mean):>12} {_number(row.intra_node_share):>10}")
    return "\n".join(lines)


def format_windowed_coselection(frame, report) -> str:
    """Per layer and window, the co-selection placement fitted on the window before against the run's placement."""
    lines = ["\nco-selection placement fitted on each window, scored on the next (against the placement given):",
             f"  {'layer':>5}  {'steps':<13} {'remote ranks':>16} {'remote nodes':>16} {'intra-node':>16}"]
    given = report.layers.set_index(["layer", "window_start"])
    for row in frame.sort_values(["layer", "window_start"], kind="stable").itertuples():
        base = given.loc[(row.layer, row.window_start)]
        cells = [f"{_number(a)} vs {_number(b)}" for a, b in (
            (row.remote_ranks_mean, base.remote_ranks_mean), (row.remote_nodes_mean, base.remote_nodes_mean),
            (row.intra_node_share, base.intra_node_share))]
        steps = f"{int(row.window_start)}-{int(row.window_end) - 1}"
        lines.append(f"  {row.layer:>5}  {steps:<13} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16}")
    if frame.empty:
        lines.append("  no window follows one with co-selection counts")
    return "\n".join(lines)


def _alternatives(names: str, store, run_id: str, placement, rank_node, tags, groups: int = 1,
                  redundant: int = 0) -> dict:
    from moescope.analyses import traffic
    from moescope.metrics.placement import Placement, PlacementError

    out = {placement.source: placement}
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if name == "default":
            out["default (contiguous)"] = Placement.contiguous(placement.ranks)
        elif name == "coselection":
            out["co-selection"] = traffic.coselection_placement(store, run_id, placement, rank_node, tags)
        elif name == "eplb":
            out["EPLB"] = traffic.eplb_placement(store, run_id, placement.ranks, rank_node, groups, redundant, tags)
        else:
            other = load_placement(name, placement.ranks)
            if other.ranks != placement.ranks:
                raise PlacementError(f"{name} places experts on {other.ranks} ranks, not {placement.ranks}")
            out[name] = other
    return out


def _traffic_command(args: argparse.Namespace) -> int:
    from moescope.analyses import traffic
    from moescope.cli.output import notes, traffic_document, wants_json, write_document
    from moescope.ingest.importers.tables import parse_tags
    from moescope.store import Store

    tags = parse_tags(args.tag) or None
    placement = load_placement(args.placement, args.ranks)
    rank_node = traffic.node_layout(placement.ranks, args.ranks_per_node, _nodes(args.nodes))
    hidden, element = args.hidden_size, 2.0
    if args.config is not None:
        config_hidden, element = traffic.read_model_config(args.config)
        hidden = hidden or config_hidden
    dispatch = args.dispatch_bytes or element
    with Store(store_location(args)) as store:
        run_id = store.check_run(args.run)
        setup = traffic.Wire(rank_node, args.home or traffic.default_home(store, run_id), hidden, dispatch,
                             args.combine_bytes or element, args.max_nodes, args.mode)
        report = traffic.traffic_report(store, run_id, placement, setup, args.window, tags)
        comparison, placements = None, {}
        if args.compare:
            placements = _alternatives(args.compare, store, run_id, placement, rank_node, tags, args.groups,
                                       args.redundant)
            comparison = traffic.compare_placements(store, run_id, placements, setup, tags)
        windowed, coselected = None, placements.get("co-selection")
        if args.window and ("co-selection" in placements or args.export):
            windowed, coselected = traffic.coselection_by_window(store, run_id, placement, setup, args.window, tags)
        if args.export and coselected is None:
            coselected = traffic.coselection_placement(store, run_id, placement, rank_node, tags)
    shown = windowed if "co-selection" in placements else None
    if wants_json(args):
        write_document("traffic", traffic_document(report, run_id, comparison, shown))
    else:
        print(format_report(report, run_id, args.matrix))
        if comparison is not None:
            print(format_comparison(comparison))
        if shown is not None:
            print(format_windowed_coselection(shown, report))
    if args.export:
        print(file=notes(args))
        write_placement(args.export, coselected, "co-selection", notes(args))
    return 0
