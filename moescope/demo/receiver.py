"""A local webhook receiver: what a user's alert endpoint sees, for the demo and for trying rules.

It listens on 127.0.0.1, checks the HMAC signature when given the secret (timestamp window,
constant-time compare: `alerts.notify.verify_signature`), drops repeats by the idempotency key
*in the body* — which the signature covers, unlike the `X-Moescope-Idempotency-Key` header that a
replayed request can change — and hands each new alert document to a callback. `alerts/notify.py`
says how any receiver should verify.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from moescope.alerts.notify import SIGNATURE_HEADER, TIMESTAMP_HEADER, verify_signature


class WebhookReceiver:
    """A JSON webhook endpoint on a free local port; use as a context manager."""

    def __init__(self, on_alert: Callable[[dict], None] | None = None, secret: str | None = None,
                 host: str = "127.0.0.1", port: int = 0):
        self.on_alert = on_alert
        self.secret = secret
        self.received: list[dict] = []
        self.rejected = 0
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
                # what the signature covers: the body's key, or the body itself when it has none
                key = str(document.get("idempotency_key") or "sha256:" + hashlib.sha256(body).hexdigest())
                with receiver._lock:
                    fresh = key not in receiver._keys
                    receiver._keys.add(key)
                    if fresh:
                        receiver.received.append(document)
                if fresh and receiver.on_alert is not None:
                    receiver.on_alert(document)
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
