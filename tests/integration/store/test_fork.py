"""A process that forks after it wrote to a store (DataLoader workers, torch.multiprocessing with
fork): delta-rs's runtime does not survive fork, so a child's commits go through a helper process
(store.delta); every row of the parent and of each child lands in the table, and no child meets
a PanicException.

Rows are counted from the raw Parquet files of the Delta snapshot (tests/integration/store/test_delta.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import traceback

import pytest
import torch

import moescope
from moescope.store import delta
from moescope.store.delta import helper as delta_helper
from moescope.store.delta import tables as delta_tables
from tests.support.deltafiles import snapshot_rows
from tests.support.zoo import tiny_model

BATCH, SEQ = 2, 6
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork is POSIX")


def _forwards(model: torch.nn.Module, n: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    with torch.no_grad():
        for _ in range(n):
            model(input_ids=torch.randint(0, vocab, (BATCH, SEQ), generator=generator))


def _moe_layers(model: torch.nn.Module) -> int:
    return int(model.config.num_hidden_layers)


def _child(store, result_path: str, forwards: int, seed: int) -> None:
    """A forked child: its own model and attach, `forwards` forwards, closed; what it saw goes to
    `result_path` as JSON. Never raises (exit status says whether it finished)."""
    result: dict = {"pid": os.getpid(), "routed": delta_helper.routed()}
    # what a forked worker of torch does first (DataLoader's do it): the parent's OpenMP threads did
    # not come through the fork, and torch's next parallel region would wait for them forever
    torch.set_num_threads(1)
    try:
        model = tiny_model("mixtral", seed=seed)
        with moescope.attach(model, store=store, routes=True, window=1) as session:
            _forwards(model, forwards, seed)
            result["run_id"] = session.run.run_id
        result["helper"] = delta_helper._HELPER is not None  # the child's commits went through its helper
        result["ok"] = True
    except BaseException as e:  # a PanicException is a BaseException: report it, whatever it is
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(result_path, "w") as f:
        json.dump(result, f)


def _fork_child(store, result_path: str, forwards: int, seed: int) -> int:
    """os.fork(): the child runs `_child` with its stderr in a file beside the result; returns its pid."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        status = 1
        try:
            err = os.open(result_path + ".stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(err, 2)
            _child(store, result_path, forwards, seed)
            status = 0
        finally:
            os._exit(status)
    return pid


def _mp_child(store, result_path: str, forwards: int, seed: int) -> None:
    err = os.open(result_path + ".stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    _child(store, result_path, forwards, seed)


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing-fork"])
def test_children_forked_after_the_parent_wrote_record_every_row(store_location, tmp_path, how):
    store = store_location
    model = tiny_model("mixtral", seed=0)
    parent = moescope.attach(model, store=store, routes=True, window=1)
    try:
        _forwards(model, 3, seed=0)
        assert parent.flush(30)
        before = snapshot_rows(store, "steps").num_rows
        assert before == 3 and delta_tables.runtime_used()  # the parent's delta-rs runtime is up: children inherit it

        children = {seed: (str(tmp_path / f"child-{seed}.json"), 2 + seed) for seed in (1, 2)}
        if how == "os.fork":
            for seed, (path, n) in children.items():
                pid = _fork_child(store, path, n, seed)
                _, status = os.waitpid(pid, 0)
                assert os.waitstatus_to_exitcode(status) == 0, open(path + ".stderr").read()[-3000:]
        else:
            context = multiprocessing.get_context("fork")
            processes = [context.Process(target=_mp_child, args=(store, path, n, seed))
                         for seed, (path, n) in children.items()]
            for process in processes:
                process.start()
            for process in processes:
                process.join(120)
                assert process.exitcode == 0

        _forwards(model, 2, seed=9)  # the parent goes on writing after its children
    finally:
        parent.close()

    results = {}
    for seed, (path, n) in children.items():
        stderr = open(path + ".stderr").read()
        assert "PanicException" not in stderr and "panicked" not in stderr, stderr[-3000:]
        result = json.load(open(path))
        assert result.get("ok"), result.get("error")
        assert result["routed"] and result["helper"] and result["pid"] != os.getpid()
        results[result["run_id"]] = n
    results[parent.run.run_id] = 5

    layers = _moe_layers(model)
    steps = snapshot_rows(store, "steps").to_pylist()
    routes = snapshot_rows(store, "routes")
    for run_id, forwards in results.items():
        assert sum(1 for r in steps if r["run_id"] == run_id) == forwards, run_id
        assert sum(1 for r in routes.column("run_id").to_pylist() if r == run_id) == forwards * BATCH * SEQ * layers
    assert len({r["step"] for r in steps if r["run_id"] == parent.run.run_id}) == 5  # none twice
    stats = snapshot_rows(store, "probe_stats").to_pylist()
    writers = {(s["run_id"], s["pid"]) for s in stats}
    assert {run for run, _ in writers} == set(results)  # every process wrote its own counts


def test_a_child_that_did_not_know_its_runtime_was_inherited_switches_to_the_helper(tmp_path):
    """Code we cannot see may have started delta-rs before the fork: the child's first delta call
    panics (a PanicException, a BaseException); store.delta catches that one, routes the process
    through its helper and makes the call there."""
    from tests.support.deltafiles import steps_rows

    first = delta.write_part(tmp_path, "steps", "r", steps_rows("r", 0, 4), "part-parent.parquet")
    delta.commit(tmp_path, "steps", [first])
    result_path = str(tmp_path / "child.json")
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            delta_helper._ROUTE = False  # as if the fork handler had not seen the parent's use
            result: dict = {}
            try:
                part = delta.write_part(tmp_path, "steps", "r", steps_rows("r", 4, 4), "part-child.parquet")
                result["version"] = delta.commit(tmp_path, "steps", [part])
                result["snapshot"] = delta.snapshot(tmp_path, "steps", version=1).version
                result["routed"] = delta_helper.routed()
            except BaseException as e:
                result["error"] = f"{type(e).__name__}: {e}"
            with open(result_path, "w") as f:
                json.dump(result, f)
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    result = json.load(open(result_path))
    assert "error" not in result, result["error"]
    assert result == {"version": 2, "snapshot": 1, "routed": True}
    assert sorted(snapshot_rows(tmp_path, "steps").column("step").to_pylist()) == list(range(8))


def _child_on_the_parents_model(model: torch.nn.Module, forwards: int, seed: int) -> None:
    """A forked child (torch.multiprocessing with fork, Hogwild style) that runs the model the parent
    attached, without an attach of its own, and exits without closing anything."""
    torch.set_num_threads(1)  # what torch's own forked workers do first (see _child)
    _forwards(model, forwards, seed)


def test_a_forked_child_running_the_parents_attached_model_is_recorded(tmp_path):
    """Under the default policy="block" the child's forwards once filled the parent's queue, whose
    worker thread did not come through the fork, and the child hung once the queue was full (16 records
    here, 256 by default); before that its rows were lost.
    Now the child's first record starts a worker of its own, the window open at the fork stays the
    parent's, and the child's last window is written when it exits."""
    store = str(tmp_path / "store")
    model = tiny_model("mixtral", seed=0)
    layers = _moe_layers(model)
    context = multiprocessing.get_context("fork")
    with moescope.attach(model, store=store, routes=True, window=1, max_queue=16) as session:
        _forwards(model, 3, seed=1)
        session.flush()  # the parent has used delta-rs before the fork
        _forwards(model, 1, seed=2)  # an open window at the fork (window=1 closes it at the next forward)
        children = [context.Process(target=_child_on_the_parents_model, args=(model, n, 10 + i))
                    for i, n in enumerate((40, 7))]  # 40 > the queue's 16 records
        for child in children:
            child.start()
        for child in children:
            child.join(120)
            assert child.exitcode == 0, f"child exit code {child.exitcode} (None: it hung)"
        _forwards(model, 2, seed=3)
        run_id = session.run.run_id
    forwards = 3 + 1 + 40 + 7 + 2

    def rows(table: str) -> int:
        data = snapshot_rows(store, table)
        return sum(1 for r in data.column("run_id").to_pylist() if r == run_id)

    assert rows("steps") == forwards
    assert rows("layer_steps") == forwards * layers
    assert rows("routes") == forwards * layers * BATCH * SEQ
