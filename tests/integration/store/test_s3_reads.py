"""Reads through S3 at object-store speed (issue 34, part 2), counted where the requests arrive: the
moto server sits behind tests/support/s3faults.py's proxy, which logs every request it forwards.

A reader opens a store by reading the tables' logs alone; a query checks the files of the tables it
reads that the process has not seen, and a fresh query sends at most three requests to such a file
(a HEAD: its size and ETag; the object whole, footer and pages checked from memory, the footer kept
in the fragment the views scan; the column chunks the query reads). Another reader of the process only asks
whether the object is still the one checked (an object written over is checked again); a refresh
after new commits asks only for the new versions' log entries, and a query then checks only the new
files; the answers are those of the raw Parquet rows.
"""

from __future__ import annotations

import collections
import re
from urllib.parse import unquote

import pyarrow.compute as pc
import pytest

from moescope.store import BadFileWarning, Store
from moescope.store.location import StoreLocation
from moescope.store.schema import TABLES
from tests.support.deltafiles import parts, read_table, write_bytes, write_run
from tests.support.s3faults import FaultProxy

_LOG_ENTRY = re.compile(r"/([a-z_]+)/_delta_log/(\d{20})\.json$")


def _through(location: StoreLocation, proxy: FaultProxy) -> StoreLocation:
    return StoreLocation(location.url, {**location.storage_options, "AWS_ENDPOINT_URL": proxy.url})


def _data_requests(proxy: FaultProxy) -> collections.Counter[str]:
    """Requests per data file (bucket/prefix/table/run_id=.../part-....parquet), any method."""
    paths = (unquote(path.split("?", 1)[0]).lstrip("/") for _, path, _ in proxy.log())
    return collections.Counter(path for path in paths if path.endswith(".parquet") and "/_delta_log/" not in path)


def _log_entries(proxy: FaultProxy) -> list[tuple[str, int]]:
    """(table, version) of every log entry asked for."""
    return [(m.group(1), int(m.group(2))) for _, path, _ in proxy.log()
            if (m := _LOG_ENTRY.search(unquote(path.split("?", 1)[0])))]


def _files(location: StoreLocation) -> set[str]:
    return {location.join(table, part.path) for table in TABLES for part in parts(location, table)}


def _brute_force_route_rows(location: StoreLocation) -> dict[str, int]:
    """Route rows per run, counted from the raw Parquet files the log names."""
    rows: collections.Counter[str] = collections.Counter()
    for part in parts(location, "routes"):
        rows[part.run_id] += read_table_rows(location, part)
    return dict(rows)


def read_table_rows(location: StoreLocation, part) -> int:
    import pyarrow.parquet as pq

    with location.filesystem().open_input_file(location.join("routes", part.path)) as source:
        return pq.read_metadata(source).num_rows


def test_a_reader_asks_at_most_three_requests_per_file_it_has_not_seen(s3_store):
    write_run(s3_store, "r", steps=6, max_rows=48)  # a routes file per step, and a file in each other table
    files = _files(s3_store)
    route_files = {f for f in files if "/routes/" in f}
    assert len(route_files) >= 6
    with FaultProxy(s3_store.storage_options["AWS_ENDPOINT_URL"]) as proxy:
        through = _through(s3_store, proxy)
        with Store(through) as store:
            assert _data_requests(proxy) == {}  # opening reads the tables' logs, no data file

            answer = store.sql("SELECT run_id, count(*) AS n, sum(step) AS steps FROM routes GROUP BY run_id")
            per_file = _per_file(proxy)
            assert set(per_file) == route_files  # the files of the table the query reads, and no other file
            # its check: a HEAD (size, ETag) and the object whole; then the column chunks it reads, no footer
            assert all(c["HEAD"] == 1 and c["GET"] == 2 and sum(c.values()) <= 3 for c in per_file.values()), per_file

            proxy.reset_counts()
            again = store.sql("SELECT run_id, count(*) AS n, sum(step) AS steps FROM routes GROUP BY run_id")
            asked = _data_requests(proxy)
            assert set(asked) <= route_files and max(asked.values()) <= 1  # its column chunks only
        raw = read_table(s3_store, "routes")
        assert answer.set_index("run_id")["n"].to_dict() == {"r": raw.num_rows}
        assert int(answer["steps"][0]) == pc.sum(raw.column("step")).as_py()
        assert again.equals(answer)

        proxy.reset_counts()
        with Store(through) as store:  # a second reader in the same process: every file already checked ...
            store.sql("SELECT count(*) FROM routes")
        per_file = _per_file(proxy)
        assert set(per_file) == route_files
        # ... it asks only whether each is the object checked, then for the data it reads
        assert all(c["HEAD"] == 1 and c["GET"] <= 1 and sum(c.values()) <= 2 for c in per_file.values()), per_file

        # an object written over (another ETag) is checked again, and this one is damaged: quarantined
        damaged = next(p for p in parts(s3_store, "routes"))
        write_bytes(s3_store, s3_store.join("routes", damaged.path), b"not parquet" * 10)
        with Store(through) as store, pytest.warns(BadFileWarning):
            left = store.sql("SELECT count(*) AS n FROM routes").n[0]
            assert [q.original_path.rsplit("/", 1)[-1] for q in store.quarantined()] == [damaged.path.split("/")[-1]]
        assert left == raw.num_rows - damaged.rows


def _per_file(proxy: FaultProxy) -> dict[str, collections.Counter[str]]:
    """Requests per data file, by method."""
    per_file: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for method, path, _ in proxy.log():
        path = unquote(path.split("?", 1)[0]).lstrip("/")
        if path.endswith(".parquet") and "/_delta_log/" not in path:
            per_file[path][method] += 1
    return per_file


def test_a_refresh_reads_only_what_the_new_versions_add(s3_store):
    write_run(s3_store, "r", steps=4, max_rows=48)
    old_files = _files(s3_store)
    with FaultProxy(s3_store.storage_options["AWS_ENDPOINT_URL"]) as proxy:
        with Store(_through(s3_store, proxy)) as store:
            store.sql("SELECT count(*) FROM routes")
            before = dict(store.versions)
            write_run(s3_store, "r2", steps=3, max_rows=48, seed=1)  # straight to the server: not counted
            new_files = _files(s3_store) - old_files
            assert new_files
            proxy.reset_counts()
            store.refresh()
            assert _data_requests(proxy) == {}  # a refresh reads the logs only
            entries = _log_entries(proxy)
            assert entries and all(version > (before.get(table) if before.get(table) is not None else -1)
                                   for table, version in entries), entries  # only the new versions' entries
            assert {table for table, _ in entries} == {table for table in TABLES
                                                      if store.versions.get(table) != before.get(table)}
            counted = store.sql("SELECT run_id, count(*) AS n FROM routes GROUP BY run_id ORDER BY run_id")
            asked = _data_requests(proxy)
            new_routes = {f for f in new_files if "/routes/" in f}
            assert new_routes <= set(asked) <= {f for f in old_files | new_files if "/routes/" in f}
            assert all(asked[f] <= 3 for f in new_routes), asked  # a new file: checked, its footer, its data
            assert all(asked[f] <= 1 for f in set(asked) - new_routes), asked  # an old one: its data only
        assert dict(zip(counted["run_id"], counted["n"])) == _brute_force_route_rows(s3_store)


def _checkpoints(location: StoreLocation) -> dict[str, tuple[int, int]]:
    """Per table with a checkpoint: (its version, its top-level columns), read with pyarrow from the
    objects `_delta_log/_last_checkpoint` names."""
    import json

    import pyarrow.parquet as pq

    filesystem = location.filesystem()
    found = {}
    for table in TABLES:
        try:
            with filesystem.open_input_stream(location.join(table, "_delta_log", "_last_checkpoint")) as f:
                version = json.loads(f.read())["version"]
        except FileNotFoundError:
            continue
        with filesystem.open_input_file(location.join(table, "_delta_log", f"{version:020d}.checkpoint.parquet")) as f:
            found[table] = (version, len(pq.read_schema(f).names))
    return found


def _log_versions(location: StoreLocation) -> dict[str, list[int]]:
    """Per table, the versions of its log's commit entries (a listing of each table's log)."""
    from pyarrow import fs as pafs

    versions: dict[str, list[int]] = {}
    for table in TABLES:
        selector = pafs.FileSelector(location.join(table, "_delta_log"), allow_not_found=True)
        names = [info.base_name for info in location.filesystem().get_file_info(selector)]
        entries = sorted(int(name[:20]) for name in names if re.fullmatch(r"\d{20}\.json", name))
        if entries:
            versions[table] = entries
    return versions


def test_compact_with_nothing_to_merge_reads_each_tables_log_past_its_checkpoint_and_no_data(s3_store):
    """`moescope compact URL` in a fresh process, on a store a compaction has just merged: it reads each
    table's log (its checkpoint pointer, a listing past it, the checkpoint, the commits after it; delta-rs
    reads each of those twice when it opens a table) and nothing else: no data file, no commit the
    checkpoint sums up, and no second look at a table it has just opened."""
    import subprocess
    import sys

    from tests.support.paths import REPO

    write_run(s3_store, "r", steps=8, max_rows=48)  # 8 routes files, and 2-4 commits in each other table
    with FaultProxy(s3_store.storage_options["AWS_ENDPOINT_URL"]) as proxy:
        through = _through(s3_store, proxy)
        options = [f"--storage-option={key}={value}" for key, value in through.storage_options.items()]
        command = [sys.executable, "-m", "moescope.cli", "compact", through.url, *options]
        first = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
        assert "8 files -> 1" in first.stdout, first.stdout
        checkpoints, versions = _checkpoints(s3_store), _log_versions(s3_store)
        assert "routes" in checkpoints  # a compaction that merged leaves a checkpoint of what it made
        proxy.reset_counts()
        again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
        assert "nothing to compact" in again.stdout, again.stdout
        requests = proxy.log()
        data, entries = _data_requests(proxy), collections.Counter(_log_entries(proxy))

    assert data == {}
    after = {table: [v for v in vs if v > checkpoints.get(table, (-1, 0))[0]] for table, vs in versions.items()}
    assert set(entries) == {(table, v) for table, vs in after.items() for v in vs}, entries  # none before a checkpoint
    assert max(entries.values()) <= 2, entries
    # What it must read: the root (the store is reachable; which tables exist: 2 listings); per table its
    # checkpoint pointer and a listing of its log past it (2), each commit after the checkpoint (twice, 2
    # each), the checkpoint object (twice: its footer and a range per top-level column, 2 x (1 + columns)).
    budget = 2 + sum(2 + 2 * len(vs) for vs in after.values()) + sum(2 * (1 + c) for _, c in checkpoints.values())
    assert len(requests) <= budget, (len(requests), budget, requests)
