"""`moescope alerts run` stopped as a service manager stops it: a real process, a real SIGTERM, a
real (slow) HTTP receiver; the alerts table is read from its raw Parquet files and the outbox
from its SQLite file."""

from __future__ import annotations

import sqlite3
import time

import pytest

from moescope.alerts.outbox import DELIVERED, PENDING
from moescope.cli import main as moescope_main
from tests.support.alert_records import BALANCED, SKEWED, write_steps
from tests.support.fixtures.servers import Receiver
from tests.support.sigterm import MOESCOPE, parquet_rows, started

pytestmark = pytest.mark.integration

RULES = "rules:\n  - {name: Skew, expr: load_max_mean > 2.0, window: 2, for: 0}\n"
# run-a: layer 0 turns skewed after two balanced steps and the run ends, so one poll finds every
# transition of layer 0: pending and at once firing (for: 0), then resolved ("run ended"); layer 1
# stays balanced. Receivers are told of firing and resolved.
EXPECTED = [("Skew", "pending", 0), ("Skew", "firing", 0), ("Skew", "resolved", 0)]


@pytest.fixture
def skewed_store(tmp_path):
    root = tmp_path / "store"
    write_steps(str(root), [BALANCED] * 2 + [SKEWED] * 4)
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    return root, rules, tmp_path / "outbox.sqlite"


@pytest.fixture
def slow_receiver():
    """Answers each POST after `delay_s` (set by the test); stopped whatever the test did."""
    receiver = Receiver(delay_s=1.0)
    try:
        yield receiver
    finally:
        receiver.stop()


def alerts_run(root, rules, outbox, receiver, *extra: str) -> list[str]:
    return [*MOESCOPE, "alerts", "run", str(root), "--rules", str(rules), "--interval", "0.2",
            "--webhook", f"hook={receiver.url}/hook", "--outbox", str(outbox), *extra]


def table_transitions(root) -> list[tuple[str, str, int]]:
    order = ("pending", "firing", "resolved")
    rows = sorted(parquet_rows(root, "alerts"), key=lambda r: (r["ts"], order.index(r["state"])))
    return [(r["alertname"], r["state"], r["layer"]) for r in rows]


def outbox_states(path) -> list[str]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        # a row per transition; a group's notification (role 'group') is counted in its transitions
        return sorted(state for (state,) in db.execute("SELECT state FROM deliveries WHERE role != 'group'"))


def test_sigterm_finishes_the_poll_writes_the_alerts_delivers_the_outbox_and_exits_0(skewed_store, slow_receiver):
    root, rules, outbox = skewed_store
    with started(alerts_run(root, rules, outbox, slow_receiver)) as child:
        child.wait_for_line("resolved  Skew run=run-a layer=0", "out")  # the poll found both transitions
        sent = child.signal()
        received_at_signal = len(slow_receiver.received())
        assert received_at_signal < 2, "the receiver answers in 1 s each: the outbox still had work at the signal"
        assert child.exit_status(15) == 0, child.output()
        took = time.monotonic() - sent
    assert took < 10, f"stopped {took:.1f} s after SIGTERM; the grace period is 10 s"
    assert "moescope alerts run: SIGTERM received, draining" in "\n".join(child.err)
    assert table_transitions(root) == EXPECTED
    # the default grouping (by rule and run): the drain sends the group held, one notification
    [notification] = [r.json() for r in slow_receiver.received("/hook")]
    assert [(a["alert"]["labels"]["alertname"], a["status"]) for a in notification["alerts"]] \
        == [("Skew", "firing"), ("Skew", "resolved")]
    assert outbox_states(outbox) == [DELIVERED, DELIVERED]


def test_a_second_sigterm_exits_at_once(skewed_store, slow_receiver):
    root, rules, outbox = skewed_store
    slow_receiver.delay_s = 60  # the outbox's final delivery hangs until its timeout
    with started(alerts_run(root, rules, outbox, slow_receiver, "--grace-period", "60")) as child:
        child.wait_for_line("resolved  Skew run=run-a layer=0", "out")
        child.signal()
        child.wait_for_line("SIGTERM received, draining")
        sent = child.signal()
        assert child.exit_status(10) == 143, child.output()
        assert time.monotonic() - sent < 3
        assert "second SIGTERM, exiting now without draining" in child.err[-1]
    assert table_transitions(root) == EXPECTED  # written by the poll, before the first signal was acted on


def test_grace_period_bounds_the_drain_and_what_is_undelivered_waits_in_the_outbox(skewed_store, slow_receiver):
    root, rules, outbox = skewed_store
    slow_receiver.delay_s = 60  # each delivery takes the outbox's whole 5 s timeout
    with started(alerts_run(root, rules, outbox, slow_receiver, "--grace-period", "2")) as child:
        child.wait_for_line("resolved  Skew run=run-a layer=0", "out")
        sent = child.signal()
        assert child.exit_status(15) == 0, child.output()  # nothing is lost: the outbox file keeps it
        took = time.monotonic() - sent
    assert took < 3.5, f"stopped {took:.1f} s after SIGTERM with --grace-period 2"
    assert table_transitions(root) == EXPECTED
    assert outbox_states(outbox) == [PENDING, PENDING]
    assert f"2 notifications still pending in {outbox}; they are sent on the next run" in child.err


def test_grace_period_must_be_a_positive_number_of_seconds(capsys):
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit) as exit_:
            moescope_main(["alerts", "run", "store", "--grace-period", bad])
        assert exit_.value.code == 2
        assert "give a positive number of seconds" in capsys.readouterr().err
