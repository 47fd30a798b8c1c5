"""`alerts run` on a real full disk (a small tmpfs, filled): it keeps evaluating and delivering,
retries the alerts-table write, keeps the outbox in memory while it cannot write it, and says
what it could not persist. Mounting needs root: elsewhere these tests skip, saying so."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from moescope.alerts.notify import WebhookNotifier
from moescope.alerts.outbox import DELIVERED, Outbox
from moescope.alerts.rules import parse_rules
from moescope.alerts.storage import StoreAlertRunner, read_alerts
from moescope.cli import main as moescope_main
from tests.support.alert_records import BALANCED, SKEWED, write_steps

RULES = "rules:\n  - {name: Skew, expr: load_max_mean > 2.0, window: 1, for: 0, cooldown: 0}\n"


# A 4 MiB disk, with tmpfs's own inode count: these tests fill its bytes (`fill` below), not its names.
pytestmark = pytest.mark.small_disk(size="4m", inodes=None)


def fill(folder) -> str:
    """Fill the filesystem under `folder` to the last byte; return the filler's path."""
    path = os.path.join(folder, "filler")
    with open(path, "wb", buffering=0) as fh:
        for chunk in (1 << 16, 4096, 1):
            try:
                while True:
                    fh.write(b"\0" * chunk)
            except OSError:
                pass
    with pytest.raises(OSError):
        with open(os.path.join(folder, "probe-room"), "wb") as fh:
            fh.write(b"x" * 4096)
            fh.flush()
            os.fsync(fh.fileno())
    return path


def test_alerts_run_starts_on_a_full_disk_delivers_and_says_what_it_could_not_persist(
        small_disk, tmp_path, receiver, capsys):
    store = Path(small_disk.path) / "store"
    write_steps(str(store), [SKEWED] * 2, close=False)  # a run still being recorded
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    filler = fill(small_disk.path)

    code = moescope_main(["alerts", "run", str(store), "--rules", str(rules), "--once",
                          "--webhook", receiver.url + "/hook", "--flush-timeout", "5"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "firing    Skew run=run-a layer=0" in captured.out
    # delivered although nothing could be written
    assert [r.json()["status"] for r in receiver.received("/hook")] == ["firing"]
    assert not (store / "alerts").exists() or not list((store / "alerts").rglob("*.parquet"))
    assert "in memory" in captured.err and "alerts-outbox.sqlite" in captured.err
    assert "2 alert transitions could not be written to the alerts table" in captured.err
    assert "No space left on device" in captured.err

    # room again: the next run writes the table (replayed from the steps) and a real outbox file
    os.remove(filler)
    code = moescope_main(["alerts", "run", str(store), "--rules", str(rules), "--once",
                          "--webhook", receiver.url + "/hook"])
    assert code == 0
    assert "could not" not in capsys.readouterr().err
    runner = StoreAlertRunner(str(store), parse_rules(RULES), write_alerts=False)
    assert list(read_alerts(runner.store).state) == ["pending", "firing"]
    with sqlite3.connect(store / ".moescope" / "alerts-outbox.sqlite") as db:
        # the firing, and the notification of its group (the rules file's default grouping)
        assert db.execute("SELECT role, state FROM deliveries ORDER BY id").fetchall() == [
            ("member", DELIVERED), ("group", DELIVERED)]


def test_the_disk_filling_while_running_loses_no_transition_and_no_delivery(small_disk, receiver):
    store = os.path.join(small_disk.path, "store")
    write_steps(store, [BALANCED] * 2, close=False)
    outbox_path = os.path.join(small_disk.path, "outbox.sqlite")
    outbox = Outbox(outbox_path, [WebhookNotifier(receiver.url + "/hook", name="hook")], persist_retry_s=0)
    runner = StoreAlertRunner(store, parse_rules(RULES), sinks=[outbox])
    try:
        assert runner.poll_once() == [] and outbox.persistent
        write_steps(store, [SKEWED, SKEWED, BALANCED], start=2, close=False)
        filler = fill(small_disk.path)

        # a notification too big for the room left: the outbox cannot write it, and goes on in memory
        assert outbox.enqueue("hook", "big", b'{"pad": "' + b"x" * 300_000 + b'"}') is True
        assert not outbox.persistent and "full" in outbox.unsaved_reason
        found = runner.poll_once()
        assert [(t.state, t.step) for t in found] == [("pending", 2), ("firing", 2), ("resolved", 4)]
        assert len(runner.writer.unwritten) == 3 and "No space left" in runner.writer.last_error
        assert outbox.deliver_due().delivered == 3
        assert sorted(r.json().get("status", "big") for r in receiver.received("/hook")) == [
            "big", "firing", "resolved"]
        assert runner.poll_once() == [] and len(runner.writer.unwritten) == 3  # retried, still no room

        os.remove(filler)
        assert runner.poll_once() == [] and runner.writer.unwritten == []
        table = read_alerts(runner.store)
        assert [(s, int(step)) for s, step in zip(table.state, table.step)] == [
            ("pending", 2), ("firing", 2), ("resolved", 4)]
        outbox.deliver_due()  # the outbox goes back to its file as soon as there is room
        assert outbox.persistent and outbox.unsaved_reason is None
    finally:
        outbox.close()
    with sqlite3.connect(outbox_path) as db:
        assert db.execute("SELECT count(*) FROM deliveries WHERE state = ?", (DELIVERED,)).fetchone() == (3,)
