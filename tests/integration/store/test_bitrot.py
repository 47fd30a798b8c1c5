"""Bit rot is never silent: a flipped bit in a file's pages is caught by the page checksums that
the writer and compaction write, and the file is quarantined; it never reads back as other numbers."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from moescope.store import BadFileWarning, Store, delta
from moescope.store.compact import compact
from moescope.store.exporter import DeltaExporter
from moescope.store.location import open_location
from moescope.store.quarantine import deep_check
from tests.support.deltafiles import file_path, parts, read_part
from tests.support.store_records import make_record, run_info

TRIALS = 80
ORDER = {"routes": ["step", "layer", "token"], "layer_steps": ["step", "layer"]}


def _canonical(frame) -> list[tuple]:
    """Rows as plain tuples (lists as tuples, maps as sorted pairs), so two readers' frames compare."""
    def cell(value):
        if isinstance(value, np.ndarray):
            value = value.tolist()
        if isinstance(value, dict):
            return tuple(sorted(value.items()))
        if isinstance(value, (list, tuple)):
            return tuple(cell(v) for v in value)
        if pd.isna(value):
            return None  # NULL reads as None, NaN or NA depending on the reader
        if hasattr(value, "item"):
            return value.item()
        return value
    return [tuple(cell(v) for v in row) for row in frame.itertuples(index=False)]


def _one_file_store(root, compacted: bool):
    rng = np.random.default_rng(0)
    exporter = DeltaExporter(root, run_info("r"), max_rows=(48 if compacted else 10**9), max_age_s=1e9)
    for step in range(8):
        exporter.export([make_record("r", step, rng, tokens=16)])
    exporter.shutdown()
    if compacted:
        [result] = compact(root, tables=("routes",))
        assert result.merged_files == 8 and len(result.written_files) == 1


def _the_file(root, table: str) -> tuple[delta.PartFile, Path]:
    location = open_location(root)
    [part] = parts(location, table)
    return part, Path(file_path(location, table, part))


@pytest.mark.parametrize("table,compacted", [("routes", False), ("layer_steps", False), ("routes", True)])
def test_a_flipped_bit_is_quarantined_or_reads_back_identical(tmp_path, table, compacted):
    root = tmp_path / "store"
    _one_file_store(root, compacted)
    part, victim = _the_file(root, table)
    pristine = victim.read_bytes()
    columns = [c for c in pq.read_schema(victim).names if c != "tags"]
    want = _canonical(read_part(open_location(root), table, part).select(columns).to_pandas()
                      .sort_values(ORDER[table]))
    footer_start = len(pristine) - int.from_bytes(pristine[-8:-4], "little") - 8
    rng = np.random.default_rng(7)
    outcomes = {"quarantined": 0, "identical": 0}
    store = Store(root)  # a long-lived reader (the dashboard's): each replaced file is checked when it appears
    for _ in range(TRIALS):
        damaged = bytearray(pristine)
        at = int(rng.integers(4, footer_start))  # the pages: everything between the magic and the footer
        damaged[at] ^= 1 << int(rng.integers(0, 8))
        tmp = victim.with_name(".tmp-damaged")
        tmp.write_bytes(bytes(damaged))
        os.replace(tmp, victim)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store.refresh()
            got = store.sql(f"SELECT {', '.join(columns)} FROM {table} ORDER BY {', '.join(ORDER[table])}")
        bad = [w for w in caught if issubclass(w.category, BadFileWarning)]
        if bad:
            assert len(got) == 0, f"byte {at}: quarantined, yet its rows were read"
            assert part.path not in {p.path for p in parts(open_location(root), table)}, "still in its table"
            assert str(victim) in str(bad[0].message)
            outcomes["quarantined"] += 1
            shutil.rmtree(root / "_quarantine")
            delta.commit(open_location(root), table, adds=[part])  # the next trial's file: back in its table
        else:
            assert _canonical(got) == want, f"a flipped bit at byte {at} of {len(pristine)} read back as other values"
            outcomes["identical"] += 1
        victim.write_bytes(pristine)
    store.close()
    # bits in compressed pages almost always matter: the checksums are what caught them
    assert outcomes["quarantined"] > TRIALS * 0.7, outcomes


def test_compaction_does_not_launder_a_damaged_source(tmp_path):
    """A source that fails its checksums is quarantined, not merged into a file with fresh ones."""
    rng = np.random.default_rng(0)
    exporter = DeltaExporter(tmp_path, run_info("r"), max_rows=48)  # one routes file per step
    for step in range(6):
        exporter.export([make_record("r", step, rng)])
    exporter.shutdown()
    location = open_location(tmp_path)
    sources = parts(location, "routes")
    victim = Path(file_path(location, "routes", sources[2]))
    good = sum(p.rows for p in sources) - sources[2].rows
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x10
    victim.write_bytes(bytes(data))
    with pytest.warns(BadFileWarning, match=victim.name):
        [result] = compact(tmp_path, tables=("routes",))
    assert result.rows == good and result.merged_files == len(sources) - 1
    [merged] = result.written_files
    pq.read_table(merged, page_checksum_verification=True)  # the merged file carries checksums that hold
    assert [p.path for p in parts(location, "routes")] == [merged.split("/routes/", 1)[1]]
    assert int(Store(tmp_path).sql("SELECT count(*) AS n FROM routes").n[0]) == good


def test_a_damaged_page_header_that_only_duckdb_rejects_is_quarantined_when_a_query_trips(tmp_path):
    """The checksum covers a page's data, not its header: a few header bits pass pyarrow's read
    and stop DuckDB's. A query that trips on one reads the file through DuckDB and moves it aside."""
    root = tmp_path / "store"
    _one_file_store(root, compacted=False)
    part, victim = _the_file(root, "steps")
    pristine = victim.read_bytes()
    meta = pq.read_metadata(victim)
    header = meta.row_group(0).column(meta.schema.names.index("step")).data_page_offset
    probe = tmp_path / "probe.parquet"
    for at, bit in ((at, bit) for at in range(header, header + 32) for bit in range(8)):
        damaged = bytearray(pristine)
        damaged[at] ^= 1 << bit
        probe.write_bytes(bytes(damaged))
        if deep_check(str(probe)) is not None:
            continue
        try:
            duckdb.connect().sql(f"SELECT * FROM read_parquet('{probe}')").fetchall()
        except duckdb.Error:
            break
    else:
        pytest.skip("no bit of this page header passes pyarrow's checks yet stops DuckDB with these versions")
    victim.write_bytes(bytes(damaged))
    store = Store(root)  # the file passes the checks made on opening
    assert store.files["steps"]
    with pytest.warns(BadFileWarning, match="unreadable data"):
        assert len(store.sql("SELECT * FROM steps")) == 0
    assert [q.original_path for q in store.quarantined()] == [str(victim)]
    assert parts(open_location(root), "steps") == []
