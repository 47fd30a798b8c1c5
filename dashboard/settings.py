"""How the dashboard was started: store folder, write permission, tokenizer, refresh interval.

`moescope dashboard` passes these to the Streamlit script as environment variables (they reach
every rerun and every page, and tests set them the same way). Run by hand, the script also takes
them as arguments after `--`: `streamlit run dashboard/app.py -- STORE [--allow-writes]`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ENV_STORE = "MOESCOPE_DASHBOARD_STORE"
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

    def env(self) -> dict[str, str]:
        """These settings as the environment variables `load` reads."""
        out = {ENV_STORE: os.path.abspath(self.store), ENV_ALLOW_WRITES: "1" if self.allow_writes else "0",
               ENV_REFRESH_S: str(self.refresh_s)}
        if self.tokenizer:
            out[ENV_TOKENIZER] = os.path.abspath(self.tokenizer)
        return out


def script_arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dashboard/app.py", add_help=False)
    parser.add_argument("store")
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
                        refresh_s=float(environ.get(ENV_REFRESH_S) or DEFAULT_REFRESH_S))
    if argv:
        args, _ = script_arguments().parse_known_args(list(argv))
        return Settings(store=args.store, allow_writes=args.allow_writes, tokenizer=args.tokenizer,
                        refresh_s=args.refresh_s)
    return None
