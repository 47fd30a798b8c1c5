"""Real parts for the alerts tests: a local HTTP receiver, Prometheus and Alertmanager servers.

Everything binds 127.0.0.1 on a free port, lives in a temporary folder, waits a bounded time,
and is shut down by the fixture whatever the test did. Prometheus and Alertmanager are the
Debian packages; without them those tests skip, saying how to install them, and fail in CI
(tests/realparts.py).
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from tests.realparts import require_program


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float = 20.0, interval_s: float = 0.1, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


class Receiver:
    """A real HTTP server that records every POST; `status` is what it answers."""

    def __init__(self, port: int = 0, status: int = 200, delay_s: float = 0.0):
        self.requests: list[Received] = []
        self.status = status
        self.delay_s = delay_s
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                with receiver._lock:
                    receiver.requests.append(Received(self.path, dict(self.headers.items()), body))
                self.send_response(receiver.status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def received(self, path: str | None = None) -> list[Received]:
        with self._lock:
            return [r for r in self.requests if path is None or r.path == path]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


@pytest.fixture
def receiver():
    r = Receiver()
    try:
        yield r
    finally:
        r.stop()


def http_get_json(url: str, timeout_s: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Server:
    """A real server process on 127.0.0.1, killed on stop; its log is kept for failure messages."""

    def __init__(self, argv: list[str], ready_url: str, log_path, timeout_s: float = 30.0):
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - open for the server's lifetime, closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: self.proc.poll() is not None or _ready(ready_url), timeout_s, what=ready_url)
            if self.proc.poll() is not None:
                raise AssertionError(f"{argv[0]} exited at start:\n{self.log()}")
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def start_alertmanager(tmp_path, webhook_url: str) -> tuple[Server, str]:
    """Start Alertmanager routing every alert to `webhook_url` at once; return (server, base URL)."""
    binary = require_program("prometheus-alertmanager", "alertmanager", package="prometheus-alertmanager")
    folder = tmp_path / "alertmanager"
    folder.mkdir()
    config = {
        "route": {
            "receiver": "test",
            "group_by": ["alertname", "run_id", "layer"],
            "group_wait": "0s",
            "group_interval": "1s",
            "repeat_interval": "1h",
        },
        "receivers": [{"name": "test", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}],
    }
    (folder / "alertmanager.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [
        binary,
        f"--config.file={folder / 'alertmanager.yml'}",
        f"--storage.path={folder / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
    ]
    return Server(argv, base + "/-/ready", folder / "log.txt"), base


def start_prometheus(tmp_path, scrape_target: str, rules_file, alertmanager: str | None = None) -> tuple[Server, str]:
    """Start Prometheus scraping `scrape_target` (host:port) every second with `rules_file`."""
    binary = require_program("prometheus", package="prometheus")
    folder = tmp_path / "prometheus"
    folder.mkdir()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(rules_file)],
        "scrape_configs": [{"job_name": "moescope", "static_configs": [{"targets": [scrape_target]}]}],
    }
    if alertmanager:
        host = alertmanager.split("://", 1)[1]
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [host]}]}]}
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [
        binary,
        f"--config.file={folder / 'prometheus.yml'}",
        f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    return Server(argv, base + "/-/ready", folder / "log.txt"), base


def promtool() -> str:
    return require_program("promtool", package="prometheus")
