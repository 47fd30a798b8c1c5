"""`moescope whatif cache`: how often would an offloaded server find its experts already resident?

Replays one run's recorded routes (``probe.attach(..., routes=True)``) layer by layer through an
expert cache of every size C from 1 to E (or the sizes ``--capacity`` names), under LRU, LFU and
the offline optimum (Belady), and prints the hit-rate curves; ``--plot`` also draws them (an HTML page,
or a PNG with the ``plot`` extra).
One pass over the routes per policy gives every size. The definitions (what a hit is,
how a token's experts are needed at once, the tie rules) are in `moescope.metrics.expert_cache`.

The replay itself is `moescope.analyses.expert_cache.cache_report`, which the dashboard's Expert cache
page draws too.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence

import pandas as pd

from moescope.analyses.expert_cache import cache_report
from moescope.cli import command_help
from moescope.cli.arguments import add_format_argument, add_store_arguments, store_epilog, store_location
from moescope.metrics.expert_cache import DEFAULT_MAX_TOKENS, MAX_EXPERTS, POLICIES


def format_report(report: pd.DataFrame, run_id: str, tags: dict[str, str] | None = None) -> str:
    """The curves as text: per layer, a row per capacity and a column per policy (hit rate in %)."""
    where = f"run {run_id}" + (f", tags {', '.join(f'{k}={v}' for k, v in tags.items())}" if tags else "")
    if report.empty:
        return (f"{where}: no routes recorded, so there is nothing to replay. Attach the probe with "
                "routes=True (probe.attach(model, store=..., routes=True)) and record again.")
    lines = [f"Expert-cache hit rate, {where}: share of expert accesses whose expert was already resident,",
             "with C experts per layer held in device memory (cold start; one cache per rank)."]
    for layer, frame in report.groupby("layer", sort=True):
        table = frame.pivot(index="capacity", columns="policy", values="hit_rate")
        policies = [p for p in POLICIES if p in table.columns]
        first = frame.iloc[0]
        lines.append("")
        lines.append(f"layer {layer}: {int(first.tokens):,} tokens, {int(first.accesses):,} expert accesses"
                     + (" (the first ones only: more were recorded)" if first.truncated else ""))
        lines.append(f"{'C':>4}  " + "  ".join(f"{p:>7}" for p in policies))
        for capacity, values in table.iterrows():
            lines.append(f"{capacity:>4}  " + "  ".join(f"{100 * values[p]:>6.1f}%" for p in policies))
    return "\n".join(lines)


def plot_backend(path: str | os.PathLike = "plot.png") -> str | None:
    """The library `write_plot` will use for `path`: "plotly-html" for a .html file (plotly is a
    dependency: always there), for a PNG "matplotlib" (the `plot` extra), "plotly" (with kaleido),
    or None."""
    if os.fspath(path).lower().endswith((".html", ".htm")):
        return "plotly-html"
    if importlib.util.find_spec("matplotlib") is not None:
        return "matplotlib"
    if importlib.util.find_spec("plotly") is not None and importlib.util.find_spec("kaleido") is not None:
        return "plotly"
    return None


def write_plot(report: pd.DataFrame, path: str | os.PathLike, title: str = "") -> str:
    """Draw the curves (hit rate against capacity, a panel per layer, a line per policy) to `path`:
    an interactive page for a .html path (plotly, the dashboard's figure), else a PNG (matplotlib,
    from `pip install "moescope[plot]"`, or plotly with kaleido). Returns the backend used. Raises
    RuntimeError when a PNG is asked for and neither is installed, ValueError for an empty report.
    """
    if report.empty:
        raise ValueError("nothing to plot: the report has no curves")
    backend = plot_backend(path)
    if backend is None:
        raise RuntimeError("no PNG written: a PNG needs matplotlib (pip install \"moescope[plot]\"); or give "
                           "--plot cache.html for an interactive page with what is installed; the table above "
                           "has the same numbers")
    if backend.startswith("plotly"):
        from moescope.dashboard.figures import cache_hit_figure

        figure = cache_hit_figure(report, title)
        if backend == "plotly-html":
            figure.write_html(os.fspath(path), include_plotlyjs=True)  # the page works offline
        else:
            figure.write_image(os.fspath(path), format="png")
        return backend
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    layers = sorted(report.layer.unique())
    columns = min(4, len(layers))
    rows = -(-len(layers) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.8 * rows), squeeze=False, sharey=True)
    for ax, layer in zip(axes.flat, layers):
        frame = report[report.layer == layer]
        for policy in POLICIES:
            line = frame[frame.policy == policy].sort_values("capacity")
            if not line.empty:
                ax.plot(line.capacity, 100 * line.hit_rate, marker="o", markersize=3, label=policy)
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("experts resident (C)", fontsize=8)
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(layers):]:
        ax.set_visible(False)
    axes[0][0].set_ylabel("hit rate (%)", fontsize=8)
    axes[0][0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png", dpi=120)
    plt.close(fig)
    return backend


def add_subcommands(subparsers) -> None:
    """`moescope whatif cache STORE [--run ID] [--layer L] [--tag k=v] [--capacity C[,C...]] [--plot FILE]`."""
    whatif = subparsers.add_parser("whatif", help=command_help("whatif"))
    kinds = whatif.add_subparsers(dest="whatif", metavar="WHAT")
    p = kinds.add_parser(
        "cache", help="expert-cache hit rate (LRU, LFU, Belady) for every number of resident experts",
        description="Replay a run's recorded routes through an expert cache of every size C from 1 to the "
                    "number of experts (or the sizes --capacity names), per layer, and print the hit rates of "
                    "LRU, LFU and the offline optimum (Belady). One pass per policy gives every size; the work "
                    "grows with tokens x min(experts, largest C). Needs routes: probe.attach(..., routes=True)."
                    "\n\nexamples:\n"
                    "  moescope whatif cache runs/demo --layer 1 --tag domain=prose --plot cache.html\n"
                    "  moescope whatif cache runs/demo --capacity 8,16,32\n"
                    "  moescope whatif cache runs/demo --format json | jq '.curves[] | select(.policy == \"lru\")'",
        epilog=store_epilog("moescope whatif cache STORE --layer 1"),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_arguments(p, what="the store given to moescope.attach(store=...): a folder or a URL "
                                "(s3://BUCKET/PREFIX, gs://..., az://...)")
    p.add_argument("--run", help="run id (default: the most recently started run)")
    p.add_argument("--layer", type=int, help="one MoE layer (default: every layer)")
    p.add_argument("--tag", action="append", default=[], metavar="K=V",
                   help="replay only the steps with this tag (repeatable: all must hold)")
    p.add_argument("--policy", action="append", choices=POLICIES,
                   help="a policy to replay (repeatable; default: all three)")
    p.add_argument("--capacity", action="append", metavar="C[,C...]",
                   help="experts resident per layer to replay: one number or a comma-separated list "
                        "(repeatable; default: every C from 1 to the layer's experts)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="replay at most this many tokens per layer, the first recorded "
                        f"(default {DEFAULT_MAX_TOKENS:,})")
    p.add_argument("--max-experts", type=int, default=MAX_EXPERTS,
                   help="refuse a layer with more routed experts than this (default "
                        f"{MAX_EXPERTS:,}; more usually means an expert id out of range in an import)")
    p.add_argument("--plot", metavar="FILE", help="also draw the curves to this file: FILE.html an interactive "
                   "page (works on any install), FILE.png an image (needs pip install \"moescope[plot]\")")
    add_format_argument(p)
    p.set_defaults(func=_cache)
    whatif.set_defaults(func=lambda args: whatif.print_help() or 2)


def _cache(args: argparse.Namespace) -> int:
    from moescope.ingest.importers.tables import parse_tags
    from moescope.store import Store

    tags = parse_tags(args.tag) or None
    capacities = _capacities(args.capacity)
    with Store(store_location(args)) as store:
        run_id = args.run or store.latest_run()
        report = cache_report(store, run_id, args.layer, tags, _policies(args.policy), args.max_tokens,
                              capacities, args.max_experts)
    from moescope.cli.output import notes, wants_json, whatif_cache_document, write_document

    if wants_json(args):
        write_document("whatif cache", whatif_cache_document(report, run_id, args.layer, tags))
    else:
        print(format_report(report, run_id, tags))
    if args.plot and not report.empty:
        try:
            backend = write_plot(report, args.plot, title=f"expert-cache hit rate, run {run_id}")
        except RuntimeError as error:
            print(f"moescope whatif cache: {error}", file=sys.stderr)
            return 1
        print(f"\nplot written to {args.plot} ({backend})", file=notes(args))
    return 0


def _policies(chosen: Sequence[str] | None) -> tuple[str, ...]:
    return tuple(dict.fromkeys(chosen)) if chosen else POLICIES


def _capacities(given: Sequence[str] | None) -> list[int] | None:
    """The --capacity values as numbers (None: every capacity). Raises ValueError for anything but
    whole numbers of at least 1."""
    if not given:
        return None
    capacities = []
    for part in (p.strip() for text in given for p in text.split(",")):
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"--capacity takes whole numbers of at least 1 (experts resident per layer), "
                             f"like --capacity 8 or --capacity 4,8,16; got {part!r}")
        capacities.append(int(part))
    return capacities
