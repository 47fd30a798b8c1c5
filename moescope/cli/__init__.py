"""`moescope`: the command line. Each command group is a module of this package with `add_subcommands`."""

from __future__ import annotations

import argparse
import importlib
import os
import select
import shutil
import signal
import sys

# Packages that add subcommands through `add_subcommands(subparsers)`.
SUBCOMMAND_MODULES = ("moescope.cli.demo", "moescope.cli.whatif", "moescope.cli.store", "moescope.cli.ingest",
                      "moescope.cli.alerts", "moescope.cli.dashboard", "moescope.cli.grafana", "moescope.cli.jitter")

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moescope", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_subcommands(subparsers)
    return parser


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
    parser = build_parser()
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
