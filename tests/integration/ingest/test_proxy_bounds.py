"""What a client, a slow engine or a burst may hold of `moescope proxy` (issue 23, item 8).

Idle, half-open and slow connections are closed after their timeouts; the connections are bounded,
and idle ones make room for a client with a request, also under a 128-descriptor limit; request
bodies are streamed, a request cut short never reaches the engine whole; the queue and the captures
are bounded in bytes; a burst of connections waits in the kernel's backlog. Real sockets on
127.0.0.1 throughout; time limits are tenths of a second so the suite stays quick.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from moescope.ingest.proxy import Captured, ProxyLimits, RoutingProxy, RoutingRecorder
from tests.support.importing import parquet_rows
from tests.support.paths import REPO
from tests.support.proxy import (
    E,
    draw,
    json_answer,
    post,
)
from tests.support.sigterm import default_signals


def closed_by_peer_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the other end closes `sock` (reads return end-of-file), or None if it did not."""
    started = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def test_idle_and_half_open_connections_are_closed_after_the_idle_timeout(engine, proxy_for):
    proxy = proxy_for(engine.port, limits=ProxyLimits(idle_timeout_s=0.3))
    half_open = socket.create_connection(("127.0.0.1", proxy.port))  # connects, never sends a byte
    kept = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    kept.request("POST", "/v1/completions", json.dumps({"seed": 1, "prompt_len": 2}))
    assert kept.getresponse().read()
    try:
        took = closed_by_peer_within(half_open, 3)
        assert took is not None and took < 1.5
        took = closed_by_peer_within(kept.sock, 3)  # kept alive after its answer, then idle
        assert took is not None and took < 1.5
    finally:
        half_open.close()
        kept.close()


def test_headers_sent_a_byte_at_a_time_are_cut_off_at_the_header_timeout(engine, proxy_for):
    proxy = proxy_for(engine.port, limits=ProxyLimits(header_timeout_s=0.5, idle_timeout_s=10))
    slow = socket.create_connection(("127.0.0.1", proxy.port))
    started = time.monotonic()
    closed_at = None
    try:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        for byte in b"X-Padding: " + b"a" * 40:  # a byte every 0.05 s: each read is quick, the whole is not
            time.sleep(0.05)
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                closed_at = time.monotonic() - started
                break
        if closed_at is None:
            took = closed_by_peer_within(slow, 2)
            closed_at = None if took is None else time.monotonic() - started
    finally:
        slow.close()
    assert closed_at is not None and 0.4 < closed_at < 1.5
    assert engine.received == []


def test_idle_connections_make_room_for_a_client_with_a_request(engine, proxy_for):
    proxy = proxy_for(engine.port, limits=ProxyLimits(max_connections=4, idle_timeout_s=30))
    idle = [socket.create_connection(("127.0.0.1", proxy.port)) for _ in range(12)]
    try:
        started = time.monotonic()
        assert post(proxy.port, "/v1/completions", {"seed": 2, "prompt_len": 2})[0] == 200
        assert time.monotonic() - started < 1.0
        closed = sum(closed_by_peer_within(sock, 0.5) is not None for sock in idle)
        assert closed >= len(idle) - 4 + 1  # each new connection past 4 hung up the one idle longest
    finally:
        for sock in idle:
            sock.close()


def test_with_every_connection_answering_a_new_client_waits_for_one_to_be_free(engine, proxy_for):
    proxy = proxy_for(engine.port, limits=ProxyLimits(max_connections=1))
    held = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    held.request("POST", "/v1/completions", json.dumps({"seed": 3, "prompt_len": 2, "max_tokens": 4, "stream": True,
                                                        "hold": True}))
    response = held.getresponse()
    assert response.read1(65536).startswith(b"data: ")  # in flight: the engine holds the rest
    answered: list[int] = []
    waiting = threading.Thread(target=lambda: answered.append(post(proxy.port, "/v1/completions",
                                                                   {"seed": 4, "prompt_len": 2})[0]))
    try:
        waiting.start()
        time.sleep(0.5)
        assert answered == [] and len(engine.received) == 1  # it waits; it is not failed
        engine.release.set()
        response.read()
        held.close()  # its connection ends: the waiting client's turn
        waiting.join(5)
    finally:
        engine.release.set()
        held.close()
    assert answered == [200]
    assert proxy.recorder.force_flush() and proxy.recorder.counts == {"recorded": 2}


@pytest.mark.integration
def test_idle_sockets_cannot_lock_clients_out_under_a_descriptor_limit(tmp_path, engine):
    """The issue's case: 1 026 idle sockets at a limit of 1 024 descriptors locked every client out.
    Here the limit is 128 and 200 sockets sit idle: a client with a request is still answered."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def limit_descriptors() -> None:
        default_signals()
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    process = subprocess.Popen([sys.executable, "-m", "moescope.cli", "proxy", "--upstream",
                                f"http://127.0.0.1:{engine.port}", "--store", str(tmp_path / "store"),
                                "--num-experts", str(E), "--listen", f"127.0.0.1:{port}", "--max-connections", "32"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=limit_descriptors)
    idle: list[socket.socket] = []
    try:
        assert "recording run" in process.stdout.readline()
        idle = [socket.create_connection(("127.0.0.1", port), timeout=2) for _ in range(200)]
        started = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("POST", "/v1/completions", json.dumps({"seed": 5, "prompt_len": 2}))
        assert conn.getresponse().status == 200
        conn.close()
        assert time.monotonic() - started < 3
    finally:
        for sock in idle:
            sock.close()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=20)
    assert process.returncode == 0, err


def test_a_burst_of_connections_waits_in_the_listen_backlog(engine, tmp_path):
    """With http.server's backlog of 5, connections past the 6th waited for a SYN retry (a second or
    more) while the proxy was busy; here nothing accepts them at all, and 300 still connect at once."""
    proxy = RoutingProxy(f"http://127.0.0.1:{engine.port}", str(tmp_path / "store"), num_experts=E, port=0)
    burst: list[socket.socket] = []
    try:
        for _ in range(300):
            burst.append(socket.create_connection(("127.0.0.1", proxy.port), timeout=0.5))
    finally:
        for sock in burst:
            sock.close()
        proxy.shutdown()
    assert len(burst) == 300


# -- request bodies ----------------------------------------------------------------------------------


def raw_request(port: int, head: bytes, body: bytes = b"", hang_up: bool = True) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head + body)
    if hang_up:
        sock.close()
    return sock


@pytest.mark.parametrize("head, body", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n", b""),  # no blank line: headers unfinished
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n", b"{" * 10),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4194304\r\n\r\n", b"a" * 2_000_000),  # streamed
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", b"5\r\nhello\r\n"),
], ids=["mid-headers", "mid-body", "mid-streamed-body", "mid-chunked-body"])
def test_a_request_the_client_cut_short_never_reaches_the_engine_whole(raw_upstream, proxy_for, head, body):
    upstream = raw_upstream(json_answer(b'{"ok": true}'))
    proxy = proxy_for(upstream.port)
    raw_request(proxy.port, head, body)
    time.sleep(0.3)  # what the proxy would forward, it forwards at once
    assert post(proxy.port, "/v1/ok", {"after": True})[0] == 200  # the proxy still serves
    assert [(m, p, b) for m, p, _, b in upstream.requests] == [("POST", "/v1/ok", b'{"after": true}')]


def test_a_large_body_is_streamed_to_the_engine_not_held_whole(raw_upstream, proxy_for):
    upstream = raw_upstream(json_answer(b'{"ok": true}'))
    proxy = proxy_for(upstream.port)
    body = os.urandom(8 * 1024 * 1024)
    sock = raw_request(proxy.port, b"POST /v1/upload HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body),
                       body[:2 * 1024 * 1024], hang_up=False)
    try:
        deadline = time.monotonic() + 3
        while upstream.body_bytes < 1024 * 1024 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert upstream.body_bytes >= 1024 * 1024, "the engine saw nothing before the client sent the whole body"
        sock.sendall(body[2 * 1024 * 1024:])
        sock.settimeout(5)
        assert b" 200 " in sock.recv(65536).split(b"\r\n")[0]
    finally:
        sock.close()
    (method, path, headers, received), = upstream.requests
    assert hashlib.sha256(received).digest() == hashlib.sha256(body).digest()
    assert headers["content-length"] == str(len(body))


def test_a_chunked_request_body_is_forwarded_chunked(raw_upstream, proxy_for):
    upstream = raw_upstream(json_answer(b'{"ok": true}'))
    proxy = proxy_for(upstream.port)
    pieces = [b"a" * 10, b"b" * 70_000, b"c"]
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    conn.request("POST", "/v1/chunks", body=iter(pieces), headers={"Transfer-Encoding": "chunked"},
                 encode_chunked=True)
    assert conn.getresponse().status == 200
    conn.close()
    (_, _, headers, received), = upstream.requests
    assert received == b"".join(pieces) and headers["transfer-encoding"] == "chunked"


@pytest.mark.parametrize("head", [
    b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    b"POST /v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
], ids=["negative", "two-lengths", "bad-chunk-size"])
def test_a_body_whose_framing_is_broken_gets_400_and_is_not_forwarded(raw_upstream, proxy_for, head):
    upstream = raw_upstream(json_answer(b'{"ok": true}'))
    proxy = proxy_for(upstream.port)
    sock = raw_request(proxy.port, head, hang_up=False)
    answer = b""
    try:
        sock.settimeout(5)
        while piece := sock.recv(65536):
            answer += piece
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 400 ") and b"was not forwarded" in answer
    assert upstream.requests == []


# -- bytes waiting to be recorded --------------------------------------------------------------------


def test_the_queue_is_bounded_in_bytes_behind_a_stalled_recorder(tmp_path):
    bound = 1024 * 1024
    recorder = RoutingRecorder(str(tmp_path / "store"), num_experts=E, max_queue_bytes=bound)
    gate, busy = threading.Event(), threading.Event()
    real = recorder._record

    def stalled(captured):
        busy.set()
        gate.wait(10)
        real(captured)

    recorder._record = stalled
    body = json.dumps({"prompt_routed_experts": draw(9, 2).tolist(), "choices": [],
                       "pad": "x" * 300_000}).encode()
    sizes = [len(body) + 1024] * 10  # a record's cost: its bytes and a fixed 1 KiB (moescope.core.pipeline)
    peak = 0
    try:
        recorder.submit(Captured(body, "application/json", {}))
        assert busy.wait(5)
        for _ in range(9):
            recorder.submit(Captured(body, "application/json", {}))
            peak = max(peak, recorder.processor.queued_bytes)
    finally:
        gate.set()
        recorder.shutdown()
    taken, held = 0, 0  # the bound, applied by a loop: a record goes in while the bytes it adds fit
    for size in sizes:
        if not held or held + size <= bound:
            held += size
            taken += 1
    assert peak <= bound
    assert recorder.counts == {"recorded": taken, "queue_bytes_full": len(sizes) - taken}
    assert parquet_rows(str(tmp_path / "store"), "steps").num_rows == taken


def test_responses_being_captured_are_bounded_in_bytes_and_still_forwarded(raw_upstream, proxy_for):
    body = json.dumps({"prompt_routed_experts": draw(3, 2).tolist(), "choices": [], "pad": "x" * 200_000}).encode()
    upstream = raw_upstream(json_answer(body))
    proxy = proxy_for(upstream.port, max_queue_bytes=64 * 1024)
    status, _, payload = post(proxy.port, "/v1/completions", {})
    assert status == 200 and payload == body
    assert proxy.recorder.force_flush() and proxy.recorder.counts == {"capture_bytes_full": 1}
