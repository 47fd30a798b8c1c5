"""Two flushers side by side never post one row twice: the outbox's delivery worker and a
`flush()` (what `session.flush()` and the demo's settling do), and two outboxes on one file (two
processes delivering the same store's outbox), against a real local HTTP receiver."""

from __future__ import annotations

import collections
import threading

from moescope.alerts.delivery import OutboxWorker
from moescope.alerts.notify import WebhookNotifier
from moescope.alerts.outbox import DELIVERED, Outbox
from tests.support.alert_delivery import transitions
from tests.support.fixtures.servers import Receiver

ROUNDS = 15
LAYERS = tuple(range(6))  # 6 firing + 6 resolved notifications per round


def _posts_per_key(receiver: Receiver, path: str) -> collections.Counter:
    return collections.Counter(r.json()["idempotency_key"] for r in receiver.received(path))


def _side_by_side(*flushes) -> None:
    start = threading.Barrier(len(flushes))

    def run(flush):
        start.wait()
        flush()

    threads = [threading.Thread(target=run, args=(f,)) for f in flushes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_a_flush_beside_the_delivery_worker_posts_each_row_once(tmp_path):
    receiver = Receiver(delay_s=0.002)  # a receiver that takes a moment widens the window a race needs
    expected = sorted(t.idempotency_key() for t in transitions(LAYERS))
    try:
        for n in range(ROUNDS):
            path = f"/r{n}"
            outbox = Outbox(str(tmp_path / f"outbox{n}.db"), [WebhookNotifier(receiver.url + path)])
            worker = OutboxWorker(outbox, interval_s=0.001)
            outbox.handle(transitions(LAYERS))
            _side_by_side(worker.start, lambda: outbox.flush(10.0))
            assert outbox.flush(10.0)
            worker.stop()
            posts = _posts_per_key(receiver, path)
            assert sorted(posts) == expected, f"round {n}: not every row was posted"
            assert set(posts.values()) == {1}, f"round {n}: rows posted more than once: {posts}"
            assert outbox.counts() == {DELIVERED: len(expected)}
            outbox.close()
    finally:
        receiver.stop()


def test_two_outboxes_on_one_file_post_each_row_once(tmp_path):
    """Two processes delivering one store's outbox (`moescope alerts run` started twice) share the
    file, not a lock in memory: the lease in the file keeps them from posting one row twice."""
    receiver = Receiver(delay_s=0.002)
    expected = sorted(t.idempotency_key() for t in transitions(LAYERS))
    try:
        for n in range(ROUNDS):
            path = f"/r{n}"
            file = str(tmp_path / f"outbox{n}.db")
            first = Outbox(file, [WebhookNotifier(receiver.url + path, name="hook")])
            second = Outbox(file, [WebhookNotifier(receiver.url + path, name="hook")])
            first.handle(transitions(LAYERS))
            _side_by_side(lambda: first.flush(10.0), lambda: second.flush(10.0))
            posts = _posts_per_key(receiver, path)
            assert sorted(posts) == expected, f"round {n}: not every row was posted"
            assert set(posts.values()) == {1}, f"round {n}: rows posted more than once: {posts}"
            first.close()
            second.close()
    finally:
        receiver.stop()
