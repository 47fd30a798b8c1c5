"""How a long-running moescope process stops: drain on the first SIGTERM, exit at once on the second.

SIGTERM is how systemd, Docker and Kubernetes stop a service (SIGINT is Ctrl-C). Every long-running
command (`moescope proxy`, `moescope alerts run`, `moescope dashboard`, a process serving the
Prometheus exporter) and the training monitor inside a job stop the same way:

1. the first SIGTERM or SIGINT sets `GracefulStop.requested` and calls the command's `on_stop`
   (e.g. stop accepting requests); the command's own loop then drains its pipeline, writes its
   final `probe_stats` and returns 0;
2. if draining takes longer than `grace_s` (default 10 s, `--grace-period` on the commands,
   `MOESCOPE_GRACE_PERIOD_S` in the environment), the process exits with status 1, saying so on
   stderr: what was still queued is lost and the message says that; a command whose work can
   wait (an outbox on disk) stops it within `remaining_s()` instead and exits 0;
3. a second signal exits at once (status 128 + the signal, 143 for SIGTERM), for an operator who
   will not wait.

This module is a leaf (standard library only): the probe, the store and alerts may all use it.
Sharp edges: signal handlers can only be installed from the main thread (elsewhere `install()`
does nothing and `installed` stays False); a signal that is ignored (SIG_IGN) when `install()`
runs stays ignored; and `restore()` puts back only the handlers that are still this object's, so a
handler someone installed after it is left in place.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

# What signal.signal returns and takes: a function, SIG_DFL / SIG_IGN, or None (a handler installed from C).
SignalHandler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None

__all__ = ["DEFAULT_GRACE_S", "GracefulStop", "add_grace_period_argument", "grace_period_s"]

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 10.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def grace_period_s(value: float | None = None) -> float:
    """The drain bound in seconds: `value` if given, else `$MOESCOPE_GRACE_PERIOD_S`, else 10.

    Raises ValueError for a value that is not a positive finite number."""
    if value is None:
        raw = os.environ.get("MOESCOPE_GRACE_PERIOD_S")
        if raw is None:
            return DEFAULT_GRACE_S
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"MOESCOPE_GRACE_PERIOD_S={raw!r}: give the drain bound in seconds, e.g. 10") from None
    if not (0 < value < float("inf")):
        raise ValueError(f"the grace period must be a positive number of seconds, not {value!r}")
    return float(value)


def _seconds(text: str) -> float:
    try:
        return grace_period_s(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of seconds, e.g. 10") from None


def add_grace_period_argument(parser: argparse.ArgumentParser, stops: str = "drain") -> None:
    """Add `--grace-period SECONDS` to a long-running command's parser (`args.grace_period`: None
    means `$MOESCOPE_GRACE_PERIOD_S` or 10 s, as `GracefulStop` reads it); `stops` says in the help
    what the command does within that many seconds, and after. A value that is not a positive
    number is an argparse error."""
    parser.add_argument("--grace-period", type=_seconds, default=None, metavar="SECONDS",
                        help=f"on SIGTERM or Ctrl-C, {stops} (default {DEFAULT_GRACE_S:g}, or "
                             "$MOESCOPE_GRACE_PERIOD_S); a second signal exits at once")


def _say(message: str) -> None:
    """Write a line to stderr, also from a signal handler: if the handler interrupted a write to
    sys.stderr (a reentrant call raises RuntimeError there), the line goes to file descriptor 2."""
    try:
        print(message, file=sys.stderr, flush=True)
    except (RuntimeError, OSError, ValueError):
        try:
            os.write(2, (message + "\n").encode(errors="replace"))
        except OSError:
            pass


class GracefulStop:
    """SIGTERM/SIGINT handling for one long-running process; see the module doc.

    Use as a context manager around the serving loop (handlers are restored on exit):

        with GracefulStop(on_stop=server_stopper) as stop:
            while not stop.requested.wait(poll_s):
                ...                      # the loop; then drain after it
        return 0

    `on_stop` runs on a thread of its own (so it may block, e.g. `http.server`'s `shutdown()`, which
    waits for `serve_forever` on the main thread). `on_signal(signum, frame)` runs in the signal
    handler itself, on the first signal, after `requested` is set: on the main thread, between two
    bytecodes of whatever it interrupted, so it may raise there (the training monitor drains and
    ends the job from it). `on_exit(status)` is called, best effort, just before a forced exit (the
    grace period ran out, or a second signal).
    """

    def __init__(self, on_stop: Callable[[], object] | None = None, grace_s: float | None = None,
                 what: str = "moescope", signals: tuple[int, ...] = STOP_SIGNALS,
                 on_exit: Callable[[int], object] | None = None,
                 on_signal: Callable[[int, FrameType | None], object] | None = None):
        self.on_stop = on_stop
        self.grace_s = grace_period_s(grace_s)
        self.what = what
        self.signals = signals
        self.on_exit = on_exit
        self.on_signal = on_signal
        self.requested = threading.Event()
        self.signum: int | None = None  # the first signal received
        self.installed = False
        self._previous: dict[int, SignalHandler] = {}
        self._requested_at: float | None = None
        self._watchdog: threading.Timer | None = None
        self._lock = threading.Lock()
        self._exiting = threading.Event()  # a forced exit has begun: its status, not the caller's, ends the process

    def install(self) -> GracefulStop:
        """Handle the signals from now on (main thread only; elsewhere a no-op); returns self."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in self.signals:
            if signal.getsignal(signum) is signal.SIG_IGN:
                continue  # e.g. SIGINT of a job started in the background by a shell
            self._previous[signum] = signal.signal(signum, self._handle)
        self.installed = bool(self._previous)
        return self

    def previous_handler(self, signum: int) -> SignalHandler:
        """The handler `install()` replaced for `signum` (SIG_DFL, a function, or None when it was
        installed from C and cannot be called from Python); SIG_DFL when this one did not install."""
        return self._previous.get(signum, signal.SIG_DFL)

    def restore(self) -> None:
        """Put the previous handlers back and cancel the watchdog; safe to call twice. A handler that
        replaced this object's after `install()` is left in place."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.installed and threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                if signal.getsignal(signum) == self._handle:
                    signal.signal(signum, signal.SIG_DFL if handler is None else handler)
            self.installed = False

    def request(self, signum: int | None = None) -> None:
        """Ask for the stop as a first signal would (tests, embedding code)."""
        with self._lock:
            if self.requested.is_set():
                return
            self.signum = signum
            self._requested_at = time.monotonic()
            self.requested.set()
            self._watchdog = threading.Timer(self.grace_s, self._out_of_time)
            self._watchdog.daemon = True
            self._watchdog.start()
        if self.on_stop is not None:
            threading.Thread(target=self._run_on_stop, name="moescope-stop", daemon=True).start()

    def remaining_s(self) -> float:
        """Seconds left of the grace period (all of it before a stop is requested; never below 0)."""
        if self._requested_at is None:
            return self.grace_s
        return max(0.0, self.grace_s - (time.monotonic() - self._requested_at))

    def _run_on_stop(self) -> None:
        try:
            self.on_stop()  # type: ignore[misc]
        except Exception:
            log.exception("%s: stopping failed", self.what)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested.is_set():
            self._exit(128 + signum, f"{self.what}: second {signal.Signals(signum).name}, exiting now without "
                                     "draining; what was still queued is lost")
        name = signal.Signals(signum).name
        _say(f"{self.what}: {name} received, draining (at most {self.grace_s:g} s; send it again to exit now)")
        self.request(signum)
        if self.on_signal is not None:
            self.on_signal(signum, frame)

    def _out_of_time(self) -> None:
        self._exit(1, f"{self.what}: could not drain within the {self.grace_s:g} s grace period; exiting, and "
                      "what was still queued is lost")

    def _exit(self, status: int, message: str) -> None:
        # Set before on_exit runs: on_exit typically kills what the main thread waits for, and the
        # main thread must not then return its own status (0 for a stop that was asked for) while
        # this thread is still on its way to os._exit.
        self._exiting.set()
        _say(message)
        if self.on_exit is not None:
            try:
                self.on_exit(status)
            except Exception:
                pass
        os._exit(status)

    def __enter__(self) -> GracefulStop:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        if self._exiting.is_set() and self._watchdog is not None and threading.current_thread() is not self._watchdog:
            # The watchdog is ending the process with status 1; leaving here would race it to exit 0.
            threading.Event().wait()
        self.restore()
