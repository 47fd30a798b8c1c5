"""`moescope compact`, `moescope prune`, `moescope query`: the store's subcommands.

`moescope/cli.py` (the lead's) calls `add_subcommands(subparsers)`; each subcommand sets
`func(args) -> int` (the exit status) on its parser.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from moescope.store_arguments import add_store_arguments, store_epilog, store_location

COMPACT_HELP = """\
Merge a store's small Parquet files into large sorted ones.

Every writer (process, rank) adds a file per table per flush interval, so a run of a few days
leaves tens of thousands of small files and queries slow down. Compaction merges the small files
of each run into files of up to 8 Mi rows sorted by (layer, step), and is safe to run while the
model is still writing and the dashboard is reading: readers never see a row twice or miss one.
Temporary files left by crashed writers (older than 15 minutes) are removed too.

example:  moescope compact runs/            (every run)
          moescope compact runs/ --run 20250101T120000-ab12cd34
"""

PRUNE_HELP = """\
Delete runs whose newest file is older than a given age.

A run still being written keeps getting new files, so it is never pruned. Use --dry-run to see
which runs would go. Files in the quarantine folder are left for you to look at.

example:  moescope prune runs/ --older-than 7d --dry-run
          moescope prune runs/ --older-than 12h
"""

QUERY_HELP = """\
Run SQL over a store and print the result as a table.

Each table of the store is a view of the same name: runs, layers, steps, layer_steps, routes,
router_logits, router_inputs, kv_cache, probe_stats (and alerts, when rules have fired). Use
DuckDB SQL; lists (expert_load, expert_ids) can be unnested, maps read with tags['key'].

example:  moescope query runs/ "SELECT run_id, count(*) AS steps FROM steps GROUP BY run_id"
          moescope query runs/ "SELECT layer, unnest(expert_load) AS load FROM layer_steps LIMIT 8"
"""


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Register compact, prune and query on the moescope command's subparsers."""
    raw = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser("compact", help="merge a store's small files (safe while writing)",
                              description=COMPACT_HELP, formatter_class=raw,
                              epilog=store_epilog("moescope compact STORE"))
    add_store_arguments(p)
    p.add_argument("--run", help="only this run id (default: every run)")
    p.add_argument("--grace", type=float, default=2.0,
                   help="seconds between publishing a merged file and deleting its sources (default 2)")
    p.set_defaults(func=_compact)

    p = subparsers.add_parser("prune", help="delete runs older than an age",
                              description=PRUNE_HELP, formatter_class=raw,
                              epilog=store_epilog("moescope prune STORE --older-than 7d --dry-run"))
    add_store_arguments(p)
    p.add_argument("--older-than", required=True, help="age of a run's newest file: 90s, 30m, 12h, 7d, 2w")
    p.add_argument("--dry-run", action="store_true", help="list the runs that would be deleted, delete nothing")
    p.set_defaults(func=_prune)

    p = subparsers.add_parser("query", help="run SQL over a store and print a table",
                              description=QUERY_HELP, formatter_class=raw,
                              epilog=store_epilog('moescope query STORE "SELECT count(*) FROM steps"'))
    add_store_arguments(p)
    p.add_argument("sql", help="the query (DuckDB SQL over the store's views)")
    p.add_argument("--max-rows", type=int, default=100, help="rows to print at most (default 100)")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table", help="output format")
    p.set_defaults(func=_query)


def _compact(args: argparse.Namespace) -> int:
    from moescope.store.compact import compact
    from moescope.store.layout import InvalidNameError

    try:
        results = compact(store_location(args), run_id=args.run, grace_s=args.grace)
    except InvalidNameError as e:
        print(f"moescope compact: {e}", file=sys.stderr)
        return 2
    merged = [r for r in results if r.merged_files]
    for r in merged:
        print(f"{r.table:<14} run {r.run_id}: {r.merged_files} files -> {len(r.written_files)} ({r.rows} rows)")
    if not merged:
        print(f"nothing to compact in {store_location(args).redacted}")
    return 0


def _prune(args: argparse.Namespace) -> int:
    from moescope.store.compact import parse_age, prune

    try:
        age = parse_age(args.older_than)
    except ValueError as e:
        print(f"moescope prune: {e}", file=sys.stderr)
        return 2
    runs = prune(store_location(args), age, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(runs)} run(s)" + "".join(f"\n  {r}" for r in runs))
    return 0


def _query(args: argparse.Namespace) -> int:
    from moescope.store import EmptyStoreError, Store, StoreError

    try:
        with Store(store_location(args)) as store:
            frame = store.sql(args.sql)
    except EmptyStoreError as e:
        print(str(e))
        return 0
    except StoreError as e:
        print(f"moescope query: {e}", file=sys.stderr)
        return 1
    if args.format == "csv":
        frame.head(args.max_rows).to_csv(sys.stdout, index=False)
    elif args.format == "json":
        print(frame.head(args.max_rows).to_json(orient="records", date_format="iso"))
    else:
        if frame.empty:
            print("(no rows)" if len(frame.columns) else "no data yet")
        else:
            with pd.option_context("display.max_columns", None, "display.width", 200):
                print(frame.head(args.max_rows).to_string(index=False))
        if len(frame) > args.max_rows:
            print(f"... {len(frame) - args.max_rows} more rows (use --max-rows)")
    return 0
