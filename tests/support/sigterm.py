"""Real processes stopped with real signals, for the SIGTERM tests of every long-running command.

`started(argv)` runs a process from the repository root, reads its stdout and stderr lines on
threads (so a chatty process never blocks on a full pipe), and kills it at the end whatever the
test did. `parquet_rows` counts a table's rows from the raw Parquet files, not through moescope.

Every test that signals a child starts it with `preexec_fn=default_signals`: a child inherits an
ignored signal (`nohup pytest` ignores SIGHUP, a shell's background job SIGINT), and a service that
finds a signal ignored rightly leaves it so (GracefulStop does), so without it those tests fail
whenever the suite itself runs under nohup.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pyarrow.parquet as pq

from tests.support.paths import REPO

# `moescope ...` as a user runs it
MOESCOPE = [sys.executable, "-m", "moescope.cli"]

# The signals the tests send a child to stop it.
STOP_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)


def default_signals() -> None:
    """For `subprocess.Popen(..., preexec_fn=default_signals)`: the child starts with the default
    disposition of STOP_SIGNALS, whichever of them the test run ignores."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


class Child:
    """A process whose output lines are collected as they come."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None):
        self.argv = argv
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=None if env is None else {**os.environ, **env}, preexec_fn=default_signals)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return "\n".join(["--- stdout", *self.out[-40:], "--- stderr", *self.err[-40:]])

    def wait_for(self, predicate: Callable[[], object], timeout_s: float = 120.0, what: str = "a line") -> object:
        """Wait until `predicate()` is truthy (returning it); fail if the process ends or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            assert self.proc.poll() is None, f"the process ended ({self.proc.returncode}) before {what}:\n" \
                                             f"{self.output()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s} s:\n{self.output()}"
            time.sleep(0.02)

    def wait_for_line(self, text: str, stream: str = "err", timeout_s: float = 120.0) -> str:
        lines = self.err if stream == "err" else self.out
        return self.wait_for(lambda: next((line for line in list(lines) if text in line), None), timeout_s,
                             f"{text!r} on std{stream}")

    def signal(self, signum: int = signal.SIGTERM) -> float:
        """Send a signal; returns when it was sent (time.monotonic())."""
        self.proc.send_signal(signum)
        return time.monotonic()

    def exit_status(self, timeout_s: float) -> int:
        """The exit status, waiting at most `timeout_s` (then the test fails with the output)."""
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {timeout_s} s later:\n{self.output()}") from None
        for reader in self._readers:
            reader.join(5)
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        for stream in (self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                stream.close()


@contextlib.contextmanager
def started(argv: list[str], env: dict[str, str] | None = None) -> Iterator[Child]:
    child = Child(argv, env)
    try:
        yield child
    finally:
        child.stop()


def parquet_files(root, table: str) -> list[str]:
    return sorted(glob.glob(os.path.join(str(root), table, "*", "*.parquet")))


def parquet_rows(root, table: str) -> list[dict]:
    """Every row of `table` under the store `root`, read from the raw Parquet files."""
    return [row for path in parquet_files(root, table) for row in pq.read_table(path).to_pylist()]
