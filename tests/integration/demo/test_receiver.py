"""moescope's own webhook receiver: signatures checked, and repeats dropped by what the signature covers."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from moescope.alerts.notify import IDEMPOTENCY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from moescope.demo.receiver import WebhookReceiver


def signed_request(url: str, body: bytes, secret: str, timestamp: str, key_header: str) -> int:
    headers = {"Content-Type": "application/json", IDEMPOTENCY_HEADER: key_header, TIMESTAMP_HEADER: timestamp,
               SIGNATURE_HEADER: sign(secret, timestamp, body)}
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def alert_body(key: str) -> bytes:
    return json.dumps({"schema": "moescope.alert/v1", "idempotency_key": key, "status": "firing",
                       "alert": {"name": "Skew"}}, sort_keys=True).encode()


def test_a_replayed_request_with_a_new_idempotency_header_is_accepted_once():
    with WebhookReceiver(secret="s3cret") as receiver:
        body = alert_body("fp:2025-01-01T00:00:00+00:00:firing")
        now = str(int(time.time()))
        assert signed_request(receiver.url, body, "s3cret", now, "fp:2025-01-01T00:00:00+00:00:firing") == 200
        # the same captured request, replayed inside the timestamp window under a fresh header
        assert signed_request(receiver.url, body, "s3cret", now, "attacker-chosen-key") == 200
        assert signed_request(receiver.url, body, "s3cret", now, "") == 200
        assert receiver.names() == ["Skew"] and receiver.repeats == 2
        # a different signed alert is accepted, whatever its header says
        other = alert_body("fp:2025-01-01T00:00:00+00:00:resolved")
        assert signed_request(receiver.url, other, "s3cret", now, "fp:2025-01-01T00:00:00+00:00:firing") == 200
        assert len(receiver.received) == 2


def test_unsigned_stale_and_tampered_requests_are_rejected():
    with WebhookReceiver(secret="s3cret") as receiver:
        body = alert_body("k")
        stale = str(int(time.time()) - 3600)
        assert signed_request(receiver.url, body, "s3cret", stale, "k") == 401
        assert signed_request(receiver.url, body, "wrong", str(int(time.time())), "k") == 401
        assert receiver.rejected == 2 and receiver.received == []


def test_a_group_is_one_notification_and_its_alerts_are_taken_once():
    taken: list[list[dict]] = []
    with WebhookReceiver(on_notification=taken.append, secret="s3cret") as receiver:
        now = str(int(time.time()))
        alerts = [{"idempotency_key": f"fp{n}:2025-01-01T00:00:00+00:00:firing", "status": "firing",
                   "alert": {"name": "Drift"}} for n in range(3)]
        group = json.dumps({"schema": "moescope.alert-group/v1", "idempotency_key": "group:abc", "status": "firing",
                            "alerts": alerts}).encode()
        assert signed_request(receiver.url, group, "s3cret", now, "group:abc") == 200
        assert [len(n) for n in taken] == [3] and len(receiver.notifications) == 1
        assert receiver.names() == ["Drift"] * 3
        # the same group resent, and one of its alerts sent alone: nothing new
        assert signed_request(receiver.url, group, "s3cret", now, "group:abc") == 200
        single = json.dumps({"schema": "moescope.alert/v1", **alerts[0]}, sort_keys=True).encode()
        assert signed_request(receiver.url, single, "s3cret", now, alerts[0]["idempotency_key"]) == 200
        assert len(receiver.received) == 3 and len(taken) == 1 and receiver.repeats == 2
