"""The store's work in a writer process (`moescope.attach(..., writer="process")`): the rows are the
model's own routing, the model's process never loads the store's libraries, a killed writer process
is counted and replaced, a killed model process loses nothing its writer process was handed, a
forked child records through a writer process of its own, and the store's errors are raised at attach.

Rows are read from the raw Parquet files the Delta log names (tests/support/deltafiles.py), and the
expected routing from the model's own router logits (`output_router_logits`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import moescope
from moescope.store.naming import InvalidNameError
from moescope.store.writer_process import ProcessExporter
from tests.support.deltafiles import snapshot_rows
from tests.support.forked import in_forked_child
from tests.support.paths import REPO
from tests.support.zoo import tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes")]

BATCH, SEQ = 2, 6


def _exporter(session) -> ProcessExporter:
    [exporter] = [e for e in session.processor.exporters if isinstance(e, ProcessExporter)]
    return exporter


def _inputs(model, n: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=generator) for _ in range(n)]


def _gone(pid: int, timeout_s: float = 60.0) -> bool:
    """Whether process `pid` (not ours to wait for) ended within `timeout_s` (a zombie counts as ended)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_routes_written_by_the_writer_process_are_the_models_own_choices(tmp_path):
    model = tiny_model("mixtral", seed=0)
    top_k = model.config.num_experts_per_tok
    batches = _inputs(model, 3, seed=1)
    expected = []  # (step, layer) -> the top-k of the model's own router probabilities, per token
    # a long flush interval: nothing is written before close, so the drain writes every row
    session = moescope.attach(model, store=tmp_path, routes=True, window=1, writer="process", flush_interval_s=60)
    writer_pid = _exporter(session).writer_pid
    with torch.no_grad():
        for ids in batches:
            out = model(input_ids=ids, output_router_logits=True)
            expected.append([torch.topk(torch.softmax(logits.float(), -1), top_k, dim=-1).indices.numpy()
                             for logits in out.router_logits])
    assert session.processor.wait_idle(60)
    assert snapshot_rows(tmp_path, "steps").num_rows == 0  # buffered in the writer process, not written
    session.close()
    assert _gone(writer_pid, 30), "the writer process did not exit after the session closed"

    routes = snapshot_rows(tmp_path, "routes").to_pylist()
    layers = len(expected[0])
    assert len(routes) == len(batches) * layers * BATCH * SEQ
    got: dict[tuple[int, int], dict[int, list[int]]] = {}
    for row in routes:
        got.setdefault((row["step"], row["layer"]), {})[row["token"]] = row["expert_ids"]
    for step, per_layer in enumerate(expected):
        for layer, ids in enumerate(per_layer):
            assert [got[(step, layer)][t] for t in range(BATCH * SEQ)] == ids.tolist(), (step, layer)
    steps = snapshot_rows(tmp_path, "steps").to_pylist()
    assert sorted(r["step"] for r in steps) == [0, 1, 2]
    [end] = snapshot_rows(tmp_path, "run_ends").to_pylist()
    assert end["last_step"] == 2 and end["pid"] == writer_pid  # the writer process's end, after the drain
    assert snapshot_rows(tmp_path, "runs").num_rows == 1
    written = {r["table_name"]: r["written_rows"] for r in snapshot_rows(tmp_path, "probe_stats").to_pylist()
               if r["reason"] is None}
    assert written["routes"] == len(routes) and written["steps"] == 3
    assert session.probe_stats()[0]["routes"] == len(routes)  # the counts came back to the model's process


# A model process that records through a writer process and says which of the store's libraries it
# loaded itself.
RECORDER = """
import json, sys, torch, moescope
from tests.support.zoo import tiny_model
model = tiny_model("mixtral", seed=0)
session = moescope.attach(model, store=sys.argv[1], routes=True, window=1, writer=sys.argv[2])
with torch.no_grad():
    for _ in range(3):
        model(input_ids=torch.randint(0, 64, (2, 6)))
session.close()
print(json.dumps({name: name in sys.modules for name in ("pyarrow", "deltalake", "pandas")}))
"""


@pytest.mark.parametrize("writer, loaded", [("process", False), ("thread", True)])
def test_the_model_process_loads_no_arrow_or_delta_with_a_writer_process(tmp_path, writer, loaded):
    """With a writer process the model's process loads none of the store's libraries; with the writer's
    thread it loads pyarrow and deltalake, and never pandas (the store builds its arrays from buffers,
    `moescope.store.columns`: pyarrow's own conversion imports pandas, most of a first attach's CPU)."""
    result = subprocess.run([sys.executable, "-c", RECORDER, str(tmp_path / writer), writer], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"pyarrow": loaded, "deltalake": loaded,
                                                                  "pandas": False}
    assert snapshot_rows(tmp_path / writer, "steps").num_rows == 3


def test_a_killed_writer_process_is_counted_and_a_new_one_writes_on(tmp_path, caplog):
    model = tiny_model("mixtral", seed=0)
    layers = model.config.num_hidden_layers
    session = moescope.attach(model, store=tmp_path, routes=True, window=1, writer="process", flush_interval_s=60)
    try:
        first = _exporter(session).writer_pid
        with torch.no_grad():
            for ids in _inputs(model, 3, seed=1):
                model(input_ids=ids)
            assert session.processor.wait_idle(60)  # three records in the writer process's buffers
            os.kill(first, signal.SIGKILL)
            assert _gone(first)
            for ids in _inputs(model, 2, seed=2):
                model(input_ids=ids)
        assert session.flush(60)
        second = _exporter(session).writer_pid
        assert second not in (None, first)
        dropped = session.probe_stats()[1]
    finally:
        session.close()
    tokens = BATCH * SEQ
    lost = {("steps", "writer_died"): 3, ("layer_steps", "writer_died"): 3 * layers,
            ("routes", "writer_died"): 3 * layers * tokens}
    assert {k: v for k, v in dropped.items() if k[1] == "writer_died"} == lost
    assert "writer process" in caplog.text and "writer_died" in caplog.text
    assert sorted(r["step"] for r in snapshot_rows(tmp_path, "steps").to_pylist()) == [3, 4]
    assert snapshot_rows(tmp_path, "runs").num_rows == 1  # the run's rows once: the first process wrote them
    stats = [r for r in snapshot_rows(tmp_path, "probe_stats").to_pylist() if r["pid"] == second]
    latest = max(r["ts"] for r in stats)
    in_store = {(r["table_name"], r["reason"]): r["dropped_rows"] for r in stats
                if r["ts"] == latest and r["reason"] == "writer_died"}
    assert in_store == lost  # the loss is in the store too, in the new writer process's counts


KILLED = """
import sys, time, torch, moescope
from tests.support.zoo import tiny_model
model = tiny_model("mixtral", seed=0)
session = moescope.attach(model, store=sys.argv[1], routes=True, window=1, writer="process", flush_interval_s=60)
[exporter] = [e for e in session.processor.exporters if hasattr(e, "writer_pid")]
print("writer", exporter.writer_pid, flush=True)
with torch.no_grad():
    for step in range(5):
        model(input_ids=torch.randint(0, 64, (2, 6)))
session.processor.wait_idle(60)
print("handed", 5, flush=True)
time.sleep(600)
"""


def test_kill_9_of_the_model_process_loses_nothing_its_writer_process_was_handed(tmp_path, spawn):
    proc = spawn("-c", KILLED, str(tmp_path))
    writer = int(proc.stdout.readline().split()[1])
    assert proc.stdout.readline().split() == ["handed", "5"], proc.stderr.read()[-3000:]
    assert snapshot_rows(tmp_path, "steps").num_rows == 0  # a 60 s flush interval: all of it buffered
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert _gone(writer), "the writer process did not finish after the model process was killed"
    steps = snapshot_rows(tmp_path, "steps").to_pylist()
    assert sorted(r["step"] for r in steps) == [0, 1, 2, 3, 4]
    layers = snapshot_rows(tmp_path, "layers").num_rows
    assert snapshot_rows(tmp_path, "routes").num_rows == 5 * layers * BATCH * SEQ
    assert snapshot_rows(tmp_path, "run_ends").num_rows == 0  # the session did not end: no end row
    assert any(r["written_rows"] == 5 for r in snapshot_rows(tmp_path, "probe_stats").to_pylist()
               if r["table_name"] == "steps" and r["reason"] is None)


def test_a_forked_child_running_the_model_records_through_a_writer_process_of_its_own(tmp_path):
    model = tiny_model("mixtral", seed=0)
    session = moescope.attach(model, store=tmp_path, window=1, writer="process", flush_interval_s=60)
    try:
        parent_writer = _exporter(session).writer_pid
        with torch.no_grad():
            for ids in _inputs(model, 3, seed=1):
                model(input_ids=ids)
        assert session.processor.wait_idle(60)

        def child() -> int | None:
            torch.set_num_threads(1)  # what torch's forked workers do first
            with torch.no_grad():
                for ids in _inputs(model, 2, seed=2):
                    model(input_ids=ids)
            assert session.processor.wait_idle(60)  # exported: through the child's own writer process
            pid = _exporter(session).writer_pid
            session.close()
            return pid

        child_writer = in_forked_child(child)
        assert child_writer not in (None, parent_writer)
        assert _exporter(session).writer_pid == parent_writer and not session.closed
        with torch.no_grad():
            for ids in _inputs(model, 2, seed=3):
                model(input_ids=ids)
    finally:
        session.close()
    steps = snapshot_rows(tmp_path, "steps").to_pylist()
    by_writer: dict[int, list[int]] = {}
    for row in snapshot_rows(tmp_path, "probe_stats").to_pylist():
        by_writer.setdefault(row["pid"], [])
    assert set(by_writer) == {parent_writer, child_writer}  # each writer process wrote its own counts
    assert sorted(r["step"] for r in steps) == [0, 1, 2, 3, 3, 4, 4]  # the child's numbered on from the fork
    assert snapshot_rows(tmp_path, "runs").num_rows == 1  # the run's rows are the parent's, once
    ends = sorted(r["pid"] for r in snapshot_rows(tmp_path, "run_ends").to_pylist())
    assert ends == sorted([parent_writer, child_writer])


def test_the_stores_errors_are_raised_at_attach(tmp_path):
    model = tiny_model("mixtral", seed=0)
    with pytest.raises(InvalidNameError):
        moescope.attach(model, store=tmp_path, writer="process", run_id="../escape")
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())  # left as it was
    with pytest.raises(ValueError, match="writer must be one of"):
        moescope.attach(model, store=tmp_path, writer="elsewhere")


def test_policy_drop_counts_in_the_model_process_reach_the_writer_processs_probe_stats(tmp_path):
    model = tiny_model("mixtral", seed=0)
    session = moescope.attach(model, store=tmp_path, routes=True, window=1, writer="process", ring_tokens=4)
    with torch.no_grad():
        for ids in _inputs(model, 2, seed=1):
            model(input_ids=ids)  # 12 tokens a forward into a ring of 4: 8 rows a layer and forward lost
    session.close()
    layers = model.config.num_hidden_layers
    rows = [r for r in snapshot_rows(tmp_path, "probe_stats").to_pylist() if r["reason"] == "ring_full"]
    latest = max(r["ts"] for r in rows)
    assert [r["dropped_rows"] for r in rows if r["ts"] == latest] == [2 * (BATCH * SEQ - 4) * layers]
