"""`moescope compact`, `prune`, `query`, `store upgrade` and `store check`: the store's subcommands.

`moescope/cli/__init__.py` calls `add_subcommands(subparsers)`; each subcommand sets `func(args) -> int`
(the exit status) on its parser. A store that cannot be read or written raises: `main` prints the
message on one line and exits 1; a bad option value is argparse's usage error (exit 2).
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import TYPE_CHECKING

from moescope.cli import command_help
from moescope.cli.arguments import (
    add_store_arguments,
    age_seconds,
    retention_hours,
    run_id,
    store_epilog,
    store_location,
)

if TYPE_CHECKING:  # pandas and pyarrow are imported where `query` needs them: `compact` starts without them
    import pandas as pd
    import pyarrow as pa

COMPACT_HELP = """\
Merge a store's small Parquet files into large sorted ones.

Every writer (process, rank) adds a file per table per flush, so a run of a few days leaves tens
of thousands of small files and queries slow down. Compaction merges the small files of each run
into files of up to 8 Mi rows sorted by (layer, step), each swap one Delta commit, and is safe to
run while the model is still writing and the dashboard is reading: readers never see a row twice
or miss one, and two compactions at once never both merge the same files. The merged-away files
stay on the storage for --retention hours (readers holding an older version still read them),
then this command (or prune) deletes them.

What it costs: every small file is read once and the merged files written once; per table and
run a handful of requests to the Delta log (a listing, a commit).

example:  moescope compact runs/            (every run)
          moescope compact runs/ --run 20250101T120000-ab12cd34
"""

PRUNE_HELP = """\
Delete runs whose newest file was committed longer ago than a given age.

A run still being written keeps committing files, so it is never pruned. Use --dry-run to see
which runs would go. Pruning removes the runs' files from every table (one Delta commit per
table): from then on no reader sees them. The files themselves are deleted by vacuum once they
were removed more than --retention hours ago (default 1): a reader (the dashboard, a running
query, a Spark job) holding a version from before the prune keeps reading them until then. A
shorter retention frees the storage sooner but can pull files from under such a reader.

What it costs: reading each table's Delta log (a listing and a few reads per table), one commit
per table holding a pruned run, and a vacuum per table (a listing of the log; one delete request
per file older than the retention). The storage shrinks only when a prune or compact runs after
the retention has passed. Files in the quarantine folder are left for you to look at.

example:  moescope prune runs/ --older-than 7d --dry-run
          moescope prune runs/ --older-than 12h
          moescope prune s3://moe-runs/fleet --older-than 30d --retention 24
"""

UPGRADE_HELP = """\
Convert a store written by a release before Delta tables, in place.

Earlier releases kept each table as folders of Parquet files with their own bookkeeping; this
release reads and writes Delta Lake tables and refuses such a store until it is converted. The
upgrade keeps exactly what the earlier readers read: each table's live files (a merged file's
sources are left out and deleted, unfinished writes deleted) are rewritten as the files of a Delta
table and committed; bad files go to _quarantine/ with their reason. The earlier _quarantine/
moves, as it is, to _previous-release/quarantine/. Query answers stay the same.

Stop every process that writes the store first. The upgrade reads and writes every file once; if
it is interrupted, run it again: it finishes or restarts the table it was on.

example:  moescope store upgrade runs/
"""

QUERY_HELP = """\
Run SQL over a store and print the result as a table.

Each table of the store is a view of the same name: runs, layers, steps, layer_steps, routes,
router_logits, router_inputs, kv_cache, probe_stats (and alerts, when rules have fired). Use
DuckDB SQL; lists (expert_load, expert_ids) can be unnested, maps read with tags['key'].

example:  moescope query runs/ "SELECT run_id, count(*) AS steps FROM steps GROUP BY run_id"
          moescope query runs/ "SELECT layer, unnest(expert_load) AS load FROM layer_steps LIMIT 8"
"""


CHECK_HELP = """\
Check every file of a store now: its footer, then every page against its checksum.

A reader checks a file when a query first reads its table, so the first answer waits only for
the files it reads; a file no query read stays unchecked until one does. This checks them all
(each read once), quarantines a bad one as a reader does (copied to STORE/_quarantine, taken out
of its table, its rows counted as lost in probe_stats), and exits 1 when a file was bad or skipped.
"""


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Register compact, prune, query and store (upgrade, check) on the moescope command's subparsers."""
    raw = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser("compact", help=command_help("compact"),
                              description=COMPACT_HELP, formatter_class=raw,
                              epilog=store_epilog("moescope compact STORE"))
    add_store_arguments(p)
    p.add_argument("--run", type=run_id, help="only this run id (default: every run)")
    p.add_argument("--target-size", type=_size, default=None, metavar="SIZE",
                   help="size a merged file grows to; files at or above it are left alone and not read "
                        "(default 128MiB; e.g. 64MiB, 1GB)")
    _add_retention(p)
    p.set_defaults(func=_compact)

    p = subparsers.add_parser("prune", help=command_help("prune"),
                              description=PRUNE_HELP, formatter_class=raw,
                              epilog=store_epilog("moescope prune STORE --older-than 7d --dry-run"))
    add_store_arguments(p)
    p.add_argument("--older-than", type=age_seconds, required=True,
                   help="age of a run's newest file: 90s, 30m, 12h, 7d, 2w")
    p.add_argument("--dry-run", action="store_true", help="list the runs that would be deleted, delete nothing")
    _add_retention(p)
    p.set_defaults(func=_prune)

    p = subparsers.add_parser("query", help=command_help("query"),
                              description=QUERY_HELP, formatter_class=raw,
                              epilog=store_epilog('moescope query STORE "SELECT count(*) FROM steps"'))
    add_store_arguments(p, followed_by_positionals=True)
    p.add_argument("sql", help="the query (DuckDB SQL over the store's views)")
    p.add_argument("--max-rows", type=int, default=100, help="rows to print at most (default 100)")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table", help="output format")
    p.set_defaults(func=_query)


    p = subparsers.add_parser("store", help=command_help("store"),
                              description="Maintenance of a store.", formatter_class=raw)
    actions = p.add_subparsers(dest="store_command", metavar="ACTION")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    u = actions.add_parser("upgrade", help="convert a store of an earlier release to Delta tables, in place",
                           description=UPGRADE_HELP, formatter_class=raw)
    u.add_argument("path", metavar="PATH", help="the store folder")
    u.set_defaults(func=_upgrade, command_name=u.prog)  # messages say `moescope store upgrade: ...`
    c = actions.add_parser("check", help="check every file of a store now: footers and page checksums",
                           description=CHECK_HELP, formatter_class=raw,
                           epilog=store_epilog("moescope store check STORE"))
    add_store_arguments(c)
    c.add_argument("--table", action="append", metavar="TABLE",
                   help="only this table (repeatable; default every table)")
    c.set_defaults(func=_check_files)


def _add_retention(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--retention", type=retention_hours, default=1.0, metavar="HOURS",
                        help="hours a removed file stays on the storage before it is deleted, so readers holding an "
                             "older version keep working (default 1)")


def _size(text: str) -> int:
    """`--target-size`: bytes, or a number and a unit (`store.compact.parse_size`)."""
    from moescope.store.compact import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _compact(args: argparse.Namespace) -> int:
    from moescope.store.compact import DEFAULT_TARGET_SIZE, CompactIO, compact

    results = compact(store_location(args), run_id=args.run, retention_hours=args.retention,
                      target_size=args.target_size or DEFAULT_TARGET_SIZE)
    merged = [r for r in results if r.merged_files]
    for r in merged:
        print(f"{r.table:<14} run {r.run_id}: {r.merged_files} files -> {len(r.written_files)} ({r.rows} rows; "
              f"{r.io})")
    if not merged:
        print(f"nothing to compact in {store_location(args).redacted}")
    total = sum((r.io for r in results), CompactIO())
    left_alone = sum(r.left_alone for r in results)
    print(f"data files: {total}; {left_alone} at or above the target size left alone "
          "(the Delta log's own reads and commits not counted)")
    return 0


def _prune(args: argparse.Namespace) -> int:
    from moescope.store.compact import prune

    runs = prune(store_location(args), args.older_than, dry_run=args.dry_run, retention_hours=args.retention)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(runs)} run(s)" + "".join(f"\n  {r}" for r in runs))
    return 0


def _query(args: argparse.Namespace) -> int:
    from moescope.store import Store

    with Store(store_location(args)) as store:  # a missing store (EmptyStoreError) too: exit 1, as every command
        result = store.arrow(args.sql)
    frame = _printable(_displayed(result))
    if args.format == "csv":
        frame.head(args.max_rows).to_csv(sys.stdout, index=False)
    elif args.format == "json":
        print(frame.head(args.max_rows).to_json(orient="records", date_format="iso"))
    else:
        if frame.empty:
            print("(no rows)" if len(frame.columns) else "no data yet")
        else:
            import pandas as pd

            with pd.option_context("display.max_columns", None, "display.width", 200):
                print(frame.head(args.max_rows).to_string(index=False))
        if len(frame) > args.max_rows:
            print(f"... {len(frame) - args.max_rows} more rows (use --max-rows)")
    return 0


def _displayed(result: pa.Table) -> pd.DataFrame:
    """The query's result as a frame that prints each value as its SQL type has it: an integer as an
    integer. DuckDB sums integers into HUGEINT (a DECIMAL(38,0) in Arrow), which pandas would turn
    into float64 (175616.0), and integer columns holding NULLs would become floats too. Here every
    integer column, a decimal of scale 0 included, is a nullable integer column (Python ints past
    int64); other decimals are floats, maps dicts, and a repeated column name gets a suffix (a, a_1),
    as in DuckDB's own frames. The values are the query's: only their display changes."""
    import pyarrow as pa

    columns, wide = [], []
    for i, column in enumerate(result.columns):
        if pa.types.is_decimal(column.type) and column.type.scale == 0:
            try:
                column = column.cast(pa.int64())  # a safe cast: it raises rather than wraps
            except pa.ArrowInvalid:
                wide.append(i)
        elif pa.types.is_decimal(column.type):
            column = column.cast(pa.float64())
        columns.append(column)
    frame = pa.Table.from_arrays(columns, names=_unique(result.column_names)).to_pandas(
        types_mapper=_nullable().get, maps_as_pydicts="strict")
    for i in wide:  # past int64: Python ints, every digit (a Decimal would be a string in JSON)
        frame.isetitem(i, frame.iloc[:, i].map(int, na_action="ignore"))
    return frame


def _unique(names: list[str]) -> list[str]:
    used: set[str] = set()
    unique = []
    for name in names:
        candidate, n = name, 0
        while candidate in used:
            n += 1
            candidate = f"{name}_{n}"
        used.add(candidate)
        unique.append(candidate)
    return unique


@functools.cache
def _nullable() -> dict:
    """Arrow's integer and boolean types -> pandas' nullable dtypes (`_displayed`'s types_mapper)."""
    import pandas as pd
    import pyarrow as pa

    return {pa.int8(): pd.Int8Dtype(), pa.int16(): pd.Int16Dtype(), pa.int32(): pd.Int32Dtype(),
            pa.int64(): pd.Int64Dtype(), pa.uint8(): pd.UInt8Dtype(), pa.uint16(): pd.UInt16Dtype(),
            pa.uint32(): pd.UInt32Dtype(), pa.uint64(): pd.UInt64Dtype(), pa.bool_(): pd.BooleanDtype()}


def _printable(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with every string (in a cell, in a cell's lists and maps, and the column names)
    through `escape_control`: a store written before control characters were refused at the door
    (or by anything else) cannot clear the screen or rewrite a line of the terminal this prints to."""
    import pandas as pd

    from moescope.store.text import escape_control

    def escape(value):
        if isinstance(value, str):
            return escape_control(value)
        if isinstance(value, dict):
            return {escape(k): escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [escape(v) for v in value]
        if hasattr(value, "dtype") and pd.api.types.is_object_dtype(value.dtype):  # arrays of strings or maps
            return [escape(v) for v in value]
        return value

    out = frame.copy()
    out.columns = [escape_control(str(c)) for c in frame.columns]
    for i, dtype in enumerate(frame.dtypes):
        if pd.api.types.is_object_dtype(dtype) or pd.api.types.is_string_dtype(dtype):
            out.isetitem(i, frame.iloc[:, i].map(escape, na_action="ignore"))
    return out


def _check_files(args: argparse.Namespace) -> int:
    import warnings

    from moescope.store import BadFileWarning, Store

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BadFileWarning)
        with Store(store_location(args)) as store:
            checked = store.check_files(args.table)
            quarantined = list(store.catalog.quarantined_now)
    for table, files in checked.items():
        if files:
            print(f"{table:<24} {len(files)} file(s), {sum(info.rows for info in files)} rows checked")
    for warning in caught:
        print(str(warning.message), file=sys.stderr)
    print(f"{len(quarantined)} bad file(s) moved to _quarantine now" if quarantined else "every file holds")
    return 1 if caught else 0


def _upgrade(args: argparse.Namespace) -> int:
    from moescope.store.errors import EmptyStoreError
    from moescope.store.upgrade import upgrade

    try:
        report = upgrade(args.path)
    except EmptyStoreError as e:  # no store at PATH: the command was given the wrong folder
        print(f"{args.command_name}: {e}", file=sys.stderr)
        return 2
    if not report.upgraded:
        print(f"{args.path} holds no table of an earlier release: nothing to upgrade")
        return 0
    for t in report.tables:
        extra = "".join([f", {t.replaced} merged-away file(s) deleted" if t.replaced else "",
                         f", {len(t.bad)} bad file(s) moved to _quarantine" if t.bad else "",
                         f", {t.in_flight} unfinished write(s) deleted" if t.in_flight else ""])
        print(f"{t.table:<24} {t.files} file(s), {t.rows} rows -> Delta version {t.version}{extra}")
    for path in report.moved_aside:
        print(f"moved aside as it was: {path}")
    return 0
