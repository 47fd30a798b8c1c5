"""Delivering the outbox's notifications: one POST per notification (`post`), what a delivery round
did (`DeliveryReport`), and the thread that runs the rounds (`OutboxWorker`).

`post` never follows a redirect and says which failures are permanent: a 4xx other than 408, 425
and 429 (the request itself is wrong and will never succeed). What is due, the retries, the backoff
and the order per receiver are the outbox's (alerts/outbox.py), which calls `post` for each row.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moescope.alerts.notify import Notifier, redact_url

if TYPE_CHECKING:
    from moescope.alerts.outbox import Outbox

log = logging.getLogger(__name__)

_PERMANENT_RETRYABLE = {408, 425, 429}


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Never follow a redirect: the 3xx reaches `post` as an HTTPError (a body-less GET carrying our
    signature to a login page must not count as delivered)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _request(notifier: Notifier, idempotency_key: str, body: bytes) -> urllib.request.Request:
    """The POST for one notification; `user:password@` in the URL becomes a Basic auth header."""
    url = notifier.url
    headers = notifier.headers(body, idempotency_key)
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None or parts.password is not None:
        hostname = parts.hostname or ""  # a notifier's URL has one (notify.py checks)
        host = f"[{hostname}]" if ":" in hostname else hostname
        netloc = host + (f":{parts.port}" if parts.port is not None else "")
        url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
        credentials = f"{urllib.parse.unquote(parts.username or '')}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode()
    return urllib.request.Request(url, data=body, method="POST", headers=headers)


def post(notifier: Notifier, idempotency_key: str, body: bytes,
         timeout_s: float = 5.0) -> tuple[bool, bool, str | None]:
    """POST one rendered notification; return (delivered, permanent failure, error text).

    Never raises for anything the receiver does: a refused or reset connection, a timeout, an
    answer that is not HTTP, a redirect (not followed) and an error status are all failures.
    """
    try:
        request = _request(notifier, idempotency_key, body)
        with _OPENER.open(request, timeout=timeout_s) as response:
            response.read(65536)
            return True, False, None
    except urllib.error.HTTPError as exc:
        detail = ""
        with contextlib.suppress(Exception):  # the error body is a courtesy; a broken one changes nothing
            detail = exc.read(512).decode("utf-8", "replace") if exc.fp else ""
        if 300 <= exc.code < 400:
            location = exc.headers.get("Location", "") if exc.headers else ""
            target = redact_url(urllib.parse.urljoin(request.full_url, location)) if location else "nowhere"
            return False, False, (f"HTTP {exc.code} redirect to {target}: not followed; configure the receiver's "
                                  "final URL (a redirect usually means a login page or a moved endpoint)")
        permanent = 400 <= exc.code < 500 and exc.code not in _PERMANENT_RETRYABLE
        return False, permanent, f"HTTP {exc.code}: {detail}".strip()
    except http.client.HTTPException as exc:  # BadStatusLine, RemoteDisconnected, IncompleteRead...
        return False, False, f"{type(exc).__name__}: not an HTTP answer: {str(exc)[:200]!r}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return False, False, f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


@dataclass(frozen=True)
class DeliveryReport:
    delivered: int = 0
    retrying: int = 0
    dead: int = 0


class OutboxWorker:
    """A thread that calls `outbox.deliver_due()` every `interval_s` until stopped."""

    def __init__(self, outbox: Outbox, interval_s: float = 1.0):
        self.outbox = outbox
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moescope-outbox", daemon=True)
        self.errors = 0

    def start(self) -> OutboxWorker:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.outbox.deliver_due()
            except Exception:  # noqa: BLE001 - keep delivering; a broken row must not stop the rest
                self.errors += 1
                log.exception("alerts outbox: a delivery round failed; the next round runs in %g s", self.interval_s)
            self._stop.wait(self.interval_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
