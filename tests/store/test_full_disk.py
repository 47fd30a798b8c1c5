"""A full disk, for real (a tmpfs filled to the last byte): readers still open the store, and every
row a writer could not write is counted where the user looks."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from store import BadFileWarning, Store
from store.writer import ParquetExporter
from tests.store.helpers import make_record, run_info


def _store_with_a_bad_part(root: Path) -> tuple[Path, int]:
    rng = np.random.default_rng(0)
    exporter = ParquetExporter(root, run_info("r"), max_rows=100)
    for step in range(6):
        exporter.export([make_record("r", step, rng)])
    exporter.shutdown()
    parts = sorted((root / "routes" / "run_id=r").glob("part-*.parquet"))
    good = sum(pq.read_metadata(p).num_rows for p in parts)
    bad = parts[0].with_name("part-99999-1-000001-1.parquet")  # half a file, as a full disk leaves one
    bad.write_bytes(parts[0].read_bytes()[:300])
    return bad, good


def _routes(store: Store) -> int:
    return int(store.sql("SELECT count(*) AS n FROM routes").n[0])


def _empty_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.stat().st_size == 0]


def test_a_store_opens_on_a_full_disk_and_skips_what_it_cannot_quarantine(small_disk):
    root = Path(small_disk.path) / "store"
    bad, good = _store_with_a_bad_part(root)
    small_disk.fill()
    with pytest.warns(BadFileWarning, match=f"{bad} could not be moved to quarantine.*No space left"):
        store = Store(root)
    assert _routes(store) == good
    assert bad.exists() and store.quarantined() == []
    assert _empty_files(root) == []
    store.refresh()  # the skipped file stays skipped, without a warning each time
    assert _routes(store) == good

    small_disk.free()
    with pytest.warns(BadFileWarning, match="moved to"):
        store = Store(root)
    [moved] = store.quarantined()
    assert moved.original_path == str(bad) and moved.reason.startswith("unreadable footer")
    assert _routes(store) == good


def test_a_reason_that_cannot_be_saved_leaves_no_empty_file(small_disk):
    root = Path(small_disk.path) / "store"
    bad, good = _store_with_a_bad_part(root)
    os.makedirs(root / "_quarantine" / "routes" / "run_id=r")  # the move needs no new space, the reason does
    small_disk.fill()
    with pytest.warns(BadFileWarning, match="moved to .*the reason could not be saved"):
        store = Store(root)
    assert _routes(store) == good and not bad.exists()
    [moved] = store.quarantined()
    assert moved.path == str(root / "_quarantine" / "routes" / "run_id=r" / bad.name)
    assert moved.reason.startswith("unknown")
    assert _empty_files(root) == []
