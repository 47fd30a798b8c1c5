"""kill -9 at random points of a write and of a compaction, on a local folder and on S3: the store
stays readable, its snapshot holds exactly the rows of the commits that landed (none twice), and a
later compaction completes.

Each process under test traces the two steps of every write to stdout (`store.delta.write_part`,
the upload; `store.delta.commit`, the commit) and is killed with SIGKILL a random moment after it
starts one. On S3 the writers and the compactor reach the server through the fault proxy with a
latency on every PUT, so the kill lands while the request is in flight: a data file or a log entry
may still reach the bucket after its writer died. What may be in the snapshot is then exact: every
commit the process saw return, plus at most the one it was making per table; the expected rows are
read from the traces and the snapshot is read with delta-rs and pyarrow, never through moescope.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import threading
import time
from typing import Any

import pytest

from tests.support.fleet import (
    Child,
    delta_files,
    duplicated_keys,
    fleet_processes,
    log_actions,
    raw_table,
)

MODULE = "tests.integration.store.test_kill"
RUN = "killed"
FLUSH_S = 0.2  # the writer commits every table every 0.2 s: most of its time is spent writing
PUT_LATENCY_S = 0.15  # on S3, every PUT waits this long in the proxy: the kill lands mid-request
START_TIMEOUT_S = 180.0
KEYS = {"routes": ("rank", "step", "layer", "token"), "steps": ("rank", "step"),
        "layer_steps": ("rank", "step", "layer"), "runs": ("rank",), "layers": ("rank", "layer")}
# (what to kill in, writer rounds): two writers killed in an upload, two in a commit
WRITER_KILLS = ("upload", "commit", "upload", "commit")


class Traced:
    """What one traced process said it uploaded and committed, from its stdout lines."""

    def __init__(self, lines: list[str]):
        self.started: dict[str, set[str]] = collections.defaultdict(set)  # table -> paths in a commit begun
        self.committed: dict[str, set[str]] = collections.defaultdict(set)  # table -> paths in a commit returned
        self.rows: dict[str, int] = {}  # path -> rows
        self.removed: dict[str, set[str]] = collections.defaultdict(set)
        for line in lines:
            kind, _, rest = line.partition(" ")
            if kind not in ("commit", "committed"):
                continue
            event = json.loads(rest)
            table = event["table"]
            target = self.started if kind == "commit" else self.committed
            for path, rows in event["adds"]:
                target[table].add(path)
                self.rows[path] = rows
            if kind == "committed":
                self.removed[table].update(event["removes"])


def _wait_lines(child: Child, prefix: str, count: int, timeout_s: float, start: int = 0) -> int:
    """The index of the `count`-th line from `start` that begins with `prefix` (waits for it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = [i for i, line in enumerate(list(child.lines)) if i >= start and line.startswith(prefix + " ")]
        if len(seen) >= count:
            return seen[count - 1]
        if child.proc.poll() is not None:
            raise AssertionError(f"{child.role} exited {child.proc.returncode}: {child.stderr()[-3000:]}")
        time.sleep(0.002)
    raise AssertionError(f"{child.role}: no {count} '{prefix}' lines within {timeout_s:.0f} s")


def _kill_during(child: Child, step: str, rng: random.Random, max_delay_s: float) -> str:
    """SIGKILL `child` a random moment (0 to max_delay_s) after it next begins `step`; returns its
    last line (what it was doing, for the failure message)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not set(KEYS) <= set(Traced(list(child.lines)).committed):  # every table holds rows of it first
        if child.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{child.role} committed only {sorted(Traced(child.lines).committed)} "
                                 f"(exit {child.proc.poll()}): {child.stderr()[-3000:]}")
        time.sleep(0.01)
    _wait_lines(child, step, 1, 60, start=len(child.lines))
    time.sleep(rng.uniform(0, max_delay_s))
    os.kill(child.proc.pid, signal.SIGKILL)
    child.wait(timeout_s=30)
    return child.lines[-1] if child.lines else ""


def _keys_of(table: str, data: Any) -> list[tuple]:
    """The table's row keys in `data`, sorted (a multiset: a key twice stays twice)."""
    return sorted(zip(*(data.column(c).to_pylist() for c in KEYS[table]))) if data.num_rows else []


def _keys(url: str, options: dict[str, str]) -> dict[str, list[tuple]]:
    """Every table's row keys in the latest snapshot, read with delta-rs and pyarrow."""
    return {table: _keys_of(table, raw_table(url, options, table)) for table in KEYS}


def _store_counts(url: str, options: dict[str, str]) -> dict[str, int]:
    """Each table's rows as a Store opened now counts them (it must open, and agree)."""
    from moescope.store import Store

    store = Store(url, storage_options=options or None)
    try:
        return {table: int(store.sql(f"SELECT count(*) AS n FROM {table}").n[0]) for table in KEYS}
    finally:
        store.close()


def _wait_for_held_commits(url: str, options: dict[str, str], quiet_s: float = 1.0, timeout_s: float = 60.0) -> None:
    """Wait until no table's version moves for `quiet_s`: a commit whose PUT the proxy had taken whole
    before its sender was killed still lands, up to PUT_LATENCY_S later (as on S3, where a request sent
    whole completes without its client), and a snapshot read before it would miss a commit a later
    reader sees (the seed-132742913 failure: 4272 routes rows apart)."""
    def versions() -> list[int]:
        return [delta_files(url, options, table)[0] for table in KEYS]

    deadline, seen, since = time.monotonic() + timeout_s, versions(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"the tables' versions still move after {timeout_s} s"
        time.sleep(0.1)
        now = versions()
        if now != seen:
            seen, since = now, time.monotonic()


@pytest.fixture
def reach(store_location, request):
    """(url, storage options for readers, storage options for the processes killed): on S3 the
    latter go through a fault proxy that holds every PUT for PUT_LATENCY_S."""
    url, options = store_location.url, dict(store_location.storage_options)
    if store_location.is_local:
        yield url, options, options
        return
    from tests.support.s3faults import FaultProxy

    with FaultProxy(options["AWS_ENDPOINT_URL"], latency_s=PUT_LATENCY_S, methods=("PUT",)) as proxy:
        yield url, options, {**options, "AWS_ENDPOINT_URL": proxy.url}


def _args(url: str, options: dict[str, str]) -> list[str]:
    return ["--store", url, *[arg for k, v in options.items() for arg in ("--option", f"{k}={v}")]]


@pytest.mark.slow
@pytest.mark.integration
def test_kill_9_of_writers_and_of_the_compactor(reach):
    url, options, killed_options = reach
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    where = f"(seed {seed}, store {url.split('://')[0] if '://' in url else 'local'})"
    max_delay_s = PUT_LATENCY_S if "://" in url else 0.02

    # -- writers killed mid-upload and mid-commit, one rank each, the others writing meanwhile ----------
    with fleet_processes() as children:
        children += [Child("writer", [*_args(url, killed_options), "--rank", str(rank)], module=MODULE)
                     for rank in range(len(WRITER_KILLS))]
        last_lines = [_kill_during(writer, step, rng, max_delay_s) for writer, step in zip(children, WRITER_KILLS)]
        traces = [Traced(writer.lines) for writer in children]
    _wait_for_held_commits(url, options)

    before: dict[str, list[tuple]] = {}
    for table in KEYS:
        _, files = delta_files(url, options, table)
        names = {f.split(f"/{table}/", 1)[1] for f in files}
        assert len(names) == len(files), f"{table}: a file twice in the snapshot {where}"
        claimed: set[str] = set()
        for rank, trace in enumerate(traces):
            mine = names & trace.started[table]
            assert trace.committed[table] <= mine, \
                f"{table}: rank {rank}'s committed files are not all in the snapshot {where}"
            in_flight = mine - trace.committed[table]
            assert len(in_flight) <= 1, f"{table}: rank {rank} has {len(in_flight)} files of unfinished commits " \
                                        f"(killed at: {last_lines[rank][:120]}) {where}"
            claimed |= mine
        assert names == claimed, f"{table}: files no traced commit added: {sorted(names - claimed)[:3]} {where}"
        data = raw_table(url, options, table)  # every file whole: page checksums verified
        per_file = collections.Counter(p.split(f"/{table}/", 1)[1] for p in data.column("file").to_pylist())
        for name, rows in per_file.items():
            expected = next(t.rows[name] for t in traces if name in t.rows)
            assert rows == expected, f"{table}/{name}: {rows} rows, its commit added {expected} {where}"
        assert duplicated_keys(data, KEYS[table]) == 0, f"{table}: rows twice {where}"
        before[table] = _keys_of(table, data)
    assert _store_counts(url, options) == {table: len(keys) for table, keys in before.items()}, where
    assert all(before.values()), "the writers committed nothing before they were killed"

    # -- the compactor killed mid-commit -----------------------------------------------------------------
    with fleet_processes() as children:
        compactor = Child("compactor", [*_args(url, killed_options), "--run", RUN], module=MODULE)
        children.append(compactor)
        nth = rng.randint(1, 2)  # the first or second table's compaction commit
        _wait_lines(compactor, "commit", nth, START_TIMEOUT_S)
        time.sleep(rng.uniform(0, max_delay_s))
        os.kill(compactor.proc.pid, signal.SIGKILL)
        compactor.wait(timeout_s=30)
    _wait_for_held_commits(url, options)
    assert _keys(url, options) == before, f"rows changed by a compaction killed mid-commit {where}"
    assert _store_counts(url, options) == {table: len(keys) for table, keys in before.items()}, where

    # -- a second compaction completes and changes no row -------------------------------------------------
    from moescope.store.compact import compact

    results = compact(url, run_id=RUN, storage_options=options or None)
    assert not [r for r in results if r.table in KEYS and r.skipped and "again" in r.skipped], results
    assert _keys(url, options) == before, f"rows changed by the second compaction {where}"
    for table in KEYS:
        assert len(delta_files(url, options, table)[1]) == 1, f"{table}: the run is not in one file {where}"
        assert log_actions(url, options, table)["compacted_removes"] > 0
    assert _store_counts(url, options) == {table: len(keys) for table, keys in before.items()}, where


# -- the processes under test -------------------------------------------------------------------------

def _trace_delta() -> None:
    """Print each upload and commit of this process as it begins and as it returns (the writer and
    compaction call `store.delta` through its module, so wrapping its functions sees every one)."""
    from moescope.store import delta

    write_part, commit = delta.write_part, delta.commit
    said = threading.Lock()

    def say(line: str) -> None:  # one whole line at a time: a flush writes its tables on threads
        with said:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def traced_write_part(loc: Any, table: str, run_id: str, data: Any, name: str, **kwargs: Any) -> Any:
        say(f"upload {json.dumps({'table': table, 'name': name})}")
        part = write_part(loc, table, run_id, data, name, **kwargs)
        say(f"uploaded {json.dumps({'table': table, 'path': part.path, 'rows': part.rows})}")
        return part

    def traced_commit(loc: Any, table: str, adds: Any = (), removes: Any = (), **kwargs: Any) -> int:
        adds, removes = list(adds), list(removes)
        event = {"table": table, "adds": [[p.path, p.rows] for p in adds],
                 "removes": [p if isinstance(p, str) else p.path for p in removes]}
        say(f"commit {json.dumps(event)}")
        version = commit(loc, table, adds, removes, **kwargs)
        say(f"committed {json.dumps({**event, 'version': version})}")
        return version

    delta.write_part, delta.commit = traced_write_part, traced_commit


def writer_main(args: argparse.Namespace) -> int:
    """Write synthetic probe records of run RUN, rank `--rank`, through the real exporter, until killed."""
    import numpy as np

    from moescope.core.pipeline import BatchProcessor
    from moescope.store.exporter import DeltaExporter
    from tests.support.store_records import make_record, run_info

    _trace_delta()
    rng = np.random.default_rng(args.rank)
    processor = BatchProcessor([], flush_interval_s=FLUSH_S)
    processor.add_exporter(DeltaExporter(args.store, run_info(RUN, rank=args.rank), max_age_s=FLUSH_S,
                                           processor=processor, storage_options=args.option or None))
    step = 0
    while True:
        processor.emit(make_record(RUN, step, rng))
        step += 1
        time.sleep(0.01)


def compactor_main(args: argparse.Namespace) -> int:
    """Compact run `--run` once (killed during it by the test)."""
    from moescope.store.compact import compact

    _trace_delta()
    compact(args.store, run_id=args.run, storage_options=args.option or None)
    print("done", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the kill -9 test's processes (started by the test)")
    parser.add_argument("role", choices=("writer", "compactor"))
    parser.add_argument("--store", required=True)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--run", default=RUN)
    args = parser.parse_args(argv)
    return {"writer": writer_main, "compactor": compactor_main}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
