"""How every command takes a store: a folder or a URL, `--storage-option KEY=VALUE`, `--state-dir`.

`summary`, `query`, `compact`, `prune`, `whatif`, `import`, `proxy`, `alerts run` and `dashboard` all
take a store the same way: `add_store_arguments(parser)` adds `--store STORE`, which every command
takes, and where the store is the command's only path also a positional STORE (`moescope summary
runs/` and `moescope summary --store runs/` are the same; `import` and `proxy` take files and
URLs as positionals, so only `--store`), and `--storage-option`; `store_location(args)` turns
them into the one `StoreLocation` the command passes on, and `store_epilog(example)` is the help
text that teaches the URL form.

The validators every command's options share are here too (`type=` for argparse: a bad value is a
usage error, exit status 2, before anything is opened): `positive_int`, `positive_number`,
`retention_hours`, `age_seconds` and `run_id`; and every analysis command's `--format table|json`
(`add_format_argument`; the document is `moescope.cli.output`'s).

State that cannot live on object storage (the alerts outbox, a SQLite file) stays beside a local
store, under `<store>/.moescope/`, as it always has; for a URL store it goes to a local folder,
`--state-dir`, by default `~/.cache/moescope/<hash of the redacted URL>` (`state_dir` and
`make_state_dir`, which live with the store's location in `moescope.store.location`).
"""

from __future__ import annotations

import argparse

from moescope.store.location import StoreLocation, open_location

STORE_HELP = "the store: a local folder, or a URL (s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, az://CONTAINER/PREFIX)"


def store_epilog(example: str) -> str:
    """Help text on the URL form, with `example` (a command line with STORE in the place of the store)."""
    url = example.replace("STORE", "s3://moe-runs/fleet")
    return (
        "a store on object storage:\n"
        "  STORE may be s3://BUCKET/PREFIX (AWS S3; MinIO, Ceph, R2 through endpoint), gs://BUCKET/PREFIX or\n"
        "  az://CONTAINER/PREFIX. Credentials come from the environment only (AWS_ACCESS_KEY_ID and\n"
        "  AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance role; GOOGLE_APPLICATION_CREDENTIALS; AZURE_STORAGE_*),\n"
        "  never from an option; what is not a secret goes in --storage-option KEY=VALUE (repeatable): endpoint,\n"
        "  region, allow_http, force_path_style, max_retries, timeout.\n"
        "example, a MinIO server on this machine:\n"
        "  export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...\n"
        f"  {url} \\\n"
        "      --storage-option endpoint=http://127.0.0.1:9000 --storage-option allow_http=true \\\n"
        "      --storage-option region=us-east-1\n")


def add_store_arguments(parser: argparse.ArgumentParser, *, option: bool = False, required: bool = True,
                        what: str = STORE_HELP, state_dir: bool = False, followed_by_positionals: bool = False) -> None:
    """Add the store (a positional STORE and `--store`, or only `--store` with `option`),
    `--storage-option KEY=VALUE` (repeatable, `args.storage_option`) and, with `state_dir`,
    `--state-dir DIR` (`args.state_dir`). `followed_by_positionals`: the command takes more
    positionals after STORE (query's SQL); its parser then reads options before positionals, so that
    `query STORE --format json SQL` and `query --store STORE SQL` both parse."""
    if option:
        parser.add_argument("--store", required=required, metavar="STORE", help=what)
    else:
        parser.add_argument("store", metavar="STORE", nargs="?", action=_StoreAction, help=what)
        if followed_by_positionals:
            parser.__class__ = _OptionsFirstParser
        parser.add_argument("--store", dest="store", metavar="STORE", action=_StoreAction,
                            help="the same as STORE (every command takes --store)")
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option to reach a store on object storage (repeatable), e.g. "
                             "endpoint=http://127.0.0.1:9000, region=us-east-1, allow_http=true; never a secret: "
                             "credentials come from the environment")
    if state_dir:
        parser.add_argument("--state-dir", metavar="DIR",
                            help="local folder for state that cannot live on object storage (the alerts outbox); "
                                 "default STORE/.moescope for a local store, ~/.cache/moescope/<hash of the URL> "
                                 "for a URL")


class _OptionsFirstParser(argparse.ArgumentParser):
    """A (sub)parser that takes every option first and then the positionals from what is left
    (argparse's intermixed parsing): an optional STORE before a required positional otherwise takes
    the wrong word once an option sits between them."""

    _intermixed = False

    def parse_known_args(self, args=None, namespace=None):
        if self._intermixed:  # parse_known_intermixed_args calls back here for each of its two passes
            return super().parse_known_args(args, namespace)
        self._intermixed = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixed = False


class _StoreAction(argparse.Action):
    """The store as a positional STORE or `--store STORE`, into one `args.store`: an absent positional
    leaves a `--store` value alone, and two different stores are an error."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None:  # the positional, not given
            return
        current = getattr(namespace, self.dest, None)
        if current is not None and current != values:
            parser.error(f"the store is given twice ({current!r} and {values!r}): give it once, as STORE or --store")
        setattr(namespace, self.dest, values)


def store_location(args: argparse.Namespace) -> StoreLocation:
    """The command's store as a `StoreLocation`. Raises LocationError (a ValueError: the command line
    prints it) for an unsupported scheme, a secret among the options, or options for a local folder,
    and ValueError when no store was given."""
    if getattr(args, "store", None) is None:
        raise ValueError("no store given: name it as STORE or --store STORE (a folder or a URL)")
    return open_location(args.store, getattr(args, "storage_option", None) or None)


def positive_int(text: str) -> int:
    """A whole number of at least 1 (`--max-queue`, `--max-connections`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive whole number")
    return value


def positive_number(text: str) -> float:
    """A finite number above 0 (timeouts in seconds, sizes in MiB)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number, e.g. 10 or 0.5") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number, e.g. 10 or 0.5")
    return value


def retention_hours(text: str) -> float:
    """`--retention`: hours a removed file stays on the storage; 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of hours, e.g. 1 or 0.5") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"the retention cannot be negative ({text})")
    return value


def age_seconds(text: str) -> float:
    """`--older-than`: an age such as 90s, 30m, 12h, 7d or 2w, in seconds (`store.compact.parse_age`)."""
    from moescope.store.compact import parse_age

    try:
        return parse_age(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run_id(text: str) -> str:
    """A run id that can be part of a store path (`store.naming.NAME_FORM`)."""
    from moescope.store.naming import InvalidNameError, check_name

    try:
        return check_name("run_id", text)
    except InvalidNameError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


FORMAT_HELP = ("table (default): for a person; json: one JSON document on stdout for a program (notes and "
               "progress go to stderr; its keys and units: the manual's Reference > Machine-readable output), "
               "e.g. --format json | jq")


def add_format_argument(parser: argparse.ArgumentParser) -> None:
    """`--format {table,json}` (`args.format`, default table): what an analysis command prints."""
    parser.add_argument("--format", choices=("table", "json"), default="table", help=FORMAT_HELP)
