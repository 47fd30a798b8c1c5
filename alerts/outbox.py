"""A persistent outbox: every notification is written to SQLite before anything is sent.

Why: a receiver that is down must get every alert when it comes back, exactly once, even if the
engine restarted in between. So the engine only *enqueues* (a row keyed by receiver and
idempotency key; a second enqueue of the same key is ignored), and a delivery loop sends what is
due, marks it delivered on a 2xx answer, and otherwise schedules a retry with exponential backoff
(`base_backoff_s * 2**attempts`, capped at `max_backoff_s`, with up to 10% jitter). Once the cap
is reached a receiver that comes back is retried within `max_backoff_s`. A 4xx answer other than
408/425/429 means the request itself is wrong and will never succeed: that delivery is marked
`dead` with the answer kept in `last_error`, as is one still undelivered after `max_age_s`.

Scheduling is per receiver. Each configured receiver gets its own `batch_size` due rows per
round, oldest first, so a dead receiver's backlog never delays a live one. A failed attempt that
may succeed later (no answer, a timeout, a 5xx, a redirect, an answer that is not HTTP) holds
*that receiver's* queue until the retry time, so its deliveries stay in order and a dead port
costs one connection per backoff, not one per row. Rows of receivers that are not configured
(left by an earlier run with other URLs) are kept, never sent, never in anyone's way;
`moescope alerts outbox list|drop` shows and drops them. Redirects are never followed: a 3xx is a
failed attempt whose `last_error` says where it pointed.

Each receiver has one deliverer at a time, so no row is ever posted by two: a round for a receiver
holds its lock in this process (a `flush()` beside the `OutboxWorker`, as `session.flush()` does,
skips the receiver the worker is sending to, and waits for it) and a lease in the file
(`receiver_leases`: another process delivering the same file waits; the lease of a process that
was killed lapses after `lease_s`, and the next outbox takes over).

With a `grouping` (`alerts.grouping`), a transition for a receiver that takes groups (JSON, Slack,
Alertmanager webhook payload) waits in a row of its own (role `member`, with its group's key) until
its group is due; then, in one transaction, the group's waiting transitions become one row (role
`group`, the rendered notification) that is delivered like any other, and they read as it does
(delivered, retrying, dead). A crash before that transaction leaves them waiting, one after it
leaves one notification to send: nothing is lost and nothing is posted twice. `counts`,
`deliveries`, `receivers` and `pending` count transitions, never the group rows.

Receivers are stored by their `name`, which carries no secret (`alerts.notify.redact_url`); the
URL with its token lives only in the notifier in memory.

When the file cannot be written (a full disk, or it cannot even be created), the outbox moves to
an in-memory copy with a loud warning, keeps enqueueing and delivering, tries every
`persist_retry_s` to save itself back to the file, and tries once more at `close()`; what it
still could not save is in `unsaved` (and lost when the process ends: a later `alerts run`
replays the store, so undelivered alerts are enqueued again, and delivered ones may be sent once
more under the same idempotency key).

Delivery is at-least-once on the wire (a 2xx lost in transit means one resend) and exactly-once
for a receiver that deduplicates on the idempotency key in the body (see `alerts.notify`). Sending
one notification (`post`) and the thread that runs the rounds (`OutboxWorker`) are
alerts/delivery.py's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import sqlite3
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence

from moescope.alerts.delivery import DeliveryReport, post
from moescope.alerts.engine import RESOLVED, AlertTransition, FlushableSink
from moescope.alerts.grouping import Grouping
from moescope.alerts.notify import (
    GroupNotifier,
    Notifier,
    NotifierError,
    redact_receiver_name,
    transition_document,
    transition_from_document,
)
from moescope.store.location import LOCAL_STATE, StoreLocation, open_location
from moescope.store.location import state_dir as state_folder

log = logging.getLogger(__name__)

PENDING, DELIVERED, DEAD, DROPPED = "pending", "delivered", "dead", "dropped"
SINGLE, MEMBER, GROUP = "single", "member", "group"  # a row's role: sent alone, in a group, or a group
_COLUMNS = ("receiver", "idempotency_key", "body", "state", "attempts", "created_at", "next_attempt_at",
            "delivered_at", "last_error", "role", "group_key", "grouped_in")

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
    role TEXT NOT NULL DEFAULT 'single',
    group_key TEXT,
    grouped_in TEXT,
    UNIQUE (receiver, idempotency_key)
);
DROP INDEX IF EXISTS deliveries_due;
CREATE INDEX IF NOT EXISTS deliveries_receiver_due ON deliveries (receiver, state, next_attempt_at);
CREATE TABLE IF NOT EXISTS receiver_leases (
    receiver TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    expires_at REAL NOT NULL
);
"""


_GROUP_KEY_PREFIX = "group:"  # a group notification's idempotency key; a transition's starts with its fingerprint
_GROUP_COLUMNS = {"role": "TEXT NOT NULL DEFAULT 'single'", "group_key": "TEXT", "grouped_in": "TEXT"}


def notifiers_by_name(notifiers: Sequence[Notifier]) -> dict[str, Notifier]:
    """Return {name: notifier}; raise NotifierError when two share a name (URLs differing only in secrets)."""
    out: dict[str, Notifier] = {}
    for notifier in notifiers:
        if notifier.name in out:
            raise NotifierError(
                f"two receivers have the same name {notifier.name!r}: their URLs differ only in what names leave "
                "out (password, token, query); give each a name of its own, e.g. --webhook ops=URL --webhook dev=URL")
        out[notifier.name] = notifier
    return out


def _redact_stored_names(db: sqlite3.Connection) -> None:
    """Rename receivers an older moescope stored by their full URL (`kind:URL`) to the redacted
    name, and make sure no copy of the old name's bytes is left in the file."""
    changed = False
    for (name,) in db.execute("SELECT DISTINCT receiver FROM deliveries").fetchall():
        clean = redact_receiver_name(name)
        if clean == name:
            continue
        db.execute("UPDATE OR IGNORE deliveries SET receiver = ? WHERE receiver = ?", (clean, name))
        db.execute("DELETE FROM deliveries WHERE receiver = ?", (name,))  # keys the clean name already holds
        changed = True
    if changed:
        with contextlib.suppress(sqlite3.Error):  # secure_delete already zeroed the old cells
            db.execute("VACUUM")
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _prepare(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA secure_delete=ON")  # deleted or renamed rows leave no old bytes behind
    db.executescript(_SCHEMA)
    have = {row[1] for row in db.execute("PRAGMA table_info(deliveries)")}
    for column, declared in _GROUP_COLUMNS.items():  # an outbox written before grouping
        if column not in have:
            db.execute(f"ALTER TABLE deliveries ADD COLUMN {column} {declared}")
    db.execute("CREATE INDEX IF NOT EXISTS deliveries_group ON deliveries (receiver, group_key, role)")
    _redact_stored_names(db)


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection):
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


class Outbox(FlushableSink):
    """Deliveries kept in a SQLite file at `path`; safe to share between threads of one process.

    Each notification is a row per receiver, keyed by the transition's idempotency key, retried
    with exponential backoff until delivered, refused for good, or too old. It never raises because
    the file cannot be created or written: the deliveries then live in memory (`persistent` False,
    `unsaved_reason` says why) and saving is tried again every `persist_retry_s`.

    Args:
        path: the SQLite file.
        notifiers: the receivers (plain JSON, Slack, Alertmanager); each name once.
        timeout_s: the most seconds one delivery attempt may take (default 5).
        base_backoff_s: delay before the first retry, doubled at each further one (default 1 s).
        max_backoff_s: the longest delay between retries (default 30 s).
        max_age_s: a delivery older than this is given up (dead) at its next failure (default 7 days).
        batch_size: the most deliveries tried per receiver per round (default 100).
        clock: the time source, in Unix seconds (tests pass their own).
        persist_retry_s: how often a move back to the file is tried while in memory (default 30 s).
        grouping: how transitions for the JSON, Slack and Alertmanager-webhook receivers are grouped
            into one notification (`alerts.grouping.Grouping`, e.g. a rule pack's `grouping`); None or
            a `group_wait` of 0: one notification per transition.

    Raises:
        NotifierError: when two notifiers share a name.
    """

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
        persist_retry_s: float = 30.0,
        grouping: Grouping | None = None,
    ):
        self.path = path
        self.notifiers = notifiers_by_name(notifiers)
        self.timeout_s = timeout_s
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_age_s = max_age_s
        self.batch_size = batch_size
        self.clock = clock
        self.persist_retry_s = persist_retry_s
        self.grouping = grouping if grouping is not None and grouping.enabled else None
        self._flushing = 0  # flush() calls under way: groups are sent at once, waits or not
        # how long a receiver's lease outlives its holder: many attempts, so a live holder renews it
        # long before, and a killed one's receivers wait at most this long for the next outbox
        self.lease_s = 30.0 + 4 * timeout_s
        self.persistent = True  # False while the deliveries live in memory only
        self.unsaved_reason: str | None = None  # why the file cannot be written, while it cannot
        self.unsaved: dict[str, int] = {}  # after close(): {state: rows} that could not be saved
        self._last_persist_try = time.monotonic()
        self._lock = threading.Lock()
        # One delivering owner per receiver: a thread of this process holds the receiver's lock, and
        # the process holds its lease in the file (another process sharing the file waits for it)
        self._delivering = {name: threading.Lock() for name in self.notifiers}
        self._owner = uuid.uuid4().hex  # this outbox's leases, as the file names them
        self._db: sqlite3.Connection | None  # None once closed
        try:
            self._db = self._open_file()
        except (sqlite3.Error, OSError) as exc:
            self._db = self._to_memory(self._read_only_copy(), exc)

    def _connection(self) -> sqlite3.Connection:
        """The database the deliveries live in; raises RuntimeError once the outbox is closed."""
        if self._db is None:
            raise RuntimeError(f"the alerts outbox {self.path} is closed")
        return self._db

    # -- where the rows live -----------------------------------------------------------------

    def _open_file(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")  # an enqueued alert survives a power cut
            _prepare(db)
        except BaseException:
            db.close()
            raise
        return db

    def _read_only_copy(self) -> sqlite3.Connection | None:
        """The existing file opened read-only (to carry its rows into memory), or None."""
        if not os.path.isfile(self.path):
            return None
        uri = "file:" + urllib.parse.quote(os.path.abspath(self.path))
        for mode in ("?mode=ro", "?mode=ro&immutable=1"):  # immutable: when not even the -shm can be made
            try:
                db = sqlite3.connect(uri + mode, uri=True, check_same_thread=False)
                db.execute("SELECT count(*) FROM deliveries").fetchone()
                return db
            except sqlite3.Error:
                with contextlib.suppress(Exception):
                    db.close()
        return None

    def _to_memory(self, source: sqlite3.Connection | None, exc: BaseException) -> sqlite3.Connection:
        memory = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        if source is not None:
            try:
                source.backup(memory)
            except sqlite3.Error as copy_exc:
                log.error("alerts outbox: could not read %s (%s); starting an empty outbox in memory",
                          self.path, copy_exc)
            finally:
                with contextlib.suppress(sqlite3.Error):
                    source.close()
        _prepare(memory)
        self.persistent = False
        self.unsaved_reason = str(exc) or type(exc).__name__
        self._last_persist_try = time.monotonic()
        log.warning("alerts outbox: cannot write %s (%s): notifications are kept IN MEMORY ONLY and are lost if "
                    "this process stops; delivery goes on, and saving to the file is retried every %g s. "
                    "Free some disk space.", self.path, self.unsaved_reason, self.persist_retry_s)
        return memory

    def _write(self, statements: Callable[[sqlite3.Connection], object]):
        """Run `statements` in one transaction (the caller holds the lock); if the file cannot take
        the write, move to memory and run them there."""
        try:
            with _transaction(self._connection()) as db:
                return statements(db)
        except sqlite3.OperationalError as exc:
            if not self.persistent:
                raise
            self._db = self._to_memory(self._connection(), exc)
            with _transaction(self._connection()) as db:
                return statements(db)

    def _try_persist(self) -> bool:
        """Merge the in-memory rows into the file and go back to it; True on success (lock held)."""
        self._last_persist_try = time.monotonic()
        db = None
        try:
            db = self._open_file()
            rows = self._connection().execute(f"SELECT {', '.join(_COLUMNS)} FROM deliveries ORDER BY id").fetchall()
            updates = ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS[3:])
            with _transaction(db):
                db.execute("DELETE FROM receiver_leases WHERE owner = ?", (self._owner,))  # taken before the move
                db.executemany(
                    f"INSERT INTO deliveries ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
                    f" ON CONFLICT (receiver, idempotency_key) DO UPDATE SET {updates}", rows)
        except (sqlite3.Error, OSError) as exc:
            if db is not None:
                with contextlib.suppress(sqlite3.Error):
                    db.close()
            self.unsaved_reason = str(exc) or type(exc).__name__
            return False
        self._connection().close()
        self._db = db
        self.persistent = True
        self.unsaved_reason = None
        log.warning("alerts outbox: saved %d notifications to %s; the outbox is on disk again", len(rows), self.path)
        return True

    # -- producing ---------------------------------------------------------------------------

    def enqueue(self, receiver: str, idempotency_key: str, body: bytes, group_key: str | None = None) -> bool:
        """Store one delivery.

        A new delivery joins its receiver's schedule: while the receiver is in backoff, it waits with
        the others, so the receiver gets its notifications in order.

        Args:
            receiver: a configured notifier's name.
            idempotency_key: what makes the delivery unique for this receiver.
            body: the rendered notification; with `group_key`, the transition's document
                (`alerts.notify.transition_document`), sent later in its group's notification.
            group_key: the group it waits in (`alerts.grouping.Grouping.group_key`); None: sent alone.

        Returns:
            False if this receiver already has this key (a repeat), else True.

        Raises:
            KeyError: for a receiver that is not configured.
            RuntimeError: once the outbox is closed.
        """
        if receiver not in self.notifiers:
            raise KeyError(f"no notifier named {receiver!r}; configured: {', '.join(self.notifiers) or 'none'}")
        now = self.clock()

        def insert(db: sqlite3.Connection) -> bool:
            cur = db.execute(
                "INSERT OR IGNORE INTO deliveries (receiver, idempotency_key, body, created_at, next_attempt_at,"
                " role, group_key) VALUES (?, ?, ?, ?, max(?, coalesce((SELECT max(next_attempt_at) FROM deliveries"
                " WHERE receiver = ? AND state = ?), 0)), ?, ?)",
                (receiver, idempotency_key, body, now, now, receiver, PENDING,
                 SINGLE if group_key is None else MEMBER, group_key),
            )
            return cur.rowcount == 1

        with self._lock:
            return bool(self._write(insert))

    def handle(self, transitions: Sequence[AlertTransition]) -> None:
        """Enqueue each firing/resolved transition for every notifier (a TransitionSink); with
        `grouping`, a receiver that takes groups gets it later, in its group's notification.

        Args:
            transitions: alert transitions; those that do not notify (pending, inactive) are skipped.
        """
        for t in transitions:
            if not t.notifies:
                continue
            for notifier in self.notifiers.values():
                if self.grouping is not None and isinstance(notifier, GroupNotifier):
                    self.enqueue(notifier.name, t.idempotency_key(), json.dumps(transition_document(t)).encode(),
                                 group_key=self.grouping.group_key(t.labels))
                else:
                    self.enqueue(notifier.name, t.idempotency_key(), notifier.render(t))

    # -- delivering --------------------------------------------------------------------------

    def backoff_s(self, attempts: int) -> float:
        """Delay before a retry: `base_backoff_s` doubled per attempt, at most `max_backoff_s`, jittered by up to +10%.

        Args:
            attempts: the retry's number (1-based).

        Returns:
            Seconds.
        """
        delay = min(self.max_backoff_s, self.base_backoff_s * 2 ** (attempts - 1))
        return delay * (1 + 0.1 * random.random())

    def deliver_due(self) -> DeliveryReport:
        """Try what is due now, receiver by receiver (up to `batch_size` each, oldest first).

        A receiver that fails is tried once per round (its later deliveries wait for its backoff); the
        others go on.

        Returns:
            A DeliveryReport: delivered, retrying and dead (given up) counts of this round.
        """
        if not self.persistent and time.monotonic() - self._last_persist_try >= self.persist_retry_s:
            with self._lock:
                self._try_persist()
        totals = [0, 0, 0]
        for name, notifier in self.notifiers.items():
            for i, n in enumerate(self._deliver_to(name, notifier)):
                totals[i] += n
        return DeliveryReport(*totals)

    def _lease(self, name: str, now: float) -> bool:
        """Take or extend this outbox's lease on delivering to `name`; False while another holds it.

        The lease outlives one attempt (`timeout_s`) with room to spare, and is extended before each,
        so it lapses only when its holder stopped (a killed process): then the next outbox takes over
        within `lease_s`."""
        return bool(self._write(lambda db: db.execute(
            "INSERT INTO receiver_leases (receiver, owner, expires_at) VALUES (?, ?, ?)"
            " ON CONFLICT (receiver) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at"
            " WHERE receiver_leases.owner = excluded.owner OR receiver_leases.expires_at <= ?",
            (name, self._owner, now + self.lease_s, now)).rowcount))

    def _deliver_to(self, name: str, notifier: Notifier) -> tuple[int, int, int]:
        """One round for one receiver, by its only deliverer: a round already under way for it (a
        worker's beside a `flush()`, or another process's on the same file) makes this one a no-op."""
        delivering = self._delivering[name]
        if not delivering.acquire(blocking=False):
            return 0, 0, 0
        try:
            with self._lock:
                now = self.clock()
                due = self._connection().execute(
                    "SELECT 1 FROM deliveries WHERE receiver = ? AND state = ? AND role != ? AND next_attempt_at <= ?"
                    " LIMIT 1", (name, PENDING, MEMBER, now)).fetchone()
                grouper = notifier if isinstance(notifier, GroupNotifier) else None
                groups = self._due_groups(self._connection(), name, now) if grouper is not None else []
                if (due is None and not groups) or not self._lease(name, now):  # nothing to send needs no lease
                    return 0, 0, 0
                if grouper is not None and groups:
                    self._write(lambda db: self._make_groups(db, name, grouper, now))
            try:
                return self._deliver_rows(name, notifier)
            finally:
                with self._lock:
                    self._write(lambda db: db.execute("DELETE FROM receiver_leases WHERE receiver = ? AND owner = ?",
                                                      (name, self._owner)))
        finally:
            delivering.release()

    def _deliver_rows(self, name: str, notifier: Notifier) -> tuple[int, int, int]:
        with self._lock:
            rows = self._connection().execute(
                "SELECT id, idempotency_key, body, attempts, created_at FROM deliveries"
                " WHERE receiver = ? AND state = ? AND role != ? AND next_attempt_at <= ? ORDER BY id LIMIT ?",
                (name, PENDING, MEMBER, self.clock(), self.batch_size),
            ).fetchall()
        delivered = dead = 0
        renew_at = self.clock() + self.lease_s / 2
        for row_id, key, body, attempts, created_at in rows:
            if self.clock() >= renew_at:
                renew_at = self.clock() + self.lease_s / 2
                with self._lock:
                    if not self._lease(name, self.clock()):  # it lapsed (this process stalled): its new holder sends
                        return delivered, 0, dead
            try:
                ok, permanent, error = post(notifier, key, bytes(body), self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - one receiver must never break the round for the others
                ok, permanent, error = False, False, f"{type(exc).__name__}: {exc}"
            attempts += 1
            now = self.clock()
            with self._lock:
                if ok:
                    self._write(lambda db: self._settle(
                        db, name, row_id, key, "state=?, attempts=?, delivered_at=?, last_error=NULL",
                        (DELIVERED, attempts, now)))
                    delivered += 1
                    continue
                if permanent or now - created_at >= self.max_age_s:
                    self._write(lambda db: self._settle(
                        db, name, row_id, key, "state=?, attempts=?, last_error=?", (DEAD, attempts, error)))
                    log.warning("alerts outbox: gave up a notification to %s after %d attempts: %s",
                                name, attempts, error)
                    dead += 1
                    continue
                delay = self.backoff_s(attempts)

                def hold(db: sqlite3.Connection) -> None:
                    self._settle(db, name, row_id, key, "attempts=?, next_attempt_at=?, last_error=?",
                                 (attempts, now + delay, error))
                    db.execute("UPDATE deliveries SET next_attempt_at=? WHERE receiver=? AND state=?"
                               " AND next_attempt_at < ?", (now + delay, name, PENDING, now + delay))

                self._write(hold)
            log.warning("alerts outbox: %s did not take a notification (attempt %d): %s; retrying in %.1f s",
                        name, attempts, error, delay)
            return delivered, 1, dead
        return delivered, 0, dead

    @staticmethod
    def _settle(db: sqlite3.Connection, name: str, row_id: int, key: str, assignments: str, values: tuple) -> None:
        """Update a sent row, and, for a group, the transitions it carries (they read as it does)."""
        db.execute(f"UPDATE deliveries SET {assignments} WHERE id=?", (*values, row_id))
        db.execute(f"UPDATE deliveries SET {assignments} WHERE receiver=? AND grouped_in=?", (*values, name, key))

    def _due_groups(self, db: sqlite3.Connection, name: str, now: float) -> list[str]:
        """The group keys of `name`'s waiting transitions whose notification is due (all of them
        while a flush() runs): a new group `group_wait` after its first transition came, a group
        that already notified `group_interval` after its last notification, as Alertmanager's."""
        if self.grouping is None:
            return []
        waiting = db.execute(
            "SELECT group_key, min(created_at) FROM deliveries WHERE receiver = ? AND role = ? AND state = ?"
            " AND grouped_in IS NULL GROUP BY group_key ORDER BY min(id)", (name, MEMBER, PENDING)).fetchall()
        if self._flushing:
            return [key for key, _ in waiting]
        due = []
        for group_key, first_at in waiting:
            last = db.execute("SELECT max(created_at) FROM deliveries WHERE receiver = ? AND role = ?"
                              " AND group_key = ?", (name, GROUP, group_key)).fetchone()[0]
            if last is not None and self._group_open(db, name, group_key):
                due_at = last + self.grouping.group_interval_s
            else:  # a new group, or one whose alerts all resolved: Alertmanager destroys it
                due_at = first_at + self.grouping.group_wait_s
            if due_at <= now:
                due.append(group_key)
        return due

    @staticmethod
    def _group_open(db: sqlite3.Connection, name: str, group_key: str) -> bool:
        """Whether an alert of the group was last notified firing (the group still holds it)."""
        last: dict[str, str] = {}  # fingerprint -> the status it was last notified with
        rows = db.execute("SELECT idempotency_key FROM deliveries WHERE receiver = ? AND role = ? AND group_key = ?"
                          " AND grouped_in IS NOT NULL ORDER BY id", (name, MEMBER, group_key))
        for (key,) in rows:
            last[key.partition(":")[0]] = key.rpartition(":")[2]  # <fingerprint>:<episode start>:<status>
        return any(status != RESOLVED for status in last.values())

    def _make_groups(self, db: sqlite3.Connection, name: str, notifier: GroupNotifier, now: float) -> int:
        """Turn each due group's waiting transitions into one notification row, in this transaction:
        a crash before its commit leaves them waiting, one after leaves one row to send; returns rows made."""
        made = 0
        for group_key in self._due_groups(db, name, now):
            members = db.execute(
                "SELECT idempotency_key, body FROM deliveries WHERE receiver = ? AND role = ? AND state = ?"
                " AND group_key = ? AND grouped_in IS NULL ORDER BY id", (name, MEMBER, PENDING, group_key)).fetchall()
            keys = [key for key, _ in members]
            digest = hashlib.sha256("\n".join([group_key, *keys]).encode()).hexdigest()[:32]
            key = _GROUP_KEY_PREFIX + digest
            transitions = [transition_from_document(json.loads(body)) for _, body in members]
            body = notifier.render_group(key, json.loads(group_key), transitions)
            db.execute(
                "INSERT INTO deliveries (receiver, idempotency_key, body, created_at, next_attempt_at, role, group_key)"
                " VALUES (?, ?, ?, ?, max(?, coalesce((SELECT max(next_attempt_at) FROM deliveries"
                " WHERE receiver = ? AND state = ? AND role != ?), 0)), ?, ?)",
                (name, key, body, now, now, name, PENDING, MEMBER, GROUP, group_key))
            db.executemany("UPDATE deliveries SET grouped_in = ? WHERE receiver = ? AND idempotency_key = ?",
                           [(key, name, k) for k in keys])
            made += 1
        return made

    # -- reading and housekeeping ------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """The deliveries over the whole outbox, per state.

        Returns:
            {state: deliveries}: pending, delivered, dead, dropped.
        """
        with self._lock:
            return dict(self._connection().execute(
                "SELECT state, count(*) FROM deliveries WHERE role != ? GROUP BY state", (GROUP,)).fetchall())

    def pending(self) -> int:
        """How many deliveries to the configured receivers are still to be made.

        Returns:
            Pending deliveries (0 without notifiers).
        """
        if not self.notifiers:
            return 0
        with self._lock:
            marks = ", ".join("?" * len(self.notifiers))
            return self._connection().execute(
                f"SELECT count(*) FROM deliveries WHERE state = ? AND role != ? AND receiver IN ({marks})",
                (PENDING, GROUP, *self.notifiers)).fetchone()[0]

    def deliveries(self) -> list[dict]:
        """Every delivery, oldest first.

        Returns:
            One dict per delivery: receiver, idempotency_key, state, attempts, last_error.
        """
        with self._lock:
            cur = self._connection().execute(
                "SELECT receiver, idempotency_key, state, attempts, last_error FROM deliveries WHERE role != ?"
                " ORDER BY id", (GROUP,))
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row)) for row in cur.fetchall()]

    def receivers(self) -> list[dict]:
        """One summary per receiver name in the outbox.

        Returns:
            Dicts with receiver, configured (in this Outbox), pending, delivered, dead, dropped,
                oldest_pending_at (Unix s) and last_error.
        """
        with self._lock:
            rows = self._connection().execute(
                "SELECT receiver, sum(state = ?), sum(state = ?), sum(state = ?), sum(state = ?),"
                " min(CASE WHEN state = ? THEN created_at END),"
                " (SELECT last_error FROM deliveries d2 WHERE d2.receiver = d.receiver AND last_error IS NOT NULL"
                "  ORDER BY id DESC LIMIT 1)"
                " FROM deliveries d WHERE role != ? GROUP BY receiver ORDER BY receiver",
                (PENDING, DELIVERED, DEAD, DROPPED, PENDING, GROUP),
            ).fetchall()
        keys = ("receiver", PENDING, DELIVERED, DEAD, DROPPED, "oldest_pending_at", "last_error")
        return [dict(zip(keys, row), configured=row[0] in self.notifiers) for row in rows]

    def drop(self, receiver: str) -> int:
        """Mark every undelivered (pending or dead) delivery to `receiver` as dropped.

        Dropped rows keep their keys, so the same alerts are not enqueued again.

        Args:
            receiver: the receiver's name (configured or not).

        Returns:
            How many deliveries were dropped.
        """
        with self._lock:
            return self._write(lambda db: db.execute(
                "UPDATE deliveries SET state = ? WHERE receiver = ? AND state IN (?, ?)",
                (DROPPED, receiver, PENDING, DEAD)).rowcount)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Deliver until nothing is due for the configured receivers or `timeout_s` passes.

        Args:
            timeout_s: the most seconds to keep trying (default 10).

        Returns:
            True when nothing is left pending for them.
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._flushing += 1
        try:
            while time.monotonic() < deadline:
                self.deliver_due()
                if not self.pending():
                    return True
                time.sleep(0.05)
            return not self.pending()
        finally:
            with self._lock:
                self._flushing -= 1

    def close(self) -> None:
        """Save to the file if the outbox had moved to memory, and close; safe twice.

        What could not be saved is logged and counted in `unsaved` ({state: rows}).
        """
        with self._lock:
            if self._db is None:
                return
            if not self.persistent and not self._try_persist():
                self.unsaved = dict(self._db.execute("SELECT state, count(*) FROM deliveries GROUP BY state"))
                log.error("alerts outbox: could not save to %s (%s): %s notifications kept in memory are lost",
                          self.path, self.unsaved_reason, sum(self.unsaved.values()))
            self._db.close()
            self._db = None


OUTBOX_NAME = "alerts-outbox.sqlite"  # in the store's local state folder
OUTBOX_FILE = os.path.join(LOCAL_STATE, OUTBOX_NAME)  # a local store's outbox, under its root


def outbox_path(store: str | os.PathLike | StoreLocation, state_dir: str | os.PathLike | None = None) -> str:
    """Where a store's alerts outbox lives by default: in the store's local state folder
    (`moescope.store.location.state_dir`): `<root>/.moescope/alerts-outbox.sqlite` for a local
    store; `state_dir`, else `~/.cache/moescope/<hash of the URL>/`, for a store on object storage,
    which cannot hold a SQLite file."""
    return os.path.join(state_folder(open_location(store), state_dir), OUTBOX_NAME)


def read_deliveries(path: str | os.PathLike, fingerprints: Sequence[str] | None = None,
                    limit: int = 1000) -> list[dict] | None:
    """The newest `limit` notifications in an outbox file, opened read-only (a reader such as the
    dashboard never writes it), newest first, optionally only those of the given alert fingerprints.

    Each: fingerprint, receiver (its name: never a secret URL), state (pending, delivered, dead,
    dropped), attempts, created_at, delivered_at (Unix seconds; None until delivered), last_error.
    None when there is no outbox file, or one this version cannot read.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        return None
    try:
        con = sqlite3.connect(f"file:{urllib.parse.quote(path)}?mode=ro", uri=True, timeout=2.0)
    except sqlite3.Error:
        return None
    try:
        rows = con.execute("SELECT receiver, idempotency_key, state, attempts, created_at, delivered_at, last_error "
                           "FROM deliveries ORDER BY id DESC LIMIT ?", (int(limit),)).fetchall()
    except sqlite3.Error:  # an outbox of another version: nothing rather than a failure
        return None
    finally:
        con.close()
    wanted = None if fingerprints is None else set(fingerprints)
    out = []
    for receiver, key, state, attempts, created, delivered, error in rows:
        if key.startswith(_GROUP_KEY_PREFIX):  # a group's notification: its transitions' rows read as it does
            continue
        fp = key.split(":", 1)[0]
        if wanted is None or fp in wanted:
            out.append({"fingerprint": fp, "receiver": redact_receiver_name(receiver), "state": state,
                        "attempts": attempts, "created_at": created, "delivered_at": delivered, "last_error": error})
    return out
