"""policy="drop" through `moescope.attach` (the probe's own queue): the model never waits for a
stuck exporter, and every record it could not keep is counted, table by table, so that what was
written plus what was dropped is exactly what the forwards produced."""

from __future__ import annotations

import threading
import time

import pyarrow.dataset as ds
import torch

import moescope
from moescope.core.exporters import InMemoryExporter
from tests.support.zoo import tiny_model

FORWARDS, BATCH, SEQ, LAYERS = 40, 2, 4, 2
STUCK_S = 20.0


class StuckExporter(InMemoryExporter):
    """An exporter whose first export hangs until released (a receiver that stopped answering)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.returned = 0

    def export(self, records) -> bool:
        if not self.returned:
            self.release.wait(STUCK_S)
        self.returned += 1
        return super().export(records)


def _rows(root, table: str) -> int:
    return ds.dataset(str(root / table), format="parquet", exclude_invalid_files=True).count_rows()


def test_a_stuck_exporter_never_blocks_the_model_and_every_drop_is_counted(tmp_path):
    model = tiny_model("mixtral")
    slow = StuckExporter()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(FORWARDS)]
    session = moescope.attach(model, store=tmp_path, exporters=[slow], routes=True, window=1, policy="drop",
                              max_queue=1, flush_interval_s=0.05)
    started = time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            model(batch)
    # every forward ran while the exporter's first call still hung: the model never waited for it
    assert slow.returned == 0 and time.perf_counter() - started < STUCK_S
    slow.release.set()
    session.close()

    dropped_rows, dropped_records = session.processor.drop_counts()
    assert set(dropped_records) == {"queue_full"} and {reason for _, reason in dropped_rows} == {"queue_full"}
    lost = dropped_records["queue_full"]
    kept = len(slow.records)
    assert 0 < lost and 0 < kept  # some of each, else the test proves nothing
    assert kept + lost == FORWARDS == session.step
    # the records that arrived are whole and in order; none is counted twice
    steps = [r.step for r in slow.records]
    assert steps == sorted(set(steps)) and set(steps) <= set(range(FORWARDS))
    assert all(len(r.layers) == LAYERS and r.tokens == BATCH * SEQ for r in slow.records)
    # table by table: rows written to Parquet plus rows counted as dropped = rows the forwards made
    made = {"steps": FORWARDS, "layer_steps": FORWARDS * LAYERS, "routes": FORWARDS * LAYERS * BATCH * SEQ}
    for table, rows in made.items():
        assert _rows(tmp_path, table) + dropped_rows.get((table, "queue_full"), 0) == rows, table
    written, dropped = session.probe_stats()
    assert written["steps"] == kept and dropped == dropped_rows
