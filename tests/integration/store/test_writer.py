"""The run writer: back-pressure (`block` loses nothing and makes the model wait; `drop` never waits
and counts every row it drops, per table, in probe_stats), a failed write or commit counted and
never visible, one writer per (store, run, rank), one Delta commit per table per flush, hosts in
probe_stats, runs and part names, and a store that cannot be used refused when the writer opens.

Rows are counted from the raw Parquet files of each table's Delta snapshot (tests/integration/store/test_delta.py's
`snapshot_rows`), never through moescope's readers."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from moescope.core.pipeline import BatchProcessor, record_rows
from moescope.core.runs import current_host
from moescope.store import delta
from moescope.store.errors import StoreError
from moescope.store.exporter import DeltaExporter
from moescope.store.location import StoreLocation
from moescope.store.naming import host_name_part
from tests.support.deltafiles import latest_probe_stats, snapshot_files, snapshot_rows
from tests.support.store_records import make_record, run_info


class SlowDisk:
    """The real Delta exporter behind a disk that takes `delay_s` per batch."""

    def __init__(self, exporter: DeltaExporter, delay_s: float):
        self.exporter, self.delay_s = exporter, delay_s

    def export(self, records):
        time.sleep(self.delay_s)
        return self.exporter.export(records)

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return self.exporter.force_flush(timeout_s)

    def shutdown(self) -> None:
        self.exporter.shutdown()


def _emit(policy: str, root, n: int = 60):
    rng = np.random.default_rng(0)
    records = [make_record("r", step, rng) for step in range(n)]
    processor = BatchProcessor([], max_queue=2, policy=policy, flush_interval_s=0.2, max_batch=1)
    exporter = DeltaExporter(root, run_info("r"), max_age_s=0.2, processor=processor)
    processor.add_exporter(SlowDisk(exporter, 0.01))
    started = time.perf_counter()
    for record in records:
        processor.emit(record)
    emit_s = time.perf_counter() - started
    processor.shutdown()
    return records, processor, emit_s


def _written(root, table: str) -> int:
    return snapshot_rows(root, table).num_rows


def _stat(stats: list[dict], table: str, reason: str | None, column: str = "dropped_rows") -> int:
    return sum(s[column] for s in stats if s["table_name"] == table and s["reason"] == reason)


def test_block_policy_is_lossless_and_waits(tmp_path):
    records, processor, emit_s = _emit("block", tmp_path)
    assert sum(processor.dropped_records.values()) == 0
    for table in ("steps", "layer_steps", "routes"):
        assert _written(tmp_path, table) == sum(record_rows(r).get(table, 0) for r in records)
    assert emit_s >= 0.01 * (len(records) - 4)  # the model waited for the disk
    stats = latest_probe_stats(tmp_path, "r")
    assert stats and sum(s["dropped_rows"] for s in stats) == 0


def test_drop_policy_never_waits_and_counts_every_row(tmp_path):
    records, processor, emit_s = _emit("drop", tmp_path)
    assert processor.dropped_records["queue_full"] > 0
    assert emit_s < 0.01 * len(records) / 2
    stats = latest_probe_stats(tmp_path, "r")
    for table in ("steps", "layer_steps", "routes"):
        emitted = sum(record_rows(r).get(table, 0) for r in records)
        dropped = _stat(stats, table, "queue_full")
        assert dropped > 0
        assert _written(tmp_path, table) + dropped == emitted, table
        assert _stat(stats, table, None, "written_rows") == _written(tmp_path, table)
    assert _stat(stats, "steps", "queue_full", "dropped_records") == processor.dropped_records["queue_full"]


def test_drop_counts_are_durable_before_shutdown(tmp_path):
    processor = BatchProcessor([], max_queue=1, policy="drop", flush_interval_s=0.1, max_batch=1)
    exporter = DeltaExporter(tmp_path, run_info("r"), max_age_s=0.1, processor=processor)
    processor.add_exporter(SlowDisk(exporter, 0.05))
    rng = np.random.default_rng(1)
    for step in range(20):
        processor.emit(make_record("r", step, rng))
    assert processor.force_flush(10)
    # a crash now would lose nothing of the accounting: the counts are already committed
    stats = latest_probe_stats(tmp_path, "r")
    dropped = sum(n for (table, _), n in processor.dropped_rows.items() if table == "steps")
    assert sum(s["dropped_rows"] for s in stats if s["table_name"] == "steps") == dropped > 0
    processor.shutdown()


def test_a_failed_write_is_counted_and_leaves_nothing_visible(tmp_path):
    exporter = DeltaExporter(tmp_path, run_info("r"), max_age_s=100)
    rng = np.random.default_rng(2)
    record = make_record("r", 0, rng)
    exporter.export([record])
    blocker = tmp_path / "routes"  # nothing flushed yet: the folder does not exist
    blocker.write_text("a file where the routes folder should be: every write under it fails")
    exporter.shutdown()
    assert exporter.dropped_rows[("routes", "write_failed")] == record_rows(record)["routes"]
    blocker.unlink()
    stats = latest_probe_stats(tmp_path, "r")
    assert _stat(stats, "routes", "write_failed") == record_rows(record)["routes"]
    assert _written(tmp_path, "routes") == 0


def test_a_file_whose_commit_failed_is_counted_lost_and_never_read(tmp_path, monkeypatch):
    """The file is written, its commit refused: its rows are counted as write_failed, and no reader
    of the snapshot sees them (no torn or uncounted rows), although the file is on disk."""
    import moescope.store.writer as writer_module

    real_commit = delta.commit
    refused: list[str] = []

    def commit(loc, table, adds=(), *args, **kwargs):
        if table == "steps" and not refused:
            refused.extend(p.path for p in adds)
            raise delta.CommitError("moescope: the test refused this commit")
        return real_commit(loc, table, adds, *args, **kwargs)

    monkeypatch.setattr(writer_module.delta, "commit", commit)
    rng = np.random.default_rng(4)
    records = [make_record("r", step, rng) for step in range(3)]
    exporter = DeltaExporter(tmp_path, run_info("r"), max_age_s=100)
    exporter.export(records[:1])
    exporter.force_flush()  # this flush's steps commit is refused
    exporter.export(records[1:])
    exporter.shutdown()
    assert len(refused) == 1 and (tmp_path / "steps" / refused[0]).exists()  # the orphan is on disk...
    steps = snapshot_rows(tmp_path, "steps").column("step").to_pylist()
    assert sorted(steps) == [1, 2]  # ...and not in the table
    stats = latest_probe_stats(tmp_path, "r")
    assert _stat(stats, "steps", "write_failed") == 1
    assert _stat(stats, "steps", None, "written_rows") == 2


def test_policy_must_be_known():
    with pytest.raises(ValueError, match="policy"):
        BatchProcessor([], policy="sometimes")


def test_rank_host_and_pid_in_file_names(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESCOPE_HOST", "gpu node/7")  # not a file name as it is: sanitised
    exporter = DeltaExporter(tmp_path, run_info("r", rank=3, world_size=4))
    exporter.shutdown()
    names = [p.name for p in tmp_path.rglob("part-*.parquet")]
    assert names and all(n.startswith(f"part-00003-gpu_node_7-{os.getpid()}-") for n in names)


class GatedDisk:
    """An exporter that holds each batch until the test opens the gate, as a stalled disk does."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.exporting = threading.Event()
        self.records: list = []

    def export(self, records):
        self.exporting.set()
        self.gate.wait(30)
        self.records.extend(records)
        return True

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def _nbytes(value) -> int:
    """Bytes of every numpy array reachable from a record (the test's own walk)."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if hasattr(value, "__dict__"):
        return sum(_nbytes(v) for v in vars(value).values())
    return 0


def _large_records(n: int) -> list:
    """n records of 3 layers x 2048 tokens of routes (the same arrays: each record counts them all)."""
    base = make_record("r", 0, np.random.default_rng(3), tokens=2048)
    return [dataclasses.replace(base, step=step) for step in range(n)]


def test_drop_policy_bounds_the_queue_by_bytes(tmp_path):
    records = _large_records(10)
    size = _nbytes(records[0])
    assert size > 100_000 and all(_nbytes(r) == size for r in records)
    disk = GatedDisk()
    processor = BatchProcessor([disk], max_queue=1000, policy="drop", max_batch=1, flush_interval_s=0.1,
                               max_queue_bytes=int(3.5 * size))
    exporter = DeltaExporter(tmp_path, run_info("r"), processor=processor)
    processor.emit(records[0])
    assert disk.exporting.wait(10)  # the writer holds record 0 in a stalled export
    started = time.perf_counter()
    for record in records[1:]:
        processor.emit(record)
    assert time.perf_counter() - started < 1.0  # never waited
    # record 0 in the stalled export, two more in the queue: 3 fit in 3.5 records' bytes, 7 do not
    assert processor.dropped_records == {"queue_bytes_full": 7}
    for table in ("steps", "layer_steps", "routes"):
        assert processor.dropped_rows[(table, "queue_bytes_full")] == sum(record_rows(r)[table] for r in records[3:])
    disk.gate.set()
    processor.add_exporter(exporter)
    processor.shutdown()
    assert [r.step for r in disk.records] == [0, 1, 2]
    stats = latest_probe_stats(tmp_path, "r")
    assert _stat(stats, "routes", "queue_bytes_full") == sum(record_rows(r)["routes"] for r in records[3:])


def test_block_policy_waits_for_queue_bytes_and_loses_nothing():
    records = _large_records(10)
    size = _nbytes(records[0])
    disk = GatedDisk()
    processor = BatchProcessor([disk], max_queue=1000, policy="block", max_batch=1, flush_interval_s=0.1,
                               max_queue_bytes=int(3.5 * size))
    returned: list[int] = []

    def model() -> None:
        for record in records:
            processor.emit(record)
            returned.append(record.step)

    thread = threading.Thread(target=model)
    thread.start()
    time.sleep(0.5)
    assert returned == [0, 1, 2], "the model waits once 3.5 records' bytes are held"
    disk.gate.set()
    thread.join(30)
    processor.shutdown()
    assert returned == list(range(10)) and [r.step for r in disk.records] == list(range(10))
    assert not processor.dropped_records


def test_a_record_larger_than_the_byte_bound_still_passes_an_empty_queue():
    [record] = _large_records(1)
    disk = GatedDisk()
    disk.gate.set()
    processor = BatchProcessor([disk], policy="drop", max_queue_bytes=1000)
    processor.emit(record)
    processor.shutdown()
    assert disk.records == [record] and not processor.dropped_records


def test_wait_idle_returns_once_every_record_handed_over_is_exported_without_a_flush():
    records = _large_records(4)
    disk = GatedDisk()
    flushes: list[float] = []
    disk.force_flush = lambda timeout_s=30.0: flushes.append(timeout_s) or True
    processor = BatchProcessor([disk], max_batch=1, flush_interval_s=60)
    for record in records:
        processor.emit(record)
    assert disk.exporting.wait(5)
    assert not processor.wait_idle(timeout_s=0.2), "a batch is still held by the stalled disk"
    disk.gate.set()
    assert processor.wait_idle(timeout_s=30)
    assert [r.step for r in disk.records] == [0, 1, 2, 3] and not flushes  # exported, not flushed
    processor.shutdown()
    assert processor.wait_idle(timeout_s=0.1)  # closed: nothing is pending


def test_exporter_buffers_are_bounded_by_bytes(tmp_path):
    records = _large_records(6)
    route_bytes = _nbytes([ls.routes for ls in records[0].layers])
    exporter = DeltaExporter(tmp_path, run_info("r"), max_age_s=1e9, max_bytes=int(2.5 * route_bytes))
    for record in records:
        exporter.export([record])
    # 6 records' routes in parts of 3 (the third crosses 2.5 records' bytes): written before any age or row limit
    parts = snapshot_files(StoreLocation(str(tmp_path)), "routes")
    per_record = record_rows(records[0])["routes"]
    assert [p["num_records"] for p in parts] == [3 * per_record, 3 * per_record]
    exporter.shutdown()


def _event(run_id: str = "run-a") -> dict:
    import datetime as dt

    return dict(run_id=run_id, ts=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc), step=3, layer=1, expert=2,
                old_weight=1.0, new_weight=0.0, score=12.5, reason="test", source="manual", rank=0)


def test_run_writer_owns_schema_naming_and_failure_counts(tmp_path):
    """Every writer of a process shares one sequence of part names; rows take the table's schema;
    a refused write is counted once, through the callback, unless the caller keeps the rows."""
    from moescope.store.writer import run_writer

    drops = []
    with run_writer(tmp_path, "run-a") as a, run_writer(tmp_path, "run-b") as b:
        assert a.write("trust_gate_events", [_event()], on_dropped=lambda *d: drops.append(d))
        assert b.write("trust_gate_events", [_event("run-b")])
        assert len({os.path.basename(f) for f in a.files + b.files}) == 2  # one sequence, two names
        table = pq.read_table(a.files[0])
        assert table.schema.field("layer").type == "int32" and table.column("score").to_pylist() == [12.5]
        (tmp_path / "expert_health").write_text("a file where the table's folder should be")
        row = dict(run_id="run-a", layer=0, expert=0)
        assert not a.write("expert_health", [row], on_dropped=lambda *d: drops.append(d))
        assert drops == [("expert_health", "write_failed", 1)] and "Error" in a.last_error
        assert not a.write("expert_health", [row], retried=True)
        assert drops == [("expert_health", "write_failed", 1)]  # kept by the caller: not counted again
        assert not a.write("expert_health", [row])  # no callback: the writer counts it itself
        assert a.drop_counts()[0] == {("expert_health", "write_failed"): 1}
        assert a.written_rows == {"trust_gate_events": 1}


def test_one_writer_per_store_run_and_rank_shared_and_reference_counted(tmp_path):
    from moescope.store.writer import open_writers, run_writer

    first = run_writer(tmp_path, "r")
    again = run_writer(os.path.join(str(tmp_path), "."), "r")  # the same store, spelled differently
    other_rank = run_writer(tmp_path, "r", rank=1)
    assert again is first and other_rank is not first
    assert first.write("trust_gate_events", [_event("r")])
    first.release()
    assert first in open_writers() and not first.closed  # one reference left
    again.release()
    assert first.closed and first not in open_writers()
    other_rank.release()
    stats = snapshot_rows(tmp_path, "probe_stats").to_pylist()
    assert {(s["rank"], s["table_name"], s["written_rows"]) for s in stats} == {(0, "trust_gate_events", 1)}
    with run_writer(tmp_path, "r") as reopened:  # a run opened again in the process counts on
        assert reopened is not first and reopened.written_rows["trust_gate_events"] == 1


def test_emitted_rows_are_written_on_the_writers_thread_and_a_failure_is_counted(tmp_path, monkeypatch):
    import moescope.store.writer as writer_module

    threads = []
    real = delta.write_part

    def spy(loc, table, *args, **kwargs):
        threads.append((table, threading.current_thread().name))
        return real(loc, table, *args, **kwargs)

    monkeypatch.setattr(writer_module.delta, "write_part", spy)
    with writer_module.run_writer(tmp_path, "r") as writer:
        writer.emit("trust_gate_events", [_event("r")])
        writer.emit("trust_gate_events", [_event("r")])
        assert writer.flush(10)
        assert {name for table, name in threads if table == "trust_gate_events"} == {"moescope-run-writer"}
        assert _written(tmp_path, "trust_gate_events") == 2
        (tmp_path / "expert_health").write_text("a file where the table's folder should be")
        writer.emit("expert_health", [dict(run_id="r", layer=0, expert=0)] * 3)
        assert writer.flush(10)
        assert writer.drop_counts()[0] == {("expert_health", "write_failed"): 3}
    stats = [s for s in latest_probe_stats(tmp_path, "r") if s["reason"] == "write_failed"]
    assert [(s["table_name"], s["dropped_rows"]) for s in stats] == [("expert_health", 3)]
    writer.emit("trust_gate_events", [_event("r")])  # after the last release: counted, never silent
    assert writer.drop_counts()[0][("trust_gate_events", "closed")] == 1


def test_refused_rows_go_back_to_a_producer_that_takes_them_and_are_not_counted_lost(tmp_path):
    from moescope.store.writer import run_writer

    (tmp_path / "trust_gate_events").write_text("no room: a file where the table's folder should be")
    refused = []
    with run_writer(tmp_path, "r") as writer:
        writer.emit("trust_gate_events", [_event("r")], on_refused=refused.append)
        assert writer.flush(10)
        assert [t.num_rows for t in refused] == [1] and "Error" in writer.last_error
        assert not writer.drop_counts()[0]  # handed back, not lost
        (tmp_path / "trust_gate_events").unlink()
        writer.emit("trust_gate_events", refused.pop(), on_refused=refused.append)
        assert writer.flush(10) and not refused and writer.last_error is None
    assert _written(tmp_path, "trust_gate_events") == 1


def test_a_training_run_with_trust_gate_and_cooldown_opens_one_writer_for_every_table(tmp_path, monkeypatch):
    """The probe's tables, health and gate events, cooldown events, alerts and train_steps of one run
    all go through one writer, which counts them all in the run's probe_stats."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    import moescope.store.writer as writer_module
    from moescope import training

    opened = []
    real_init = writer_module.RunWriter.__init__

    def counted(self, key, counts, location=None):
        opened.append(key)
        real_init(self, key, counts, location)

    monkeypatch.setattr(writer_module.RunWriter, "__init__", counted)
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = training.watch(model, optimizer, store=tmp_path, trust_gate="auto", cooldown="auto", routes=True)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for step in range(4):
        if step == 2:
            monitor.session.trust.override(0, 1, 0.5, "an operator's override")  # a gate event and its alert
            monitor.cooldown.actuator.start(0, factor=0.5, epsilon=0.01)  # a cooldown event and its alert
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    run_id = monitor.session.run.run_id
    assert opened == [(os.path.abspath(tmp_path), run_id, 0)]
    assert [w for w in writer_module.open_writers() if w.run_id == run_id] == []  # given back at close
    tables = {"runs", "layers", "steps", "layer_steps", "routes", "expert_health", "trust_gate_events",
              "routing_cooldown_events", "alerts", "train_steps", "run_ends"}
    host = host_name_part(current_host())
    on_disk = {}
    for table in tables:
        for action in snapshot_files(StoreLocation(str(tmp_path)), table):
            assert action["path"].startswith(f"run_id={run_id}/part-00000-{host}-{os.getpid()}-")
            on_disk[table] = on_disk.get(table, 0) + action["num_records"]
    assert tables <= set(on_disk)
    stats = latest_probe_stats(tmp_path, run_id)
    assert {s["host"] for s in stats} == {current_host()}
    counted_rows = {s["table_name"]: s["written_rows"] for s in stats if s["reason"] is None}
    assert {table: counted_rows.get(table) for table in tables} == {table: on_disk[table] for table in tables}
    assert {table: _written(tmp_path, table) for table in tables} == on_disk  # and the files hold those rows


# -- the store: where it is, who writes it, and what it refuses -------------------------------------

def test_a_writer_writes_a_folder_and_an_s3_store_alike(store_location, monkeypatch):
    """The probe's exporter through the run's writer, on both kinds of store: every row committed,
    counted in probe_stats with the writer's host, the runs row with its host too."""
    monkeypatch.setenv("MOESCOPE_HOST", "host-a")
    rng = np.random.default_rng(5)
    records = [make_record("r", step, rng) for step in range(4)]
    exporter = DeltaExporter(store_location, run_info("r", rank=1, world_size=2), max_age_s=1e9)
    exporter.export(records[:2])
    exporter.force_flush()
    exporter.export(records[2:])
    exporter.shutdown()
    for table in ("steps", "layer_steps", "routes"):
        assert _written(store_location, table) == sum(record_rows(r)[table] for r in records), table
    stats = latest_probe_stats(store_location, "r")
    assert {(s["host"], s["rank"], s["pid"]) for s in stats} == {("host-a", 1, os.getpid())}
    assert _stat(stats, "routes", None, "written_rows") == sum(record_rows(r)["routes"] for r in records)
    [run] = snapshot_rows(store_location, "runs").to_pylist()
    assert (run["run_id"], run["host"], run["rank"]) == ("r", "host-a", 1)
    # two flushes, one commit per table each: the routes table holds two files (versions 1 and 2)
    assert len(snapshot_files(store_location, "routes")) == 2
    assert delta.snapshot(store_location, "routes").version == 2


def test_one_commit_per_table_per_flush(tmp_path):
    from deltalake import DeltaTable

    rng = np.random.default_rng(6)
    exporter = DeltaExporter(tmp_path, run_info("r"), max_age_s=1e9)
    exporter.export([make_record("r", step, rng) for step in range(5)])
    exporter.force_flush()
    for table in ("steps", "layer_steps", "routes"):
        log = DeltaTable(str(tmp_path / table)).history()
        assert [h["operation"] for h in reversed(log)] == ["CREATE TABLE", "WRITE"], table
    exporter.shutdown()


def test_the_pipelines_drain_commits_the_last_parts_the_run_end_and_the_counts_in_one_round(tmp_path):
    from deltalake import DeltaTable

    rng = np.random.default_rng(7)
    processor = BatchProcessor([], flush_interval_s=60)
    exporter = DeltaExporter(tmp_path, run_info("r"), max_age_s=1e9, processor=processor)
    processor.add_exporter(exporter)
    for step in range(3):
        processor.emit(make_record("r", step, rng))
    processor.count_dropped_rows("steps", "ring_full", 5)  # the counts changed: a last flush would write them
    processor.shutdown()
    # told that the pipeline drains, the exporter did its shutdown's work in that last flush: each
    # table one commit, probe_stats written once (a last flush and then a shutdown write it twice)
    for table in ("steps", "layer_steps", "routes", "run_ends", "probe_stats"):
        log = DeltaTable(str(tmp_path / table)).history()
        assert [h["operation"] for h in reversed(log)] == ["CREATE TABLE", "WRITE"], table
    assert _written(tmp_path, "steps") == 3
    assert snapshot_rows(tmp_path, "run_ends").to_pylist()[0]["last_step"] == 2
    assert _stat(latest_probe_stats(tmp_path, "r"), "steps", "ring_full") == 5


def test_a_run_writer_is_one_per_store_url_run_and_rank(tmp_path, s3_store):
    from moescope.store.writer import run_writer

    local = run_writer(tmp_path, "r")
    same = run_writer(StoreLocation(os.path.abspath(tmp_path)), "r")
    remote = run_writer(s3_store, "r")
    remote_again = run_writer(s3_store.url, "r", storage_options=dict(s3_store.storage_options))
    try:
        assert same is local and remote_again is remote and remote is not local
        assert (remote.root, remote.run_id, remote.rank) == (s3_store.url, "r", 0)
        assert remote.write("trust_gate_events", [_event("r")])
        [action] = snapshot_files(s3_store, "trust_gate_events")
        assert remote.files == [f"{s3_store.url}/trust_gate_events/{action['path']}"]
    finally:
        for writer in (local, same, remote, remote_again):
            writer.release()
    assert _written(s3_store, "trust_gate_events") == 1 and _written(tmp_path, "trust_gate_events") == 0


def test_attach_to_a_missing_bucket_fails_at_once_naming_the_url_not_the_secret(s3_store):
    import moescope
    from tests.support.zoo import tiny_model

    model = tiny_model("mixtral")
    missing = StoreLocation("s3://no-such-bucket/fleet", s3_store.storage_options)
    started = time.monotonic()
    with pytest.raises(StoreError) as raised:
        moescope.attach(model, store=missing)
    assert time.monotonic() - started < 10
    message = str(raised.value)
    assert "s3://no-such-bucket/fleet" in message and "bucket does not exist" in message
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in message
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())  # left as it was


def test_wrong_credentials_fail_when_the_writer_opens_naming_the_url_not_the_secret(s3_store, monkeypatch):
    from moescope.store.writer import open_writers

    wrong = "not-the-secret-9876543210"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    other = StoreLocation(s3_store.url + "/elsewhere", s3_store.storage_options)  # not checked yet this process
    with pytest.raises(delta.StoreAccessError) as raised:
        DeltaExporter(other, run_info("r"))
    message = str(raised.value)
    assert other.redacted in message and "credentials were refused" in message and wrong not in message
    assert not [w for w in open_writers() if w.root == other.url]


def test_a_store_of_the_previous_release_is_refused_for_writing(tmp_path):
    import pyarrow as pa

    from moescope.store.writer import run_writer

    old = tmp_path / "steps" / "run_id=r"
    old.mkdir(parents=True)
    pq.write_table(pa.table({"run_id": ["r"], "step": [0]}), old / "part-00000-1-000001-1.parquet")
    with pytest.raises(delta.LegacyStoreError) as raised:
        run_writer(tmp_path, "new-run")
    assert f"moescope store upgrade {tmp_path}" in str(raised.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps"]  # nothing written, nothing converted
    assert sorted(p.name for p in old.iterdir()) == ["part-00000-1-000001-1.parquet"]


def test_the_runs_rows_are_written_once_when_two_threads_retry_them(tmp_path, monkeypatch):
    """on_attach writes a run's own rows on the caller's thread and export/force_flush retry them on
    the pipeline's: with a slow first commit both once committed them (8 writers on S3: every rank's
    runs and layers rows twice)."""
    exporter = DeltaExporter(tmp_path, max_age_s=0.0)
    real_write = exporter._write

    def slow_write(table, data, retried=False):
        time.sleep(0.3)  # a slow object store's commit
        return real_write(table, data, retried=retried)

    monkeypatch.setattr(exporter, "_write", slow_write)
    run = run_info("r")
    attaching = threading.Thread(target=exporter.on_attach, args=(run,))
    attaching.start()
    time.sleep(0.05)
    exporter.force_flush()  # the pipeline's thread, while the attach's first write is in flight
    attaching.join()
    exporter.shutdown()
    assert snapshot_rows(tmp_path, "runs").num_rows == 1
    assert snapshot_rows(tmp_path, "layers").num_rows == len(run.layers)


def test_route_files_carry_the_encodings_the_layout_names_and_page_checksums(tmp_path):
    """Parquet settings name a nested column's leaf: the expert ids (a list) are dictionary encoded
    and the gate weights split by byte stream, not only named so; token numbers are delta encoded.
    Every page still carries its checksum (a damaged page is detected, `store.quarantine`)."""
    rng = np.random.default_rng(9)
    exporter = DeltaExporter(tmp_path, run_info("r"), max_age_s=1e9)
    exporter.export([make_record("r", step, rng, tokens=64) for step in range(4)])
    exporter.shutdown()
    [part] = delta.snapshot(str(tmp_path), "routes", with_stats=True).files
    path = tmp_path / "routes" / part.path
    group = pq.ParquetFile(path).metadata.row_group(0)
    encodings = {group.column(i).path_in_schema: set(group.column(i).encodings) for i in range(group.num_columns)}
    assert "RLE_DICTIONARY" in encodings["expert_ids.list.element"]
    assert "BYTE_STREAM_SPLIT" in encodings["gate_weights.list.element"]
    assert "DELTA_BINARY_PACKED" in encodings["token_id"] and "DELTA_BINARY_PACKED" in encodings["token"]
    assert "RLE_DICTIONARY" in encodings["layer"]
    # min/max on the top-level columns (Delta's stats and DuckDB's pruning read them), none on nested leaves
    with_stats = {group.column(i).path_in_schema for i in range(group.num_columns) if group.column(i).is_stats_set}
    assert with_stats == {"step", "layer", "token", "sequence", "position", "token_id", "rank"}
    stats = json.loads(part.stats)
    assert (stats["minValues"]["step"], stats["maxValues"]["step"]) == (0, 3)
    assert (stats["minValues"]["token"], stats["maxValues"]["token"]) == (0, 63)
    assert pq.read_table(path, page_checksum_verification=True).num_rows == 4 * 3 * 64
    token_ids = group.column(5)
    assert token_ids.path_in_schema == "token_id"
    with open(path, "r+b") as f:  # one flipped bit in the token ids' data: the page checksum catches it
        f.seek(token_ids.data_page_offset + token_ids.total_compressed_size - 8)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(OSError):
        pq.read_table(path, page_checksum_verification=True)
