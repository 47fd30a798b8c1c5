"""A full disk, for real (a tmpfs filled to the last byte): readers still open the store, and every
row a writer could not write is counted where the user looks."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import moescope
from moescope.store import BadFileWarning, Store
from moescope.store.exporter import DeltaExporter
from moescope.store.location import open_location
from tests.support.deltafiles import file_path, parts
from tests.support.store_records import make_record, run_info


def _store_with_a_bad_part(root: Path) -> tuple[Path, int]:
    """A store with one of its committed routes files cut short (as a failing disk leaves one)."""
    rng = np.random.default_rng(0)
    exporter = DeltaExporter(root, run_info("r"), max_rows=100)
    for step in range(6):
        exporter.export([make_record("r", step, rng)])
    exporter.shutdown()
    location = open_location(root)
    files = parts(location, "routes")
    good = sum(p.rows for p in files[1:])
    bad = Path(file_path(location, "routes", files[0]))
    bad.write_bytes(bad.read_bytes()[:300])
    return bad, good


def _routes(store: Store) -> int:
    return int(store.sql("SELECT count(*) AS n FROM routes").n[0])


def _empty_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.stat().st_size == 0]


def _in_table(root: Path, bad: Path) -> bool:
    return bad.name in {p.path.rsplit("/", 1)[-1] for p in parts(open_location(root), "routes")}


def test_a_store_opens_on_a_full_disk_and_skips_what_it_cannot_quarantine(small_disk):
    root = Path(small_disk.path) / "store"
    bad, good = _store_with_a_bad_part(root)
    small_disk.fill()
    store = Store(root)  # opening reads the logs only: the first query of routes checks its files
    with pytest.warns(BadFileWarning, match=f"{bad} could not be moved to quarantine.*No space left"):
        assert _routes(store) == good
    assert bad.exists() and _in_table(root, bad) and store.quarantined() == []
    assert _empty_files(root) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", BadFileWarning)
        store.refresh()  # the skipped file stays skipped, without a warning each time
        assert _routes(store) == good

    small_disk.free()
    store = Store(root)
    with pytest.warns(BadFileWarning, match="moved to"):
        _routes(store)
    [moved] = store.quarantined()
    assert moved.original_path == str(bad) and moved.reason.startswith("unreadable footer")
    assert _routes(store) == good and not _in_table(root, bad)


def test_a_reason_that_cannot_be_saved_leaves_no_empty_file(small_disk):
    root = Path(small_disk.path) / "store"
    bad, good = _store_with_a_bad_part(root)
    os.makedirs(root / "_quarantine" / "routes" / "run_id=r")
    small_disk.fill()
    small_disk.free_one_inode()  # the quarantine's hard link takes it; its reason finds no room
    store = Store(root)
    with pytest.warns(BadFileWarning, match="moved to .*the reason could not be saved"):
        assert _routes(store) == good
    [moved] = store.quarantined()
    assert moved.path == str(root / "_quarantine" / "routes" / "run_id=r" / bad.name)
    assert moved.reason.startswith("unknown")
    assert _empty_files(root) == []
    small_disk.free()
    store = Store(root)
    with pytest.warns(BadFileWarning):  # once there is room, the next reader takes it out of its table
        assert _routes(store) == good
    assert not _in_table(root, bad)


def _rows_on_disk(root: Path, table: str) -> int:
    return sum(pq.read_metadata(p).num_rows for p in (root / table).rglob("part-*.parquet"))


def _latest_probe_stats(root: Path) -> dict[tuple[str, str], int]:
    """The last probe_stats snapshot on disk, read from the raw Parquet rows: (table, reason) -> rows."""
    rows = [row for p in (root / "probe_stats").rglob("part-*.parquet") for row in pq.read_table(p).to_pylist()]
    last = max(row["ts"] for row in rows)
    return {(r["table_name"], r["reason"]): r["dropped_rows"] for r in rows if r["ts"] == last and r["reason"]}


def test_rows_a_full_disk_refused_are_counted_in_the_session_prometheus_and_the_store(small_disk, caplog):
    import torch
    from prometheus_client import CollectorRegistry

    from moescope.prometheus.exporter import PrometheusExporter
    from tests.support.zoo import tiny_model

    root = Path(small_disk.path) / "store"
    model = tiny_model("mixtral")
    registry = CollectorRegistry()
    generator = torch.Generator().manual_seed(0)
    batch, seq = 2, 8
    session = moescope.attach(model, store=root, routes=True, window=1, flush_interval_s=0.05,
                           exporters=[PrometheusExporter(registry=registry)])
    layers = len(session.layers)
    forwards = 0

    def run(n: int) -> None:
        nonlocal forwards
        with torch.no_grad():
            for i in range(n):
                model(torch.randint(0, 128, (batch, seq), generator=generator))
                forwards += 1
                if i % 3 == 2:
                    assert session.flush(30)
        assert session.flush(30)

    try:
        run(3)
        small_disk.fill()
        with caplog.at_level("WARNING", logger="moescope.store.writer"):
            run(12)
            written, dropped = session.probe_stats()
            lost = {table: dropped.get((table, "write_failed"), 0) for table in ("steps", "layer_steps", "routes")}
            assert lost["steps"] >= 12 and lost["layer_steps"] == lost["steps"] * layers
            assert lost["routes"] == lost["steps"] * layers * batch * seq  # tens of thousands at real sizes
            for (table, reason), rows in dropped.items():
                value = registry.get_sample_value("moescope_probe_records_dropped_total",
                                                  {"table": table, "reason": reason})
                assert value == rows, (table, reason)
            small_disk.free()
            run(3)
        failing = [r for r in caplog.records if "cannot write to the store" in r.getMessage()]
        recovered = [r for r in caplog.records if "works again" in r.getMessage()]
        assert len(failing) == 1 and len(recovered) == 1, "one log line when failures start, one when they end"
    finally:
        session.close()

    written, dropped = session.probe_stats()
    emitted = {"steps": forwards, "layer_steps": forwards * layers, "routes": forwards * layers * batch * seq}
    for table, rows in emitted.items():
        assert _rows_on_disk(root, table) == written[table], table
        assert written[table] + dropped.get((table, "write_failed"), 0) == rows, table
    on_disk = _latest_probe_stats(root)
    assert on_disk == {key: rows for key, rows in dropped.items() if rows}
    assert on_disk[("routes", "write_failed")] == lost["routes"]
    assert _rows_on_disk(root, "runs") == 1 and _rows_on_disk(root, "layers") == layers
