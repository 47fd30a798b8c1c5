"""How the dashboard was started: store (a folder or a URL) and how to reach it, write permission,
tokenizer, refresh interval, local state folder.

`moescope dashboard` passes these to the Streamlit script as environment variables (they reach
every rerun and every page, and tests set them the same way). Run by hand, the script also takes
them as arguments after `--`: `streamlit run dashboard/app.py -- STORE [--allow-writes]
[--storage-option KEY=VALUE]`. Storage options hold no secret (`store.location` refuses one):
credentials reach the store's libraries through the environment chain, never through these.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from moescope.store.location import StoreLocation, open_location, parse_storage_options

ENV_STORE = "MOESCOPE_DASHBOARD_STORE"
ENV_STORAGE_OPTIONS = "MOESCOPE_DASHBOARD_STORAGE_OPTIONS"  # a JSON object
ENV_STATE_DIR = "MOESCOPE_DASHBOARD_STATE_DIR"
ENV_ALLOW_WRITES = "MOESCOPE_DASHBOARD_ALLOW_WRITES"
ENV_TOKENIZER = "MOESCOPE_DASHBOARD_TOKENIZER"
ENV_REFRESH_S = "MOESCOPE_DASHBOARD_REFRESH_S"

DEFAULT_REFRESH_S = 5.0


@dataclass(frozen=True)
class Settings:
    store: str
    allow_writes: bool = False
    tokenizer: str | None = None
    refresh_s: float = DEFAULT_REFRESH_S
    storage_options: Mapping[str, str] = field(default_factory=dict)
    state_dir: str | None = None

    @property
    def location(self) -> StoreLocation:
        """The store as every reader takes it. Raises LocationError for a URL or options that cannot be used."""
        return open_location(self.store, self.storage_options or None)

    def env(self) -> dict[str, str]:
        """These settings as the environment variables `load` reads."""
        out = {ENV_STORE: self.location.url, ENV_ALLOW_WRITES: "1" if self.allow_writes else "0",
               ENV_REFRESH_S: str(self.refresh_s)}
        if self.storage_options:
            out[ENV_STORAGE_OPTIONS] = json.dumps(dict(self.storage_options), sort_keys=True)
        if self.state_dir:
            out[ENV_STATE_DIR] = os.path.abspath(self.state_dir)
        if self.tokenizer:
            out[ENV_TOKENIZER] = os.path.abspath(self.tokenizer)
        return out


def script_arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dashboard/app.py", add_help=False)
    parser.add_argument("store")
    parser.add_argument("--storage-option", action="append", default=[])
    parser.add_argument("--state-dir")
    parser.add_argument("--allow-writes", action="store_true")
    parser.add_argument("--tokenizer")
    parser.add_argument("--refresh-s", type=float, default=DEFAULT_REFRESH_S)
    return parser


def load(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> Settings | None:
    """Settings from the environment, else from script arguments; None when neither names a store."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_STORE):
        return Settings(store=environ[ENV_STORE],
                        allow_writes=environ.get(ENV_ALLOW_WRITES, "0").lower() in ("1", "true", "yes"),
                        tokenizer=environ.get(ENV_TOKENIZER) or None,
                        refresh_s=float(environ.get(ENV_REFRESH_S) or DEFAULT_REFRESH_S),
                        storage_options=parse_storage_options(json.loads(environ.get(ENV_STORAGE_OPTIONS) or "{}")),
                        state_dir=environ.get(ENV_STATE_DIR) or None)
    if argv:
        args, _ = script_arguments().parse_known_args(list(argv))
        return Settings(store=args.store, allow_writes=args.allow_writes, tokenizer=args.tokenizer,
                        refresh_s=args.refresh_s, storage_options=parse_storage_options(args.storage_option),
                        state_dir=args.state_dir)
    return None


def current() -> Settings | None:
    """The settings of this Streamlit process: its environment, else the script's arguments."""
    return load(argv=sys.argv[1:] if sys.argv and sys.argv[0].endswith("app.py") else None)


def location_of(root: str | os.PathLike | StoreLocation) -> StoreLocation:
    """The store at `root` (a page's `ctx.root`: a folder or a URL) with the storage options the
    dashboard was started with when it is the dashboard's store, else as `open_location` reads it."""
    if isinstance(root, StoreLocation):
        return root
    conf = current()
    if conf is not None:
        location = conf.location
        if location.url == os.fspath(root):
            return location
    return open_location(root)
