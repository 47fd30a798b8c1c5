"""The commit retry's two guards against a commit landing twice (store/delta/commits.py, issue 42),
each needed on its own, each staged with real faults: the fault proxy in front of the S3 server
(tests/support/s3faults.py) and the local filesystem's own refusal.

- the retry's look-up: before committing again, a retry reads the table's app transaction and does
  not commit a commit that is already in, also for a writer's own app id (`app_unseen`, whose first
  try does not look);
- `_landed`: after a failed try, whether the table holds the commit anyway: a failure that is not
  retried (any error of a local store but a conflict) still returns the landed version.

Each test is the kill of one mutation in tests/support/mutations.py (`commit-retry-skips-app-lookup`,
`commit-landed-unchecked`): without its guard the retried append lands twice, or a landed commit is
reported as failed. Expected values come from the Delta log's JSON read with pyarrow's filesystem
and the raw Parquet files the log lists (tests/support/deltafiles.py), never from moescope's readers.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
from collections.abc import Iterator

import pyarrow as pa
import pytest

from moescope.store import delta
from moescope.store.delta.tables import TABLE_CONFIGURATION
from moescope.store.location import StoreLocation
from moescope.store.schema import SCHEMAS
from tests.support.deltafiles import snapshot_rows
from tests.support.s3faults import FaultProxy

pytestmark = pytest.mark.integration

TS0 = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
ROWS = 10  # per commit
WRITER = "writer"  # the app id every commit of these tests carries
# delta-rs writes a checkpoint after the commit of this version (every `checkpointInterval` commits)
CHECKPOINTED = int(TABLE_CONFIGURATION["delta.checkpointInterval"]) - 1


def _steps(seq: int) -> pa.Table:
    """The ROWS rows of commit `seq`: steps (seq - 1) * ROWS up to seq * ROWS."""
    first = (seq - 1) * ROWS
    return pa.Table.from_pylist([dict(run_id="r", step=step, ts=TS0 + dt.timedelta(seconds=step), tokens=2 * step,
                                      rank=0, tags=[]) for step in range(first, first + ROWS)],
                                schema=SCHEMAS["steps"])


def _commit_rows(loc: StoreLocation, seqs: range) -> None:
    for seq in seqs:
        part = delta.write_part(loc, "steps", "r", _steps(seq), f"part-{seq:03d}.parquet")
        delta.commit(loc, "steps", [part], app=(WRITER, seq), app_unseen=True)


def _log(loc: StoreLocation) -> dict[int, list[dict]]:
    """Every JSON commit of the steps table's log, {version: actions}, read with pyarrow's filesystem."""
    from pyarrow import fs

    filesystem = loc.filesystem()
    found = filesystem.get_file_info(fs.FileSelector(loc.join("steps", "_delta_log")))
    commits = {}
    for info in found:
        name = info.base_name
        if info.type == fs.FileType.File and name.endswith(".json") and name[:-5].isdigit():
            with filesystem.open_input_stream(info.path) as f:
                commits[int(name[:-5])] = [json.loads(line) for line in f.read().decode().splitlines() if line]
    return commits


def _check_committed_once(loc: StoreLocation, last_seq: int) -> None:
    """The log is versions 0 (the table's creation) to `last_seq`, one commit per seq, each holding
    its app transaction; the snapshot's raw Parquet rows are each commit's rows, once."""
    log = _log(loc)
    assert sorted(log) == list(range(last_seq + 1)), f"versions {sorted(log)}: a commit landed twice"
    holders = {version: [a["txn"]["version"] for a in actions if "txn" in a] for version, actions in log.items()}
    assert holders == {0: [], **{seq: [seq] for seq in range(1, last_seq + 1)}}
    steps = snapshot_rows(loc, "steps").column("step").to_pylist()
    assert sorted(steps) == list(range(last_seq * ROWS)), "rows lost or added twice"


def _fault_proxy(loc: StoreLocation) -> FaultProxy:
    """A fault proxy in front of the S3 server (any port: `transient` reads statuses, not the URL's
    digits; tests/unit/store/test_retries.py holds that)."""
    return FaultProxy(loc.storage_options["AWS_ENDPOINT_URL"])


def _through_proxy(loc: StoreLocation, proxy: FaultProxy, **options: str) -> StoreLocation:
    return StoreLocation(loc.url, {**loc.storage_options, "AWS_ENDPOINT_URL": proxy.url, **options})


def _faulted(proxy: FaultProxy) -> list[tuple[str, str, str]]:
    """The requests the proxy answered with a fault: (method, the object's name, outcome)."""
    return [(method, path.rsplit("/", 1)[-1], outcome) for method, path, outcome in proxy.log()
            if outcome in ("503", "reset")]


# -- (a) the retry's look-up ------------------------------------------------------------------------

@pytest.mark.parametrize("app_unseen", [True, False], ids=["unseen", "looked-for"])
def test_a_retry_finds_its_landed_commit_when_landed_could_not_look(s3_store, caplog, app_unseen):
    """The commit's PUT is stored but answered 503, and the read `_landed` makes right after is
    answered 503 too: `_landed` finds nothing, the commit is retried, and the retry's own look-up
    finds the app transaction and commits nothing. Without that look-up (a writer's own app id,
    `app_unseen`, is not looked for at the first try) the retry appended the rows a second time.

    Only on object storage: a local commit is a rename whose answer is not lost, and the failures
    after it (a checkpoint's) are not retried on a local store. The location has `max_retries=0`,
    so each 503 reaches moescope as when a store's own retries run out (with retries, delta-rs
    retried the PUT into a 412 and a read into a success, and `_landed` found the commit)."""
    loc = s3_store
    _commit_rows(loc, range(1, 2))
    with _fault_proxy(loc) as proxy:
        through = _through_proxy(loc, proxy, max_retries="0")
        part = delta.write_part(through, "steps", "r", _steps(2), "part-002.parquet")
        # the first two requests naming version 2's log entry: the commit's PUT (applied, then
        # answered 503), then `_landed`'s read of it
        proxy.set_faults(slowdown_every=1, path_contains=f"_delta_log/{2:020d}.json", after_forward=True, budget=2)
        with caplog.at_level(logging.INFO, logger="moescope.store.delta.commits"):
            version = delta.commit(through, "steps", [part], app=(WRITER, 2), app_unseen=app_unseen)
        faulted = _faulted(proxy)
    assert faulted == [("PUT", f"{2:020d}.json", "503"), ("GET", f"{2:020d}.json", "503")], faulted
    assert "(try 1 of" in caplog.text  # retried: the version came from the retry's look-up, not `_landed`
    assert version == 2
    _check_committed_once(loc, 2)


# -- (b) `_landed` after a failed try ----------------------------------------------------------------

@contextlib.contextmanager
def _fails_after_landing(loc: StoreLocation, version: int) -> Iterator[StoreLocation]:
    """A location whose commit of `version` lands and then fails. On a local store the checkpoint
    delta-rs writes after it is refused (a folder holds its name: EISDIR from the filesystem, raised
    as a DeltaError), an error `commit` does not retry. On S3 the connection of the commit's PUT is
    reset after the server stored it (object_store does not retry that PUT): a transient error,
    which `commit` would retry."""
    if loc.is_local:
        assert version == CHECKPOINTED
        blocker = os.path.join(loc.join("steps", "_delta_log"), f"{version:020d}.checkpoint.parquet")
        os.mkdir(blocker)
        yield loc
        assert os.listdir(blocker) == []  # the checkpoint really failed
        return
    with _fault_proxy(loc) as proxy:
        proxy.set_faults(reset_every=1, methods=("PUT",), path_contains=f"_delta_log/{version:020d}.json",
                         after_forward=True, budget=1)
        yield _through_proxy(loc, proxy)
        assert _faulted(proxy) == [("PUT", f"{version:020d}.json", "reset")]


def test_a_commit_that_landed_before_a_failure_returns_its_version(store_location, caplog):
    """The commit lands, then its try fails (see `_fails_after_landing`): `_landed` finds the commit
    and `commit` returns its version from the failed try. Without `_landed`, the local store's
    error (not retried) raised CommitError for rows that are in the table, and a caller would write
    them again; on S3 the reset is retried and the retry's look-up (the test above) found the
    commit, so there `_landed` only spares a backoff and a second try: what the log line shows."""
    loc = store_location
    landing = CHECKPOINTED if loc.is_local else 2
    _commit_rows(loc, range(1, landing))
    with _fails_after_landing(loc, landing) as through:
        part = delta.write_part(through, "steps", "r", _steps(landing), f"part-{landing:03d}.parquet")
        with caplog.at_level(logging.INFO, logger="moescope.store.delta.commits"):
            version = delta.commit(through, "steps", [part], app=(WRITER, landing), app_unseen=True)
    assert "retrying" not in caplog.text  # returned by the failed try itself: nothing was tried again
    assert version == landing
    _check_committed_once(loc, landing)
