"""What `moescope proxy` keeps and shows of its users and its engine (issue 23, items 9 to 11).

Credentials in --upstream go to the engine as Authorization and nowhere else; control characters in
tag headers are not stored, and `moescope query` escapes any a store holds from before; token ids
(the prompt's text, given a tokenizer) are stored only when asked. Real stand-in engine and proxy on
127.0.0.1; stored values are read from the raw Parquet files.
"""

from __future__ import annotations

import base64
import json
import re
import signal
import socket

import pytest

from moescope.ingest.proxy import Captured, RoutingProxy, RoutingRecorder, parse_upstream
from tests.support.importing import parquet_rows
from tests.support.paths import REPO
from tests.support.proxy import (
    E,
    draw,
    generated_token_ids,
    post,
    prompt_token_ids,
    stop_command,
)
from tests.support.sigterm import default_signals

# What a terminal acts on: C0 but newline, DEL, C1, bidirectional overrides and isolates.
TERMINAL_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


# -- item 9: credentials in --upstream -------------------------------------------------------------


def test_upstream_credentials_go_to_the_engine_as_basic_auth_and_nowhere_else(tmp_path, engine):
    proxy = RoutingProxy(f"http://admin:hunter2@127.0.0.1:{engine.port}", str(tmp_path / "store"), num_experts=E,
                         port=0).start()
    try:
        status, _, _ = post(proxy.port, "/v1/completions", {"seed": 1, "prompt_len": 2},
                            {"Authorization": "Bearer the-clients-own"})
    finally:
        proxy.shutdown()
    assert status == 200
    received = engine.received[0]
    assert received["Host"] == f"127.0.0.1:{engine.port}"
    assert received["Authorization"] == "Basic " + base64.b64encode(b"admin:hunter2").decode()
    assert "hunter2" not in proxy.upstream_url + repr(proxy.upstream) + proxy.recorder.report()


def test_percent_encoded_credentials_are_decoded():
    upstream = parse_upstream("http://ad%3Amin:p%40ss%20word@[::1]:8000/api/")
    assert upstream.authorization == "Basic " + base64.b64encode(b"ad:min:p@ss word").decode()
    assert upstream.host_header == "[::1]:8000" and upstream.path == "/api" and upstream.url == "http://[::1]:8000/api"


def test_a_bad_upstream_is_refused_without_showing_its_password(tmp_path):
    for url in ("https://admin:hunter2@example.com", "http://admin:hunter2@example.com:notaport",
                "http://admin:hunter2@example.com/?q=1"):
        with pytest.raises(ValueError) as refused:
            RoutingProxy(url, str(tmp_path / "store"), num_experts=E, port=0)
        assert "hunter2" not in str(refused.value) and "--upstream" in str(refused.value)


def test_a_502_does_not_return_the_upstream_password(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    proxy = RoutingProxy(f"http://admin:hunter2@127.0.0.1:{dead_port}", str(tmp_path / "store"), num_experts=E,
                         port=0).start()
    try:
        status, _, payload = post(proxy.port, "/v1/completions", {})
    finally:
        proxy.shutdown()
    assert status == 502 and b"did not answer" in payload
    assert b"hunter2" not in payload and b"admin" not in payload


@pytest.mark.integration
def test_the_command_never_prints_the_upstream_password(tmp_path, engine):
    process, port, first = _start_with_credentials(str(tmp_path / "store"), engine.port)
    try:
        assert post(port, "/v1/completions", {"seed": 2, "prompt_len": 2})[0] == 200
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        stop_command(process)
    assert process.returncode == 0, err
    assert f"-> http://127.0.0.1:{engine.port}," in first
    assert "hunter2" not in first + out + err


def _start_with_credentials(root: str, engine_port: int):
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "moescope.cli", "proxy", "--upstream",
                                f"http://admin:hunter2@127.0.0.1:{engine_port}", "--store", root, "--num-experts",
                                str(E), "--listen", f"127.0.0.1:{port}", "--run-id", "live"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=default_signals)
    first = process.stdout.readline()
    assert "recording run live" in first, first
    return process, port, first


# -- item 10: control characters -------------------------------------------------------------------


def test_tag_headers_with_control_characters_are_not_stored(tmp_path, engine, proxy_for):
    proxy = proxy_for(engine.port)
    status, _, _ = post(proxy.port, "/v1/completions", {"seed": 3, "prompt_len": 2},
                        {"X-Router-Version": "v2\x1b[2J", "X-Moescope-Tag-Bell": "ring\x07",
                         "X-Moescope-Tag-Nul": "a\x00b", "X-Moescope-Tag-Ok": "fine"})
    assert status == 200
    assert engine.received[0]["X-Router-Version"] == "v2\x1b[2J"  # forwarded unchanged all the same
    assert proxy.recorder.force_flush()
    steps = parquet_rows(str(tmp_path / "store"), "steps", proxy.recorder.spec.run_id).to_pylist()
    assert [dict(step["tags"]) for step in steps] == [{"ok": "fine"}]


@pytest.fixture
def old_store(tmp_path) -> str:
    """A store holding control characters, as one written before they were refused at the door:
    a run's model name and a step's tag value, written through the run's writer."""
    root = str(tmp_path / "store")
    recorder = RoutingRecorder(root, num_experts=E, run_id="old", model="m\x1b[2J\x07")
    body = json.dumps({"prompt_routed_experts": draw(1, 2).tolist(), "choices": []}).encode()
    recorder.submit(Captured(body, "application/json", {"t": "x\x1b]0;owned\x07\u202e\x00"}))
    recorder.shutdown()
    assert parquet_rows(root, "runs", "old").column("model_class").to_pylist() == ["m\x1b[2J\x07"]  # stored raw
    tags = parquet_rows(root, "steps", "old").column("tags").to_pylist()
    assert [dict(t) for t in tags] == [{"t": "x\x1b]0;owned\x07\u202e\x00"}]
    return root


@pytest.mark.parametrize("output", ["table", "csv", "json"])
def test_query_prints_control_characters_as_escapes(old_store, output, capsys):
    from moescope.cli import main

    sql = "SELECT r.model_class, s.tags, s.tags['t'] AS t FROM runs r JOIN steps s USING (run_id)"
    assert main(["query", old_store, sql, "--format", output]) == 0
    printed = capsys.readouterr().out
    assert not TERMINAL_CONTROL.findall(printed), ascii(printed)
    shown = printed.replace("\\\\", "\\")  # JSON doubles the backslash
    assert "m\\x1b[2J\\x07" in shown
    assert shown.count("x\\x1b]0;owned\\x07\\u202e\\x00") == 2  # the map's value, and the value alone


# -- item 11: token ids ----------------------------------------------------------------------------


def stored_token_ids(root: str, run_id: str) -> dict[int, int | None]:
    """{position: token_id} of layer 0's raw routes rows."""
    rows = parquet_rows(root, "routes", run_id).to_pylist()
    return {r["position"]: r["token_id"] for r in rows if r["layer"] == 0}


@pytest.mark.parametrize("record", [False, True])
def test_token_ids_are_stored_only_when_asked(tmp_path, engine, proxy_for, record):
    proxy = proxy_for(engine.port, **({"record_token_ids": True} if record else {}))
    status, _, payload = post(proxy.port, "/v1/completions", {"seed": 4, "prompt_len": 5, "max_tokens": 4,
                                                              "token_ids": True})
    assert status == 200 and json.loads(payload)["prompt_token_ids"] == prompt_token_ids(5)
    assert proxy.recorder.force_flush()
    stored = stored_token_ids(str(tmp_path / "store"), proxy.recorder.spec.run_id)
    ids = prompt_token_ids(5) + generated_token_ids(4)
    assert sorted(stored) == list(range(8))  # 5 prompt tokens and 3 of the 4 generated ones, routed
    assert stored == ({p: ids[p] for p in range(8)} if record else dict.fromkeys(range(8)))


def test_the_command_takes_record_token_ids_off_by_default():
    from moescope.cli import build_parser

    base = ["proxy", "--upstream", "http://x:1", "--store", "s", "--num-experts", "4"]
    assert build_parser().parse_args(base).record_token_ids is False
    assert build_parser().parse_args([*base, "--record-token-ids"]).record_token_ids is True
