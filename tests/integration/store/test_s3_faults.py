"""A probe session writing to S3 through the faults a real bucket has: 503 SlowDown, connection
resets, 2 s latency (tests/support/s3faults.py between the writer and the S3 server, tests/support/s3server.py).

What must hold: the writer retries with backoff and the model's forward never waits on the store;
at the end every row the forwards produced is either in the tables' Delta snapshot or counted as
dropped in probe_stats. The expected counts come from the model's shape (forwards x layers x
tokens), the written rows from the raw Parquet files of the snapshot, found by replaying the Delta
log's JSON commits ourselves and read with pyarrow through the S3 API, never from moescope's own
readers. A bucket that does not exist and wrong credentials are refused at attach, with a message
that names the URL and never the secret.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
import uuid

import pyarrow.parquet as pq
import pytest
import torch

import moescope
from moescope.store.errors import StoreError
from tests.support.s3faults import FaultProxy
from tests.support.zoo import tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BATCH, SEQ = 2, 8
MADE = ("steps", "layer_steps", "routes")  # the tables whose rows per forward the model's shape fixes
LATENCY_S = 2.0  # what the proxy adds to every request: a forward that waited on one would take this long


def _live_files(s3, loc, table: str) -> list[str]:
    """The table's live data files (paths relative to the table) at its latest version: every JSON
    commit of `_delta_log/`, listed and read through the S3 API, replayed in order ([] when the
    table was never made)."""
    prefix = f"{loc.url.split('/', 3)[3]}/{table}/_delta_log/"
    client = s3.client()
    commits = sorted(k for k in s3.keys(prefix) if k.endswith(".json") and k[len(prefix):-5].isdigit())
    assert [int(k[len(prefix):-5]) for k in commits] == list(range(len(commits))), "a gap in the log"
    live: set[str] = set()
    for key in commits:
        for line in client.get_object(Bucket=s3.bucket, Key=key)["Body"].read().decode().splitlines():
            action = json.loads(line)
            if "add" in action:
                live.add(action["add"]["path"])
            elif "remove" in action:
                live.discard(action["remove"]["path"])
    if commits:  # delta-rs's own view of the same version agrees with our replay of the log
        from deltalake import DeltaTable

        uris = DeltaTable(loc.table_uri(table), storage_options=dict(loc.storage_options)).file_uris()
        assert sorted(u.removeprefix(f"{loc.table_uri(table)}/") for u in uris) == sorted(live), table
    return sorted(live)


def _rows_in_snapshot(s3, loc, table: str) -> int:
    """Rows of the table's snapshot, counted from the raw Parquet files read with pyarrow over S3."""
    filesystem = loc.filesystem()
    return sum(pq.read_table(loc.join(table, path), filesystem=filesystem).num_rows
               for path in _live_files(s3, loc, table))


def _stored_probe_stats(s3, loc) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """The writer's last probe_stats rows in the store (read raw): rows written per table, and rows
    dropped per (table, reason)."""
    filesystem = loc.filesystem()
    rows = [row for path in _live_files(s3, loc, "probe_stats")
            for row in pq.read_table(loc.join("probe_stats", path), filesystem=filesystem).to_pylist()]
    last = [r for r in rows if r["ts"] == max(row["ts"] for row in rows)]
    written = {r["table_name"]: r["written_rows"] for r in last if r["reason"] is None}
    return written, {(r["table_name"], r["reason"]): r["dropped_rows"] for r in last if r["reason"]}


def _forwards(model, count: int, generator: torch.Generator) -> list[float]:
    """Run `count` forwards; returns each one's wall time."""
    times = []
    with torch.no_grad():
        for _ in range(count):
            tokens = torch.randint(0, 128, (BATCH, SEQ), generator=generator)
            started = time.perf_counter()
            model(tokens)
            times.append(time.perf_counter() - started)
    return times


@pytest.fixture
def proxied(s3_env, request):
    """A fault proxy in front of the S3 server and a store location on a fresh prefix reached through it."""
    prefix = s3_env.fresh_prefix(request.node.name)
    with FaultProxy(s3_env.endpoint) as proxy:
        yield proxy, s3_env.location(prefix, endpoint=proxy.url)
    s3_env.delete_prefix(prefix + "/")


def _check_every_row_accounted(s3, loc, session, forwards: int, layers: int) -> dict[tuple[str, str], int]:
    """rows in the snapshot + rows counted dropped == rows the forwards made, table by table; the
    session's counts and the probe_stats rows in the store say the same. Returns the drops."""
    written, dropped = session.probe_stats()
    stored_written, stored_dropped = _stored_probe_stats(s3, loc)
    made = {"steps": forwards, "layer_steps": forwards * layers, "routes": forwards * layers * BATCH * SEQ}
    for table, rows in made.items():
        in_snapshot = _rows_in_snapshot(s3, loc, table)
        lost = sum(n for (t, _), n in dropped.items() if t == table)
        assert in_snapshot == written.get(table, 0) == stored_written.get(table, 0), table
        assert in_snapshot + lost == rows, (table, in_snapshot, lost, rows)
    assert stored_dropped == {key: n for key, n in dropped.items() if n}
    return dropped


def test_slowdowns_and_resets_cost_retries_not_rows(proxied, s3_env, caplog):
    caplog.set_level(logging.INFO)  # the writer's retry lines carry the storage's error text
    proxy, loc = proxied
    model = tiny_model("mixtral")
    generator = torch.Generator().manual_seed(0)
    session = moescope.attach(model, store=loc, routes=True, window=1, policy="drop", flush_interval_s=0.2)
    layers = len(session.layers)
    try:
        proxy.set_faults(slowdown_every=4, reset_every=7)
        forwards = 0
        for _ in range(2):
            forwards += len(_forwards(model, 5, generator))
            assert session.flush(120)
        counts = proxy.counts()
    finally:
        proxy.set_faults()  # the last flush and probe_stats at close go through cleanly
        session.close()
    assert counts["faults"].get("slowdown", 0) >= 3 and counts["faults"].get("reset", 0) >= 2
    assert counts["requests"].get("PUT", 0) >= 4  # data files and commits went through the proxy
    dropped = _check_every_row_accounted(s3_env, loc, session, forwards, layers)
    # every fault was transient and each flush waited for the retries: nothing needed to be dropped
    assert not any(dropped.values()), f"rows dropped though every fault was transient (not retried?): {dropped}"
    assert s3_env.secret_key not in caplog.text


@pytest.mark.parametrize("where", [
    "/routes/_delta_log/00000000000000000000.json",  # the PUT that creates the table
    "/routes/_delta_log/00000000000000000001.json",  # its first commit
    "/routes/run_id=",  # its first data file's upload
], ids=["create", "commit", "upload"])
def test_a_reset_at_any_step_of_a_write_is_retried(proxied, s3_env, where):
    """One connection reset, aimed at one step of the routes table's first write: the writer tries
    again and nothing is dropped."""
    proxy, loc = proxied
    model = tiny_model("mixtral")
    generator = torch.Generator().manual_seed(2)
    proxy.set_faults(reset_every=1, methods=("PUT", "POST"), path_contains=where, budget=1)
    session = moescope.attach(model, store=loc, routes=True, window=1, policy="drop", flush_interval_s=0.2)
    layers = len(session.layers)
    try:
        forwards = len(_forwards(model, 3, generator))
        assert session.flush(120)
        forwards += len(_forwards(model, 3, generator))
        assert session.flush(120)
        counts = proxy.counts()
    finally:
        proxy.set_faults()
        session.close()
    assert counts["faults"] == {"reset": 1}, counts
    dropped = _check_every_row_accounted(s3_env, loc, session, forwards, layers)
    assert not any(dropped.values()), f"rows dropped after one reset at {where}: {dropped}"


def test_forwards_never_wait_on_a_store_two_seconds_away(proxied, s3_env):
    """Every request to the store takes 2 s: the forwards go on at their own pace (policy="drop"),
    the rows the writer could not take in time are counted, and none is lost uncounted."""
    proxy, loc = proxied
    model = tiny_model("mixtral")
    generator = torch.Generator().manual_seed(1)
    baseline_session = moescope.attach(model, routes=True, window=1, policy="drop")  # the probe, no store
    try:
        _forwards(model, 5, generator)  # warm-up
        baseline = _forwards(model, 30, generator)
    finally:
        baseline_session.close()

    session = moescope.attach(model, store=loc, routes=True, window=1, policy="drop", flush_interval_s=0.05,
                              max_queue=4)
    layers = len(session.layers)
    try:
        proxy.set_faults(latency_s=LATENCY_S)
        slow = _forwards(model, 30, generator)
        proxy.set_faults(slowdown_every=5, reset_every=9, latency_s=LATENCY_S)
        slow += _forwards(model, 30, generator)
        counts = proxy.counts()
    finally:
        proxy.set_faults()
        session.close()
    assert sum(counts["requests"].values()) > 0  # the writer was talking to the slow store meanwhile
    assert max(slow) < LATENCY_S, f"a forward took {max(slow):.2f} s: it waited on the store"
    # generous (2 shared cores, other processes): a forward that waited even now and then would blow it
    assert statistics.median(slow) <= 4 * statistics.median(baseline) + 0.25, (statistics.median(slow),
                                                                              statistics.median(baseline))
    dropped = _check_every_row_accounted(s3_env, loc, session, len(slow), layers)
    # some rows were dropped (the writer could not keep up) and some written, else this proves little
    assert dropped.get(("routes", "queue_full"), 0) > 0
    assert _rows_in_snapshot(s3_env, loc, "routes") > 0


def _refused_at_attach(loc, caplog, capfd) -> str:
    model = tiny_model("mixtral")
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(StoreError) as refused:
            moescope.attach(model, store=loc, routes=True, window=1)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks
    captured = capfd.readouterr()
    return "\n".join([str(refused.value), caplog.text, captured.out, captured.err])


def test_a_bucket_that_does_not_exist_is_refused_at_attach_naming_the_url(s3_env, caplog, capfd):
    loc = s3_env.location("fleet/a", bucket="no-such-bucket")
    started = time.monotonic()
    said = _refused_at_attach(loc, caplog, capfd)
    assert time.monotonic() - started < 60
    assert "s3://no-such-bucket/fleet/a" in said
    assert s3_env.secret_key not in said and s3_env.access_key not in said.replace("s3://", "")


@pytest.mark.parametrize("wrong", ["secret", "key"])
def test_wrong_credentials_are_refused_at_attach_without_the_secret(s3_env, caplog, capfd, monkeypatch, wrong):
    secret = f"wrong-secret-{uuid.uuid4().hex}"
    if wrong == "secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    else:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000000")
    loc = s3_env.location(s3_env.fresh_prefix("creds"))
    said = _refused_at_attach(loc, caplog, capfd)
    assert loc.url in said
    assert secret not in said and s3_env.secret_key not in said
    assert s3_env.keys(loc.url.split("/", 3)[3]) == []  # nothing was written
