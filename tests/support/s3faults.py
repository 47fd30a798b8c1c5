"""A fault-injecting HTTP proxy between S3 clients and the test server (tests/support/s3server.py).

`FaultProxy(upstream)` listens on 127.0.0.1 on a free port and forwards every request to
`upstream`, unless the faults it is set to say otherwise:

- `slowdown_every=N`: every Nth request is answered 503 with S3's `SlowDown` XML error body;
- `reset_every=N`: every Nth request's connection is reset (TCP RST, no response);
- `latency_s=S`: every request waits S seconds before it is forwarded;
- `methods` / `path_contains`: only matching requests count towards N and get the faults (the
  path is matched URL-decoded: `run_id=` matches `run_id%3D`);
- `after_forward=True`: a 503 or a reset comes AFTER upstream has applied the request (the
  ambiguous failure: the write happened, the client was told it did not);
- `budget=K`: at most K faults, then requests pass.

It counts requests by method, faults by kind and responses by status (`counts()`), and keeps the
last LOG_SIZE requests' method, path and outcome (`log()`).

The proxy's threaded server runs in its own process (like the S3 server, so a client call that
holds the GIL cannot starve it) and is bounded: it stops on `stop()`, when the test process dies
(its stdin closes), and after `lifetime_s` in any case; each upstream call times out.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

SLOWDOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                 b'<Message>Please reduce your request rate.</Message><RequestId>moescope-fault</RequestId></Error>')
LIFETIME_S = 900.0
UPSTREAM_TIMEOUT_S = 60.0
LOG_SIZE = 5000
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
               "expect"}


class FaultProxy:
    """The proxy in a child process; `url` is where clients point their endpoint."""

    def __init__(self, upstream: str, *, lifetime_s: float = LIFETIME_S, **faults: Any):
        self.upstream = upstream
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--upstream", upstream, "--lifetime", str(lifetime_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            self.url: str = self._reply(timeout_s=30)["url"]
            if faults:
                self.set_faults(**faults)
        except BaseException:
            self.stop()
            raise

    def set_faults(self, *, slowdown_every: int = 0, reset_every: int = 0, latency_s: float = 0.0,
                   methods: tuple[str, ...] | None = None, path_contains: str = "", after_forward: bool = False,
                   budget: int = -1) -> None:
        """Replace the faults (all off by default) and restart the count that `*_every` divides."""
        self._call({"op": "faults", "slowdown_every": slowdown_every, "reset_every": reset_every,
                    "latency_s": latency_s, "methods": list(methods) if methods else None,
                    "path_contains": path_contains, "after_forward": after_forward, "budget": budget})

    def counts(self) -> dict[str, Any]:
        """{"requests": {method: n}, "faults": {"slowdown"|"reset": n}, "statuses": {status: n},
        "forwarded": n, "errors": n} since the start or the last `reset_counts()`."""
        return self._call({"op": "counts"})

    def log(self) -> list[tuple[str, str, str]]:
        """The last LOG_SIZE requests since the start or `reset_counts()`: (method, path, outcome),
        outcome an HTTP status, "reset", or "error" (the client or upstream went away)."""
        return [tuple(entry) for entry in self._call({"op": "log"})["log"]]  # type: ignore[misc]

    def reset_counts(self) -> None:
        """Zero the counts and empty the log."""
        self._call({"op": "reset_counts"})

    def stop(self) -> None:
        """Stop the proxy process; safe to call twice."""
        from tests.support.s3server import stop_child  # this file also runs as the proxy's own script

        proc, self._proc = self._proc, None
        if proc is not None:
            stop_child(proc)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, command: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._proc is None or self._proc.stdin is None:
                raise RuntimeError("the fault proxy is stopped")
            self._proc.stdin.write(json.dumps(command) + "\n")
            self._proc.stdin.flush()
            return self._reply(timeout_s=10)

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        readable, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if readable else ""
        if not line:
            raise RuntimeError(f"the fault proxy did not answer (exit {self._proc.poll()})")
        return json.loads(line)


# -- the proxy itself (runs in the child) --------------------------------------------------------


class _Faults:
    """What to inject and what was seen; one lock guards both."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.configure({})
        self.reset_counts()

    def configure(self, spec: dict[str, Any]) -> None:
        with self.lock:
            self.slowdown_every = int(spec.get("slowdown_every") or 0)
            self.reset_every = int(spec.get("reset_every") or 0)
            self.latency_s = float(spec.get("latency_s") or 0.0)
            methods = spec.get("methods")
            self.methods = {m.upper() for m in methods} if methods else None
            self.path_contains = str(spec.get("path_contains") or "")
            self.after_forward = bool(spec.get("after_forward"))
            self.budget = int(spec.get("budget", -1))
            self.eligible = 0

    def reset_counts(self) -> None:
        with self.lock:
            self.requests: collections.Counter[str] = collections.Counter()
            self.faults: collections.Counter[str] = collections.Counter()
            self.statuses: collections.Counter[str] = collections.Counter()
            self.forwarded = 0
            self.errors = 0
            self.log: collections.deque[tuple[str, str, str]] = collections.deque(maxlen=LOG_SIZE)

    def outcome(self, method: str, path: str, outcome: str) -> None:
        with self.lock:
            self.log.append((method, path, outcome))
            if outcome.isdigit():
                self.statuses[outcome] += 1
            elif outcome == "error":
                self.errors += 1

    def decide(self, method: str, path: str) -> tuple[str | None, float]:
        """The fault for this request (None, "slowdown" or "reset") and the latency to add."""
        with self.lock:
            self.requests[method] += 1
            if (self.methods is not None and method not in self.methods) or self.path_contains not in unquote(path):
                return None, 0.0
            self.eligible += 1
            fault = None
            if self.budget != 0:
                if self.slowdown_every and self.eligible % self.slowdown_every == 0:
                    fault = "slowdown"
                elif self.reset_every and self.eligible % self.reset_every == 0:
                    fault = "reset"
            if fault:
                self.faults[fault] += 1
                if self.budget > 0:
                    self.budget -= 1
            return fault, self.latency_s

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"requests": dict(self.requests), "faults": dict(self.faults), "statuses": dict(self.statuses),
                    "forwarded": self.forwarded, "errors": self.errors}


def _make_server(upstream: str, faults: _Faults) -> ThreadingHTTPServer:
    target = urlsplit(upstream)
    up_host, up_port = target.hostname or "127.0.0.1", target.port or 80

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().strip().split(b";")[0], 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _reset(self) -> None:
            # SO_LINGER 0: close() sends RST, not FIN; the client sees "connection reset by peer"
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            self.wfile = _Discard()  # nothing more goes out on this connection
            faults.outcome(self.command, self.path, "reset")

        def _slowdown(self) -> None:
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(SLOWDOWN_BODY)))
            self.send_header("Retry-After", "1")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(SLOWDOWN_BODY)
            faults.outcome(self.command, self.path, "503")

        def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            upstream_conn = http.client.HTTPConnection(up_host, up_port, timeout=UPSTREAM_TIMEOUT_S)
            try:
                # the Host header goes through unchanged: the client signed it
                upstream_conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for key, value in headers.items():
                    upstream_conn.putheader(key, value)
                upstream_conn.endheaders(body)
                response = upstream_conn.getresponse()
                data = response.read()
                with faults.lock:
                    faults.forwarded += 1
                return response.status, response.getheaders(), data
            finally:
                upstream_conn.close()

        def _handle(self) -> None:
            try:
                body = self._body()
                fault, latency_s = faults.decide(self.command, self.path)
                if latency_s:
                    time.sleep(latency_s)
                if fault and not faults.after_forward:
                    return self._slowdown() if fault == "slowdown" else self._reset()
                status, headers, data = self._forward(body)
                if fault:
                    return self._slowdown() if fault == "slowdown" else self._reset()
                self.send_response(status)
                for key, value in headers:
                    if key.lower() not in _HOP_BY_HOP and key.lower() not in ("server", "date"):
                        self.send_header(key, value)  # HEAD keeps upstream's Content-Length (the object's size)
                if not any(k.lower() == "content-length" for k, _ in headers):
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                faults.outcome(self.command, self.path, str(status))
            except OSError:  # the client went away, or upstream did: the client sees a closed connection
                faults.outcome(self.command, self.path, "error")
                self.close_connection = True

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # clients dropping keep-alive sockets, and the resets we make ourselves

    return Server(("127.0.0.1", 0), Handler)


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return False


def _serve(upstream: str, lifetime_s: float) -> int:
    faults = _Faults()
    server = _make_server(upstream, faults)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    print(json.dumps({"url": f"http://127.0.0.1:{server.server_address[1]}"}), flush=True)
    deadline = time.monotonic() + lifetime_s
    try:
        while time.monotonic() < deadline:
            readable, _, _ = select.select([sys.stdin], [], [], min(1.0, max(0.0, deadline - time.monotonic())))
            if not readable:
                continue
            line = sys.stdin.readline()
            if not line:
                break  # the parent closed stdin (stop(), or it died)
            command = json.loads(line)
            op = command.get("op")
            if op == "faults":
                faults.configure(command)
                reply: dict[str, Any] = {"ok": True}
            elif op == "counts":
                reply = faults.snapshot()
            elif op == "log":
                with faults.lock:
                    reply = {"log": list(faults.log)}
            elif op == "reset_counts":
                faults.reset_counts()
                reply = {"ok": True}
            else:
                reply = {"error": f"unknown op {op!r}"}
            print(json.dumps(reply), flush=True)
    finally:
        server.shutdown()
        server.server_close()
    return 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="fault-injecting S3 proxy for the tests (started by FaultProxy)")
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--lifetime", type=float, default=LIFETIME_S)
    args = parser.parse_args()
    sys.exit(_serve(args.upstream, args.lifetime))
