"""The stand-in engine, raw upstream and request helpers the proxy suites share."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from moescope.ingest.proxy import RoutingProxy

E, L, K = 8, 3, 2




def draw(seed: int, rows: int, dense: int | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.stack([[rng.choice(E, K, replace=False) for _ in range(L)] for _ in range(rows)]).astype(np.int64)
    if dense is not None:
        out[:, dense] = -1
    return out


def prompt_token_ids(prompt_len: int) -> list[int]:
    return [100 + i for i in range(prompt_len)]


def generated_token_ids(gen: int) -> list[int]:
    return [200 + i for i in range(gen)]


def rows_of(step: int, *arrays: np.ndarray) -> list[tuple]:
    return [(step, layer, a[t, layer].tolist()) for a in arrays for t in range(len(a)) for layer in range(L)
            if a[t, layer, 0] >= 0]


class StandInEngine:
    """A stand-in for a vLLM / SGLang server (the real engines cannot run here), on 127.0.0.1."""

    def __init__(self):
        self.received: list[dict] = []  # headers of each request as the engine saw them
        self.sent: list[bytes] = []  # bodies exactly as sent
        self.release = threading.Event()  # a stream holds its later chunks until this is set
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                engine.received.append(dict(self.headers.items()))
                getattr(self, "route_" + self.path.strip("/").replace("/", "_"))(body)

            def reply(self, status: int, payload: bytes, content_type: str = "application/json", **headers) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.send_header("X-Engine", "stand-in")
                for name, value in headers.items():
                    self.send_header(name.replace("_", "-"), value)
                self.end_headers()
                engine.sent.append(payload)
                self.wfile.write(payload)

            def route_v1_completions(self, body: dict) -> None:
                seed, prompt_len, gen = body["seed"], body["prompt_len"], body.get("max_tokens", 4)
                prompt, generated = draw(seed, prompt_len), draw(seed + 1000, gen - 1)
                if not body.get("stream"):
                    reply = {"id": f"cmpl-{seed}", "object": "text_completion", "created": 1_700_000_000, "model": "m",
                             "prompt_routed_experts": prompt.tolist(),
                             "choices": [{"index": 0, "text": "hi", "routed_experts": generated.tolist()}],
                             "usage": {"prompt_tokens": prompt_len, "completion_tokens": gen}}
                    if body.get("token_ids"):  # as vLLM with return_token_ids: the prompt's and the generated ids
                        reply["prompt_token_ids"] = prompt_token_ids(prompt_len)
                        reply["choices"][0]["token_ids"] = generated_token_ids(gen)
                    self.reply(200, json.dumps(reply).encode())
                    return
                events = [{"id": f"cmpl-{seed}", "prompt_routed_experts": prompt.tolist(),
                           "choices": [{"index": 0, "text": "h", "routed_experts": generated[:1].tolist()}]}]
                events += [{"id": f"cmpl-{seed}", "choices": [{"index": 0, "text": "x" * body.get("pad", 1),
                                                               "routed_experts": generated[i:i + 1].tolist()}]}
                           for i in range(1, len(generated))]
                events.append({"id": f"cmpl-{seed}", "choices": [{"index": 0, "text": "!", "routed_experts": []}],
                               "usage": {"prompt_tokens": prompt_len, "completion_tokens": gen}})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                sent = b""
                for i, event in enumerate([*map(json.dumps, events), "[DONE]"]):
                    data = f"data: {event}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                    sent += data
                    if i == 0 and body.get("hold"):
                        engine.release.wait(10)
                self.wfile.write(b"0\r\n\r\n")
                engine.sent.append(sent)

            def route_generate(self, body: dict) -> None:
                ids = draw(body["seed"], body["prompt_len"] + 3 - 1, dense=1)
                self.reply(200, json.dumps({"text": "ok", "meta_info": {
                    "id": "r1", "prompt_tokens": body["prompt_len"], "completion_tokens": 3,
                    "routed_experts": base64.b64encode(ids.astype("<i4").tobytes()).decode()}}).encode())

            def route_v1_fail(self, body: dict) -> None:
                self.reply(503, b'{"error": {"message": "engine overloaded"}}', Retry_After="7")

            def route_v1_plain(self, body: dict) -> None:
                self.reply(200, b'{"id": "x", "choices": [{"index": 0, "text": "no routing here"}]}')

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class RawUpstream:
    """An engine that misbehaves on purpose, on a raw socket at 127.0.0.1: each connection's first
    request is read (Content-Length or chunked) and `answer(upstream, conn)` writes whatever it likes.
    `requests` holds (method, path, lowercased headers, body) of every request received whole,
    `partial` the bytes of those that ended before they were whole, `body_bytes` the body bytes
    received so far. `close()` releases answers waiting on `hold`, and stops everything."""

    def __init__(self, answer):
        self.answer = answer
        self.requests: list[tuple[str, str, dict, bytes]] = []
        self.partial: list[bytes] = []
        self.body_bytes = 0
        self.hold = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self.hold.is_set():
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        reader = conn.makefile("rb")
        raw = b""
        try:
            while not raw.endswith(b"\r\n\r\n"):
                line = reader.readline()
                if not line:
                    self.partial.append(raw)
                    return
                raw += line
            lines = raw.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
            body = b""
            if headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size = int(reader.readline().split(b";")[0] or b"x", 16)
                    if not size:
                        if reader.readline() != b"\r\n":
                            raise ValueError("no end of the chunked body")
                        break
                    piece = reader.read(size)
                    body += piece
                    self.body_bytes += len(piece)
                    if len(piece) < size or reader.readline() != b"\r\n":
                        raise ValueError("a short chunk")
            else:
                left = int(headers.get("content-length", 0))
                while left:
                    piece = reader.read1(min(left, 65536))
                    if not piece:
                        raise ValueError("a short body")
                    body += piece
                    left -= len(piece)
                    self.body_bytes += len(piece)
        except (ValueError, OSError):
            self.partial.append(raw)
            conn.close()
            return
        self.requests.append((method, path, headers, body))
        try:
            self.answer(self, conn)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.hold.set()
        self._thread.join(5)
        self.listener.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()


def json_answer(body: bytes):
    """An answer that sends `body` whole as a JSON response, and closes."""

    def answer(upstream: RawUpstream, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (len(body), body))

    return answer


@pytest.fixture
def raw_upstream():
    started = []

    def start(answer) -> RawUpstream:
        upstream = RawUpstream(answer)
        started.append(upstream)
        return upstream

    yield start
    for upstream in started:
        upstream.close()


@pytest.fixture
def engine():
    stand_in = StandInEngine()
    yield stand_in
    stand_in.close()


@pytest.fixture
def proxy_for(tmp_path):
    started = []

    def start(port: int, **options) -> RoutingProxy:
        proxy = RoutingProxy(f"http://127.0.0.1:{port}", str(tmp_path / "store"), num_experts=E, port=0,
                             **options).start()
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.shutdown()


def post(port: int, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    return response.status, dict(response.getheaders()), payload


def stop_command(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.communicate()
