"""Compaction is one Delta commit per table and run: every row once, sorted, in merged files with page
checksums; a reader holding the version before keeps reading it; two compactions made from one version
commit once; appends racing it land; a merge that does not add up is never committed; a compactor
killed at any point leaves a store that reads exactly the rows written. Rows are counted from the raw
Parquet files of each snapshot with pyarrow."""

from __future__ import annotations

import collections
import os
import random
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moescope.store import Store, delta
from moescope.store import compact as compaction
from moescope.store.compact import compact, parse_age
from moescope.store.location import open_location
from tests.support.deltafiles import exists, file_path, parts, read_part, read_table, write_run

KEY = ["run_id", "rank", "step", "layer", "token"]


def _rows(location, table: str = "routes") -> collections.Counter:
    """Every routes row of the latest version as a hashable tuple, counted (a row twice counts 2)."""
    data = read_table(location, table)
    if not data.num_rows:
        return collections.Counter()
    columns = [c for c in data.column_names if c != "tags"]
    return collections.Counter(
        tuple(tuple(v) if isinstance(v, list) else v for v in row)
        for row in zip(*(data.column(c).to_pylist() for c in columns)))


def _keys(location) -> collections.Counter:
    data = read_table(location, "routes")
    if not data.num_rows:
        return collections.Counter()
    return collections.Counter(zip(*(data.column(c).to_pylist() for c in KEY)))


def test_compaction_in_groups_keeps_every_row_once_sorted(store_location):
    write_run(store_location, "r", steps=12)  # one routes file per step
    want = _rows(store_location)
    assert len(parts(store_location, "routes")) == 12 and sum(want.values()) == 12 * 48
    before = Store(store_location)  # a reader holding the version before the swap
    old = {p.path for p in parts(store_location, "routes")}

    [result] = compact(store_location, tables=("routes",), target_rows=48 * 4)
    assert result.merged_files == 12 and len(result.written_files) == 3 and result.rows == 12 * 48
    merged = parts(store_location, "routes")
    assert len(merged) == 3 and not old & {p.path for p in merged}
    fs = store_location.filesystem()
    for part in merged:
        with fs.open_input_file(file_path(store_location, "routes", part)) as f:
            data = pq.ParquetFile(f, page_checksum_verification=True).read(columns=["layer", "step"]).to_pandas()
        assert data.equals(data.sort_values(["layer", "step"], kind="stable"))
        assert "run_id" not in pq.read_schema(fs.open_input_file(file_path(store_location, "routes", part))).names
    assert _rows(store_location) == want

    query = "SELECT count(*) AS n, count(DISTINCT (rank, step, layer, token)) AS d FROM routes"
    assert before.sql(query).values.tolist() == [[12 * 48, 12 * 48]]  # its version's files are still there
    assert Store(store_location).sql(query).values.tolist() == [[12 * 48, 12 * 48]]
    assert all(exists(store_location, location_path) for location_path in
               (store_location.join("routes", *p.split("/")) for p in old))  # kept for the retention
    delta.vacuum(store_location, "routes", retention_hours=0)
    assert not any(exists(store_location, store_location.join("routes", *p.split("/"))) for p in old)
    assert Store(store_location).sql(query).values.tolist() == [[12 * 48, 12 * 48]]


def test_parse_age():
    assert parse_age("7d") == 7 * 86400 and parse_age("90s") == 90 and parse_age("1.5h") == 5400


def test_a_merge_that_loses_a_row_is_never_committed(tmp_path, monkeypatch):
    """The row-count check: a merged file holding fewer rows than its sources (a lossy merge, made
    here by rewriting the real merge's output without its last row) raises, commits nothing and
    leaves no merged file behind; the store reads exactly what it read before."""
    location = open_location(tmp_path)
    write_run(location, "r", steps=4)
    folder = tmp_path / "routes" / "run_id=r"
    before_files = sorted(p.name for p in folder.iterdir())
    version = delta.snapshot(location, "routes").version
    want = _rows(location)
    real_merge = compaction._merge

    def lossy_merge(con, catalog, table, run_id, group, row_group_rows):
        part = real_merge(con, catalog, table, run_id, group, row_group_rows)
        path = file_path(location, table, part)
        merged = pq.read_table(path)
        pq.write_table(merged.slice(0, merged.num_rows - 1), path)
        return delta.PartFile(part.path, os.path.getsize(path), merged.num_rows - 1, run_id, None)

    monkeypatch.setattr(compaction, "_merge", lossy_merge)
    with pytest.raises(RuntimeError, match=f"merged {4 * 48 - 1} rows of routes/r, expected {4 * 48}"):
        compact(tmp_path, tables=("routes",))
    assert sorted(p.name for p in folder.iterdir()) == before_files  # no merged file left
    assert delta.snapshot(location, "routes").version == version and _rows(location) == want
    monkeypatch.setattr(compaction, "_merge", real_merge)
    [result] = compact(tmp_path, tables=("routes",))  # the honest merge goes through
    assert (result.merged_files, result.rows) == (4, 4 * 48)
    assert _rows(location) == want


def test_two_compactions_made_from_one_version_commit_once(store_location, monkeypatch):
    """Compaction A reads a version, merges, and before it commits compaction B does the same from
    the same version and commits. A's commit carries the same app transaction version and is not
    made: A deletes its merged files, looks again, finds nothing to merge. Every row stays once."""
    write_run(store_location, "r", steps=8)
    want = _rows(store_location)
    real_commit = delta.commit
    state = {"inner": None}

    def commit_after_a_rival(loc, table, adds=(), removes=(), **kwargs):
        if state["inner"] is None and table == "routes" and removes:
            state["inner"] = "running"
            monkeypatch.setattr(compaction.delta, "commit", real_commit)
            [rival] = compact(store_location, tables=("routes",), retention_hours=None)
            state["inner"] = rival
            state["lost"] = [file_path(store_location, table, p) for p in adds]
        return real_commit(loc, table, adds, removes, **kwargs)

    monkeypatch.setattr(compaction.delta, "commit", commit_after_a_rival)
    [first] = compact(store_location, tables=("routes",), retention_hours=None)
    rival = state["inner"]
    assert rival.merged_files == 8 and rival.version is not None
    assert first.merged_files == 0 and first.skipped == "nothing to merge"
    assert not any(exists(store_location, path) for path in state["lost"])  # the loser's files deleted
    assert len(parts(store_location, "routes")) == 1
    assert _rows(store_location) == want


def test_appends_between_a_compactions_read_and_its_commit_land(store_location, monkeypatch):
    write_run(store_location, "r", steps=6)
    real_commit = delta.commit

    def commit_after_an_append(loc, table, adds=(), removes=(), **kwargs):
        if table == "routes" and removes and not getattr(commit_after_an_append, "done", False):
            commit_after_an_append.done = True
            write_run(store_location, "r", steps=3, seed=7, rank=1)  # another writer's flushes land first
        return real_commit(loc, table, adds, removes, **kwargs)

    monkeypatch.setattr(compaction.delta, "commit", commit_after_an_append)
    [result] = compact(store_location, tables=("routes",))
    assert result.merged_files == 6
    keys = _keys(store_location)
    assert max(keys.values()) == 1
    assert sum(keys.values()) == 9 * 48 and {k[1] for k in keys} == {0, 1}


def test_a_source_removed_between_a_compactions_read_and_its_commit_stays_removed(tmp_path, monkeypatch):
    """A quarantine (or prune) takes one of the sources out after the compaction read them: the
    compaction's commit is refused (nothing committed, its merged file deleted), and it merges again
    from the new version, without the removed file's rows."""
    location = open_location(tmp_path)
    write_run(location, "r", steps=5)
    files = parts(location, "routes")
    taken = files[1]
    [taken_step] = set(read_part(location, "routes", taken).column("step").to_pylist())
    real_commit = delta.commit
    refused = []

    def remove_a_source_first(loc, table, adds=(), removes=(), **kwargs):
        if table == "routes" and adds and not refused:
            refused.extend(file_path(location, table, p) for p in adds)
            real_commit(loc, table, removes=[taken])  # as a reader's quarantine does
        return real_commit(loc, table, adds, removes, **kwargs)

    monkeypatch.setattr(compaction.delta, "commit", remove_a_source_first)
    [result] = compact(location, tables=("routes",))
    assert result.merged_files == 4 and result.rows == 4 * 48
    assert refused and not any(exists(location, path) for path in refused)
    keys = _keys(location)
    assert sum(keys.values()) == len(keys) == 4 * 48
    assert {k[2] for k in keys} == set(range(5)) - {taken_step}


@pytest.mark.integration
def test_a_writer_appending_while_compactions_commit_loses_and_doubles_nothing(tmp_path, spawn):
    """A writer process appends while compaction commits again and again: the final version's raw
    files hold every row the writer wrote exactly once, and a reader never saw a row twice."""
    location = open_location(tmp_path)
    steps = 120
    writer = spawn("-m", "tests.support.store_records", "--store", str(tmp_path), "--run", "live", "--rank", "0",
                   "--steps", str(steps), "--sleep", "0.02", "--flush", "0.1")
    while not delta.table_exists(location, "routes") or not parts(location, "routes"):
        assert writer.poll() is None, writer.stderr.read()
        time.sleep(0.05)
    committed = 0
    seen_twice = []
    deadline = time.monotonic() + 180
    while writer.poll() is None and time.monotonic() < deadline:
        results = compact(tmp_path, run_id="live", tables=("routes",), target_rows=100_000)
        committed += sum(1 for r in results if r.version is not None)
        keys = _keys(location)
        if keys and max(keys.values()) > 1:
            seen_twice.append(sum(n - 1 for n in keys.values() if n > 1))
    assert writer.wait(timeout=60) == 0, writer.stderr.read()
    compact(tmp_path, run_id="live", tables=("routes",))
    assert not seen_twice and committed >= 2
    keys = _keys(location)
    assert sum(keys.values()) == len(keys) == steps * 48
    assert {k[2] for k in keys} == set(range(steps))
    assert len(parts(location, "routes")) == 1


COMPACTOR = """
import sys, time
from moescope.store.compact import compact
print("start", flush=True)
compact(sys.argv[1], tables=("routes",), target_rows=48 * 4, retention_hours=None)
print("done", flush=True)
"""


@pytest.mark.integration
def test_a_compactor_killed_at_any_point_leaves_exactly_the_rows_written(tmp_path, spawn):
    """kill -9 of a compaction in the middle of its work (merging, committing, checking its commit):
    after each kill a new reader reads exactly the rows written, none twice, none lost."""
    location = open_location(tmp_path)
    rng = random.Random(3)
    kills = collections.Counter()
    took = None
    for trial in range(7):
        write_run(location, "r", steps=8, seed=trial, rank=trial)  # 8 small files more
        want = _rows(location)
        child = spawn("-c", COMPACTOR, str(tmp_path))
        assert child.stdout.readline().strip() == "start", child.stderr.read()
        started = time.monotonic()
        if took is None:  # the first one runs to its end: how long a compaction takes here
            assert child.stdout.readline().strip() == "done", child.stderr.read()
            took = time.monotonic() - started
        else:
            time.sleep(rng.uniform(0.05, 0.9) * took)
            child.kill()
        child.wait(timeout=30)
        kills["after it finished" if child.stdout.read().strip() == "done" or trial == 0 else "while it worked"] += 1
        assert _rows(location) == want, f"trial {trial}: the store does not read the rows written"
        store = Store(location)
        got = store.sql("SELECT count(*) AS n, count(DISTINCT (rank, step, layer, token)) AS d FROM routes")
        assert got.values.tolist() == [[sum(want.values())] * 2]
        assert store.quarantined() == []
    assert kills["while it worked"] >= 2, kills
    [result] = compact(location, tables=("routes",), target_rows=10**6)  # a later compaction cleans up
    assert result.rows == sum(_rows(location).values()) == 7 * 8 * 48


def test_compact_refuses_a_store_of_the_previous_release(tmp_path):
    folder = tmp_path / "routes" / "run_id=r"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"run_id": ["r"], "step": [1]}), folder / "part-00000-1-000001-000000000001.parquet")
    with pytest.raises(delta.LegacyStoreError, match="moescope store upgrade"):
        compact(tmp_path)
    assert not (tmp_path / "routes" / "_delta_log").exists()


def test_compaction_keeps_what_a_pinned_reader_needs_until_the_retention(tmp_path):
    """The merged-away files are kept for the retention: a reader that pinned the version before
    keeps answering; once vacuum deleted them, it says to refresh rather than answer wrongly."""
    location = open_location(tmp_path)
    write_run(location, "r", steps=4)
    reader = Store(location)
    compact(location, tables=("routes",), retention_hours=1)
    assert int(reader.sql("SELECT count(*) AS n FROM routes").n[0]) == 4 * 48
    delta.vacuum(location, "routes", retention_hours=0)
    with pytest.raises(Exception, match="refresh"):
        reader.sql("SELECT count(*) AS n FROM routes")
    reader.refresh()
    assert int(reader.sql("SELECT count(*) AS n FROM routes").n[0]) == 4 * 48


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))


def _sorted_rows(location) -> list[tuple]:
    """Every routes row of the latest version in file order, the files in name order (the merged ones)."""
    fs = location.filesystem()
    out = []
    for part in sorted(parts(location, "routes"), key=lambda p: p.path):
        with fs.open_input_file(file_path(location, "routes", part)) as f:
            data = pq.read_table(f)
        columns = [c for c in data.column_names if c != "tags"]
        out += [tuple(tuple(v) if isinstance(v, list) else v for v in row)
                for row in zip(*(data.column(c).to_pylist() for c in columns + ["tags"]))]
    return out


def test_the_in_memory_merge_and_duckdbs_write_the_same_rows_in_the_same_order(tmp_path, monkeypatch):
    """A group that fits in memory is sorted by pyarrow (each source read once), a larger one by
    DuckDB: both give the same rows in the same (layer, step, rank, token) order, in row groups of
    the size asked. Two ranks' files interleave, so the order is not the files' own."""
    stores = {}
    for name, limit in (("memory", compaction.IN_MEMORY_MERGE_BYTES), ("duckdb", -1)):
        location = open_location(tmp_path / name)
        write_run(location, "r", steps=6, rank=0, seed=3)
        write_run(location, "r", steps=6, rank=1, seed=4)
        want = _rows(location)
        monkeypatch.setattr(compaction, "IN_MEMORY_MERGE_BYTES", limit)
        calls = []
        for merge in ("_merge_in_memory", "_merge_duckdb"):
            real = getattr(compaction, merge)
            monkeypatch.setattr(compaction, merge, lambda *a, _real=real, _name=merge, **k: (calls.append(_name),
                                                                                            _real(*a, **k))[1])
        [result] = compact(location, tables=("routes",), row_group_rows=100)
        assert set(calls) == {"_merge_in_memory" if name == "memory" else "_merge_duckdb"}
        assert result.merged_files == 12 and _rows(location) == want
        [part] = parts(location, "routes")
        meta = pq.read_metadata(file_path(location, "routes", part))
        assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [100] * 5 + [76]
        rows = _sorted_rows(location)
        stores[name] = rows
    assert stores["memory"] == stores["duckdb"]
    keys = [(row[1], row[0], row[-2], row[2]) for row in stores["memory"]]  # layer, step, rank, token
    assert keys == sorted(keys)


def test_a_source_found_damaged_while_merged_in_memory_is_quarantined_and_the_merge_goes_on(tmp_path):
    """Compaction reads each source once, checking every page as it reads: a file whose footer is
    sound but a page damaged is found there, copied to quarantine and taken out of the table, and
    the other sources are merged without it; no merged file holds its rows."""
    location = open_location(tmp_path)
    write_run(location, "r", steps=5)
    sources = sorted(parts(location, "routes"), key=lambda p: p.path)
    bad = sources[2]
    path = tmp_path / "routes" / bad.path
    meta = pq.read_metadata(path)
    column = meta.row_group(0).column(7)
    assert column.path_in_schema == "gate_weights.list.element"
    data = bytearray(path.read_bytes())
    data[column.data_page_offset + column.total_compressed_size - 4] ^= 0x10
    path.write_bytes(bytes(data))
    assert pq.read_metadata(path).num_rows == 48  # the footer reads: only a read through finds it
    good = collections.Counter()
    for part in sources:
        if part != bad:
            rows = pq.read_table(tmp_path / "routes" / part.path)
            good.update(zip(*(rows.column(c).to_pylist() for c in ("step", "layer", "token"))))
    with pytest.warns(Warning):
        [result] = compact(location, tables=("routes",))
    assert result.merged_files == 4 and result.rows == 4 * 48
    assert bad.path not in {p.path for p in parts(location, "routes")}
    assert collections.Counter(zip(*(read_table(location, "routes").column(c).to_pylist()
                                     for c in ("step", "layer", "token")))) == good
    [moved] = Store(location).quarantined()
    assert moved.reason.startswith("damaged data") and moved.original_path.endswith(bad.path.split("/")[-1])
