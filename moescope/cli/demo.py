"""`moescope demo` and `moescope train-demo`: the demo story on the shipped model, and how that model is made."""

from __future__ import annotations

import argparse

from moescope.cli import command_help, program_name
from moescope.demo import story as demo
from moescope.demo import train as train_demo


def add_subcommands(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help=command_help("demo"),
        description=demo.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(p)
    p.set_defaults(func=lambda args: demo.run(args, program=program_name()))

    p = subparsers.add_parser(
        "train-demo", help=command_help("train-demo"),
        description="Train the small Mixtral-architecture demo model on text that ships with Python "
                    "(stdlib source, pydoc topics, generated arithmetic), reproducibly from a seed.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    train_demo.add_arguments(p)
    p.set_defaults(func=train_demo.run)
