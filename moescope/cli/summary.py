"""`moescope summary STORE`: prints the per-layer summary of one run (`moescope.analyses.summary`).

The report itself lives in the analyses room, where the demo reads it too; `format_summary`,
`layer_rows`, `host_rows` and `store_arguments` are still found here.
"""

from __future__ import annotations

import argparse

from moescope.analyses.summary import (
    format_report,
    format_summary,
    host_rows,
    layer_rows,
    store_arguments,
    summary_report,
)
from moescope.cli import command_help, program_name
from moescope.cli.arguments import add_format_argument, add_store_arguments, store_epilog, store_location

__all__ = ["add_subcommands", "format_summary", "host_rows", "layer_rows", "store_arguments"]


def _summary_command(args: argparse.Namespace) -> int:
    from moescope.cli.output import summary_document, wants_json, write_document
    from moescope.store import Store

    location = store_location(args)
    with Store(location) as store:
        report = summary_report(store, store.check_run(args.run))
    if wants_json(args):
        write_document("summary", summary_document(report))
    else:
        print(format_report(report, location, program=program_name()))
    return 0


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "summary", help=command_help("summary"),
        description="Print a per-layer summary of one run in a store (the latest unless --run is "
                    "given); a run recorded by several hosts also gets a per-host table.\n\nexamples:\n"
                    "  moescope summary runs/demo\n"
                    "  moescope summary runs/demo --format json | jq '.layers[] | {layer, load_cv}'",
        epilog=store_epilog("moescope summary STORE"), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_store_arguments(p, what="the store given to moescope.attach(store=...): a folder or a URL "
                                "(s3://BUCKET/PREFIX, gs://..., az://...)")
    p.add_argument("--run", help="run id (default: the most recently started run)")
    add_format_argument(p)
    p.set_defaults(func=_summary_command)

