"""The Overview says when the probe could not record everything: rows dropped by the queue and
rows a failed write lost, as the writers' last probe_stats on disk counts them."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow.parquet as pq

from moescope.core.pipeline import BatchProcessor, record_rows
from moescope.store.writer import ParquetExporter
from tests.support.pages import app_for, assert_clean, open_page
from tests.support.store_records import make_record, run_info


class StalledDisk:
    """Holds the first batch until released, so the queue fills behind it."""

    def __init__(self) -> None:
        self.gate, self.exporting = threading.Event(), threading.Event()

    def export(self, records) -> bool:
        self.exporting.set()
        return self.gate.wait(30)

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def test_overview_shows_rows_not_recorded(monkeypatch, tmp_path):
    root = tmp_path / "store"
    rng = np.random.default_rng(0)
    records = [make_record("lossy", step, rng) for step in range(8)]
    stalled = StalledDisk()
    processor = BatchProcessor([stalled], max_queue=2, policy="drop", max_batch=1)
    exporter = ParquetExporter(root, run_info("lossy"), processor=processor, max_age_s=1e9)
    processor.add_exporter(exporter)
    processor.emit(records[0])
    assert stalled.exporting.wait(10)
    for record in records[1:]:
        processor.emit(record)  # two fit in the queue behind the stalled batch, five are dropped
    (root / "routes").write_text("a file where the routes folder should be: every routes write fails")
    stalled.gate.set()
    processor.shutdown()
    (root / "routes").unlink()

    queue_full = sum(record_rows(r)["steps"] + record_rows(r)["layer_steps"] + record_rows(r)["routes"]
                     for r in records[3:])
    write_failed = sum(record_rows(r)["routes"] for r in records[:3])
    stats = [row for p in (root / "probe_stats").rglob("*.parquet") for row in pq.read_table(p).to_pylist()]
    last = max(row["ts"] for row in stats)
    on_disk = {(r["table_name"], r["reason"]): r["dropped_rows"] for r in stats if r["ts"] == last and r["reason"]}
    assert on_disk[("routes", "write_failed")] == write_failed
    assert sum(n for (_, reason), n in on_disk.items() if reason == "queue_full") == queue_full

    at = open_page(app_for(monkeypatch, str(root)), "views/overview.py")
    assert_clean(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Rows not recorded"] == f"{queue_full + write_failed:,}"
    [warning] = at.warning
    assert f"{write_failed:,} rows of routes (write_failed)" in warning.value
    assert "queue_full" in warning.value
