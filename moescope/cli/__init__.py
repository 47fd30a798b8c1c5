"""`moescope`: the command line. Each command group is a module of this package with `add_subcommands`.

`COMMANDS` names every command, the module that adds it and its line in `moescope --help`. A run of
the command line loads the module of the command it runs and no other, so `moescope --help`,
`summary`, `query`, `compact` and every command that needs no model start without importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import shutil
import signal
import sys
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """A command: the module whose `add_subcommands(subparsers)` adds it, and its one line of help."""

    module: str
    help: str


COMMANDS: dict[str, Command] = {
    "demo": Command("moescope.cli.demo", "record a demo run on a small MoE model and print what moescope saw"),
    "summary": Command("moescope.cli.summary", "per-layer load spread, entropy, drops and active fraction of a run"),
    "train-demo": Command("moescope.cli.demo", "retrain the shipped demo model from its seed (minutes on 2 CPU cores)"),
    "whatif": Command("moescope.cli.whatif", "replay recorded routes under another serving setup"),
    "compact": Command("moescope.cli.store", "merge a store's small files (safe while writing)"),
    "prune": Command("moescope.cli.store", "delete runs older than an age"),
    "query": Command("moescope.cli.store", "run SQL over a store and print a table"),
    "store": Command("moescope.cli.store", "maintenance: check every file now, upgrade a store of an earlier release"),
    "import": Command("moescope.cli.ingest", "bring vLLM, SGLang, TensorRT-LLM or Megatron routing into a store"),
    "proxy": Command("moescope.cli.ingest", "record routed experts in front of a vLLM or SGLang server"),
    "alerts": Command("moescope.cli.alerts", "judge recorded routing and notify receivers"),
    "dashboard": Command("moescope.cli.dashboard", "open a store in the browser (Streamlit dashboard)"),
    "grafana": Command("moescope.cli.grafana",
                       "print a Grafana dashboard (JSON) over the Prometheus exporter's metrics"),
    "placement": Command("moescope.cli.placement",
                         "load per expert-parallel rank under a placement: balancedness, hottest rank and experts"),
    "traffic": Command("moescope.cli.traffic",
                       "what a placement costs on the wire: remote ranks and nodes per token, links, bytes"),
    "jitter": Command("moescope.cli.jitter",
                      "does the same input go to the same experts when batched, padded, cast or repeated?"),
    "check": Command("moescope.cli.check",
                     "can an engine's routed-experts trace be trusted? zero rows, repeats, short traces, physical ids"),
    "mismatch": Command("moescope.cli.mismatch",
                        "engine vs reference routing per token and layer (RL rollouts); export it for replay"),
}


def command_help(name: str) -> str:
    """The one line `moescope --help` shows for command `name` (its module's parser uses the same)."""
    return COMMANDS[name].help

DESCRIPTION = """\
moescope watches how a Mixture-of-Experts model routes its tokens.

  moescope demo                    record a demo run and print what it found
  moescope summary runs/           per-layer load, entropy and drops of the latest run
  moescope dashboard runs/         open the dashboard on 127.0.0.1
  moescope alerts run runs/        watch a store with the default rules, notify webhooks
  moescope whatif cache runs/      expert-cache hit rates (LRU, LFU, Belady) from recorded routes
  moescope grafana > board.json    a Grafana dashboard over the Prometheus exporter's metrics

A store is a folder or a URL a fleet shares: s3://BUCKET/PREFIX (AWS S3, or MinIO, Ceph, R2 through
an endpoint), gs://BUCKET/PREFIX, az://CONTAINER/PREFIX. Credentials come from the environment
(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance role); the rest is given with
--storage-option KEY=VALUE:

  moescope summary s3://moe-runs/fleet --storage-option endpoint=http://127.0.0.1:9000

In Python, one call attaches the probe to any transformers MoE model:

  import moescope
  with moescope.attach(model, store="runs/", routes=True):
      model(**batch)
  moescope.attach(model, store="s3://moe-runs/fleet", storage_options={"region": "eu-west-1"})
"""


def program_name() -> str:
    """How to call moescope so that a command printed for the user runs as printed: `moescope` where
    the shell finds this installation's script, else the script's path (`.venv/bin/moescope` from
    the project folder, when the virtual environment is not activated), else `python -m moescope.cli`."""
    script = os.path.join(os.path.dirname(sys.executable), "moescope")
    if not os.path.isfile(script):
        return f"{sys.executable} -m moescope.cli"
    found = shutil.which("moescope")
    if found and os.path.realpath(found) == os.path.realpath(script):
        return "moescope"
    relative = os.path.relpath(script)
    return relative if not relative.startswith("..") else script


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser.

    Args:
        commands: the commands to parse in full, their modules loaded; None: every command (the
            manual's reference and the tests walk it). Every other command is listed in `--help`
            with its line from `COMMANDS` and nothing more.

    Returns:
        The parser; a parsed command in full sets `func`, the function that runs it.
    """
    parser = argparse.ArgumentParser(prog="moescope", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = list(COMMANDS) if commands is None else [name for name in commands if name in COMMANDS]
    for module in dict.fromkeys(COMMANDS[name].module for name in wanted):
        importlib.import_module(module).add_subcommands(subparsers)
    for name, command in COMMANDS.items():
        if name not in subparsers.choices:
            subparsers.add_parser(name, help=command.help)
    # the order of `moescope --help` is the table's, whichever modules were loaded
    subparsers._choices_actions.sort(key=lambda action: list(COMMANDS).index(action.dest))
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The command an argument list runs: its first word that is not an option."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status. A command returns its own status or raises: a
    StoreError, OSError or ValueError (and the probe's attach errors) is printed on one line,
    `moescope COMMAND: message` (a nested command may name itself with a `command_name` default),
    and the status is 1; anything else is a bug and keeps its traceback.

    A reader of stdout that goes away (`moescope query ... | head`) ends the command quietly with
    status 141 (128 + SIGPIPE), what a shell reports for `git log | head` or `grep ... | head`."""
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # the last buffered lines meet a closed pipe here, not at interpreter exit
    except BrokenPipeError:  # only stdout's: _run reports any other as an error
        return _stdout_closed_status()


def _run(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_of(argv)
    parser = build_parser([command] if command else [])
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a user-facing error: say what went wrong, not a traceback
        from moescope.probe import NoMoELayersError, ProbeAttachError
        from moescope.store import StoreError

        if isinstance(e, BrokenPipeError) and closed_pipe(sys.stdout):
            raise  # not an error: the reader had what it wanted
        # OSError: a store that cannot be reached (a missing bucket, refused credentials), its URL named
        if isinstance(e, (StoreError, NoMoELayersError, ProbeAttachError, OSError, ValueError)):
            command = getattr(args, "command_name", None) or f"moescope {args.command}"
            print(f"{command}: {e}", file=sys.stderr)
            return 1
        raise


def closed_pipe(stream) -> bool:
    """Whether `stream` is a pipe whose reading end is closed. A BrokenPipeError alone does not say
    which pipe broke: a socket to the store or a webhook raises it too, and that one is an error to
    report."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no descriptor, a closed stream
        return False


def _stdout_closed_status() -> int:
    """The status of a command whose stdout reader went away, with stdout pointed at the null device.

    git, grep and cat die of SIGPIPE there, which a shell reports as 141. Python ignores SIGPIPE (so
    that a socket's reset is an exception, not death) and raises BrokenPipeError instead; the command
    returns the same status rather than killing itself, so `finally` blocks and atexit handlers (a
    store's last flush) still run. Whatever is still buffered for stdout goes to the null device:
    flushed at exit into the closed pipe, it would print "Exception ignored ... BrokenPipeError"."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass
    return 128 + getattr(signal, "SIGPIPE", 13)


if __name__ == "__main__":
    sys.exit(main())
