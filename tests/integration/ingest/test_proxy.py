"""`moescope proxy`: forwarding to an engine unchanged while recording the routing it returns.

vLLM and SGLang cannot run here (no GPU), so a stand-in engine — a real HTTP server on 127.0.0.1,
started and stopped by each test — answers in the response formats those engines document for
`--enable-return-routed-experts`: vLLM's OpenAI-compatible JSON and server-sent-event chunks with
`prompt_routed_experts` / `choices[i].routed_experts`, SGLang's `/generate` with base64 int32
`meta_info.routed_experts`. Bytes through the proxy are compared with the bytes the stand-in sent;
expected loads are counted by loops over the arrays the stand-in drew.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from moescope.ingest.proxy import RoutingProxy, RoutingRecorder, parse_listen
from tests.support.importing import loop_loads, parquet_rows, stored_loads
from tests.support.paths import REPO
from tests.support.proxy import E, K, L, StandInEngine, draw, post, rows_of, stop_command
from tests.support.sigterm import default_signals


def test_a_response_passes_unchanged_and_its_routing_is_recorded_with_header_tags(tmp_path, engine, proxy_for):
    proxy = proxy_for(engine.port)
    request = {"seed": 1, "prompt_len": 5, "max_tokens": 4}
    direct = post(engine.port, "/v1/completions", request)
    via = post(proxy.port, "/v1/completions", request, {"X-Router-Version": "v2", "X-Moescope-Tag-Tenant": "acme",
                                                        "X-Client-Trace": "abc"})
    assert via[0] == direct[0] == 200 and via[2] == direct[2] == engine.sent[1]
    assert via[1]["X-Engine"] == "stand-in" and via[1]["Content-Length"] == str(len(direct[2]))
    assert engine.received[1]["X-Client-Trace"] == "abc" and engine.received[1]["X-Router-Version"] == "v2"
    assert proxy.recorder.force_flush()
    root = str(tmp_path / "store")
    run = proxy.recorder.spec.run_id
    assert stored_loads(root, run) == loop_loads(rows_of(0, draw(1, 5), draw(1001, 3)), E)
    steps = parquet_rows(root, "steps", run).to_pylist()
    assert [dict(s["tags"]) for s in steps] == [{"router_version": "v2", "tenant": "acme"}]
    positions = sorted(r["position"] for r in parquet_rows(root, "routes", run).to_pylist() if r["layer"] == 0)
    assert positions == list(range(8))  # 5 prompt tokens, then 3 of the 4 generated ones
    assert parquet_rows(root, "runs", run).to_pylist()[0]["source"] == "proxy"


def test_a_stream_is_forwarded_chunk_by_chunk_and_recorded_once_complete(tmp_path, engine, proxy_for):
    proxy = proxy_for(engine.port)
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps({"seed": 2, "prompt_len": 4, "max_tokens": 6, "stream": True,
                                                        "hold": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.getheader("Content-Type") == "text/event-stream"
    first = response.read1(65536)  # arrives while the engine still holds every later chunk back
    assert first.startswith(b"data: ") and b"prompt_routed_experts" in first and not engine.release.is_set()
    engine.release.set()
    rest = response.read()
    conn.close()
    assert first + rest == engine.sent[0]
    assert proxy.recorder.force_flush()
    run = proxy.recorder.spec.run_id
    assert stored_loads(str(tmp_path / "store"), run) == loop_loads(rows_of(0, draw(2, 4), draw(1002, 5)), E)


def test_sglang_generate_with_base64_routing(tmp_path, engine, proxy_for):
    proxy = proxy_for(engine.port, num_layers=L, top_k=K)
    status, _, payload = post(proxy.port, "/generate", {"seed": 3, "prompt_len": 6})
    assert status == 200 and payload == engine.sent[0]
    assert proxy.recorder.force_flush()
    run = proxy.recorder.spec.run_id
    assert stored_loads(str(tmp_path / "store"), run) == loop_loads(rows_of(0, draw(3, 8, dense=1)), E)
    assert sorted({r["layer"] for r in parquet_rows(str(tmp_path / "store"), "layer_steps", run).to_pylist()}) == [0, 2]


def test_upstream_errors_pass_through_and_a_dead_upstream_is_a_502(tmp_path, engine, proxy_for):
    proxy = proxy_for(engine.port)
    direct = post(engine.port, "/v1/fail", {})
    via = post(proxy.port, "/v1/fail", {})
    assert via[0] == direct[0] == 503 and via[2] == direct[2] and via[1]["Retry-After"] == "7"
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    dead = proxy_for(dead_port)
    status, _, payload = post(dead.port, "/v1/completions", {"seed": 1, "prompt_len": 3})
    assert status == 502 and b"did not answer" in payload
    for p in (proxy, dead):
        assert p.recorder.force_flush()
    assert proxy.recorder.counts == {"upstream_status_5xx": 1}
    assert dead.recorder.counts == {"upstream_unreachable": 1}
    assert parquet_rows(str(tmp_path / "store"), "steps").num_rows == 0


def test_a_response_without_routing_is_counted_not_fatal(tmp_path, engine, proxy_for):
    proxy = proxy_for(engine.port)
    assert post(proxy.port, "/v1/plain", {})[2] == engine.sent[0]
    assert post(proxy.port, "/v1/completions", {"seed": 4, "prompt_len": 2})[0] == 200
    proxy.shutdown()
    assert proxy.recorder.counts == {"no_routing": 1, "recorded": 1}
    stats = parquet_rows(str(tmp_path / "store"), "probe_stats", proxy.recorder.spec.run_id).to_pylist()
    latest = max(s["ts"] for s in stats)  # the run writer's snapshot counts every table; responses are steps
    assert {(s["reason"], s["written_rows"], s["dropped_records"]) for s in stats
            if s["ts"] == latest and s["table_name"] == "steps"} == {(None, 1, 0), ("no_routing", 0, 1)}


def _dechunk(raw: bytes) -> bytes:
    out, rest = b"", raw
    while True:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        if not size:
            return out
        out, rest = out + rest[:size], rest[size + 2:]


def test_a_stalled_client_holds_up_no_one_and_still_gets_every_byte(tmp_path, engine, proxy_for):
    proxy = proxy_for(engine.port)
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.settimeout(30)
    slow.connect(("127.0.0.1", proxy.port))
    request = json.dumps({"seed": 5, "prompt_len": 3, "max_tokens": 40, "stream": True, "pad": 60_000}).encode()
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (len(request), request))
    time.sleep(0.3)  # the client reads nothing: the proxy's write to it blocks
    started = time.perf_counter()
    assert post(proxy.port, "/v1/completions", {"seed": 6, "prompt_len": 2})[0] == 200
    assert time.perf_counter() - started < 1.0
    raw = b""
    while chunk := slow.recv(65536):
        raw += chunk
    slow.close()
    head, body = raw.split(b"\r\n\r\n", 1)
    assert b" 200 " in head.split(b"\r\n")[0] and b"chunked" in head.lower()
    deadline = time.monotonic() + 5
    while not any(s.startswith(b"data:") for s in engine.sent) and time.monotonic() < deadline:
        time.sleep(0.01)  # the engine notes what it sent just after its last write
    stream = next(s for s in engine.sent if s.startswith(b"data:"))
    assert _dechunk(body) == stream and len(stream) > 2_000_000
    assert proxy.recorder.force_flush() and proxy.recorder.counts["recorded"] == 2


def test_a_full_queue_drops_and_counts_without_waiting(tmp_path):
    recorder = RoutingRecorder(str(tmp_path / "store"), num_experts=E, max_queue=2)
    gate, busy = threading.Event(), threading.Event()
    real = recorder._record

    def held(captured):
        busy.set()
        gate.wait(10)
        real(captured)

    recorder._record = held
    from moescope.ingest.proxy import Captured

    body = json.dumps({"prompt_routed_experts": draw(9, 2).tolist(), "choices": []}).encode()
    recorder.submit(Captured(body, "application/json", {}))
    assert busy.wait(5)
    started = time.perf_counter()
    for _ in range(5):
        recorder.submit(Captured(body, "application/json", {}))
    assert time.perf_counter() - started < 0.05
    assert recorder.counts == {"queue_full": 3}
    gate.set()
    recorder.shutdown()
    assert recorder.counts == {"queue_full": 3, "recorded": 3}
    assert parquet_rows(str(tmp_path / "store"), "steps").num_rows == 3


def test_listens_on_loopback_unless_told(tmp_path, engine):
    from moescope.cli import build_parser

    proxy = RoutingProxy(f"http://127.0.0.1:{engine.port}", str(tmp_path / "store"), num_experts=E, port=0)
    try:
        assert proxy.host == "127.0.0.1"
    finally:
        proxy.shutdown()
    args = build_parser().parse_args(["proxy", "--upstream", "http://x:1", "--store", "s", "--num-experts", "4"])
    assert parse_listen(args.listen)[0] == "127.0.0.1" and parse_listen(":9000") == ("127.0.0.1", 9000)
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        RoutingProxy("https://example.com", str(tmp_path / "store"), num_experts=E)


def start_command(root: str, engine: StandInEngine, *options: str) -> tuple[subprocess.Popen, int]:
    """`moescope proxy` as its own process in front of the stand-in engine, recording run "live";
    returns the process (once it says it is recording) and its port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "moescope.cli", "proxy", "--upstream",
                                f"http://127.0.0.1:{engine.port}", "--store", root, "--num-experts", str(E),
                                "--listen", f"127.0.0.1:{port}", "--run-id", "live", *options],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=default_signals)
    assert "recording run live" in process.stdout.readline()
    return process, port




@pytest.mark.integration
def test_the_command_runs_as_a_process_and_writes_on_interrupt(tmp_path, engine):
    root = str(tmp_path / "store")
    process, port = start_command(root, engine)
    try:
        assert post(port, "/v1/completions", {"seed": 7, "prompt_len": 3}, {"X-Router-Version": "v1"})[0] == 200
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=30)
    finally:
        stop_command(process)
    assert "recorded 1 responses into run live" in out
    assert stored_loads(root, "live") == loop_loads(rows_of(0, draw(7, 3), draw(1007, 3)), E)


@pytest.mark.integration
def test_sigterm_drains_every_answered_request_writes_the_counts_and_exits_0(tmp_path, engine):
    """SIGTERM is how systemd, Docker and Kubernetes stop a service: nothing answered may be lost."""
    root = str(tmp_path / "store")
    process, port = start_command(root, engine, "--grace-period", "10")
    expected = []
    try:
        for step in range(10):
            seed = 20 + step
            assert post(port, "/v1/completions", {"seed": seed, "prompt_len": 3})[0] == 200
            expected += rows_of(step, draw(seed, 3), draw(seed + 1000, 3))
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=20)
        took = time.monotonic() - started
    finally:
        stop_command(process)
    assert process.returncode == 0, err
    assert took < 10, f"draining took {took:.1f} s, beyond the grace period"
    steps = parquet_rows(root, "steps", "live")  # raw Parquet rows, read without moescope
    assert steps.num_rows == 10 and sorted(steps.column("step").to_pylist()) == list(range(10))
    assert stored_loads(root, "live") == loop_loads(expected, E)
    stats = parquet_rows(root, "probe_stats", "live").to_pylist()
    final = max(s["ts"] for s in stats)
    assert [s["written_rows"] for s in stats if s["ts"] == final and s["table_name"] == "steps"
            and s["reason"] is None] == [10]
    assert "recorded 10 responses into run live" in out


def _hold_a_request(port: int) -> http.client.HTTPConnection:
    """A streamed request the stand-in engine holds after its first chunk: in flight until released."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"seed": 2, "prompt_len": 4, "max_tokens": 6, "stream": True,
                                                        "hold": True}), {"Content-Type": "application/json"})
    assert conn.getresponse().read1(65536).startswith(b"data: ")
    return conn


@pytest.mark.integration
def test_a_second_sigterm_exits_at_once_without_waiting_for_the_drain(tmp_path, engine):
    process, port = start_command(str(tmp_path / "store"), engine, "--grace-period", "60")
    try:
        held = _hold_a_request(port)
        process.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert process.poll() is None  # draining: the request in flight is still being answered
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=10)
        took = time.monotonic() - started
        held.close()
    finally:
        stop_command(process)
    assert process.returncode == 128 + signal.SIGTERM and took < 2


@pytest.mark.integration
def test_a_drain_longer_than_the_grace_period_exits_1_and_says_so(tmp_path, engine):
    process, port = start_command(str(tmp_path / "store"), engine, "--grace-period", "1")
    try:
        held = _hold_a_request(port)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=10)
        took = time.monotonic() - started
        held.close()
    finally:
        stop_command(process)
    assert process.returncode == 1 and 1 <= took < 5
    assert "could not drain within the 1 s grace period" in err
