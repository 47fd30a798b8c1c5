"""Bad files do not break queries: detected, moved aside with the reason, and reported."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from moescope.store import BadFileWarning, Store
from moescope.store.writer import ParquetExporter
from tests.store.helpers import make_record, run_info


@pytest.fixture
def store_root(tmp_path):
    rng = np.random.default_rng(0)
    exporter = ParquetExporter(tmp_path, run_info("r"), max_rows=200)
    for step in range(10):
        exporter.export([make_record("r", step, rng, tokens=64)])
    exporter.shutdown()
    return tmp_path


def _count(store: Store) -> int:
    return int(store.sql("SELECT count(*) AS n FROM routes").n[0])


def _victim(root):
    files = sorted((root / "routes" / "run_id=r").glob("part-*.parquet"))
    return files[0], sum(__import__("pyarrow.parquet").parquet.read_metadata(f).num_rows for f in files)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_file_with_a_bad_footer_is_quarantined(store_root, damage):
    victim, total = _victim(store_root)
    good_rows = total - __import__("pyarrow.parquet").parquet.read_metadata(victim).num_rows
    bad = victim.with_name("part-99999-1-000001-1.parquet")  # copied in by hand
    data = victim.read_bytes()
    bad.write_bytes({"truncated": data[: len(data) // 2], "garbage": os.urandom(5000), "empty": b""}[damage])
    victim.unlink()
    with pytest.warns(BadFileWarning, match=str(bad)):
        store = Store(store_root)
    assert _count(store) == good_rows
    [moved] = store.quarantined()
    assert moved.original_path == str(bad) and os.path.exists(moved.path) and "footer" in moved.reason
    assert moved.path.startswith(str(store_root / "_quarantine" / "routes" / "run_id=r"))
    assert not bad.exists()


def test_damage_inside_a_file_is_found_when_it_is_next_listed(store_root):
    """A file damaged after a reader checked it is a new file to that reader (its mtime changed):
    the next refresh reads it through, pages against their checksums, and moves it aside."""
    victim, total = _victim(store_root)
    good_rows = total - __import__("pyarrow.parquet").parquet.read_metadata(victim).num_rows
    store = Store(store_root)
    data = bytearray(victim.read_bytes())
    rng = np.random.default_rng(1)
    footer = int.from_bytes(data[-8:-4], "little") + 8
    middle = slice(100, len(data) - footer)  # pages, not the footer: the footer check still passes
    data[middle] = rng.integers(0, 256, middle.stop - middle.start, dtype=np.uint8).tobytes()
    tmp = victim.with_name(".tmp-damaged")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, victim)
    with pytest.warns(BadFileWarning, match="damaged data"):
        store.refresh()
    query = "SELECT count(*) AS n, sum(token_id) AS s, sum(list_sum(gate_weights)) AS g FROM routes"
    n = int(store.sql(query).n[0])
    assert n == good_rows
    assert [q.original_path for q in store.quarantined()] == [str(victim)]
    other = Store(store_root)  # a fresh reader does not trip on it again
    assert _count(other) == good_rows


def test_quarantined_files_are_kept_not_deleted(store_root):
    victim, _ = _victim(store_root)
    copy = victim.with_name("part-99999-1-000001-2.parquet")
    shutil.copy(victim, copy)
    with open(copy, "r+b") as f:
        f.truncate(100)
    with pytest.warns(BadFileWarning):
        store = Store(store_root)
    [moved] = store.quarantined()
    assert os.path.getsize(moved.path) == 100
