"""One incident, one notification: transitions grouped by rule and run (Alertmanager's group_by,
group_wait, group_interval) reach real local receivers as one signed POST listing every alert,
exactly once through the outbox, also when the process is killed between grouping and posting;
Alertmanager itself still gets every alert on its own."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from moescope.alerts.grouping import Grouping
from moescope.alerts.notify import (
    GROUP_SCHEMA,
    SCHEMA,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    AlertmanagerNotifier,
    AlertmanagerWebhookNotifier,
    SlackNotifier,
    WebhookNotifier,
    verify_signature,
)
from moescope.alerts.outbox import DELIVERED, PENDING, Outbox
from moescope.alerts.rules import parse_rules
from tests.support.alert_delivery import Clock, transitions
from tests.support.fixtures.servers import Receiver, http_get_json, start_alertmanager, wait_until

LAYERS = tuple(range(6))  # a shift seen in every layer of a 6-layer model, at one step
GROUPING = Grouping(group_by=("alertname", "run_id"), group_wait_s=30, group_interval_s=300)


def firing_and_resolved():
    found = transitions(LAYERS)
    return [t for t in found if t.state == "firing"], [t for t in found if t.state == "resolved"]


def test_a_shift_in_every_layer_is_one_signed_notification_listing_every_alert(tmp_path, receiver):
    firing, resolved = firing_and_resolved()
    clock = Clock()
    outbox = Outbox(str(tmp_path / "outbox.db"), [WebhookNotifier(receiver.url + "/hook", secret="s3cret")],
                    clock=clock, grouping=GROUPING)
    try:
        outbox.handle(firing)
        clock.now += 29  # inside group_wait: the group is still gathering
        assert outbox.deliver_due().delivered == 0 and receiver.received() == []
        clock.now += 2
        assert outbox.deliver_due().delivered == 1
        [post] = receiver.received("/hook")
        assert verify_signature("s3cret", post.headers[TIMESTAMP_HEADER], post.body, post.headers[SIGNATURE_HEADER])
        doc = post.json()
        assert doc["schema"] == GROUP_SCHEMA and doc["status"] == "firing"
        assert doc["group_labels"] == {"alertname": "Skew", "run_id": firing[0].run_id}
        assert doc["common_labels"] == {k: v for k, v in firing[0].labels.items() if k != "layer"}
        # every alert listed once, with its own key, status and labels
        assert sorted(a["idempotency_key"] for a in doc["alerts"]) == sorted(t.idempotency_key() for t in firing)
        assert sorted(a["alert"]["labels"]["layer"] for a in doc["alerts"]) == sorted(str(n) for n in LAYERS)
        assert {a["status"] for a in doc["alerts"]} == {"firing"}
        assert outbox.counts() == {DELIVERED: len(firing)}  # per alert, as before grouping

        # the resolves join a group that has notified and still fires: they wait group_interval
        outbox.handle(resolved)
        clock.now += 31
        assert outbox.deliver_due().delivered == 0
        clock.now += 300
        assert outbox.deliver_due().delivered == 1
        second = receiver.received("/hook")[1].json()
        assert second["status"] == "resolved" and len(second["alerts"]) == len(resolved)

        # every alert of the group resolved and notified: the group is over, a new episode waits
        # group_wait again, not group_interval (Alertmanager destroys an empty group)
        again = [dataclasses.replace(t, starts_at=t.starts_at + dt.timedelta(hours=1)) for t in firing[:2]]
        outbox.handle(again)
        clock.now += 31
        assert outbox.deliver_due().delivered == 1
        assert len(receiver.received("/hook")[2].json()["alerts"]) == 2

        # a replay of the same transitions (an engine that restarted) sends nothing
        outbox.handle(firing + resolved + again)
        clock.now += 1000
        assert outbox.deliver_due().delivered == 0 and len(receiver.received("/hook")) == 3
    finally:
        outbox.close()


def test_slack_and_alertmanager_webhook_payloads_group_too(tmp_path, receiver):
    firing, _ = firing_and_resolved()
    clock = Clock()
    outbox = Outbox(str(tmp_path / "outbox.db"), [SlackNotifier(receiver.url + "/slack"),
                                                  AlertmanagerWebhookNotifier(receiver.url + "/v4")],
                    clock=clock, grouping=GROUPING)
    try:
        outbox.handle(firing)
        clock.now += 31
        assert outbox.deliver_due().delivered == 2
        [slack] = [r.json() for r in receiver.received("/slack")]
        assert slack["text"].startswith(f":rotating_light: [FIRING:{len(firing)}] alertname=Skew")
        assert all(f"layer {n} " in slack["blocks"][1]["text"]["text"] for n in LAYERS)
        [v4] = [r.json() for r in receiver.received("/v4")]
        assert v4["version"] == "4" and v4["status"] == "firing" and len(v4["alerts"]) == len(firing)
        assert v4["groupLabels"] == {"alertname": "Skew", "run_id": firing[0].run_id}
        assert "layer" not in v4["commonLabels"] and v4["commonLabels"]["alertname"] == "Skew"
        assert sorted(a["fingerprint"] for a in v4["alerts"]) == sorted(t.fingerprint for t in firing)
    finally:
        outbox.close()


def test_group_wait_zero_keeps_one_notification_per_transition(tmp_path, receiver):
    pack = parse_rules("grouping:\n  group_wait: 0\nrules:\n  - {name: Skew, expr: load_max_mean > 2.0}\n")
    firing, _ = firing_and_resolved()
    outbox = Outbox(str(tmp_path / "outbox.db"), [WebhookNotifier(receiver.url + "/hook")], grouping=pack.grouping)
    try:
        outbox.handle(firing)
        assert outbox.deliver_due().delivered == len(firing)
        docs = [r.json() for r in receiver.received("/hook")]
        assert [d["schema"] for d in docs] == [SCHEMA] * len(firing)
        assert [d["idempotency_key"] for d in docs] == [t.idempotency_key() for t in firing]
    finally:
        outbox.close()


def test_flush_sends_what_is_held_at_once(tmp_path, receiver):
    """flush() (a session's, the demo's settling, `alerts run` at SIGTERM) does not wait for group_wait."""
    firing, _ = firing_and_resolved()
    outbox = Outbox(str(tmp_path / "outbox.db"), [WebhookNotifier(receiver.url + "/hook")], grouping=GROUPING)
    try:
        outbox.handle(firing)
        assert outbox.flush(10)
        [post] = receiver.received("/hook")
        assert len(post.json()["alerts"]) == len(firing)
    finally:
        outbox.close()


_KILLED = textwrap.dedent("""
    import os, signal, sys
    from moescope.alerts import outbox as outbox_module
    from moescope.alerts.grouping import Grouping
    from moescope.alerts.notify import WebhookNotifier
    from tests.support.alert_delivery import transitions

    path, url, where = sys.argv[1:4]
    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    if where == "posting":  # killed once the group is made, as it is about to be posted
        outbox_module.post = die
    box = outbox_module.Outbox(path, [WebhookNotifier(url, name="hook", secret="s3cret")],
                               grouping=Grouping(group_wait_s=30))
    if where == "grouping":  # killed halfway through making the group: its row written, its alerts not marked
        box._db.set_trace_callback(lambda sql: die() if sql.startswith("UPDATE deliveries SET grouped_in") else None)
    box.handle([t for t in transitions(tuple(range(6))) if t.state == "firing"])
    box.flush(10)
    sys.exit(3)  # not reached: the process is killed above
""")


@pytest.mark.parametrize("where", ["grouping", "posting"])
def test_a_kill_between_grouping_and_posting_loses_nothing_and_posts_nothing_twice(tmp_path, receiver, where):
    path = str(tmp_path / "outbox.db")
    url = receiver.url + "/hook"
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    killed = subprocess.run([sys.executable, "-c", _KILLED, path, url, where], env=env, timeout=120,
                            capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    assert receiver.received() == []
    # what the killed process left in the file, read by hand: the group made or not, nothing sent
    with sqlite3.connect(path) as db:
        roles = dict(db.execute("SELECT role, count(*) FROM deliveries GROUP BY role").fetchall())
    assert roles == ({"member": 6, "group": 1} if where == "posting" else {"member": 6})

    # the next process (past the killed one's lease) replays the same transitions and delivers
    firing, _ = firing_and_resolved()
    later = time.time() + 600
    outbox = Outbox(path, [WebhookNotifier(url, name="hook", secret="s3cret")], grouping=GROUPING,
                    clock=lambda: later)
    try:
        outbox.handle(firing)
        assert outbox.flush(10)
        [post] = receiver.received("/hook")
        assert verify_signature("s3cret", post.headers[TIMESTAMP_HEADER], post.body, post.headers[SIGNATURE_HEADER])
        keys = sorted(a["idempotency_key"] for a in post.json()["alerts"])
        assert keys == sorted(t.idempotency_key() for t in firing)
        assert outbox.counts() == {DELIVERED: 6}
        outbox.handle(firing)
        assert outbox.flush(5) and len(receiver.received("/hook")) == 1
    finally:
        outbox.close()


@pytest.mark.integration
def test_alertmanager_still_receives_each_alert(tmp_path):
    """Alertmanager groups by itself: the outbox pushes it every alert at once, grouping or not,
    and a real Alertmanager holds each one; the JSON receiver beside it waits for its group."""
    hook = Receiver()
    am_webhook = Receiver()
    am = None
    try:
        am, am_url = start_alertmanager(tmp_path, am_webhook.url + "/am")
        firing, _ = firing_and_resolved()
        clock = Clock()
        clock.now = time.time()
        outbox = Outbox(str(tmp_path / "outbox.db"), [AlertmanagerNotifier(am_url, name="am"),
                                                      WebhookNotifier(hook.url + "/hook", name="hook")],
                        clock=clock, grouping=GROUPING)
        outbox.handle(firing)
        assert outbox.deliver_due().delivered == len(firing)  # one push per alert to Alertmanager, none to the hook
        assert [d["state"] for d in outbox.deliveries() if d["receiver"] == "am"] == [DELIVERED] * 6
        assert [d["state"] for d in outbox.deliveries() if d["receiver"] == "hook"] == [PENDING] * 6
        held = http_get_json(am_url + "/api/v2/alerts?filter=alertname%3D%22Skew%22")
        assert sorted(a["labels"]["layer"] for a in held) == sorted(str(n) for n in LAYERS)
        routed = wait_until(lambda: [a for r in am_webhook.received("/am") for a in r.json()["alerts"]], 30,
                            what="Alertmanager to notify its receiver\n" + am.log())
        assert {a["labels"]["alertname"] for a in routed} == {"Skew"}
        assert hook.received() == []
        clock.now += 31
        assert outbox.deliver_due().delivered == 1 and len(hook.received("/hook")[0].json()["alerts"]) == 6
        outbox.close()
    finally:
        if am is not None:
            am.stop()
        hook.stop()
        am_webhook.stop()
