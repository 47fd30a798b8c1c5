"""moescope.core.lifecycle.GracefulStop: drain on the first signal within the grace period, exit at once on
the second; in a real process that gets real signals, and in-process for what needs no exit."""

from __future__ import annotations

import argparse
import signal
import sys
import textwrap
import threading
import time

import pytest

from moescope.core.lifecycle import DEFAULT_GRACE_S, GracefulStop, add_grace_period_argument, grace_period_s
from tests.support.sigterm import started

# A service loop: "ready" once the handlers are in, then it waits for the stop, "drains" for
# DRAIN_S seconds (interruptible, as a real drain waiting on a thread or a socket is) and returns 0.
SERVICE = textwrap.dedent("""
    import os, sys, threading, time
    from moescope.core.lifecycle import GracefulStop

    drain_s, grace = float(sys.argv[1]), (float(sys.argv[2]) if len(sys.argv) > 2 else None)
    main = threading.main_thread()

    def say(line):  # one write per line: the callbacks run on different threads
        sys.stdout.write(line + "\\n")
        sys.stdout.flush()

    def on_stop():
        say("on_stop ran " + ("on the main thread" if threading.current_thread() is main else "on a thread"))

    def on_signal(signum, frame):
        say(f"on_signal {signum} " + ("on the main thread" if threading.current_thread() is main else "elsewhere"))

    def on_exit(status):
        say(f"on_exit {status}")

    with GracefulStop(on_stop=on_stop, grace_s=grace, on_exit=on_exit, on_signal=on_signal, what="svc") as stop:
        say("ready")
        while not stop.requested.wait(0.05):
            pass
        time.sleep(drain_s)  # the drain
        say(f"drained with {stop.remaining_s():.1f} s left")
    say("returned")
    sys.exit(0)
""")


def service(*args: str, env: dict[str, str] | None = None):
    return started([sys.executable, "-c", SERVICE, *args], env)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_drains_and_the_loop_returns_0(signum):
    with service("0.5") as child:
        child.wait_for_line("ready", "out")
        sent = child.signal(signum)
        assert child.exit_status(30) == 0, child.output()
        assert time.monotonic() - sent < DEFAULT_GRACE_S
        assert "on_stop ran on a thread" in child.out  # it may block (an HTTP server's shutdown)
        assert f"on_signal {int(signum)} on the main thread" in child.out
        assert "returned" in child.out and not any(line.startswith("on_exit") for line in child.out)
        name = signal.Signals(signum).name
        assert f"svc: {name} received, draining (at most 10 s; send it again to exit now)" in child.err


def test_second_signal_exits_at_once_without_draining():
    with service("60", "60") as child:
        child.wait_for_line("ready", "out")
        child.signal()
        child.wait_for_line("draining", "err")  # the first was handled: the drain is under way
        sent = child.signal()
        assert child.exit_status(10) == 128 + signal.SIGTERM
        assert time.monotonic() - sent < 5
        assert "on_exit 143" in child.out and "returned" not in child.out
        assert "svc: second SIGTERM, exiting now without draining; what was still queued is lost" in child.err


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_a_drain_past_the_grace_period_exits_1_at_its_end(how):
    args, env = (("60", "1.5"), None) if how == "argument" else (("60",), {"MOESCOPE_GRACE_PERIOD_S": "1.5"})
    with service(*args, env=env) as child:
        child.wait_for_line("ready", "out")
        sent = child.signal()
        assert child.exit_status(20) == 1
        took = time.monotonic() - sent
        assert 1.5 <= took < 6, took  # the watchdog, not the 60 s drain
        assert "on_exit 1" in child.out and "returned" not in child.out
        assert "svc: could not drain within the 1.5 s grace period" in child.err[-1]


# The dashboard's shape: on_exit kills the child the main thread waits for, so the main thread's
# wait returns while the watchdog is still on its way to os._exit. The forced exit's status must win.
KILLED_WAIT = textwrap.dedent("""
    import sys, threading, time
    from moescope.core.lifecycle import GracefulStop

    child_gone = threading.Event()

    def on_exit(status):
        child_gone.set()  # as kill_child's kill() would end the main thread's wait
        time.sleep(1.0)   # and its wait(5) holds this thread back from os._exit meanwhile

    with GracefulStop(on_exit=on_exit, grace_s=0.5, what="svc") as stop:
        stop.request()
        child_gone.wait()
    sys.exit(0)  # a stop that was asked for, had the child ended by itself
""")


def test_a_forced_exit_under_way_wins_over_the_main_threads_own_return():
    with started([sys.executable, "-c", KILLED_WAIT]) as child:
        assert child.exit_status(30) == 1, child.output()
        assert "svc: could not drain within the 0.5 s grace period" in child.err[-1]


def test_grace_period_from_argument_environment_or_default(monkeypatch):
    monkeypatch.delenv("MOESCOPE_GRACE_PERIOD_S", raising=False)
    assert grace_period_s() == DEFAULT_GRACE_S == 10.0
    assert grace_period_s(2.5) == 2.5
    monkeypatch.setenv("MOESCOPE_GRACE_PERIOD_S", "3")
    assert grace_period_s() == 3.0 and grace_period_s(1) == 1.0  # the argument wins
    for bad in ("ten", "0", "-1", "inf", "nan"):
        monkeypatch.setenv("MOESCOPE_GRACE_PERIOD_S", bad)
        with pytest.raises(ValueError, match="MOESCOPE_GRACE_PERIOD_S|positive number of seconds"):
            grace_period_s()
    for bad in (0, -2.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive number of seconds"):
            grace_period_s(bad)


def test_request_runs_on_stop_on_a_thread_and_counts_down_the_grace_period():
    ran = threading.Event()
    stop = GracefulStop(on_stop=ran.set, grace_s=600)
    assert stop.remaining_s() == 600 and not stop.requested.is_set()
    try:
        stop.request()
        stop.request()  # a second request changes nothing
        assert ran.wait(5) and stop.requested.is_set() and stop.signum is None
        assert 599 < stop.remaining_s() <= 600
    finally:
        stop.restore()  # cancels the watchdog, which would end this process in 600 s


def test_restore_puts_back_only_its_own_handler_and_leaves_ignored_signals_ignored():
    before = signal.getsignal(signal.SIGTERM)
    try:
        stop = GracefulStop(signals=(signal.SIGTERM,)).install()
        assert stop.installed and stop.previous_handler(signal.SIGTERM) is before
        stop.restore()
        assert signal.getsignal(signal.SIGTERM) is before
        stop = GracefulStop(signals=(signal.SIGTERM,)).install()

        def later(signum, frame):
            pass

        signal.signal(signal.SIGTERM, later)  # someone installs a handler after it
        stop.restore()
        assert signal.getsignal(signal.SIGTERM) is later
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop = GracefulStop(signals=(signal.SIGTERM,)).install()
        assert not stop.installed and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        stop.restore()
    finally:
        signal.signal(signal.SIGTERM, before)


def test_install_off_the_main_thread_does_nothing():
    results = []
    thread = threading.Thread(target=lambda: results.append(GracefulStop().install().installed))
    thread.start()
    thread.join(5)
    assert results == [False]


def test_grace_period_argument(capsys):
    parser = argparse.ArgumentParser()
    add_grace_period_argument(parser, "drain the queue within this many seconds")
    assert parser.parse_args([]).grace_period is None  # GracefulStop then reads the environment, or 10 s
    assert parser.parse_args(["--grace-period", "2.5"]).grace_period == 2.5
    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--grace-period", bad])
        assert "give a positive number of seconds" in capsys.readouterr().err
