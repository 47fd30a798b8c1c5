"""A forked child records through what it inherited, and the at-fork registry keeps its rows apart
from the parent's: a child that attaches nothing new emits through the parent's `BatchProcessor`
(or runs the parent's attached model), its rows land in the store under its own pid, none of the
rows the parent had buffered at the fork is written twice, and the parent's rows are its own.

Rows are read straight from the Parquet files with pyarrow, and the files from the Delta log's JSON
with the json module: none of moescope's readers is used."""

from __future__ import annotations

import glob
import json
import os
import re
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import moescope
from moescope.core.pipeline import BatchProcessor
from moescope.store.writer import ParquetExporter
from tests.support.forked import in_forked_child
from tests.support.store_records import make_record, run_info
from tests.support.zoo import tiny_model

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork is POSIX")

HOST = "forkhost"
RUN = "fork-run"


@pytest.fixture(autouse=True)
def host(monkeypatch):
    monkeypatch.setenv("MOESCOPE_HOST", HOST)  # the part names read `part-<rank>-forkhost-<pid>-...`


def committed_files(store: str, table: str) -> set[str]:
    """Paths (relative to the table) the Delta log adds and does not remove, from its JSON commits."""
    files: set[str] = set()
    for commit in sorted(glob.glob(os.path.join(store, table, "_delta_log", "*.json"))):
        with open(commit) as f:
            for line in f:
                action = json.loads(line)
                if "add" in action:
                    files.add(action["add"]["path"])
                if "remove" in action:
                    files.discard(action["remove"]["path"])
    return files


def rows_by_pid(store: str, table: str, column: str) -> dict[int, list]:
    """`column` of every row of `table`, per writing pid (from the part's name), read with pyarrow.
    Asserts that the files on disk are exactly the files the log committed (none lost, none orphan)."""
    on_disk = {os.path.relpath(path, os.path.join(store, table))
               for path in glob.glob(os.path.join(store, table, "run_id=*", "*.parquet"))}
    assert on_disk == committed_files(store, table)
    by_pid: dict[int, list] = {}
    for path in sorted(on_disk):
        match = re.fullmatch(rf"run_id=[^/]+/part-\d+-{HOST}-(\d+)-\d+-\d+\.parquet", path)
        assert match, path
        values = pq.read_table(os.path.join(store, table, path)).column(column).to_pylist()
        by_pid.setdefault(int(match.group(1)), []).extend(values)
    return by_pid


def written_counts(store: str) -> dict[int, dict[str, int]]:
    """Per pid, the rows written per table in that process's latest `probe_stats` snapshot, from
    the raw rows (the snapshots are cumulative: the latest per writer is its final count)."""
    rows = []
    for path in committed_files(store, "probe_stats"):
        rows += pq.read_table(os.path.join(store, "probe_stats", path)).to_pylist()
    latest = {pid: max(r["ts"] for r in rows if r["pid"] == pid) for pid in {r["pid"] for r in rows}}
    return {pid: {r["table_name"]: r["written_rows"] for r in rows
                  if r["pid"] == pid and r["ts"] == at and r["reason"] is None} for pid, at in latest.items()}


def test_a_child_emitting_through_the_parents_processor_writes_its_own_rows(tmp_path):
    store = str(tmp_path / "store")
    rng_parent, run = np.random.default_rng(0), run_info(RUN)
    processor = BatchProcessor([], flush_interval_s=60)
    # a long max_age: the parent's rows are still in the exporter's buffers at the fork
    processor.add_exporter(ParquetExporter(store, run, max_age_s=60, processor=processor))
    for step in range(3):
        processor.emit(make_record(RUN, step, rng_parent))
    assert processor.wait_idle(30)  # exported, not written: buffered at the fork

    def child() -> int:
        rng = np.random.default_rng(1)
        for step in range(100, 104):
            processor.emit(make_record(RUN, step, rng))
        processor.shutdown()  # the child's rows, its run_ends row and its counts
        return os.getpid()

    child_pid = in_forked_child(child)
    for step in range(3, 5):
        processor.emit(make_record(RUN, step, rng_parent))
    processor.shutdown()

    steps = rows_by_pid(store, "steps", "step")
    assert set(steps) == {os.getpid(), child_pid}
    assert sorted(steps[os.getpid()]) == [0, 1, 2, 3, 4]  # the parent's rows, each once
    assert sorted(steps[child_pid]) == [100, 101, 102, 103]  # the child's only: none of the parent's buffer
    layers = rows_by_pid(store, "layer_steps", "step")
    assert sorted(layers[os.getpid()]) == sorted([s for s in range(5) for _ in range(3)])
    assert sorted(layers[child_pid]) == sorted([s for s in range(100, 104) for _ in range(3)])
    runs = rows_by_pid(store, "runs", "model_class")
    assert runs == {os.getpid(): ["Synthetic"]}  # the run's row is the parent's to write, once
    ends = rows_by_pid(store, "run_ends", "pid")
    assert ends == {os.getpid(): [os.getpid()], child_pid: [child_pid]}
    stats = rows_by_pid(store, "probe_stats", "pid")  # every process wrote its own counts
    assert set(stats) == {os.getpid(), child_pid}
    assert set(stats[child_pid]) == {child_pid} and set(stats[os.getpid()]) == {os.getpid()}
    # each counts what it wrote: the child's writer started its counts afresh at the fork
    counts = written_counts(store)
    assert counts[os.getpid()]["steps"] == 5 and counts[os.getpid()]["runs"] == 1
    assert counts[child_pid]["steps"] == 4 and "runs" not in counts[child_pid]


def _forwards(model: torch.nn.Module, n: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(n):
            model(input_ids=torch.randint(0, model.config.vocab_size, (2, 6), generator=generator))


def test_a_child_running_the_parents_attached_model_records_through_the_sessions_pipeline(tmp_path):
    store = str(tmp_path / "store")
    model = tiny_model("mixtral", seed=0)
    layers = int(model.config.num_hidden_layers)
    # two forwards a window: the third forward's window is open at the fork, and it is the parent's
    session = moescope.attach(model, store=store, window=2, window_s=None, flush_interval_s=60)
    try:
        _forwards(model, 3, seed=1)
        assert session.processor.wait_idle(30)  # the first window is in the store's buffers, not written

        def child() -> int:
            torch.set_num_threads(1)  # what torch's forked workers do first: the parent's pool did not come along
            _forwards(model, 4, seed=2)  # no attach of its own: the session's hooks, inherited
            session.close()  # the child's last window and counts
            return os.getpid()

        child_pid = in_forked_child(child)
        assert not session.closed  # the child's close was the child's
        _forwards(model, 2, seed=3)
    finally:
        session.close()
    starts, ends = rows_by_pid(store, "steps", "step"), rows_by_pid(store, "steps", "step_end")
    assert set(starts) == {os.getpid(), child_pid}
    covered = {pid: sorted(f for start, end in zip(starts[pid], ends[pid]) for f in range(start, end + 1))
               for pid in starts}
    assert covered[os.getpid()] == [0, 1, 2, 3, 4]  # every forward of the parent's, once
    assert covered[child_pid] == [3, 4, 5, 6]  # numbered on from the fork; the open window stayed the parent's
    layer_steps = rows_by_pid(store, "layer_steps", "step")
    assert len(layer_steps[os.getpid()]) == len(starts[os.getpid()]) * layers
    assert len(layer_steps[child_pid]) == len(starts[child_pid]) * layers
    assert rows_by_pid(store, "runs", "model_class") == {os.getpid(): [type(model).__name__]}  # once, the parent's
