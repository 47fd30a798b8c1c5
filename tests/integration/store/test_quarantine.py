"""Bad files do not break queries: detected, copied aside with the reason, taken out of their table by a
Delta commit, their rows counted as lost in probe_stats, and the copy kept; on a local folder and on S3."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

from moescope.store import BadFileWarning, Store, delta
from moescope.store.catalog import count_lost
from moescope.store.quarantine import display
from tests.support.deltafiles import exists, file_path, parts, read_bytes, read_part, write_bytes, write_run


def pc_sum(column) -> int:
    import pyarrow.compute as pc

    return pc.sum(column).as_py() or 0


def read_table_rows(location, table: str) -> int:
    return sum(read_part(location, table, p).num_rows for p in parts(location, table))


@pytest.fixture
def written(store_location):
    write_run(store_location, "r", steps=6, max_rows=48)  # one routes file per step
    files = parts(store_location, "routes")
    assert len(files) == 6
    return store_location, files


def _damaged(data: bytes, damage: str) -> bytes:
    if damage == "truncated":
        return data[: len(data) // 2]
    if damage == "garbage":
        return np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    footer = int.from_bytes(data[-8:-4], "little") + 8
    middle = bytearray(data)
    rng = np.random.default_rng(1)
    middle[100: len(data) - footer] = rng.integers(0, 256, len(data) - footer - 100, dtype=np.uint8).tobytes()
    return bytes(middle)  # pages scrambled, the footer intact: only the checksums see it


def _lost(store: Store, run_id: str) -> dict[tuple[str, str], int]:
    stats = store.probe_stats(run_id)
    return {(r.table_name, r.reason): int(r.dropped_rows) for r in stats.itertuples() if isinstance(r.reason, str)}


@pytest.mark.parametrize("damage", ["truncated", "garbage", "pages"])
def test_a_damaged_file_is_quarantined_removed_from_its_table_and_its_rows_counted(written, damage):
    location, files = written
    victim, others = files[2], [p for p in files if p is not files[2]]
    want = sum(read_part(location, "routes", p).num_rows for p in others)
    path = file_path(location, "routes", victim)
    bad = _damaged(read_bytes(location, path), damage)
    write_bytes(location, path, bad)

    store = Store(location)  # opening reads the logs only: the first query that reads routes checks its files
    with pytest.warns(BadFileWarning, match=victim.path.split("/")[-1]):
        assert int(store.sql("SELECT count(*) AS n FROM routes").n[0]) == want
    [moved] = store.quarantined()
    assert moved.original_path == display(location, path)
    assert moved.reason.startswith("damaged data" if damage == "pages" else "unreadable footer")
    assert moved.path.endswith(f"_quarantine/routes/run_id=r/{victim.path.split('/')[-1]}")
    quarantine_path = moved.path.split("://", 1)[-1]
    assert read_bytes(location, quarantine_path) == bad  # the copy is the file as it was found
    assert victim.path not in {p.path for p in parts(location, "routes")}  # out of the table, for every reader
    assert exists(location, path)  # still there for readers of older versions, until vacuum
    assert _lost(store, "r") == {("routes", "quarantined"): victim.rows}

    with warnings.catch_warnings():
        warnings.simplefilter("error", BadFileWarning)  # a fresh reader does not trip on it again
        other = Store(location)
        assert int(other.sql("SELECT count(*) AS n FROM routes").n[0]) == want
    assert _lost(other, "r") == {("routes", "quarantined"): victim.rows}


def test_rows_of_a_file_two_readers_quarantine_are_counted_once(written):
    """The count comes before the removal and is one counter per file: a reader that counted and
    died before removing the file, and the next reader that counts and removes it, count it once."""
    location, files = written
    victim = files[0]
    path = file_path(location, "routes", victim)
    write_bytes(location, path, _damaged(read_bytes(location, path), "truncated"))
    count_lost(location, "routes", victim)  # the first reader, killed after its count
    store = Store(location)
    with pytest.warns(BadFileWarning):
        store.sql("SELECT count(*) FROM routes")
    assert _lost(store, "r") == {("routes", "quarantined"): victim.rows}


def test_quarantined_files_are_kept_when_vacuum_deletes_the_removed_originals(written):
    location, files = written
    victim = files[1]
    path = file_path(location, "routes", victim)
    bad = _damaged(read_bytes(location, path), "truncated")
    write_bytes(location, path, bad)
    store = Store(location)
    with pytest.warns(BadFileWarning):
        store.check_files()
    delta.vacuum(location, "routes", retention_hours=0)
    assert not exists(location, path)
    [moved] = store.quarantined()
    assert read_bytes(location, moved.path.split("://", 1)[-1]) == bad


def test_damage_inside_a_file_is_found_when_it_is_next_listed(tmp_path):
    """A file damaged after a reader checked it is a new file to that reader (its mtime changed):
    the next refresh reads it through, pages against their checksums, and quarantines it."""
    from moescope.store.location import open_location

    location = open_location(tmp_path / "store")
    write_run(location, "r", steps=6)
    files = parts(location, "routes")
    victim = files[3]
    want = sum(p.rows for p in files) - victim.rows
    store = Store(location)
    query = "SELECT count(*) AS n, sum(token_id) AS s, sum(list_sum(gate_weights)) AS g FROM routes"
    assert int(store.sql(query).n[0]) == sum(p.rows for p in files)  # every routes file checked now
    path = file_path(location, "routes", victim)
    write_bytes(location, path, _damaged(read_bytes(location, path), "pages"))
    store.refresh()
    with pytest.warns(BadFileWarning, match="damaged data"):
        assert int(store.sql(query).n[0]) == want
    assert [q.original_path for q in store.quarantined()] == [path]


def _raw_route_rows(location) -> int:
    """Route rows of the files the routes log names, read from the raw Parquet files."""
    return sum(read_part(location, "routes", p).num_rows for p in parts(location, "routes"))


def test_a_damaged_file_waits_unread_until_a_query_reads_its_table(written):
    """The first answer does not wait for every file: a damaged routes file is neither read nor
    reported by queries of other tables, and the first query that reads routes quarantines it and
    answers from the rest; the damage is never read as numbers."""
    location, files = written
    victim = files[4]
    want = _raw_route_rows(location) - victim.rows  # counted from the raw files before the damage
    path = file_path(location, "routes", victim)
    write_bytes(location, path, _damaged(read_bytes(location, path), "pages"))

    with warnings.catch_warnings():
        warnings.simplefilter("error", BadFileWarning)
        store = Store(location)
        runs = store.runs()  # reads `runs` only
        steps = int(store.sql("SELECT count(*) AS n FROM steps").n[0])
    assert runs.run_id.tolist() == ["r"]
    assert steps == read_table_rows(location, "steps")
    assert victim.path in {p.path for p in parts(location, "routes")}  # nobody has looked at it yet
    assert store.quarantined() == []

    with pytest.warns(BadFileWarning, match="damaged data"):
        got = store.sql("SELECT count(*) AS n, sum(step) AS s FROM routes")
    assert int(got.n[0]) == want
    kept = [p for p in files if p.path != victim.path]
    assert int(got.s[0]) == sum(int(pc_sum(read_part(location, "routes", p).column("step"))) for p in kept)
    assert victim.path not in {p.path for p in parts(location, "routes")}
    assert _lost(store, "r") == {("routes", "quarantined"): victim.rows}


def test_store_check_finds_a_damaged_file_no_query_read(written, capsys):
    """`moescope store check` checks every file now, as the first query of each table would."""
    from moescope.cli import main

    location, files = written
    victim = files[1]
    path = file_path(location, "routes", victim)
    write_bytes(location, path, _damaged(read_bytes(location, path), "pages"))
    options = [f"--storage-option={k}={v}" for k, v in location.storage_options.items()]
    assert main(["store", "check", location.url, *options]) == 1
    out = capsys.readouterr()
    assert "1 bad file(s) moved to _quarantine now" in out.out
    assert re.search(rf"^routes +{len(files) - 1} file\(s\), {sum(p.rows for p in files) - victim.rows} rows checked$",
                     out.out, re.MULTILINE), out.out
    assert victim.path.split("/")[-1] in out.err and "damaged data" in out.err
    assert victim.path not in {p.path for p in parts(location, "routes")}
    with warnings.catch_warnings():
        warnings.simplefilter("error", BadFileWarning)
        assert main(["store", "check", location.url, *options]) == 0  # nothing bad is left
