"""A persistent outbox: every notification is written to SQLite before anything is sent.

Why: a receiver that is down must get every alert when it comes back, exactly once, even if the
engine restarted in between. So the engine only *enqueues* (a row keyed by receiver and
idempotency key; a second enqueue of the same key is ignored), and a delivery loop sends what is
due, marks it delivered on a 2xx answer, and otherwise schedules a retry with exponential backoff
(`base_backoff_s * 2**attempts`, capped at `max_backoff_s`, with up to 10% jitter). Once the cap
is reached a receiver that comes back is retried within `max_backoff_s`. A 4xx answer other than
408/425/429 means the request itself is wrong and will never succeed: that delivery is marked
`dead` with the answer kept in `last_error`, as is one still undelivered after `max_age_s`.

Delivery is at-least-once on the wire (a 2xx lost in transit means one resend) and exactly-once
for a receiver that honours the idempotency key header, which every request carries.
"""

from __future__ import annotations

import random
import sqlite3
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from alerts.engine import AlertTransition
from alerts.notify import Notifier

PENDING, DELIVERED, DEAD = "pending", "delivered", "dead"
_PERMANENT_RETRYABLE = {408, 425, 429}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS deliveries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    receiver TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    body BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    next_attempt_at REAL NOT NULL,
    delivered_at REAL,
    last_error TEXT,
    UNIQUE (receiver, idempotency_key)
);
CREATE INDEX IF NOT EXISTS deliveries_due ON deliveries (state, next_attempt_at);
"""


def post(notifier: Notifier, idempotency_key: str, body: bytes, timeout_s: float = 5.0) -> tuple[bool, bool, str | None]:
    """POST one rendered notification; return (delivered, permanent failure, error text)."""
    request = urllib.request.Request(
        notifier.url, data=body, method="POST", headers=notifier.headers(body, idempotency_key)
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read(65536)
            return True, False, None
    except urllib.error.HTTPError as exc:
        detail = exc.read(512).decode("utf-8", "replace") if exc.fp else ""
        permanent = 400 <= exc.code < 500 and exc.code not in _PERMANENT_RETRYABLE
        return False, permanent, f"HTTP {exc.code}: {detail}".strip()
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        return False, False, f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


@dataclass(frozen=True)
class DeliveryReport:
    delivered: int = 0
    retrying: int = 0
    dead: int = 0


class Outbox:
    """Deliveries kept in a SQLite file at `path`; safe to share between threads of one process."""

    def __init__(
        self,
        path: str,
        notifiers: Sequence[Notifier] = (),
        timeout_s: float = 5.0,
        base_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        max_age_s: float = 7 * 24 * 3600,
        batch_size: int = 100,
        clock: Callable[[], float] = time.time,
    ):
        self.path = path
        self.notifiers: dict[str, Notifier] = {n.name: n for n in notifiers}
        self.timeout_s = timeout_s
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_age_s = max_age_s
        self.batch_size = batch_size
        self.clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # an enqueued alert survives a power cut
        self._db.executescript(_SCHEMA)

    # -- producing ---------------------------------------------------------------------------

    def enqueue(self, receiver: str, idempotency_key: str, body: bytes) -> bool:
        """Store one delivery; return False if this receiver already has this key (a repeat)."""
        if receiver not in self.notifiers:
            raise KeyError(f"no notifier named {receiver!r}; configured: {', '.join(self.notifiers) or 'none'}")
        now = self.clock()
        with self._lock:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO deliveries (receiver, idempotency_key, body, created_at, next_attempt_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (receiver, idempotency_key, body, now, now),
            )
            return cur.rowcount == 1

    def handle(self, transitions: Sequence[AlertTransition]) -> None:
        """Enqueue each firing/resolved transition for every notifier (a TransitionSink)."""
        for t in transitions:
            if not t.notifies:
                continue
            for notifier in self.notifiers.values():
                self.enqueue(notifier.name, t.idempotency_key(), notifier.render(t))

    # -- delivering --------------------------------------------------------------------------

    def backoff_s(self, attempts: int) -> float:
        """Delay before retry number `attempts` (1-based), jittered by up to +10%."""
        delay = min(self.max_backoff_s, self.base_backoff_s * 2 ** (attempts - 1))
        return delay * (1 + 0.1 * random.random())

    def deliver_due(self) -> DeliveryReport:
        """Try every delivery that is due now, once; return what happened."""
        now = self.clock()
        with self._lock:
            rows = self._db.execute(
                "SELECT id, receiver, idempotency_key, body, attempts, created_at FROM deliveries"
                " WHERE state = ? AND next_attempt_at <= ? ORDER BY id LIMIT ?",
                (PENDING, now, self.batch_size),
            ).fetchall()
        delivered = retrying = dead = 0
        down: set[str] = set()  # one failed connection per receiver per round is enough
        for row_id, receiver, key, body, attempts, created_at in rows:
            notifier = self.notifiers.get(receiver)
            if notifier is None:
                continue  # configured in another run of the engine; kept until it is configured again
            if receiver in down:
                continue
            ok, permanent, error = post(notifier, key, bytes(body), self.timeout_s)
            attempts += 1
            now = self.clock()
            with self._lock:
                if ok:
                    self._db.execute(
                        "UPDATE deliveries SET state=?, attempts=?, delivered_at=?, last_error=NULL WHERE id=?",
                        (DELIVERED, attempts, now, row_id),
                    )
                    delivered += 1
                elif permanent or now - created_at >= self.max_age_s:
                    self._db.execute(
                        "UPDATE deliveries SET state=?, attempts=?, last_error=? WHERE id=?", (DEAD, attempts, error, row_id)
                    )
                    dead += 1
                else:
                    self._db.execute(
                        "UPDATE deliveries SET attempts=?, next_attempt_at=?, last_error=? WHERE id=?",
                        (attempts, now + self.backoff_s(attempts), error, row_id),
                    )
                    retrying += 1
                    down.add(receiver)
        return DeliveryReport(delivered, retrying, dead)

    def counts(self) -> dict[str, int]:
        """Return {state: deliveries} over the whole outbox."""
        with self._lock:
            return dict(self._db.execute("SELECT state, count(*) FROM deliveries GROUP BY state").fetchall())

    def deliveries(self) -> list[dict]:
        with self._lock:
            cur = self._db.execute(
                "SELECT receiver, idempotency_key, state, attempts, last_error FROM deliveries ORDER BY id"
            )
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row)) for row in cur.fetchall()]

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Deliver until nothing is due or `timeout_s` passes; True when nothing is left pending."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.deliver_due()
            if not self.counts().get(PENDING):
                return True
            time.sleep(0.05)
        return not self.counts().get(PENDING)

    def close(self) -> None:
        with self._lock:
            self._db.close()


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
            self._stop.wait(self.interval_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

