"""store.delta: files written with pyarrow and added to Delta tables by atomic commits, on a local
folder and on a real S3 API (moto's server in its own process, tests/support/s3server.py).

Expected values come from elsewhere: the rows each test wrote, and the raw Parquet files that the
Delta log lists (listed by delta-rs, read with pyarrow), never from moescope's readers."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from moescope.store import delta
from moescope.store.errors import StoreError
from moescope.store.location import StoreLocation
from moescope.store.schema import SCHEMAS
from tests.support.deltafiles import snapshot_files, snapshot_rows, steps_rows

# -- the independent reader ------------------------------------------------------------------------









# -- writing and committing --------------------------------------------------------------------------

def test_a_committed_file_is_in_the_snapshot_with_its_stats_and_an_uncommitted_one_is_not(store_location):
    loc = store_location
    data = steps_rows("r1", 10, 50)
    part = delta.write_part(loc, "steps", "r1", data, "part-00000-h-1-000001-1.parquet")
    orphan = delta.write_part(loc, "steps", "r1", steps_rows("r1", 100, 7), "part-00000-h-1-000002-2.parquet")
    assert (part.path, part.rows, part.run_id) == ("run_id=r1/part-00000-h-1-000001-1.parquet", 50, "r1")
    assert delta.snapshot(loc, "steps") is None and not delta.table_exists(loc, "steps")

    version = delta.commit(loc, "steps", [part])

    assert delta.table_exists(loc, "steps")
    [action] = snapshot_files(loc, "steps")  # the orphan was never committed: no reader sees it
    assert action["path"] == part.path and action["size_bytes"] == part.size == loc.filesystem().get_file_info(
        loc.join("steps", part.path)).size
    rows = snapshot_rows(loc, "steps")
    assert sorted(rows.column("step").to_pylist()) == list(range(10, 60))
    assert set(rows.column("run_id").to_pylist()) == {"r1"}
    snap = delta.snapshot(loc, "steps")
    assert snap is not None and snap.version == version and [f.path for f in snap.files] == [part.path]
    assert snap.files[0].rows == 50 and orphan.path not in {f.path for f in snap.files}
    assert snap.files[0].modification_time == action["modification_time"] > 0
    # the stats readers prune on, against the rows themselves
    stats = json.loads(part.stats)
    assert stats["numRecords"] == 50
    assert (stats["minValues"]["step"], stats["maxValues"]["step"]) == (pc.min(data["step"]).as_py(),
                                                                        pc.max(data["step"]).as_py())
    assert stats["nullCount"]["duration_s"] == 50 and stats["nullCount"]["tokens"] == 0
    assert "duration_s" not in stats["minValues"] and "tags" not in stats["nullCount"]  # floats, maps: no bounds
    low, high = pc.min(data["ts"]).as_py(), pc.max(data["ts"]).as_py()
    assert stats["minValues"]["ts"] == low.strftime("%Y-%m-%dT%H:%M:%S.") + f"{low.microsecond // 1000:03d}Z"
    assert stats["maxValues"]["ts"] == high.strftime("%Y-%m-%dT%H:%M:%S.") + f"{high.microsecond // 1000 + 1:03d}Z"
    assert action["min.step"] == 10 and action["max.step"] == 59  # delta-rs reads them back
    # and prunes with them
    from deltalake import DeltaTable

    table = DeltaTable(loc.table_uri("steps"), storage_options=dict(loc.storage_options) or None)
    assert table.file_uris(file_pruning_predicate="step > 59") == []
    assert len(table.file_uris(file_pruning_predicate="step > 58")) == 1


def test_the_table_is_made_with_the_schema_modules_columns_partitioned_by_run(tmp_path):
    from deltalake import DeltaTable

    part = delta.write_part(tmp_path, "routes", "r", SCHEMAS["routes"].empty_table(), "part-0.parquet")
    delta.commit(tmp_path, "routes", [part])
    table = DeltaTable(str(tmp_path / "routes"))
    assert table.metadata().partition_columns == ["run_id"]
    assert [f.name for f in table.schema().fields] == SCHEMAS["routes"].names
    assert pa.schema(table.schema()).field("expert_ids").type == pa.list_(pa.int32())


def test_pages_carry_checksums_that_catch_a_flipped_bit(tmp_path):
    part = delta.write_part(tmp_path, "steps", "r", steps_rows("r", 0, 2000), "part-0.parquet")
    path = tmp_path / "steps" / part.path
    assert pq.ParquetFile(path, page_checksum_verification=True).read().num_rows == 2000
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 4] ^= 0x10  # inside the first column chunk's pages
    path.write_bytes(bytes(raw))
    with pytest.raises(OSError, match="(?i)crc|checksum|corrupt"):
        pq.ParquetFile(path, page_checksum_verification=True).read()


def test_columns_the_table_does_not_have_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="no column 'nope'"):
        delta.write_part(tmp_path, "steps", "r", pa.table({"step": [1], "nope": [2]}), "part-0.parquet")
    assert not (tmp_path / "steps").exists()


def test_removes_and_adds_in_one_commit_and_an_old_version_stays_readable(store_location):
    loc = store_location
    first = delta.write_part(loc, "steps", "r", steps_rows("r", 0, 10), "part-a.parquet")
    second = delta.write_part(loc, "steps", "r", steps_rows("r", 10, 10), "part-b.parquet")
    v1 = delta.commit(loc, "steps", [first])
    v2 = delta.commit(loc, "steps", [second])
    merged = delta.write_part(loc, "steps", "r", steps_rows("r", 0, 20), "part-merged.parquet")
    v3 = delta.commit(loc, "steps", [merged], [first, second.path], data_change=False)
    assert (v1, v2, v3) == (1, 2, 3)
    assert sorted(snapshot_rows(loc, "steps").column("step").to_pylist()) == list(range(20))  # each row once
    old = delta.snapshot(loc, "steps", version=v2)
    assert old is not None and sorted(f.path for f in old.files) == [first.path, second.path]
    assert [f.path for f in delta.snapshot(loc, "steps").files] == [merged.path]


def test_a_rewrite_of_a_file_someone_else_removed_is_refused_and_commits_nothing(tmp_path):
    """A compaction read files a and b; meanwhile another commit (a quarantine) removed b. Its commit
    (remove a and b, add their merge) would bring b's rows back: it is refused, and nothing changes."""
    a = delta.write_part(tmp_path, "steps", "r", steps_rows("r", 0, 10), "part-a.parquet")
    b = delta.write_part(tmp_path, "steps", "r", steps_rows("r", 10, 10), "part-b.parquet")
    delta.commit(tmp_path, "steps", [a, b])
    read = delta.snapshot(tmp_path, "steps")
    quarantined = delta.commit(tmp_path, "steps", removes=[b])
    merged = delta.write_part(tmp_path, "steps", "r", steps_rows("r", 0, 20), "part-merged.parquet")
    with pytest.raises(delta.CommitConflictError, match="no longer in the table"):
        delta.commit(tmp_path, "steps", [merged], read.files, data_change=False, app=("moescope-compact:steps", 1))
    assert delta.snapshot(tmp_path, "steps").version == quarantined
    assert sorted(snapshot_rows(tmp_path, "steps").column("step").to_pylist()) == list(range(10))
    assert delta.transaction_version(tmp_path, "steps", "moescope-compact:steps") is None


def test_vacuum_deletes_removed_and_orphaned_files_and_keeps_live_ones(tmp_path):
    live = delta.write_part(tmp_path, "steps", "r", steps_rows("r", 0, 5), "part-live.parquet")
    gone = delta.write_part(tmp_path, "steps", "r", steps_rows("r", 5, 5), "part-gone.parquet")
    delta.commit(tmp_path, "steps", [live, gone])
    delta.commit(tmp_path, "steps", removes=[gone])
    orphan = delta.write_part(tmp_path, "steps", "r", steps_rows("r", 9, 1), "part-orphan.parquet")
    in_flight = delta.write_part(tmp_path, "steps", "r", steps_rows("r", 9, 1), "part-in-flight.parquet")
    three_hours_ago = time.time() - 3 * 3600
    os.utime(tmp_path / "steps" / orphan.path, (three_hours_ago, three_hours_ago))  # a crashed writer's file
    # removed 0 h ago: kept by a 1 h retention; the old orphan goes, the file a writer may still commit stays
    assert [os.path.basename(p) for p in delta.vacuum(tmp_path, "steps", retention_hours=1)] == [
        "part-orphan.parquet"]
    # a retention of 0 deletes what was removed, and never a file in flight
    assert [os.path.basename(p) for p in delta.vacuum(tmp_path, "steps", retention_hours=0)] == ["part-gone.parquet"]
    assert sorted(p.name for p in (tmp_path / "steps" / "run_id=r").iterdir()) == [
        "part-in-flight.parquet", "part-live.parquet"]
    version = delta.commit(tmp_path, "steps", [in_flight])  # committed after the vacuums: still there
    assert version == delta.snapshot(tmp_path, "steps").version  # (each vacuum logs its start and end)
    assert sorted(snapshot_rows(tmp_path, "steps").column("step").to_pylist()) == [0, 1, 2, 3, 4, 9]
    assert delta.vacuum(tmp_path, "routes", retention_hours=0) == []  # no table: nothing to do


def test_an_app_transaction_is_committed_once(tmp_path):
    part = delta.write_part(tmp_path, "steps", "r", steps_rows("r", 0, 3), "part-0.parquet")
    version = delta.commit(tmp_path, "steps", [part], app=("writer-a", 1))
    again = delta.commit(tmp_path, "steps", [part], app=("writer-a", 1))  # a retry after a lost answer
    assert again == version == 1
    assert len(os.listdir(tmp_path / "steps" / "_delta_log")) == 2  # versions 0 (create) and 1: no third
    other = delta.write_part(tmp_path, "steps", "r", steps_rows("r", 3, 3), "part-1.parquet")
    assert delta.commit(tmp_path, "steps", [other], app=("writer-a", 2)) == 2
    assert delta.commit(tmp_path, "steps", [other], app=("writer-b", 1)) == 3  # another writer's own sequence
    assert snapshot_rows(tmp_path, "steps").num_rows == 6
    assert delta.transaction_version(tmp_path, "steps", "writer-a") == 2
    assert delta.transaction_version(tmp_path, "steps", "writer-c") is None
    assert delta.transaction_version(tmp_path, "routes", "writer-a") is None  # no table


def test_an_empty_commit_and_an_unknown_table_are_refused(tmp_path):
    with pytest.raises(ValueError, match="at least one file"):
        delta.commit(tmp_path, "steps")
    part = delta.PartFile("run_id=r/part-0.parquet", 1, 1, "r")
    with pytest.raises(StoreError, match="not a table of the store"):
        delta.commit(tmp_path, "no_such_table", [part])


# -- many processes ----------------------------------------------------------------------------------

WORKERS, COMMITS, ROWS = 4, 6, 50


def _returning(results, target, args) -> None:
    results.put(target(*args))


def _in_processes(target, calls: list[tuple]) -> list:
    """`target(*args)` for each args, each in a spawned process of its own (a pool may hand two calls
    to one worker when another is slow to start, and then fewer processes race), their results."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_returning, args=(results, target, args)) for args in calls]
    for process in processes:
        process.start()
    for process in processes:
        process.join(600)
    assert [p.exitcode for p in processes] == [0] * len(processes)  # a child that raised put nothing
    return [results.get(timeout=30) for _ in processes]


def _append_worker(url: str, options: dict, worker: int) -> int:
    loc = StoreLocation(url, options)
    for commit in range(COMMITS):
        first = (worker * COMMITS + commit) * ROWS
        run_id = f"run-{worker % 2}"
        name = f"part-{worker:05d}-w-{os.getpid()}-{commit:06d}-{time.time_ns() % 10**12:012d}.parquet"
        part = delta.write_part(loc, "steps", run_id, steps_rows(run_id, first, ROWS, worker), name)
        delta.commit(loc, "steps", [part], app=(f"worker-{worker}", commit + 1))
    return os.getpid()


def test_concurrent_appends_from_four_processes_commit_every_row_once(store_location):
    """4 spawned processes race to create the table and append to it: every row committed once."""
    loc = store_location
    pids = _in_processes(_append_worker, [(loc.url, dict(loc.storage_options), w) for w in range(WORKERS)])
    assert len(set(pids)) == WORKERS
    steps = snapshot_rows(loc, "steps").column("step").to_pylist()
    assert len(steps) == WORKERS * COMMITS * ROWS  # rows committed == rows written
    assert sorted(steps) == list(range(WORKERS * COMMITS * ROWS))  # none duplicated, none lost
    assert len(snapshot_files(loc, "steps")) == WORKERS * COMMITS
    assert delta.snapshot(loc, "steps").version == WORKERS * COMMITS  # version 0 made the table, once


RACED_TABLES = ("steps", "layer_steps", "runs", "layers")


def _create_at(url: str, options: dict, start: float) -> int:
    loc = StoreLocation(url, options)
    for i, table in enumerate(RACED_TABLES):
        while time.time() < start + i:  # every process tries at the same moment, a table a second
            pass
        delta.create_table(loc, table)
    return os.getpid()


def test_processes_racing_to_create_a_table_make_one_creation(store_location):
    """6 spawned processes create the same tables at one instant: each log holds version 0 only. On
    object storage delta-rs retried a lost creation as version 1 (a second metaData), seen as an
    extra version in a loaded CI run; a lost creation now opens the winner's table."""
    loc = store_location
    start = time.time() + 6  # after every process has imported moescope
    pids = _in_processes(_create_at, [(loc.url, dict(loc.storage_options), start)] * 6)
    assert len(set(pids)) == 6
    assert {table: delta.snapshot(loc, table).version for table in RACED_TABLES} == dict.fromkeys(RACED_TABLES, 0)


# -- object storage: faults and refusals ---------------------------------------------------------------

@pytest.mark.parametrize("app_unseen", [False, True], ids=["looked-for", "unseen"])
def test_an_ambiguous_commit_is_not_committed_twice(s3_store, app_unseen):
    """The commit's PUT reaches the server but the client is told 503: the retry finds the writer's
    app transaction in the log and does not add the file a second time; also when the first try
    did not look for it (app_unseen: a writer's own app id)."""
    from tests.support.s3faults import FaultProxy

    loc = s3_store
    part = delta.write_part(loc, "steps", "r", steps_rows("r", 0, 10), "part-0.parquet")
    delta.commit(loc, "steps", [part], app=("writer", 1))
    endpoint = loc.storage_options["AWS_ENDPOINT_URL"]
    with FaultProxy(endpoint) as proxy:
        through = StoreLocation(loc.url, {**loc.storage_options, "AWS_ENDPOINT_URL": proxy.url})
        second = delta.write_part(through, "steps", "r", steps_rows("r", 10, 10), "part-1.parquet")
        proxy.set_faults(slowdown_every=1, methods=("PUT",), path_contains="_delta_log/", after_forward=True,
                         budget=1)
        version = delta.commit(through, "steps", [second], app=("writer", 2), app_unseen=app_unseen)
        assert proxy.counts()["faults"] == {"slowdown": 1}  # the commit's answer really was lost once
    assert version == 2
    log_keys = [k for k in s3_store_keys(loc) if "/steps/_delta_log/" in k and k.endswith(".json")]
    assert len(log_keys) == 3  # versions 0, 1, 2: the retried commit made no version 3
    assert sorted(snapshot_rows(loc, "steps").column("step").to_pylist()) == list(range(20))


def test_a_writers_commit_reads_no_more_of_the_log_as_it_grows(s3_store):
    """A commit of a writer's own app id (app_unseen) does not read the log entries since the last
    checkpoint to look for it: through S3, that was a GET per entry, up to 49 per commit. Counted
    at the server's door (a proxy), on a table of 20 versions without a checkpoint."""
    from tests.support.s3faults import FaultProxy

    loc = s3_store
    with FaultProxy(loc.storage_options["AWS_ENDPOINT_URL"]) as proxy:
        through = StoreLocation(loc.url, {**loc.storage_options, "AWS_ENDPOINT_URL": proxy.url})
        for seq in range(1, 20):  # the writer's table is open (its state read) from the first commit on
            part = delta.write_part(through, "steps", "r", steps_rows("r", seq * 10, 10), f"part-{seq}.parquet")
            delta.commit(through, "steps", [part], app=("writer", seq), app_unseen=True)
        part = delta.write_part(through, "steps", "r", steps_rows("r", 200, 10), "part-20.parquet")
        proxy.reset_counts()
        assert delta.commit(through, "steps", [part], app=("writer", 20), app_unseen=True) == 20
        log_reads = [path for method, path, _ in proxy.log() if method == "GET" and path.endswith(".json")]
    assert len(log_reads) <= 6, log_reads  # the new entry and the table's state, not the 19 before it
    assert sorted(snapshot_rows(loc, "steps").column("step").to_pylist()) == list(range(10, 210))


def s3_store_keys(loc: StoreLocation) -> list[str]:
    import boto3

    bucket, _, prefix = loc.url.split("://", 1)[1].partition("/")
    client = boto3.client("s3", endpoint_url=loc.storage_options["AWS_ENDPOINT_URL"],
                          region_name=loc.storage_options["AWS_REGION"])
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys.extend(item["Key"] for item in page.get("Contents", ()))
    return keys


def test_a_missing_bucket_is_named_with_what_to_do(s3_store):
    missing = StoreLocation("s3://no-such-bucket/fleet", s3_store.storage_options)
    with pytest.raises(delta.StoreAccessError) as raised:
        delta.check_store(missing)
    message = str(raised.value)
    assert "s3://no-such-bucket/fleet" in message and "bucket does not exist" in message
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in message
    part = delta.PartFile("run_id=r/part-0.parquet", 1, 1, "r")
    with pytest.raises(StoreError, match="s3://no-such-bucket/fleet/steps"):
        delta.commit(missing, "steps", [part])


def test_wrong_credentials_are_named_without_the_secret(s3_store, monkeypatch):
    wrong = "wrong-secret-0123456789"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    started = time.monotonic()
    with pytest.raises(delta.StoreAccessError) as raised:
        delta.check_store(s3_store)
    assert time.monotonic() - started < 10  # refused at once, not after minutes of retries
    message = str(raised.value)
    assert s3_store.url in message and "credentials were refused" in message and "AWS_SECRET_ACCESS_KEY" in message
    assert wrong not in message and repr(wrong) not in repr(raised.value)
    with pytest.raises(StoreError) as committed:
        delta.commit(s3_store, "steps", [delta.PartFile("run_id=r/part-0.parquet", 1, 1, "r")])
    assert s3_store.url in str(committed.value) and wrong not in str(committed.value)


def test_a_store_of_the_previous_release_is_refused_naming_the_upgrade(tmp_path):
    old = tmp_path / "steps" / "run_id=r"
    old.mkdir(parents=True)
    pq.write_table(steps_rows("r", 0, 3), old / "part-00000-1-000001-1.parquet")
    assert delta.legacy_tables(tmp_path) == ["steps"]
    with pytest.raises(delta.LegacyStoreError, match=f"moescope store upgrade {tmp_path}"):
        delta.check_store(tmp_path)
    fresh = tmp_path / "fresh"
    delta.commit(fresh, "steps", [delta.write_part(fresh, "steps", "r", steps_rows("r", 0, 3), "part-0.parquet")])
    assert delta.legacy_tables(fresh) == []
    delta.check_store(fresh)
