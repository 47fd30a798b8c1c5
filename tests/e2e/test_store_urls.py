"""`store=` as a URL everywhere, the local state a URL store keeps on this machine, and a run's
figures broken down by host.

The fleet here is real processes: three writers (hosts alpha, alpha, beta; ranks 0, 1, 2) record
one run into one store, a local folder or a bucket of the S3 test server (tests/support/s3server.py), with
their credentials in the environment only. Expected values come from the rows of each table's
current Delta snapshot read by delta-rs itself (`raw`), summed by plain loops.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pandas as pd
import pytest
import torch

import moescope
from moescope.cli import build_parser, main
from moescope.cli.arguments import store_location
from moescope.store.location import StoreLocation, open_location, state_dir
from tests.support.paths import REPO

CHILD = os.path.join(REPO, "tests", "support", "children", "host_writer_child.py")
FLEET = (("alpha", 0, 0, 64), ("alpha", 1, 0, 64), ("beta", 2, 64, 128))  # host, rank, token ids [low, high)
STEPS = 6
RUN = "fleet-run"
RULES = """
version: 1
defaults: {window: 2, for: 0s, cooldown: 0s}
rules:
  - name: ExpertLoadSkew
    expr: load_max_mean > 1.1
"""
COMMANDS = (["summary"], ["query"], ["compact"], ["prune"], ["whatif", "cache"], ["import"], ["proxy"],
            ["alerts", "run"], ["dashboard"])


def options_args(location: StoreLocation) -> list[str]:
    return [arg for key, value in location.storage_options.items() for arg in ("--storage-option", f"{key}={value}")]


def raw(location: StoreLocation, table: str) -> pd.DataFrame:
    """A table's rows in its current Delta snapshot, read by delta-rs (credentials from the environment)."""
    from deltalake import DeltaTable

    delta = DeltaTable(location.table_uri(table), storage_options=dict(location.storage_options) or None)
    return delta.to_pyarrow_table().to_pandas()


def every_object(location: StoreLocation) -> dict[str, bytes]:
    """Every file under the store, by path: what the store holds, byte for byte."""
    from pyarrow import fs

    filesystem = location.filesystem()
    infos = filesystem.get_file_info(fs.FileSelector(location.join(), recursive=True))
    out = {}
    for info in infos:
        if info.type == fs.FileType.File:
            with filesystem.open_input_stream(info.path) as stream:
                out[info.path] = stream.read()
    return out


# -- the fleet: three writer processes, two hosts, one run ---------------------------------------

@contextlib.contextmanager
def _s3_environment(server):
    from tests.support.s3server import CLEARED_ENV

    with pytest.MonkeyPatch.context() as patch:
        for key in CLEARED_ENV:
            patch.delenv(key, raising=False)
        for key, value in server.environment().items():
            patch.setenv(key, value)
        yield


@pytest.fixture(scope="module", params=("local", "s3"))
def fleet(request, tmp_path_factory):
    """(location, secret) of a store three processes wrote run RUN into, as hosts alpha and beta."""
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        context = _s3_environment(server)
        prefix = server.fresh_prefix("fleet")
        location, secret = server.location(prefix), server.secret_key
    else:
        server, context = None, contextlib.nullcontext()
        location, secret = open_location(tmp_path_factory.mktemp("fleet") / "store"), None
    with context:
        writers = []
        for host, rank, low, high in FLEET:
            env = {**os.environ, "MOESCOPE_HOST": host, "RANK": str(rank), "WORLD_SIZE": str(len(FLEET)),
                   "PYTHONPATH": REPO}
            args = [sys.executable, CHILD, location.url, RUN, str(STEPS), str(low), str(high)]
            if location.storage_options:
                args.append(json.dumps(dict(location.storage_options)))
            writers.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True))
        try:
            for writer in writers:
                out, _ = writer.communicate(timeout=600)
                assert writer.returncode == 0, out[-3000:]
        finally:
            for writer in writers:
                if writer.poll() is None:
                    writer.kill()
                    writer.wait()
        yield location, secret
    if server is not None and server.running:
        server.delete_prefix(prefix + "/")


def expected_hosts(location: StoreLocation) -> dict[str, dict]:
    """Per host, from the raw rows: ranks, forwards per rank, tokens, and per layer the summed load."""
    runs, steps, layer_steps = raw(location, "runs"), raw(location, "steps"), raw(location, "layer_steps")
    host_of = {int(r.rank): r.host for r in runs[runs.run_id == RUN].itertuples()}
    out: dict[str, dict] = defaultdict(lambda: {"ranks": set(), "forwards": 0, "tokens": 0, "loads": {},
                                                "layer_tokens": defaultdict(int), "dropped": 0})
    for row in steps[steps.run_id == RUN].itertuples():
        host = out[host_of[int(row.rank)]]
        host["ranks"].add(int(row.rank))
        host["forwards"] += int(row.forwards) if pd.notna(row.forwards) else 1
        host["tokens"] += int(row.tokens)
    for row in layer_steps[layer_steps.run_id == RUN].itertuples():
        host = out[host_of[int(row.rank)]]
        load = np.asarray(row.expert_load, dtype=np.int64)
        host["loads"][int(row.layer)] = host["loads"].get(int(row.layer), 0) + load
        host["layer_tokens"][int(row.layer)] += int(row.tokens)
        host["dropped"] += int(row.dropped_tokens or 0)
    for host in out.values():
        host["forwards"] //= len(host["ranks"])
        spreads = {layer: load.max() / load.mean() for layer, load in host["loads"].items()}
        cvs = {layer: load.std() / load.mean() for layer, load in host["loads"].items()}
        weights = np.array([host["layer_tokens"][layer] for layer in cvs], dtype=np.float64)
        host["max_over_mean"] = max(spreads.values())
        host["load_cv"] = float(np.sum(np.array(list(cvs.values())) * weights) / weights.sum())
        host["dropped_rate"] = host["dropped"] / sum(host["layer_tokens"].values())
    return dict(out)


def test_each_writer_recorded_its_host(fleet):
    location, _ = fleet
    runs, stats = raw(location, "runs"), raw(location, "probe_stats")
    assert sorted(zip(runs["rank"], runs.host)) == sorted((rank, host) for host, rank, _, _ in FLEET)
    assert set(zip(stats["rank"], stats.host)) == {(rank, host) for host, rank, _, _ in FLEET}


def test_host_breakdown_matches_a_loop_over_the_raw_rows(fleet):
    from moescope.cli.summary import host_rows
    from moescope.store import Store

    location, _ = fleet
    expected = expected_hosts(location)
    with Store(location) as store:
        totals = store.host_totals(RUN)
        per_layer = store.host_layer_totals(RUN)
        rows = {r["host"]: r for r in host_rows(store, RUN)}
    assert list(totals.host) == ["alpha", "beta"]
    for t in totals.itertuples():
        want = expected[t.host]
        assert (t.ranks, t.forwards, t.tokens) == (len(want["ranks"]), want["forwards"], want["tokens"])
        layers = per_layer[per_layer.host == t.host]
        assert {int(r.layer): list(r.expert_load) for r in layers.itertuples()} == {
            layer: list(load) for layer, load in want["loads"].items()}
        got = rows[t.host]
        assert got["max_over_mean"] == pytest.approx(want["max_over_mean"])
        assert got["load_cv"] == pytest.approx(want["load_cv"])
        assert got["dropped_rate"] == pytest.approx(want["dropped_rate"])
    alpha, beta = ({layer: list(load) for layer, load in expected[h]["loads"].items()} for h in ("alpha", "beta"))
    assert alpha != beta  # the hosts saw different tokens


def test_host_breakdown_follows_the_tag_filter(fleet):
    from moescope.store import Store

    location, _ = fleet
    steps, runs = raw(location, "steps"), raw(location, "runs")
    host_of = {int(r.rank): r.host for r in runs.itertuples()}
    even = steps[[dict(t).get("domain") == "even" for t in steps.tags]]
    want = defaultdict(int)
    for row in even.itertuples():
        want[host_of[int(row.rank)]] += int(row.tokens)
    with Store(location) as store:
        got = store.host_totals(RUN, tags={"domain": "even"})
    assert dict(zip(got.host, got.tokens)) == dict(want)
    assert 0 < sum(want.values()) < steps.tokens.sum()


def test_summary_prints_the_per_host_table(fleet, capsys):
    location, secret = fleet
    expected = expected_hosts(location)
    assert main(["summary", location.url, *options_args(location), "--run", RUN]) == 0
    captured = capsys.readouterr()
    assert "by host (2 hosts" in captured.out
    for host, want in expected.items():
        line = (f"  {host:<24} {len(want['ranks']):>5} {want['forwards']:>9,} {want['tokens']:>12,} "
                f"{want['load_cv']:>8.2f} {want['max_over_mean']:>9.2f} {100 * want['dropped_rate']:>7.2f}")
        assert line in captured.out, captured.out
    assert f"moescope query {location.url}" in captured.out
    if secret:
        assert secret not in captured.out + captured.err


def test_a_single_host_run_has_no_host_table(tmp_path):
    from moescope.cli.summary import format_summary
    from tests.support.zoo import tiny_model

    model = tiny_model("mixtral")
    with moescope.attach(model, store=tmp_path / "one", run_id="solo") as session, torch.no_grad():
        model(torch.randint(0, 128, (1, 4)))
    assert session.run.run_id == "solo"
    assert "by host" not in format_summary(tmp_path / "one", "solo")


# -- every command: a URL, --storage-option, --help ----------------------------------------------

@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_teaches_the_url_form(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    out = capsys.readouterr().out
    assert "s3://BUCKET/PREFIX" in out and "--storage-option KEY=VALUE" in out
    assert "--storage-option endpoint=http://127.0.0.1:9000" in out
    assert "AWS_SECRET_ACCESS_KEY" in out  # where credentials go instead


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_makes_one_location_of_its_store(command):
    extra = {"query": ["SELECT 1"], "prune": ["--older-than", "1d"], "import": ["vllm", "x.json"],
             "proxy": ["--upstream", "http://127.0.0.1:1", "--num-experts", "4"]}.get(command[0], [])
    store = ["--store", "s3://bucket/runs/"] if command[0] in ("import", "proxy") else ["s3://bucket/runs/"]
    args = build_parser().parse_args([*command, *store, *extra, "--storage-option", "endpoint=http://127.0.0.1:9000",
                                      "--storage-option", "region=eu-west-1"])
    assert store_location(args) == StoreLocation("s3://bucket/runs", {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
                                                                       "AWS_REGION": "eu-west-1"})


@pytest.mark.parametrize("argv, says", [
    (["summary", "ftp://host/runs"], "not supported"),
    (["summary", "s3://bucket/runs", "--storage-option", "aws_secret_access_key=hunter2-do-not-print"],
     "environment"),
    (["summary", "s3://AKIAEXAMPLE:hunter2-do-not-print@bucket/runs"], "credentials do not go in the URL"),
    (["summary", "runs/", "--storage-option", "region=eu-west-1"], "object storage"),
    (["summary", "s3://bucket/runs", "--storage-option", "no-equals-sign"], "KEY=VALUE"),
])
def test_a_store_that_cannot_be_used_is_refused_with_what_to_do(argv, says, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
    assert "hunter2-do-not-print" not in err


# -- local state of a URL store ------------------------------------------------------------------

def test_state_dir_is_local_and_named_by_the_redacted_url(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    local = open_location(tmp_path / "store")
    assert state_dir(local) == str(tmp_path / "store" / ".moescope")  # where a local store always kept it
    url = open_location("s3://bucket/fleet", {"endpoint": "http://127.0.0.1:9000"})
    digest = hashlib.sha256(b"s3://bucket/fleet").hexdigest()[:16]
    assert state_dir(url) == str(tmp_path / "cache" / "moescope" / digest)
    assert state_dir(open_location("s3://bucket/fleet/")) == state_dir(url)  # options and a trailing / change nothing
    assert state_dir(open_location("s3://bucket/other")) != state_dir(url)
    assert state_dir(url, tmp_path / "mine") == str(tmp_path / "mine")
    from moescope.alerts.outbox import outbox_path

    assert outbox_path(url) == os.path.join(state_dir(url), "alerts-outbox.sqlite")
    assert outbox_path(str(tmp_path / "store")) == str(tmp_path / "store" / ".moescope" / "alerts-outbox.sqlite")


# -- the commands on a bucket --------------------------------------------------------------------

@pytest.fixture
def s3_fleet(fleet):
    location, secret = fleet
    if location.is_local:
        pytest.skip("the bucket's own checks")
    return location, secret


def test_query_whatif_and_summary_read_the_bucket(s3_fleet, capsys):
    location, secret = s3_fleet
    steps = raw(location, "steps")
    assert main(["query", location.url, *options_args(location), "--format", "json",
                 "SELECT count(*) AS n, sum(tokens) AS tokens FROM steps"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"n": len(steps), "tokens": int(steps.tokens.sum())}]
    assert main(["whatif", "cache", location.url, *options_args(location), "--layer", "0"]) == 0
    out = capsys.readouterr().out
    assert f"run {RUN}" in out and "layer 0:" in out
    # and as a process, as an operator runs it: the secret stays in the environment
    result = subprocess.run([sys.executable, "-m", "moescope.cli", "summary", location.url, *options_args(location)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"run {RUN}" in result.stdout and "by host" in result.stdout
    assert secret not in result.stdout + result.stderr


def test_a_missing_bucket_is_named_without_the_secret(s3_fleet):
    location, secret = s3_fleet
    missing = location.url.replace("s3://moescope-test/", "s3://no-such-bucket/")
    result = subprocess.run([sys.executable, "-m", "moescope.cli", "summary", missing, *options_args(location)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 1
    assert "no-such-bucket" in result.stderr and "Traceback" not in result.stderr
    assert secret not in result.stdout + result.stderr


def test_alerts_run_keeps_its_outbox_on_this_machine_and_its_alerts_in_the_bucket(s3_fleet, tmp_path, monkeypatch,
                                                                                   capsys):
    location, secret = s3_fleet
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    before = len(raw(location, "alerts")) if "alerts" in _tables(location) else 0
    assert main(["alerts", "run", location.url, *options_args(location), "--rules", str(rules), "--once",
                 "--flush-timeout", "1"]) == 0
    captured = capsys.readouterr()
    outbox = os.path.join(state_dir(location), "alerts-outbox.sqlite")
    assert os.path.isfile(outbox) and f"outbox {outbox}" in captured.err
    assert open(os.path.join(state_dir(location), "STORE")).read().strip() == location.redacted
    assert len(raw(location, "alerts")) > before  # the transitions went to the bucket's alerts table
    assert not [path for path in every_object(location) if "/.moescope" in path or path.endswith(".sqlite")]
    assert main(["alerts", "outbox", "list", location.url]) == 0  # found again by the same URL
    assert secret not in captured.out + captured.err


def _tables(location: StoreLocation) -> set[str]:
    from moescope.store.delta import table_exists
    from moescope.store.schema import SCHEMAS

    return {table for table in SCHEMAS if table_exists(location, table)}


def test_no_store_file_holds_the_secret(s3_fleet):
    location, secret = s3_fleet
    objects = every_object(location)
    assert any(path.endswith(".parquet") for path in objects) and any("_delta_log" in path for path in objects)
    assert not [path for path, body in objects.items() if secret.encode() in body]


# -- the dashboard -------------------------------------------------------------------------------

def _app(monkeypatch, location: StoreLocation):
    from streamlit.testing.v1 import AppTest

    from moescope.dashboard import settings

    monkeypatch.setenv(settings.ENV_STORE, location.url)
    if location.storage_options:
        monkeypatch.setenv(settings.ENV_STORAGE_OPTIONS, json.dumps(dict(location.storage_options)))
    else:
        monkeypatch.delenv(settings.ENV_STORAGE_OPTIONS, raising=False)
    monkeypatch.setenv(settings.ENV_ALLOW_WRITES, "0")
    monkeypatch.delenv(settings.ENV_TOKENIZER, raising=False)
    return AppTest.from_file(os.path.join(REPO, "dashboard", "app.py"), default_timeout=240)


def _page_text(at) -> str:
    """Everything the page shows (values, labels, captions, table cells, figure data) as one text."""
    return str(at._tree) + "".join(str(node.proto) for node in _nodes(at._tree) if hasattr(node, "proto"))


def _nodes(node):
    yield node
    for child in getattr(node, "children", {}).values():
        yield from _nodes(child)


def test_dashboard_overview_breaks_the_run_down_by_host(fleet, monkeypatch):
    location, secret = fleet
    expected = expected_hosts(location)
    at = _app(monkeypatch, location)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert any(s.value == "By host" for s in at.subheader)
    frame = next(d.value for d in at.dataframe if "host" in d.value.columns)
    assert list(frame.host) == ["alpha", "beta"]
    for _, row in frame.iterrows():
        want = expected[row["host"]]
        assert (row["ranks"], row["forwards"], row["tokens"]) == (len(want["ranks"]), want["forwards"], want["tokens"])
        assert row["load CV"] == pytest.approx(want["load_cv"])
        assert row["max/mean (most uneven layer)"] == pytest.approx(want["max_over_mean"])
    chart = json.loads(at.get("plotly_chart")[-1].proto.spec)
    assert [trace["name"] for trace in chart["data"]] == ["alpha", "beta"]
    for trace in chart["data"]:
        loads = expected[trace["name"]]["loads"]
        assert trace["y"] == pytest.approx([loads[int(x)].max() / loads[int(x)].mean() for x in trace["x"]])
    at.selectbox(key="ov_host").set_value("beta").run()  # the host filter
    frame = next(d.value for d in at.dataframe if "host" in d.value.columns)
    assert list(frame.host) == ["beta"]
    chart = json.loads(at.get("plotly_chart")[-1].proto.spec)
    assert [trace["name"] for trace in chart["data"]] == ["beta"]
    text = _page_text(at)
    assert location.redacted in text
    if secret:
        assert secret not in text
        assert not math.isnan(expected["beta"]["load_cv"])


# -- the writers that take a store: attach, the training monitor, the importers, the proxy --------

def test_attach_refuses_storage_options_without_a_store():
    from tests.support.zoo import tiny_model

    with pytest.raises(ValueError, match="without a store"):
        moescope.attach(tiny_model("mixtral"), storage_options={"region": "eu-west-1"})


def test_training_monitor_writes_its_steps_to_the_bucket(s3_store):
    from moescope import training
    from tests.support.zoo import tiny_model

    model = tiny_model("mixtral")
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = training.watch(model, optimizer, store=s3_store.url, storage_options=dict(s3_store.storage_options),
                             run_id="trained")
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 6), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    train_steps = raw(s3_store, "train_steps")  # a row per (optimizer step, MoE layer)
    layers = len(monitor.session.layers)
    assert sorted(train_steps[train_steps.run_id == "trained"].optimizer_step) == sorted([1, 2, 3] * layers)
    assert set(raw(s3_store, "runs").run_id) == {"trained"}


def test_import_writes_a_run_into_the_bucket_and_refuses_its_id_twice(s3_store, tmp_path, capsys):
    from moescope.core.runs import current_host

    experts = np.array([[[0, 1]], [[2, 3]], [[0, 2]]])  # 3 tokens, 1 layer, top-2
    source = tmp_path / "responses.jsonl"
    source.write_text(json.dumps({"id": "r1", "prompt_token_ids": [5, 6, 7],
                                  "prompt_routed_experts": experts.tolist(), "choices": []}) + "\n")
    argv = ["import", "vllm", str(source), "--store", s3_store.url, *options_args(s3_store), "--run-id", "imported",
            "--num-experts", "4"]
    assert main(argv) == 0
    assert "into run imported" in capsys.readouterr().out
    layer_steps = raw(s3_store, "layer_steps")
    assert [list(v) for v in layer_steps.expert_load] == [[2, 1, 2, 1]]  # a loop over the 3 tokens' choices
    runs = raw(s3_store, "runs")
    assert list(zip(runs.source, runs.host)) == [("vllm", current_host())]  # the files do not say; the importer's
    assert main(argv) == 1
    assert "already holds a run 'imported'" in capsys.readouterr().err


def test_the_proxy_records_into_the_bucket(s3_store):
    from moescope.core.runs import current_host
    from moescope.ingest.proxy import RoutingProxy
    from tests.support.proxy import StandInEngine, post

    engine = StandInEngine()
    try:
        proxy = RoutingProxy(f"http://127.0.0.1:{engine.port}", s3_store, num_experts=8, port=0).start()
        try:
            status, _, _ = post(proxy.port, "/v1/completions", {"seed": 1, "prompt_len": 5, "max_tokens": 4})
            assert status == 200
            assert proxy.recorder.force_flush()
        finally:
            proxy.shutdown()
    finally:
        engine.close()
    run_id = proxy.recorder.spec.run_id
    runs = raw(s3_store, "runs")
    assert list(zip(runs.run_id, runs.source, runs.host)) == [(run_id, "proxy", current_host())]
    steps = raw(s3_store, "steps")
    assert list(steps.run_id) == [run_id] and int(steps.tokens.iloc[0]) == 8


def test_dashboard_on_an_empty_prefix_says_there_is_no_store_yet(s3_store, monkeypatch):
    at = _app(monkeypatch, s3_store)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert any("no store" in i.value.lower() or "no run" in i.value.lower() for i in at.info), [
        i.value for i in at.info]
    assert s3_store.redacted in _page_text(at)
