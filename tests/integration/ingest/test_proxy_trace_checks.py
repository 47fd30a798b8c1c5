"""The trace checks behind `moescope proxy`: each fault injected alone into a stand-in engine's
responses is found by the one check that names it, with the count the injection put there.

vLLM and SGLang cannot run here, so a real HTTP server on 127.0.0.1 (started and stopped by each
test) answers with the STAND-IN engine's routing (tests/support/engine_standin.py: a tiny Mixtral
in bfloat16) in vLLM's and SGLang's response formats, one response per request, faults injected
into the arrays (tests/support/trace_faults.py); the proxy in front of it records them.
"""

from __future__ import annotations

import copy
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moescope.ingest.proxy import RoutingProxy
from tests.support.engine_standin import sglang_responses, vllm_responses
from tests.support.importing import parquet_rows
from tests.support.proxy import post
from tests.support.trace_faults import FAULTS, FORMATS, sent, standin_trace


class Replies:
    """A stand-in engine that answers each POST with the next of `bodies`, on 127.0.0.1."""

    def __init__(self, bodies: list[bytes]):
        self.bodies = list(bodies)
        replies = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                payload = replies.bodies.pop(0)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def standin():
    return standin_trace()


def proxied(tmp_path, fmt: str, requests, engine, layers: int, k: int, experts: int) -> tuple[str, RoutingProxy]:
    lines = (vllm_responses if fmt == "vllm" else sglang_responses)(requests, engine).splitlines()
    upstream = Replies([line.encode() for line in lines])
    root = str(tmp_path / "store")
    extra = dict(num_layers=layers, top_k=k) if fmt == "sglang" else {}
    proxy = RoutingProxy(f"http://127.0.0.1:{upstream.port}", root, num_experts=experts + 2, port=0, **extra).start()
    try:
        for _ in lines:
            status, _, _ = post(proxy.port, "/generate" if fmt == "sglang" else "/v1/completions", {})
            assert status == 200
    finally:
        proxy.shutdown()
        upstream.close()
    return root, proxy


@pytest.mark.parametrize("fmt", FORMATS)
def test_clean_standin_responses_through_the_proxy_give_no_finding(tmp_path, standin, fmt):
    requests, engine, layers, k, experts = standin
    root, proxy = proxied(tmp_path, fmt, requests, engine, layers, k, experts)
    assert proxy.recorder.counts["recorded"] == (8 if fmt == "sglang" else 4)
    assert parquet_rows(root, "trace_findings", proxy.recorder.spec.run_id).num_rows == 0
    assert "trace checks: no finding" in proxy.recorder.report()


@pytest.mark.parametrize("fault", [f for f in FAULTS if f.__name__ != "physical"], ids=lambda f: f.__name__)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_fault_alone_through_the_proxy_is_found_by_its_check(tmp_path, standin, fmt, fault):
    requests, clean, layers, k, experts = standin
    engine = copy.deepcopy(clean)
    check, count_of = fault(requests, engine, experts)
    expected = count_of(sent(fmt, requests, engine))
    root, proxy = proxied(tmp_path, fmt, requests, engine, layers, k, experts)
    rows = parquet_rows(root, "trace_findings", proxy.recorder.spec.run_id).to_pylist()
    found: dict[str, int] = {}
    for row in rows:  # a row per flush: a check's figure is the sum
        assert row["origin"] == "proxy"
        found[row["check_name"]] = found.get(row["check_name"], 0) + row["count"]
    assert found == {check: expected}
    assert f"trace checks found: {check} {expected}" in proxy.recorder.report()
