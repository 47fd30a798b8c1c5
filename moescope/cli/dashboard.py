"""`moescope dashboard STORE`: start the Streamlit dashboard over a store.

`add_subcommands(subparsers)` registers the subcommand on moescope's command line; `python -m
moescope.cli.dashboard STORE` runs it alone. The app runs as a `streamlit run` subprocess (headless, no
usage statistics, bound to --host) and gets the store and flags through environment variables
(see `dashboard.settings`). SIGTERM, SIGHUP or Ctrl-C sent to this process stop that child, and the
command exits 0 only once the child is gone (`moescope.core.lifecycle`: a second signal, or a child that
outlives --grace-period, kills it).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

from moescope import dashboard as dashboard_package
from moescope.cli import command_help
from moescope.cli.arguments import add_store_arguments, store_epilog, store_location
from moescope.core.lifecycle import GracefulStop, add_grace_period_argument
from moescope.dashboard.settings import DEFAULT_REFRESH_S, Settings
from moescope.store.location import parse_storage_options

# the app Streamlit runs by path: the dashboard package's entry file (dashboard/app.py), not a file beside this one
APP = os.path.join(os.path.dirname(os.path.abspath(dashboard_package.__file__)), "app.py")
# Ctrl-C also reaches the child from the terminal itself; the SIGTERM this command sends it then is harmless
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

DESCRIPTION = """\
Open a store in the browser: run overview and the active-parameter fraction, load heatmaps
(click a cell to see which tokens went to that expert), UMAP clusters of router inputs, drift
against a baseline with the alert history, expert health and the trust gate, and run or tag
comparisons. Works on a finished store and on one still being written (live refresh).

The dashboard only reads the store, unless --allow-writes is given: then the Expert health
page offers a manual trust-gate control, which writes requests into the store's
trust_gate_requests table for the model-side trust policy to apply.
"""

EPILOG = """\
examples:
  moescope dashboard runs/demo                       # http://127.0.0.1:8501
  moescope dashboard runs/demo --port 8600 --tokenizer moescope/demo/model
  moescope dashboard /data/store --host 0.0.0.0      # reachable from other machines: mind who can

""" + store_epilog("moescope dashboard STORE")


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_store_arguments(parser, what="the store given to moescope.attach(store=...): a folder or a URL "
                                     "(s3://BUCKET/PREFIX, gs://..., az://...)", state_dir=True)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8501, help="port to listen on (default 8501)")
    parser.add_argument("--wait", action="store_true",
                        help="serve a local store that does not exist yet, waiting for its first run (without "
                             "it, a missing store is an error, as for every command)")
    parser.add_argument("--allow-writes", action="store_true",
                        help="show the manual trust-gate control (writes gate requests into the store)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="local tokenizer folder (transformers.AutoTokenizer, never downloaded) to show "
                             "token text instead of ids, e.g. moescope/demo/model")
    parser.add_argument("--refresh-s", type=float, default=DEFAULT_REFRESH_S,
                        help=f"how often live refresh checks for new data (default {DEFAULT_REFRESH_S:g} s)")
    add_grace_period_argument(parser, "or SIGHUP, stop the server within this many seconds and exit 0; one still "
                                      "running then is killed and the command exits 1")
    parser.set_defaults(func=run)
    return parser


def add_subcommands(subparsers) -> None:
    """Register `dashboard STORE [--storage-option K=V] [--state-dir DIR] [--host] [--port] [--allow-writes]
    [--tokenizer PATH]`."""
    build_parser(subparsers.add_parser(
        "dashboard", help=command_help("dashboard"), description=DESCRIPTION,
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter))


def command(args: argparse.Namespace) -> list[str]:
    """The `streamlit run` command line for these arguments."""
    return [sys.executable, "-m", "streamlit", "run", APP,
            "--server.address", args.host, "--server.port", str(args.port), "--server.headless", "true",
            "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
            "--global.developmentMode", "false", "--client.toolbarMode", "viewer"]


def environment(args: argparse.Namespace) -> dict[str, str]:
    """The Streamlit child's environment: this one (credentials reach the store's libraries from it,
    never through the settings), with the settings added."""
    settings = Settings(store=args.store, allow_writes=args.allow_writes, tokenizer=args.tokenizer,
                        refresh_s=args.refresh_s, storage_options=parse_storage_options(args.storage_option),
                        state_dir=getattr(args, "state_dir", None))
    env = dict(os.environ)
    env.update(settings.env())
    root = os.path.dirname(os.path.dirname(APP))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run(args: argparse.Namespace) -> int:
    """Start the server in the foreground; returns 0 once a stop was asked for and the server is gone,
    else the server's own exit status.

    SIGTERM (`kill PID`, a service manager), SIGHUP (a closed terminal) and Ctrl-C stop the Streamlit
    child (SIGTERM to it), which is then waited for, so its port is free when this returns. If it is
    still there after the grace period (--grace-period) it is killed and the command exits 1; a
    second signal kills it and exits at once (128 + the signal). See `moescope.core.lifecycle`.
    """
    if args.tokenizer and not os.path.isdir(args.tokenizer):
        print(f"moescope dashboard: no tokenizer folder at {args.tokenizer!r}; give a local folder holding "
              "tokenizer.json (e.g. moescope/demo/model), or leave --tokenizer out to show token ids",
              file=sys.stderr)
        return 2
    try:
        location = store_location(args)
    except ValueError as e:
        print(f"moescope dashboard: {e}", file=sys.stderr)
        return 2
    if location.is_local and os.path.isfile(location.url):
        print(f"moescope dashboard: {args.store!r} is a file, not a store: give the folder that "
              "moescope.attach(store=...) or `moescope import` wrote into", file=sys.stderr)
        return 1
    if location.is_local and not os.path.isdir(location.url):
        if not args.wait:
            print(f"moescope dashboard: no store at {args.store!r}: record a run there first (e.g. `moescope "
                  "demo`), or give --wait to open the dashboard now and wait for the first run", file=sys.stderr)
            return 1
        print(f"moescope dashboard: no store at {args.store!r} yet; the dashboard waits for the first run "
              "to be recorded there", file=sys.stderr)
    print(f"moescope dashboard: http://{args.host}:{args.port}  (store {location.redacted})",
          file=sys.stderr, flush=True)
    process: subprocess.Popen | None = None

    def stop_child() -> None:
        if process is not None and process.poll() is None:
            process.terminate()

    def kill_child(_status: int) -> None:  # a forced exit: the child must not outlive this process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(5)

    with GracefulStop(on_stop=stop_child, on_exit=kill_child, grace_s=args.grace_period,
                      what="moescope dashboard", signals=STOP_SIGNALS) as stop:
        process = subprocess.Popen(command(args), env=environment(args))
        if stop.requested.is_set():  # a signal came while the child was being started
            stop_child()
        code = _wait(process)
    if stop.requested.is_set():
        return 0
    return 128 - code if code < 0 else code


def _wait(process: subprocess.Popen) -> int:
    """Wait for the child, in short waits so that signals are handled at once; its exit status."""
    while True:
        try:
            return process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            continue


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argparse.ArgumentParser(
        prog="moescope dashboard", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
