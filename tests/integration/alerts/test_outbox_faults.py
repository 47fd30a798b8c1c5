"""The outbox against hostile and unlucky receivers: a dead one with a backlog, one that answers
with an SSH banner, one that redirects to a login page, and URLs that carry secrets."""

from __future__ import annotations

import glob
import logging
import socket
import sqlite3
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moescope.alerts.notify import NotifierError, SlackNotifier, WebhookNotifier, redact_url
from moescope.alerts.outbox import DELIVERED, DROPPED, PENDING, Outbox
from moescope.cli import main as moescope_main
from moescope.cli.alerts import receivers_from_options
from tests.support.alert_delivery import Clock, transitions
from tests.support.fixtures.servers import Receiver, free_port


class BannerServer:
    """A TCP server on 127.0.0.1 that answers every connection like sshd: a banner, not HTTP."""

    BANNER = b"SSH-2.0-OpenSSH_9.6p1 Debian-4\r\n"

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(65536)  # the client's request, as sshd would read a client banner
                    conn.sendall(self.BANNER)
                except OSError:
                    pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


class RedirectingServer:
    """Answers every POST with 302 to a login page, and records any GET that follows."""

    def __init__(self):
        self.posts: list[str] = []
        self.gets: list[tuple[str, dict]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.posts.append(self.path)
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{server.port}/login?next=/hook")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self):  # noqa: N802
                server.gets.append((self.path, dict(self.headers.items())))
                self.send_response(200)
                self.send_header("Content-Length", "5")
                self.end_headers()
                self.wfile.write(b"login")

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def pending_rows(path: str, receiver: str) -> list[tuple[int, float]]:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT attempts, next_attempt_at FROM deliveries WHERE receiver=? AND state=?",
                          (receiver, PENDING)).fetchall()


# -- item 7: a dead receiver's backlog never blocks a live one -----------------------------------

def test_a_dead_receiver_with_a_long_backlog_does_not_starve_a_live_one(tmp_path, receiver):
    clock = Clock()
    path = str(tmp_path / "outbox.db")
    dead = WebhookNotifier(f"http://127.0.0.1:{free_port()}/hook", name="dead")  # nothing listens: refused
    live = WebhookNotifier(receiver.url + "/hook", name="live")
    outbox = Outbox(path, [dead, live], clock=clock, batch_size=100)
    try:
        for i in range(150):  # a backlog older than anything the live receiver is owed
            outbox.enqueue("dead", f"backlog-{i}", b'{"n": %d}' % i)
        found = transitions(layers=(0, 1, 2))
        outbox.handle(found)
        report = outbox.deliver_due()
        got = sorted(r.json()["idempotency_key"] for r in receiver.received("/hook"))
        assert got == sorted(t.idempotency_key() for t in found)
        assert report.delivered == len(found) == 6 and report.retrying == 1
        # the dead receiver was tried once, and its whole queue waits for that retry
        rows = pending_rows(path, "dead")
        assert len(rows) == 156 and sum(a for a, _ in rows) == 1
        assert min(t for _, t in rows) > clock.now
        # what the dead receiver is owed is still there, in order, when it comes back
        assert outbox.deliver_due().retrying == 0
    finally:
        outbox.close()


def test_rows_of_a_receiver_no_longer_configured_are_kept_listed_and_dropped(tmp_path, receiver, capsys):
    store = tmp_path / "store"
    store.mkdir()
    path = str(tmp_path / "outbox.db")
    old = WebhookNotifier(f"http://127.0.0.1:{free_port()}/old-hook")
    outbox = Outbox(path, [old])
    for i in range(150):
        outbox.enqueue(old.name, f"old-{i}", b"{}")
    outbox.close()

    # a later `alerts run` with another URL: the old rows are neither sent nor in the way
    live = WebhookNotifier(receiver.url + "/hook")
    outbox = Outbox(path, [live])
    try:
        outbox.handle(transitions())
        assert outbox.deliver_due().delivered == 2
        assert len(receiver.received("/hook")) == 2
        assert outbox.counts() == {PENDING: 150, DELIVERED: 2}
    finally:
        outbox.close()

    assert moescope_main(["alerts", "outbox", "list", str(store), "--outbox", path]) == 0
    listing = capsys.readouterr().out
    old_line = next(line for line in listing.splitlines() if old.name in line)
    assert "150" in old_line and "pending" in old_line
    assert moescope_main(["alerts", "outbox", "drop", str(store), "--outbox", path, "--receiver", old.name]) == 0
    assert "150" in capsys.readouterr().out
    with sqlite3.connect(path) as db:
        states = dict(db.execute("SELECT state, count(*) FROM deliveries GROUP BY state").fetchall())
    assert states == {DROPPED: 150, DELIVERED: 2}
    # a dropped row keeps its key: the same alert configured again is not sent again
    outbox = Outbox(path, [old])
    try:
        assert outbox.enqueue(old.name, "old-0", b"{}") is False
    finally:
        outbox.close()
    assert moescope_main(["alerts", "outbox", "drop", str(store), "--outbox", path, "--receiver", "nobody"]) == 2
    assert "no undelivered notification" in capsys.readouterr().err


# -- item 8: an answer that is not HTTP is a failed attempt, not a broken round ------------------

def test_a_port_answering_with_an_ssh_banner_is_a_failed_attempt_and_the_others_are_delivered(tmp_path, receiver):
    clock = Clock()
    ssh = BannerServer()
    path = str(tmp_path / "outbox.db")
    try:
        notifiers = [WebhookNotifier(ssh.url, name="ssh"), WebhookNotifier(receiver.url + "/hook", name="ok")]
        outbox = Outbox(path, notifiers, clock=clock)
        outbox.handle(transitions())
        report = outbox.deliver_due()
        assert (report.delivered, report.retrying, report.dead) == (2, 1, 0)
        assert ssh.connections == 1 and len(receiver.received("/hook")) == 2
        states = {(d["receiver"], d["state"]) for d in outbox.deliveries()}
        assert states == {("ssh", PENDING), ("ok", DELIVERED)}
        ssh_rows = [d for d in outbox.deliveries() if d["receiver"] == "ssh"]
        assert "BadStatusLine" in ssh_rows[0]["last_error"] and "SSH-2.0" in ssh_rows[0]["last_error"]
        assert sorted(a for a, _ in pending_rows(path, "ssh")) == [0, 1]
        assert all(t >= clock.now + 1.0 for _, t in pending_rows(path, "ssh"))  # backoff, not hammering
        clock.now += 2
        assert outbox.deliver_due().retrying == 1 and ssh.connections == 2
        outbox.close()
    finally:
        ssh.stop()


# -- item 9: a redirect is never followed and never counts as delivered --------------------------

def test_a_redirect_is_a_failure_logged_with_its_location_and_is_not_followed(tmp_path, caplog):
    clock = Clock()
    server = RedirectingServer()
    try:
        outbox = Outbox(str(tmp_path / "outbox.db"), [WebhookNotifier(server.url, name="sso", secret="s")], clock=clock)
        outbox.handle(transitions()[:1])
        with caplog.at_level(logging.WARNING, logger="moescope.alerts.outbox"):
            report = outbox.deliver_due()
        assert (report.delivered, report.retrying) == (0, 1)
        assert server.posts == ["/hook"] and server.gets == []  # no body-less GET with our signature
        [row] = outbox.deliveries()
        assert row["state"] == PENDING and "302" in row["last_error"] and "/login" in row["last_error"]
        assert any("302" in r.getMessage() and "/login" in r.getMessage() for r in caplog.records)
        outbox.close()
    finally:
        server.stop()


def test_test_webhook_reports_a_redirect_as_a_failure(capsys):
    server = RedirectingServer()
    try:
        assert moescope_main(["alerts", "test-webhook", server.url, "--timeout", "3"]) == 1
        err = capsys.readouterr().err
        assert "302" in err and "/login" in err and server.gets == []
    finally:
        server.stop()


# -- item 13: no secret at rest ------------------------------------------------------------------

@pytest.mark.parametrize("url, shown", [
    ("https://hooks.slack.com/services/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",
     "https://hooks.slack.com/services/T0123ABCD/B0456EFGH/***"),
    ("https://alice:hunter2@alerts.example.com:8443/moescope/in", "https://alerts.example.com:8443/moescope/in"),
    ("https://example.com/hook?token=abc123&channel=ops#frag", "https://example.com/hook?***"),
    ("https://discord.com/api/webhooks/123456789012345678/Zx9-Qw8_er7Ty6Ui5Op4As3Df2Gh1Jk0LzXcVbNm",
     "https://discord.com/api/webhooks/123456789012345678/***"),
    ("https://events.pagerduty.com/integration/0123456789abcdef0123456789abcdef/enqueue",
     "https://events.pagerduty.com/integration/***/enqueue"),
    ("http://127.0.0.1:9093/api/v2/alerts", "http://127.0.0.1:9093/api/v2/alerts"),
    ("http://[::1]:8080/hook", "http://[::1]:8080/hook"),
])
def test_redacted_receiver_names(url, shown):
    assert redact_url(url) == shown


SECRETS = ("hunter2", "alice", "vKx3bQ9sLmN2pR7tWz4yA1cD", "tok3n-s3cr3t")


def secret_receivers(receiver: Receiver) -> list:
    host = receiver.url.split("://", 1)[1]
    return [
        WebhookNotifier(f"http://alice:hunter2@{host}/services/T0123ABCD/B0456EFGH/vKx3bQ9sLmN2pR7tWz4yA1cD"),
        SlackNotifier(f"http://{host}/slack?token=tok3n-s3cr3t"),
    ]


def test_no_secret_of_a_receiver_url_lands_in_the_outbox_file(tmp_path, receiver):
    path = str(tmp_path / "outbox.db")
    notifiers = secret_receivers(receiver)
    outbox = Outbox(path, notifiers)
    try:
        outbox.handle(transitions())
        assert outbox.deliver_due().delivered == 4
        # the live configuration still sends to the secret URLs
        assert len(receiver.received("/services/T0123ABCD/B0456EFGH/vKx3bQ9sLmN2pR7tWz4yA1cD")) == 2
        assert len(receiver.received("/slack?token=tok3n-s3cr3t")) == 2
        [signed] = receiver.received("/services/T0123ABCD/B0456EFGH/vKx3bQ9sLmN2pR7tWz4yA1cD")[:1]
        assert signed.headers["Authorization"] == "Basic YWxpY2U6aHVudGVyMg=="  # alice:hunter2 as basic auth
        names = {d["receiver"] for d in outbox.deliveries()}
        assert names == {n.name for n in notifiers} and all("***" in n for n in names)
        files = glob.glob(path + "*")
        assert len(files) >= 2  # the database and its write-ahead log: both are checked
        for file in files:
            data = open(file, "rb").read()
            for secret in SECRETS:
                assert secret.encode() not in data, (file, secret)
    finally:
        outbox.close()


def test_an_old_outbox_naming_receivers_by_full_url_is_redacted_on_open(tmp_path, receiver):
    path = str(tmp_path / "outbox.db")
    [hook, _] = secret_receivers(receiver)
    legacy = f"webhook:{hook.url}"
    Outbox(path, []).close()  # create the schema
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO deliveries (receiver, idempotency_key, body, created_at, next_attempt_at)"
                   " VALUES (?, 'k1', x'7b7d', 0, 0)", (legacy,))
    db.close()
    outbox = Outbox(path, [hook])
    try:
        assert [d["receiver"] for d in outbox.deliveries()] == [hook.name]
        assert outbox.deliver_due().delivered == 1  # still delivered, to the configured secret URL
    finally:
        outbox.close()
    for file in glob.glob(path + "*"):
        data = open(file, "rb").read()
        assert b"hunter2" not in data and b"vKx3bQ9sLmN2pR7tWz4yA1cD" not in data, file


def test_receivers_that_differ_only_in_secrets_need_names(tmp_path, capsys):
    a = WebhookNotifier("https://example.com/hook?token=one")
    b = WebhookNotifier("https://example.com/hook?token=two")
    with pytest.raises(NotifierError, match="same name"):
        Outbox(str(tmp_path / "o.db"), [a, b])
    store = tmp_path / "store"
    code = moescope_main(["alerts", "run", str(store), "--once", "--webhook", "https://example.com/hook?token=one",
                          "--webhook", "https://example.com/hook?token=two"])
    assert code == 2
    assert "give each a name" in capsys.readouterr().err
    [ops, dev] = receivers_from_options(webhook=["ops=https://example.com/hook?token=one",
                                                 "dev=https://example.com/hook?token=two"])
    assert (ops.name, ops.url, dev.name) == ("webhook:ops", "https://example.com/hook?token=one", "webhook:dev")


def test_the_drift_page_shows_receivers_redacted_even_from_an_old_outbox(tmp_path, receiver, monkeypatch):
    from moescope.alerts.rules import parse_rules
    from moescope.alerts.storage import StoreAlertRunner
    from tests.support.alert_records import SKEWED, write_steps
    from tests.support.pages import app_for, assert_clean, open_page

    root = tmp_path / "store"
    write_steps(str(root), [SKEWED] * 3, close=False)  # a run still being recorded
    path = root / ".moescope" / "alerts-outbox.sqlite"
    path.parent.mkdir()
    notifiers = secret_receivers(receiver)
    outbox = Outbox(str(path), notifiers)
    runner = StoreAlertRunner(str(root), parse_rules("rules:\n  - {name: Skew, expr: load_max_mean > 2, for: 0}\n"),
                              sinks=[outbox])
    [firing] = [t for t in runner.poll_once() if t.state == "firing"]
    assert outbox.flush(5)
    outbox.close()
    with sqlite3.connect(path) as db:  # a row as an older moescope wrote it: named by the full URL
        db.execute("INSERT INTO deliveries (receiver, idempotency_key, body, created_at, next_attempt_at)"
                   " VALUES (?, ?, x'7b7d', 0, 0)", (f"webhook:{notifiers[0].url}", f"{firing.fingerprint}:old:firing"))
    db.close()

    at = open_page(app_for(monkeypatch, str(root)), "views/drift.py")
    assert_clean(at)
    [deliveries] = [d.value for d in at.dataframe if "receiver" in d.value.columns]
    assert set(deliveries.receiver) == {n.name for n in notifiers}  # the old row too, redacted
    shown = [str(e.value) for kind in ("markdown", "caption", "text", "info", "success", "subheader")
             for e in at.get(kind)] + [d.value.to_csv() for d in at.dataframe]
    for secret in SECRETS:
        assert not [s for s in shown if secret in s], secret
