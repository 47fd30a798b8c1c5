"""Many writers, no locks: four gloo ranks write one run side by side, and several processes
write while compaction merges and a reader counts; every row is seen exactly once throughout."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import torch.multiprocessing as mp

from moescope.store import Store
from moescope.store.compact import compact
from tests.support.children import gloo_child


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
def test_four_gloo_ranks_write_one_run(tmp_path):
    port = _free_port()
    mp.spawn(gloo_child.run, args=(4, port, str(tmp_path)), nprocs=4, join=True)
    store = Store(tmp_path)
    assert len(store.runs()) == 1, "attach should share rank 0's run id with every rank"
    run_id = store.latest_run()
    runs = store.sql("SELECT rank, world_size FROM runs WHERE run_id = ? ORDER BY rank", [run_id])
    assert runs["rank"].tolist() == [0, 1, 2, 3] and set(runs.world_size) == {4}
    layers = len(store.layers(run_id))
    steps = store.sql("SELECT rank, step FROM steps WHERE run_id = ? ORDER BY rank, step", [run_id])
    assert list(zip(steps["rank"], steps.step)) == [(r, s) for r in range(4) for s in range(gloo_child.STEPS)]
    tokens = gloo_child.BATCH * gloo_child.SEQ
    counts = store.sql("""SELECT count(*) AS n, count(DISTINCT (rank, step, layer, token)) AS distinct_rows
                          FROM routes WHERE run_id = ?""", [run_id])
    assert counts.n[0] == counts.distinct_rows[0] == 4 * gloo_child.STEPS * layers * tokens
    for rank in range(4):  # the rows are each rank's own tokens
        for step in range(gloo_child.STEPS):
            got = store.sql("""SELECT token_id FROM routes WHERE run_id = ? AND rank = ? AND step = ? AND layer = 0
                               ORDER BY token""", [run_id, rank, step]).token_id.to_numpy()
            np.testing.assert_array_equal(got, gloo_child.inputs(rank, step).reshape(-1).numpy())
    assert len(list(tmp_path.rglob("part-*.parquet"))) == len({p.name for p in tmp_path.rglob("part-*.parquet")})


ROWS_PER_STEP = 3 * 16  # helpers.make_record: 3 layers of 16 tokens


@pytest.mark.integration
def test_compaction_under_writers_and_a_reader_sees_every_row_once(tmp_path, spawn):
    writers = [spawn("-m", "tests.support.store_records", "--store", str(tmp_path), "--run", "live",
                     "--rank", str(rank),
                     "--steps", "150", "--sleep", "0.02", "--flush", "0.1") for rank in (0, 1)]
    problems: list[str] = []
    checks = [0]
    stop = threading.Event()

    def reader() -> None:
        store = None
        while not stop.is_set():
            try:
                if store is None:
                    store = Store(tmp_path)
                store.refresh()
                frame = store.sql("""SELECT rank, count(*) AS n, count(DISTINCT (step, layer, token)) AS d,
                                            max(step) AS last FROM routes GROUP BY rank""")
            except Exception as e:  # noqa: BLE001 - anything here is a failure to report
                problems.append(f"query failed: {e!r}")
                continue
            for row in frame.itertuples():
                if row.n != row.d:
                    problems.append(f"rank {row.rank}: {row.n - row.d} rows seen twice")
                elif row.n != (row.last + 1) * ROWS_PER_STEP:
                    problems.append(f"rank {row.rank}: {(row.last + 1) * ROWS_PER_STEP - row.n} rows missing")
            checks[0] += 1

    thread = threading.Thread(target=reader)
    while not list(tmp_path.glob("routes/run_id=live/part-*.parquet")):
        time.sleep(0.05)
    thread.start()
    compactions = 0
    try:
        deadline = time.monotonic() + 120
        while any(w.poll() is None for w in writers) and time.monotonic() < deadline:
            results = compact(tmp_path, run_id="live", target_rows=100_000)
            compactions += sum(1 for r in results if r.merged_files)
        for w in writers:
            assert w.wait(timeout=60) == 0, w.stderr.read()
        compact(tmp_path, run_id="live")
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not problems, problems[:5]
    assert checks[0] > 5 and compactions > 2
    store = Store(tmp_path)
    final = store.sql("SELECT count(*) AS n, count(DISTINCT (rank, step, layer, token)) AS d FROM routes")
    assert final.n[0] == final.d[0] == 2 * 150 * ROWS_PER_STEP
    assert len(store.files["routes"]) == 1  # all merged
