"""A local webhook receiver: what a user's alert endpoint sees, for the demo and for trying rules.

It listens on 127.0.0.1, checks the HMAC signature when given the secret (timestamp window,
constant-time compare: `alerts.notify.verify_signature`), drops repeats by the idempotency keys
*in the body* — which the signature covers, unlike the `X-Moescope-Idempotency-Key` header that a
replayed request can change — and hands each notification's new alerts to a callback. It takes both
payloads: one alert (`moescope.alert/v1`) and a group of them (`moescope.alert-group/v1`, whose
every alert carries its own key, so an alert is taken once whichever notification brings it).
`alerts/notify.py` says how any receiver should verify.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from moescope.alerts.notify import GROUP_SCHEMA, SIGNATURE_HEADER, TIMESTAMP_HEADER, verify_signature


def alerts_of(document: dict) -> list[dict]:
    """The alerts a notification carries, each as a `moescope.alert/v1` document (idempotency_key,
    status, alert): the one of a single notification, or every one of a group's."""
    if document.get("schema") == GROUP_SCHEMA:
        return [a for a in document.get("alerts") or [] if isinstance(a, dict)]
    return [document]


class WebhookReceiver:
    """A JSON webhook endpoint on a free local port; use as a context manager.

    `received` holds every alert taken (one document per alert, as `alerts_of` gives), `notifications`
    every notification taken (a group counts once), `repeats` how many signed POSTs brought nothing
    new (a resend: zero from an outbox whose every notification is posted once); `on_notification`
    gets each notification's new alerts, in one call."""

    def __init__(self, on_notification: Callable[[list[dict]], None] | None = None, secret: str | None = None,
                 host: str = "127.0.0.1", port: int = 0):
        self.on_notification = on_notification
        self.secret = secret
        self.received: list[dict] = []
        self.notifications: list[dict] = []
        self.rejected = 0
        self.repeats = 0
        self._keys: set[str] = set()
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if receiver.secret and not verify_signature(
                        receiver.secret, self.headers.get(TIMESTAMP_HEADER, ""),
                        body, self.headers.get(SIGNATURE_HEADER, "")):
                    with receiver._lock:
                        receiver.rejected += 1
                    self.send_response(401)
                    self.end_headers()
                    return
                try:
                    document = json.loads(body)
                    if not isinstance(document, dict):
                        raise ValueError("not a JSON object")
                except ValueError:
                    self.send_response(400)
                    self.end_headers()
                    return
                # what the signature covers: the body's keys, or the body itself when it has none
                key = str(document.get("idempotency_key") or "sha256:" + hashlib.sha256(body).hexdigest())
                with receiver._lock:
                    fresh = key not in receiver._keys
                    receiver._keys.add(key)
                    new = []
                    for alert in alerts_of(document) if fresh else []:
                        alert_key = str(alert.get("idempotency_key") or key)
                        if alert_key == key or alert_key not in receiver._keys:
                            receiver._keys.add(alert_key)
                            new.append(alert)
                    if new:
                        receiver.notifications.append(document)
                        receiver.received.extend(new)
                    else:
                        receiver.repeats += 1
                if new and receiver.on_notification is not None:
                    receiver.on_notification(new)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:  # quiet: the callback reports
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="moescope-receiver", daemon=True)

    @property
    def url(self) -> str:
        address = self._server.server_address
        assert isinstance(address, tuple) and isinstance(address[0], str)  # an AF_INET server's (host, port)
        return f"http://{address[0]}:{address[1]}/alerts"

    def start(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> WebhookReceiver:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def names(self, status: str | None = None) -> list[str]:
        """Alert names received, optionally only those with `status` (firing/resolved)."""
        with self._lock:
            return [d["alert"]["name"] for d in self.received if status is None or d.get("status") == status]
