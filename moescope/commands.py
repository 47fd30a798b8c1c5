"""The top-level subcommands that belong to no single package: demo, summary, train-demo."""

from __future__ import annotations

import argparse

from moescope.demo import story as demo
from moescope.demo import train as train_demo
from moescope.summary import format_summary


def _summary(args: argparse.Namespace) -> int:
    print(format_summary(args.store, args.run))
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
                    "given).\n\nexample:\n  moescope summary runs/demo",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", help="the store folder given to moescope.attach(store=...)")
    p.add_argument("--run", help="run id (default: the most recently started run)")
    p.set_defaults(func=_summary)

    p = subparsers.add_parser(
        "train-demo", help="retrain the shipped demo model from its seed (minutes on 2 CPU cores)",
        description="Train the small Mixtral-architecture demo model on text that ships with Python "
                    "(stdlib source, pydoc topics, generated arithmetic), reproducibly from a seed.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    train_demo.add_arguments(p)
    p.set_defaults(func=train_demo.run)
