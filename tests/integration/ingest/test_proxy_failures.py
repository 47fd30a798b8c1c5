"""`moescope proxy` when the engine or a body misbehaves (issue 23, items 6 and 7).

An engine that fails mid-response must fail the client at once, as it would directly, and be
counted as an upstream error; a body the recorder cannot read is counted and skipped, and a
recorder that stops all the same stops the proxy. The engines here are real sockets on 127.0.0.1
(tests/support/proxy.py's RawUpstream and StandInEngine); stored rows are read from the raw
Parquet files and compared with loops over the arrays that were sent.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from moescope.ingest.proxy import ProxyLimits, RoutingRecorder
from tests.support.importing import loop_loads, parquet_rows, stored_loads
from tests.support.paths import REPO
from tests.support.proxy import (
    E,
    RawUpstream,
    draw,
    post,
    rows_of,
)

HEAD_5000 = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n"


def closes_after_100_of_5000(upstream: RawUpstream, conn: socket.socket) -> None:
    conn.sendall(HEAD_5000 + b"x" * 100)


def closes_inside_a_stream(upstream: RawUpstream, conn: socket.socket) -> None:
    data = b'data: {"id": "x"}\n\n'
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"%x\r\n%s\r\n" % (len(data), data) + b"400\r\nonly part of a chunk")


def stalls_after_100_of_5000(upstream: RawUpstream, conn: socket.socket) -> None:
    conn.sendall(HEAD_5000 + b"x" * 100)
    upstream.hold.wait(10)


def client_outcome(port: int) -> tuple[str, float]:
    """What a client sees asking `port` for a response the engine does not finish, and how soon."""
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST", "/v1/completions", b"{}", {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        outcome = f"whole {response.status}"
    except http.client.IncompleteRead:
        outcome = "incomplete"
    except TimeoutError:
        outcome = "timed out"
    finally:
        conn.close()
    return outcome, time.monotonic() - started


@pytest.mark.parametrize("answer", [closes_after_100_of_5000, closes_inside_a_stream])
def test_an_engine_that_closes_mid_response_fails_the_client_at_once(raw_upstream, proxy_for, answer):
    upstream = raw_upstream(answer)
    direct = client_outcome(upstream.port)
    proxy = proxy_for(upstream.port)
    via = client_outcome(proxy.port)
    assert direct[0] == via[0] == "incomplete"
    assert via[1] < 1.0, f"the client waited {via[1]:.1f} s for an engine that had already closed"
    assert proxy.recorder.force_flush()
    assert proxy.recorder.counts == {"upstream_incomplete": 1}


def test_an_engine_that_stalls_mid_response_is_an_upstream_timeout_not_a_client_disconnect(raw_upstream, proxy_for):
    upstream = raw_upstream(stalls_after_100_of_5000)
    proxy = proxy_for(upstream.port, limits=ProxyLimits(upstream_timeout_s=0.5))
    outcome, took = client_outcome(proxy.port)
    assert outcome == "incomplete" and 0.4 < took < 2.0
    assert proxy.recorder.force_flush()
    assert proxy.recorder.counts == {"upstream_timeout": 1}


def test_an_engine_that_never_answers_is_a_504_within_the_upstream_timeout(raw_upstream, proxy_for):
    upstream = raw_upstream(lambda up, conn: up.hold.wait(10))
    proxy = proxy_for(upstream.port, limits=ProxyLimits(upstream_timeout_s=0.5))
    started = time.monotonic()
    status, _, payload = post(proxy.port, "/v1/completions", {})
    assert status == 504 and b"--upstream-timeout 0.5 s" in payload and time.monotonic() - started < 2.0
    assert proxy.recorder.force_flush() and proxy.recorder.counts == {"upstream_timeout": 1}


# -- item 7: odd bodies ---------------------------------------------------------------------------


def good_body(seed: int) -> bytes:
    return json.dumps({"prompt_routed_experts": draw(seed, 3).tolist(),
                       "choices": [{"index": 0, "routed_experts": draw(seed + 1000, 2).tolist()}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 3}}).encode()


ODD_BODIES = [
    json.dumps({"prompt_routed_experts": draw(1, 3).tolist(),
                "choices": [{"index": None, "routed_experts": draw(2, 2).tolist()}]}).encode(),  # a TypeError once
    b"[" * 100_000 + b"]" * 100_000,  # past the recursion limit
    json.dumps({"prompt_routed_experts": [[[0, 1]] * 3], "choices": [], "usage": {"prompt_tokens": "x"}}).encode(),
    b'{"prompt_routed_experts": [[[0, 1]]], "choices": [{"index": 0, "routed_experts": {"a": 1}}]}',
]


def test_odd_bodies_are_counted_and_skipped_and_every_later_response_is_recorded(tmp_path, raw_upstream, proxy_for):
    bodies = iter(ODD_BODIES + [good_body(seed) for seed in range(20)])
    upstream = raw_upstream(lambda up, conn: json_answer_next(conn, next(bodies)))
    proxy = proxy_for(upstream.port)
    for _ in range(len(ODD_BODIES) + 20):
        assert post(proxy.port, "/v1/completions", {})[0] == 200
    assert proxy.recorder.force_flush(10)
    assert proxy.recorder.failed is None
    assert proxy.recorder.counts == {"bad_routing": len(ODD_BODIES), "recorded": 20}
    assert "recorded 20 responses" in proxy.recorder.report() and f"bad_routing {len(ODD_BODIES)}" in \
        proxy.recorder.report()
    root, run = str(tmp_path / "store"), proxy.recorder.spec.run_id
    assert parquet_rows(root, "steps", run).num_rows == 20
    expected = [row for step in range(20) for row in rows_of(step, draw(step, 3), draw(step + 1000, 2))]
    assert stored_loads(root, run) == loop_loads(expected, E)


def json_answer_next(conn: socket.socket, body: bytes) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                 b"Connection: close\r\n\r\n%s" % (len(body), body))


def _end_the_worker(captured) -> None:
    # Every body is handled, so nothing a response holds ends the recorder's thread any more; this
    # stands for a fault we do not know of (a bug, an interpreter error) and ends it as one would.
    raise SystemExit("the recorder's thread ends here")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_recorder_that_stops_stops_the_proxy_which_answers_503(engine, proxy_for, monkeypatch):
    proxy = proxy_for(engine.port)
    monkeypatch.setattr(proxy.recorder, "_record", _end_the_worker)
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"seed": 1, "prompt_len": 3}))
        assert conn.getresponse().read() and True
        deadline = time.monotonic() + 3
        while proxy.failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proxy.failure and "recorder's thread ended" in proxy.failure
        conn.request("POST", "/v1/completions", json.dumps({"seed": 2, "prompt_len": 3}))  # kept alive
        response = conn.getresponse()
        payload = response.read()
    finally:
        conn.close()
    assert response.status == 503 and b"send requests to the engine directly or restart" in payload
    assert len(engine.received) == 1  # the second request never reached the engine


@pytest.mark.integration
def test_the_command_exits_1_when_its_recorder_stops(tmp_path, engine):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = ("import sys\n"
              "from moescope.ingest.proxy import RoutingRecorder\n"
              "from tests.integration.ingest.test_proxy_failures import _end_the_worker\n"
              "RoutingRecorder._record = lambda self, captured: _end_the_worker(captured)\n"
              "from moescope.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    process = subprocess.Popen([sys.executable, "-c", script, "proxy", "--upstream", f"http://127.0.0.1:{engine.port}",
                                "--store", str(tmp_path / "store"), "--num-experts", str(E), "--listen",
                                f"127.0.0.1:{port}", "--run-id", "live"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "recording run live" in process.stdout.readline()
        assert post(port, "/v1/completions", {"seed": 7, "prompt_len": 3})[0] == 200
        out, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.communicate()
    assert process.returncode == 1, err
    assert "stopped because the recorder's thread ended" in err and "was not recorded" in err
    assert "recorded 0 responses into run live" in out and "recorder's thread ended" in out


def test_a_recorder_counts_each_bad_body_once_in_a_batch(tmp_path):
    """A batch mixing good and bad bodies: each is counted once (once the whole batch went to
    export_failed as well, good ones included)."""
    from moescope.ingest.proxy import Captured

    recorder = RoutingRecorder(str(tmp_path / "store"), num_experts=E)
    for body in [good_body(1), ODD_BODIES[0], good_body(2), ODD_BODIES[1], good_body(3)]:
        recorder.submit(Captured(body, "application/json", {}))
    recorder.shutdown()
    assert recorder.counts == {"recorded": 3, "bad_routing": 2}
    assert parquet_rows(str(tmp_path / "store"), "steps").num_rows == 3
