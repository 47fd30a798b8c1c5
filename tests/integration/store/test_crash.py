"""kill -9 in the middle of a run. A write is a file (`write_part`) then a commit: a writer killed
between the two leaves a file no commit added, which no reader reads and `vacuum` deletes once it
is old enough that no writer can still be about to commit it. The rows of every commit that
returned are there, whole, once."""

from __future__ import annotations

import os
import signal
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moescope.store import Store, delta

FLUSH_S = 0.5
SLACK_S = 1.0  # the time a flush itself takes on a busy two-core machine

# A writer that commits three files of 2, 3 and 4 steps rows, reporting each commit once it
# returned, then writes a fourth file, reports it, and waits to be killed before committing it.
WRITER = """
import sys, time
import pyarrow as pa
from moescope.store import delta
root = sys.argv[1]
step = 0
for i, rows in enumerate((2, 3, 4, 5)):
    data = pa.table({"step": pa.array(range(step, step + rows), pa.int64()), "rank": pa.array([0] * rows, pa.int32())})
    part = delta.write_part(root, "steps", "crash", data, f"part-00000-h-1-{i:06d}-{i:012d}.parquet")
    step += rows
    if i == 3:
        print("written", part.path, rows, flush=True)
        time.sleep(600)
    delta.commit(root, "steps", [part])
    print("committed", part.path, rows, flush=True)
"""


def _raw_rows(root, snap: delta.Snapshot) -> pa.Table:
    """The rows of the snapshot's files, read with pyarrow from the files themselves."""
    return pa.concat_tables([pq.read_table(os.path.join(root, "steps", p.path), columns=["step"]) for p in snap.files])


@pytest.mark.integration
def test_a_writer_killed_between_write_and_commit_leaves_an_orphan_nobody_reads(tmp_path, spawn):
    proc = spawn("-c", WRITER, str(tmp_path))
    committed: dict[str, int] = {}
    orphan = None
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        what, path, rows = line.split()
        if what == "committed":
            committed[path] = int(rows)
        else:
            orphan = path
            break
        assert time.monotonic() < deadline
    assert orphan is not None, proc.stderr.read()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)

    orphan_file = tmp_path / "steps" / orphan
    assert orphan_file.exists() and pq.read_table(orphan_file).num_rows == 5  # written whole, never committed
    snap = delta.snapshot(tmp_path, "steps")
    assert sorted(p.path for p in snap.files) == sorted(committed)
    assert sorted(_raw_rows(tmp_path, snap).column("step").to_pylist()) == list(range(sum(committed.values())))
    with Store(tmp_path) as store:
        got = store.sql("SELECT count(*) AS n, count(DISTINCT step) AS d FROM steps WHERE run_id = 'crash'")
    assert got.values.tolist() == [[sum(committed.values())] * 2] == [[9, 9]]

    # a young orphan may be a write about to be committed: no retention deletes it
    assert delta.vacuum(tmp_path, "steps", retention_hours=1) == []
    assert delta.vacuum(tmp_path, "steps", retention_hours=0) == []
    two_hours_ago = time.time() - 2 * 3600
    os.utime(orphan_file, (two_hours_ago, two_hours_ago))
    # a retention of 0 (below ORPHAN_MIN_HOURS) deletes only removed files, never an orphan, however old
    assert delta.vacuum(tmp_path, "steps", retention_hours=0) == []
    # a retention of at least an hour deletes an orphan older than it, and nothing else; delta-rs
    # counts whole hours, so 0.5 is rounded up to 1
    assert delta.vacuum(tmp_path, "steps", retention_hours=3) == []
    assert orphan_file.exists()
    assert [os.path.basename(p) for p in delta.vacuum(tmp_path, "steps", retention_hours=0.5)] == [
        os.path.basename(orphan)]
    assert not orphan_file.exists()
    assert sorted(p.name for p in (tmp_path / "steps" / "run_id=crash").iterdir()) == sorted(
        os.path.basename(p) for p in committed)
    assert sorted(_raw_rows(tmp_path, delta.snapshot(tmp_path, "steps")).column("step").to_pylist()) == list(range(9))


@pytest.mark.integration
def test_sigkill_mid_run_loses_at_most_one_flush_interval(tmp_path, spawn):
    proc = spawn("-m", "tests.support.children.kill_child", str(tmp_path), "crash", str(FLUSH_S))
    emitted: list[tuple[int, float]] = []

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("emitted"):
                _, step, at = line.split()
                emitted.append((int(step), float(at)))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while (not emitted or emitted[-1][1] - emitted[0][1] < 3 * FLUSH_S + 1) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    assert emitted, "the writing process never got going"
    os.kill(proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    proc.wait(timeout=30)
    reader.join(timeout=10)

    last_step = emitted[-1][0]
    recent = [step for step, at in emitted if at >= killed_at - FLUSH_S - SLACK_S]
    with Store(tmp_path) as store:
        assert store.quarantined() == []
        layers = len(store.layers("crash"))
    for table, per_step in (("steps", 1), ("layer_steps", layers), ("routes", layers * 16)):
        snap = delta.snapshot(tmp_path, table)
        assert snap is not None and snap.files, table
        # every committed file is whole; counted from the files themselves, not through the store
        steps = pa.concat_tables([pq.read_table(tmp_path / table / p.path, columns=["step"]) for p in snap.files])
        counts: dict[int, int] = {}
        for step in steps.column("step").to_pylist():
            counts[step] = counts.get(step, 0) + 1
        assert sorted(counts) == list(range(len(counts))), f"{table}: steps are not a prefix"
        assert set(counts.values()) == {per_step}, f"{table}: a step is only partly there"
        lost = last_step + 1 - len(counts)
        assert lost <= len(recent), f"{table}: lost {lost} steps, more than the last flush interval ({len(recent)})"
