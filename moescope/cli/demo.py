"""The top-level subcommands that belong to no single package: demo, summary, train-demo."""

from __future__ import annotations

import argparse

from moescope.cli.arguments import add_store_arguments, store_epilog, store_location
from moescope.cli.summary import format_summary
from moescope.demo import story as demo
from moescope.demo import train as train_demo


def _summary(args: argparse.Namespace) -> int:
    print(format_summary(store_location(args), args.run))
    return 0


def add_subcommands(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="record a demo run on a small MoE model and print what moescope saw",
        description=demo.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)

    p = subparsers.add_parser(
        "summary", help="per-layer load spread, entropy, drops and active fraction of a run",
        description="Print a per-layer summary of one run in a store (the latest unless --run is "
                    "given); a run recorded by several hosts also gets a per-host table.\n\nexample:\n"
                    "  moescope summary runs/demo",
        epilog=store_epilog("moescope summary STORE"), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_arguments(p, what="the store given to moescope.attach(store=...): a folder or a URL "
                                "(s3://BUCKET/PREFIX, gs://..., az://...)")
    p.add_argument("--run", help="run id (default: the most recently started run)")
    p.set_defaults(func=_summary)

    p = subparsers.add_parser(
        "train-demo", help="retrain the shipped demo model from its seed (minutes on 2 CPU cores)",
        description="Train the small Mixtral-architecture demo model on text that ships with Python "
                    "(stdlib source, pydoc topics, generated arithmetic), reproducibly from a seed.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    train_demo.add_arguments(p)
    p.set_defaults(func=train_demo.run)
