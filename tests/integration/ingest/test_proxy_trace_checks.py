"""The trace checks behind `moescope proxy`: each fault injected alone into a stand-in engine's
responses is found by the one check that names it, with the count the injection put there.

vLLM and SGLang cannot run here, so a real HTTP server on 127.0.0.1 (started and stopped by each
test) answers with the STAND-IN engine's routing (tests/support/engine_standin.py: a tiny Mixtral
in bfloat16) in vLLM's and SGLang's response formats, one response per request, faults injected
into the arrays (tests/support/trace_faults.py); the proxy in front of it records them. Physical
ids are checked against the engine's map the way a user gives it: `moescope proxy --placement FILE`,
run as its own process.
"""

from __future__ import annotations

import copy
import json
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from moescope.ingest.proxy import RoutingProxy
from tests.support.engine_standin import sglang_responses, vllm_responses
from tests.support.importing import parquet_rows, store_files
from tests.support.paths import REPO
from tests.support.proxy import post, stop_command
from tests.support.sigterm import default_signals
from tests.support.trace_faults import (
    FAULTS,
    FORMATS,
    load_sorted_map,
    misread_slots,
    physical,
    redundant_map,
    sent,
    slot_loads,
    standin_trace,
    to_physical,
)


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


def proxied(tmp_path, fmt: str, requests, engine, layers: int, k: int, experts: int,
            **options) -> tuple[str, RoutingProxy]:
    lines = (vllm_responses if fmt == "vllm" else sglang_responses)(requests, engine).splitlines()
    upstream = Replies([line.encode() for line in lines])
    root = str(tmp_path / "store")
    extra = dict(num_layers=layers, top_k=k) if fmt == "sglang" else {}
    options = {"num_experts": experts + 2, **options}
    proxy = RoutingProxy(f"http://127.0.0.1:{upstream.port}", root, port=0, **extra, **options).start()
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


def map_file(tmp_path, mapping: list[list[int]], **load) -> str:
    """vLLM's physical_to_logical_map (a row per MoE layer) as a file `--placement` reads, with the
    load the engine recorded beside it under the engine's own name."""
    path = tmp_path / "eplb_map.json"
    path.write_text(json.dumps({"physical_to_logical_map": mapping, "ranks": 1, **load}))
    return str(path)


def proxied_command(tmp_path, fmt: str, requests, engine, layers: int, k: int, num_experts: int,
                    *options: str) -> tuple[str, str, int]:
    """The stand-in's responses through `moescope proxy` as its own process (run "live"), stopped
    with SIGINT once every request is answered; returns (the store, its stdout, the responses sent)."""
    lines = (vllm_responses if fmt == "vllm" else sglang_responses)(requests, engine).splitlines()
    upstream = Replies([line.encode() for line in lines])
    root = str(tmp_path / "store")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shape = ["--num-layers", str(layers), "--top-k", str(k)] if fmt == "sglang" else []
    process = subprocess.Popen([sys.executable, "-m", "moescope.cli", "proxy", "--upstream",
                                f"http://127.0.0.1:{upstream.port}", "--store", root, "--num-experts",
                                str(num_experts), "--listen", f"127.0.0.1:{port}", "--run-id", "live", *shape,
                                *options], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=default_signals)
    try:
        first = process.stdout.readline()
        assert "recording run live" in first
        for _ in lines:
            status, _, _ = post(port, "/generate" if fmt == "sglang" else "/v1/completions", {})
            assert status == 200
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        stop_command(process)
        upstream.close()
    assert process.returncode == 0, err
    return root, first + out, len(lines)


def found_by_check(root: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for row in parquet_rows(root, "trace_findings", "live").to_pylist():  # a row per flush: the sum
        assert row["origin"] == "proxy"
        found[row["check_name"]] = found.get(row["check_name"], 0) + row["count"]
    return found


def slots_a_logical_reading_gets_wrong(arrays: list[np.ndarray], mapping: list[list[int]]) -> int:
    """Counted here by a loop over what the engine sent: slots of routed (token, layer) rows (not all
    zero, no -1) whose id is a physical slot holding another logical expert than the id."""
    count = 0
    for ids in arrays:
        for row in ids.tolist():
            for layer, chosen in enumerate(row):
                if any(chosen) and min(chosen) >= 0:
                    count += sum(1 for e in chosen if mapping[layer][e] != e)
    return count


@pytest.mark.integration
@pytest.mark.parametrize("fmt", FORMATS)
def test_physical_ids_under_the_placement_map_are_found_through_the_proxy_command(tmp_path, standin, fmt):
    """The engine returned the physical slot (a redundant copy past the E logical experts) for every
    other token routed to experts 0 and 1. A response naming a copy is refused as out_of_range, as
    before (--num-experts is the model's E), but checked first, so physical_ids counts every slot."""
    requests, clean, layers, k, experts = standin
    engine = copy.deepcopy(clean)
    physical(requests, engine, experts)
    mapping = redundant_map(experts, layers)
    arrays = sent(fmt, requests, engine)
    expected = slots_a_logical_reading_gets_wrong(arrays, mapping)
    assert expected == sum(int((a >= experts).sum()) for a in arrays) > 0  # the injected copies, nothing else
    root, out, responses = proxied_command(tmp_path, fmt, requests, engine, layers, k, experts,
                                           "--placement", map_file(tmp_path, mapping))
    assert found_by_check(root) == {"physical_ids": expected}
    assert f"trace checks found: physical_ids {expected} " in out
    # each response as the engine sent it: vLLM's holds a request's prompt rows and every choice's own,
    # SGLang's one (prompt, choice) whole
    bodies = [[engine[(r, 0)][:len(prompt)], *(engine[(r, c)][len(prompt):] for c in range(len(generated)))]
              for r, (prompt, generated) in enumerate(requests)] if fmt == "vllm" else [[a] for a in engine.values()]
    assert len(bodies) == responses
    refused = sum(1 for arrays in bodies if any((a >= experts).any() for a in arrays))
    assert 0 < refused <= responses and parquet_rows(root, "steps", "live").num_rows == responses - refused
    assert f"recorded {responses - refused} responses" in out and f"not recorded: bad_routing {refused}" in out


@pytest.mark.integration
@pytest.mark.parametrize("placement", ["identity", "none"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_clean_trace_through_the_proxy_command_gives_no_physical_ids(tmp_path, standin, fmt, placement):
    requests, clean, layers, k, experts = standin
    options = ["--placement", map_file(tmp_path, [list(range(experts))] * layers)] if placement == "identity" else []
    root, out, responses = proxied_command(tmp_path, fmt, requests, clean, layers, k, experts, *options)
    assert found_by_check(root) == {}
    assert "trace checks: no finding in" in out and f"recorded {responses} responses" in out
    assert ("trace checks against the engine map" in out) == (placement == "identity")


@pytest.mark.integration
def test_a_bad_placement_map_stops_the_proxy_at_start_with_one_line(tmp_path, standin):
    _, _, layers, _, experts = standin
    root = str(tmp_path / "store")
    base = [sys.executable, "-m", "moescope.cli", "proxy", "--upstream", "http://127.0.0.1:9", "--store", root,
            "--listen", "127.0.0.1:0", "--num-experts", str(experts)]
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    other = map_file(tmp_path, [list(range(experts * 2))] * layers)  # the map of a model with 2E experts
    for options, says in [(["--placement", str(tmp_path / "missing.json")], "missing.json"),
                          (["--placement", str(broken)], "broken.json"),
                          (["--placement", other], f"{experts * 2} logical experts, but --num-experts is {experts}")]:
        done = subprocess.run([*base, *options], cwd=REPO, capture_output=True, text=True, timeout=60)
        err = done.stderr.strip()
        assert done.returncode == 1 and done.stdout == "", (done.stdout, err)
        assert len(err.splitlines()) == 1 and err.startswith("moescope proxy: ") and says in err, err
    assert store_files(root) == []  # refused before the run was opened


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_permutation_with_the_engines_load_is_found_through_the_proxy(tmp_path, standin, fmt):
    """No id past the experts: the map's recorded load (vLLM's expert_load_window) tells physical ids,
    judged over the responses of one flush (the interval is longer than the test)."""
    from moescope.cli.check import read_engine_map

    requests, clean, layers, k, experts = standin
    mapping = load_sorted_map(list(clean.values()), experts)
    engine = {key: to_physical(ids, mapping) for key, ids in clean.items()}
    arrays = sent(fmt, requests, engine)
    expected = slots_a_logical_reading_gets_wrong(arrays, mapping)
    assert 0 < expected == misread_slots(arrays, mapping)
    engine_map = read_engine_map(map_file(tmp_path, mapping, expert_load_window=[slot_loads(arrays, experts)]))
    root, proxy = proxied(tmp_path, fmt, requests, engine, layers, k, experts, num_experts=experts,
                          engine_map=engine_map, flush_interval_s=3600)
    rows = parquet_rows(root, "trace_findings", proxy.recorder.spec.run_id).to_pylist()
    assert [(r["check_name"], r["count"], r["origin"]) for r in rows] == [("physical_ids", expected, "proxy")]
    (tmp_path / "logical").mkdir()  # the same traffic returned logical, under the same map and load
    root, proxy = proxied(tmp_path / "logical", fmt, requests, clean, layers, k, experts, num_experts=experts,
                          engine_map=engine_map, flush_interval_s=3600)
    assert parquet_rows(root, "trace_findings", proxy.recorder.spec.run_id).num_rows == 0


def test_a_map_whose_rows_do_not_fit_the_responses_is_reported_and_the_other_checks_go_on(tmp_path, standin):
    from moescope.cli.check import read_engine_map

    requests, clean, layers, k, experts = standin
    engine = copy.deepcopy(clean)
    check, count_of = FAULTS[0](requests, engine, experts)  # zero rows, found whatever the map
    rows = layers + 3  # neither a row per MoE layer (vLLM) nor one per layer up to the last MoE one (SGLang)
    engine_map = read_engine_map(map_file(tmp_path, [list(range(experts))] * rows))
    root, proxy = proxied(tmp_path, "vllm", requests, engine, layers, k, experts, num_experts=experts,
                          engine_map=engine_map)
    assert proxy.recorder.counts["recorded"] == len(requests)
    found = parquet_rows(root, "trace_findings", proxy.recorder.spec.run_id).to_pylist()
    assert {r["check_name"] for r in found} == {check}
    assert sum(r["count"] for r in found) == count_of(sent("vllm", requests, engine))
    assert (f"physical_ids not checked: eplb_map.json: the map has {rows} rows, but the run has {layers} MoE layers"
            in proxy.recorder.report())
