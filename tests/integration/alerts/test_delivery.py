"""Notifiers and the outbox against a real local HTTP server, including one that is down."""

from __future__ import annotations

import json
import time

import pytest

from moescope.alerts.notify import (
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    AlertmanagerNotifier,
    AlertmanagerWebhookNotifier,
    NotifierError,
    SlackNotifier,
    WebhookNotifier,
    sign,
    validate_url,
    verify_signature,
)
from moescope.alerts.outbox import DEAD, DELIVERED, PENDING, Outbox
from tests.support.alert_delivery import Clock, transitions
from tests.support.fixtures.servers import Receiver, free_port


@pytest.mark.parametrize(
    "url, hint",
    [("ftp://x/y", "http:// or https://"), ("http://", "names no host"), ("", "empty"), ("http://a b", "spaces"),
     ("127.0.0.1:9093", "http:// or https://"), ("http://h:99999/", "invalid port")],
)
def test_urls_are_validated_up_front(url, hint):
    with pytest.raises(NotifierError, match=hint):
        WebhookNotifier(url)
    assert validate_url("https://hooks.example.com/x") == "https://hooks.example.com/x"


def test_signature_roundtrip_and_rejections():
    body = b'{"a": 1}'
    sig = sign("s3cret", "1700000000", body)
    assert verify_signature("s3cret", "1700000000", body, sig, now=1700000100)
    assert not verify_signature("s3cret", "1700000000", body + b" ", sig, now=1700000100)
    assert not verify_signature("other", "1700000000", body, sig, now=1700000100)
    assert not verify_signature("s3cret", "1700000000", body, sig, now=1700009999)  # stale: replay
    assert not verify_signature("s3cret", "x", body, sig)


def test_each_notifier_renders_its_documented_payload():
    firing, resolved = transitions()
    doc = json.loads(WebhookNotifier("http://h/x").render(firing))
    assert doc["schema"] == "moescope.alert/v1" and doc["status"] == "firing"
    assert doc["idempotency_key"] == firing.idempotency_key()
    assert doc["alert"]["name"] == "Skew" and doc["alert"]["layer"] == 0 and doc["alert"]["ends_at"] is None
    assert doc["alert"]["values"]["load_max_mean"] == pytest.approx(4.5)
    slack = json.loads(SlackNotifier("https://hooks.slack.com/services/x").render(firing))
    assert "FIRING" in slack["text"] and "Skew" in slack["text"] and slack["blocks"][0]["type"] == "section"
    am = AlertmanagerNotifier("http://127.0.0.1:9093/")
    assert am.url == "http://127.0.0.1:9093/api/v2/alerts"
    [alert] = json.loads(am.render(resolved))
    assert alert["labels"]["alertname"] == "Skew" and alert["endsAt"].startswith("2025-01-01T00:00:01")
    v4 = json.loads(AlertmanagerWebhookNotifier("http://h/x").render(firing))
    assert v4["version"] == "4" and v4["status"] == "firing" and v4["alerts"][0]["fingerprint"] == firing.fingerprint
    assert v4["alerts"][0]["endsAt"] == "0001-01-01T00:00:00Z" and v4["commonLabels"]["layer"] == "0"


def test_signed_webhook_reaches_a_real_receiver(tmp_path, receiver):
    hook = WebhookNotifier(receiver.url + "/hook", secret="s3cret")
    outbox = Outbox(str(tmp_path / "outbox.db"), [hook])
    try:
        outbox.handle(transitions())
        assert outbox.deliver_due().delivered == 2
        got = receiver.received("/hook")
        assert [r.json()["status"] for r in got] == ["firing", "resolved"]
        for r in got:
            assert verify_signature("s3cret", r.headers[TIMESTAMP_HEADER], r.body, r.headers[SIGNATURE_HEADER])
            assert r.headers[IDEMPOTENCY_HEADER] == r.json()["idempotency_key"]
    finally:
        outbox.close()


def test_receiver_down_ten_minutes_and_engine_restart_lose_nothing_and_duplicate_nothing(tmp_path):
    port = free_port()  # nothing listens here yet: connections are refused
    url = f"http://127.0.0.1:{port}/hook"
    clock = Clock()
    path = str(tmp_path / "outbox.db")
    found = transitions(layers=(0, 1, 2))  # 3 firing + 3 resolved
    outbox = Outbox(path, [WebhookNotifier(url)], clock=clock, max_backoff_s=30)
    outbox.handle(found)
    attempts = 0
    while clock.now < 1_000_000 + 600:  # ten minutes of outage, retried on the backoff schedule
        report = outbox.deliver_due()
        attempts += report.retrying
        assert report.delivered == 0
        clock.now += 5
    assert attempts >= 20  # backoff is capped at 30 s, so the receiver is tried throughout
    assert outbox.counts() == {PENDING: 6}
    outbox.close()

    # the engine restarts: a new outbox on the same file, and the replayed data enqueues again
    outbox = Outbox(path, [WebhookNotifier(url)], clock=clock, max_backoff_s=30)
    outbox.handle(transitions(layers=(0, 1, 2)))
    assert outbox.counts() == {PENDING: 6}
    receiver = Receiver(port=port)
    try:
        clock.now += 40  # past the longest backoff
        assert outbox.deliver_due().delivered == 6
        clock.now += 100
        assert outbox.deliver_due().delivered == 0
        keys = [r.json()["idempotency_key"] for r in receiver.received("/hook")]
        assert sorted(keys) == sorted(t.idempotency_key() for t in found) and len(set(keys)) == 6
        # per alert, firing arrives before resolved
        for t in found:
            if t.state == "resolved":
                firing_key = t.idempotency_key().replace(":resolved", ":firing")
                assert keys.index(firing_key) < keys.index(t.idempotency_key())
        assert outbox.counts() == {DELIVERED: 6}
    finally:
        receiver.stop()
        outbox.close()


def test_client_errors_are_dead_server_errors_retry_and_slow_receivers_time_out(tmp_path):
    clock = Clock()
    bad = Receiver(status=400)
    flaky = Receiver(status=503)
    slow = Receiver(delay_s=1.0)
    try:
        notifiers = [WebhookNotifier(bad.url, name="bad"), WebhookNotifier(flaky.url, name="flaky"),
                     WebhookNotifier(slow.url, name="slow")]
        outbox = Outbox(str(tmp_path / "o.db"), notifiers, clock=clock, timeout_s=0.3)
        outbox.handle(transitions()[:1])
        t0 = time.monotonic()
        report = outbox.deliver_due()
        assert time.monotonic() - t0 < 3
        assert (report.delivered, report.retrying, report.dead) == (0, 2, 1)
        states = {d["receiver"]: d for d in outbox.deliveries()}
        assert states["bad"]["state"] == DEAD and "HTTP 400" in states["bad"]["last_error"]
        assert states["flaky"]["state"] == PENDING and "HTTP 503" in states["flaky"]["last_error"]
        assert states["slow"]["state"] == PENDING and "timed out" in states["slow"]["last_error"].lower()
        flaky.status = 200
        slow.delay_s = 0
        clock.now += 10
        assert outbox.deliver_due().delivered == 2
        assert len(bad.requests) == 1  # a dead delivery is never retried
        outbox.close()
    finally:
        for r in (bad, flaky, slow):
            r.stop()


def test_backoff_doubles_and_is_capped():
    outbox = Outbox(":memory:", [], base_backoff_s=1, max_backoff_s=30)
    delays = [outbox.backoff_s(n) for n in range(1, 9)]
    for n, d in enumerate(delays, start=1):
        expected = min(30, 2 ** (n - 1))
        assert expected <= d <= expected * 1.1
    outbox.close()
