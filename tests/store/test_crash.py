"""kill -9 in the middle of a run: every file left is readable, nothing torn is visible, and the
rows lost are at most those of the last flush interval."""

from __future__ import annotations

import os
import signal
import threading
import time

import duckdb
import pyarrow.parquet as pq
import pytest

from moescope.store import Store
from moescope.store.layout import clean_tmp, tmp_files

FLUSH_S = 0.5
SLACK_S = 1.0  # the time a flush itself takes on a busy two-core machine


@pytest.mark.integration
def test_sigkill_mid_run_loses_at_most_one_flush_interval(tmp_path, spawn):
    proc = spawn("-m", "tests.store.kill_child", str(tmp_path), "crash", str(FLUSH_S))
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

    files = [p for p in tmp_path.rglob("part-*.parquet")]
    assert files
    for path in files:  # every visible file is whole, for both readers
        pq.read_table(path)
        duckdb.sql(f"SELECT count(*) FROM read_parquet('{path}')").fetchall()
    store = Store(tmp_path)
    assert store.quarantined() == []
    layers = len(store.layers("crash"))
    last_step = emitted[-1][0]
    recent = [step for step, at in emitted if at >= killed_at - FLUSH_S - SLACK_S]
    for table, per_step in (("steps", 1), ("layer_steps", layers), ("routes", layers * 16)):
        got = store.sql(f"SELECT step, count(*) AS n FROM {table} WHERE run_id = ? GROUP BY step ORDER BY step",
                        ["crash"])
        steps = got.step.tolist()
        assert steps == list(range(len(steps))), f"{table}: steps are not a prefix"
        assert (got.n == per_step).all(), f"{table}: a step is only partly there"
        lost = last_step + 1 - len(steps)
        assert lost <= len(recent), f"{table}: lost {lost} steps, more than the last flush interval ({len(recent)})"

    # a temporary file a crash leaves behind is never read, and is cleaned once it is old
    leftover = tmp_path / "routes" / "run_id=crash" / ".tmp-part-00000-1-000001-1.parquet.inprogress"
    leftover.write_bytes(files[0].read_bytes()[:100])
    Store(tmp_path).sql("SELECT count(*) FROM routes")
    assert str(leftover) in tmp_files(tmp_path)
    os.utime(leftover, (time.time() - 3600, time.time() - 3600))
    assert clean_tmp(tmp_path, older_than_s=900) == [str(leftover)]
