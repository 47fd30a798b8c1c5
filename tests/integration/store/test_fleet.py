"""A fleet on one store: 4 hosts x 2 ranks write one run into one S3 store while compaction runs
every few seconds and a reader queries in a loop; every row each writer reports written is in the
final snapshot once, and the reader never fails.

The run is ONE run of 8 ranks, as a training job of 4 nodes with 2 GPUs each records it: every
process has MOESCOPE_RUN_ID (the run), RANK and WORLD_SIZE=8 (as torchrun sets them; moescope reads
them when no process group is initialised), and MOESCOPE_HOST=host-<rank // 2>. One run is the
hardest case for the store: every writer and the compactor commit to the same partition of the
same tables.

Expected values come from outside moescope's query path: the forwards each writer ran (its model's
inputs), its final `probe_stats` row, and the snapshot read with delta-rs (`DeltaTable.file_uris`)
and each file with pyarrow (page checksums verified).

The processes are this file's own entry points (`python -m tests.integration.store.test_fleet writer|compactor|
reader ...`); `Fleet` starts them and stops every one it started.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import select
import sys
import time
import traceback
from typing import Any

import pytest

from tests.support.fleet import REPO, Child, delta_files, duplicated_keys, fleet_processes, log_actions, raw_table

HOSTS = 4
RANKS_PER_HOST = 2
# The writers run forwards from "go" until the parent says "stop": at least WRITE_S, and until the
# compactor has merged files (it checks every small file of the run it has not seen, ~20 requests
# each on S3: on a loaded machine that takes longer than any fixed time) and a flush more has passed.
WRITE_S = 30.0
WRITE_CAP_S = 600.0  # a writer stops by itself after this, should the parent never say "stop"
COMPACTED_TIMEOUT_S = 300.0
FORWARD_SLEEP_S = 0.1  # between forwards: under 10 forwards a second per writer
FLUSH_S = 5.0  # moescope's default: each writer commits each table every 5 s, racing 7 others for the log
COMPACT_EVERY_S = 4.0
BATCH, SEQ = 2, 8  # tokens per forward: BATCH * SEQ
START_TIMEOUT_S = 300.0  # 8 interpreters importing torch and transformers on 2 busy cores
# the tables a writer writes and their key: no key twice in the snapshot
KEYS = {"routes": ("run_id", "rank", "step", "layer", "token"), "steps": ("run_id", "rank", "step"),
        "layer_steps": ("run_id", "rank", "step", "layer"), "runs": ("run_id", "rank"),
        "layers": ("run_id", "rank", "layer"), "run_ends": ("run_id", "rank", "pid")}


# -- the processes ------------------------------------------------------------------------------------





def wait_for(children: list[Child], prefix: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(child.has(prefix) for child in children):
            return
        for child in children:
            if child.proc.poll() is not None and not child.has(prefix):
                raise AssertionError(f"{child.role} exited {child.proc.returncode} before '{prefix}': "
                                     f"{child.stderr()[-3000:]}")
        time.sleep(0.1)
    late = [c.role for c in children if not c.has(prefix)]
    raise AssertionError(f"not '{prefix}' within {timeout_s:.0f} s: {late}")


def option_args(storage_options: dict[str, str]) -> list[str]:
    return [arg for key, value in storage_options.items() for arg in ("--option", f"{key}={value}")]


def writer_env(run_id: str, rank: int, world_size: int, ranks_per_host: int = RANKS_PER_HOST) -> dict[str, str]:
    """What a fleet's process gets from its launcher: the run, its rank, the world, its host."""
    return {"MOESCOPE_RUN_ID": run_id, "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % ranks_per_host), "MOESCOPE_HOST": f"host-{rank // ranks_per_host}",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# -- reading the snapshot without moescope ------------------------------------------------------------











def final_written(probe_stats: Any) -> dict[tuple[str, int, int], dict[str, int]]:
    """Each writer's (host, rank, pid) rows written per table, from its latest `probe_stats` snapshot."""
    latest: dict[tuple[str, int, int], Any] = {}
    rows = probe_stats.to_pylist()
    for row in rows:
        writer = (row["host"], row["rank"], row["pid"])
        latest[writer] = max(latest.get(writer, row["ts"]), row["ts"])
    written: dict[tuple[str, int, int], dict[str, int]] = collections.defaultdict(dict)
    for row in rows:
        writer = (row["host"], row["rank"], row["pid"])
        if row["ts"] == latest[writer] and row["reason"] is None:
            written[writer][row["table_name"]] = row["written_rows"]
    return dict(written)


def final_dropped(probe_stats: Any) -> dict[tuple[str, int, int], dict[tuple[str, str], int]]:
    """Each writer's rows dropped per (table, reason), from its latest `probe_stats` snapshot."""
    latest: dict[tuple[str, int, int], Any] = {}
    rows = probe_stats.to_pylist()
    for row in rows:
        writer = (row["host"], row["rank"], row["pid"])
        latest[writer] = max(latest.get(writer, row["ts"]), row["ts"])
    dropped: dict[tuple[str, int, int], dict[tuple[str, str], int]] = collections.defaultdict(dict)
    for row in rows:
        writer = (row["host"], row["rank"], row["pid"])
        if row["ts"] == latest[writer] and row["reason"] is not None and row["dropped_rows"]:
            dropped[writer][(row["table_name"], row["reason"])] = row["dropped_rows"]
    return dict(dropped)


# -- the test -------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.integration
def test_four_hosts_two_ranks_with_compaction_and_a_reader(s3_store):
    url, options = s3_store.url, dict(s3_store.storage_options)
    run_id = "fleet-run"
    world = HOSTS * RANKS_PER_HOST
    with fleet_processes() as children:
        writers = [Child("writer", ["--store", url, *option_args(options), "--seconds", str(WRITE_CAP_S),
                                    "--sleep", str(FORWARD_SLEEP_S), "--flush", str(FLUSH_S)],
                         env=writer_env(run_id, rank, world)) for rank in range(world)]
        children += writers
        # the reader from the start: it checks each file once, as it first sees it
        reader = Child("reader", ["--store", url, *option_args(options)])
        children.append(reader)
        wait_for([*writers, reader], "ready", START_TIMEOUT_S)
        for writer in writers:
            writer.send("go")
        wait_for(writers, "first-forward", 60)
        time.sleep(FLUSH_S + 1)  # the tables exist and hold rows before compaction begins
        compactor = Child("compactor", ["--store", url, *option_args(options), "--run", run_id,
                                        "--every", str(COMPACT_EVERY_S)])
        children.append(compactor)
        started = time.monotonic()
        wait_for([compactor], "compacted", COMPACTED_TIMEOUT_S)  # a compaction committed under the writers
        time.sleep(max(FLUSH_S + 1, WRITE_S - (time.monotonic() - started)))  # and every writer commits after it
        for writer in writers:
            writer.send("stop")
        for writer in writers:
            assert writer.wait(timeout_s=180) == 0, writer.stderr()[-3000:]
        time.sleep(COMPACT_EVERY_S + 1)  # one more compaction, and reads of it, with every writer done
        compactor.close_stdin()
        reader.close_stdin()
        assert compactor.wait(timeout_s=300) == 0, compactor.stderr()[-3000:]
        assert reader.wait(timeout_s=300) == 0, reader.stderr()[-3000:]
        reports = [writer.result() for writer in writers]
        compacted = compactor.result()
        read = reader.result()

    # the reader: no failed query, no row seen twice, no rank's count ever going back
    assert read["queries"] >= 3, read
    assert read["errors"] == 0, read["first_errors"]
    assert read["problems"] == [], read["problems"][:5]
    assert compacted["errors"] == 0, compacted["first_errors"]
    assert compacted["compactions"] >= 1, compacted

    tables = {table: raw_table(url, options, table) for table in (*KEYS, "probe_stats")}
    # 0 duplicated: no key twice in any table's snapshot, no file twice
    for table, key in KEYS.items():
        assert duplicated_keys(tables[table], key) == 0, f"{table}: rows in the snapshot twice"
        _, files = delta_files(url, options, table)
        assert len(files) == len(set(files)), f"{table}: a file is in the snapshot twice"

    # 0 lost: every row a writer ran is in the snapshot, and what it reported written is exactly there
    written = final_written(tables["probe_stats"])
    assert sorted(w[1] for w in written) == list(range(world)), f"a writer's final probe_stats is missing: {written}"
    assert final_dropped(tables["probe_stats"]) == {}, "a writer dropped rows"
    by_rank = {table: collections.Counter(data.column("rank").to_pylist()) if data.num_rows else collections.Counter()
               for table, data in tables.items()}
    for report in reports:
        rank, host, pid = report["rank"], report["host"], report["pid"]
        assert host == f"host-{rank // RANKS_PER_HOST}" and report["run_id"] == run_id
        assert report["forwards"] > 10, f"rank {rank} ran only {report['forwards']} forwards"
        expected_routes = report["forwards"] * report["moe_layers"] * BATCH * SEQ  # from the model's inputs
        reported = written[(host, rank, pid)]
        assert reported["routes"] == report["written"]["routes"] == expected_routes, (rank, reported, report)
        for table in KEYS:
            assert by_rank[table][rank] == reported.get(table, 0), \
                f"rank {rank}: {table} holds {by_rank[table][rank]} rows, the writer wrote {reported.get(table, 0)}"
        assert by_rank["steps"][rank] >= 1 and by_rank["run_ends"][rank] == 1

    # the hosts: each rank's host in runs and probe_stats, 4 distinct
    runs = tables["runs"].to_pylist()
    assert {(r["rank"], r["host"]) for r in runs} == {(rank, f"host-{rank // RANKS_PER_HOST}") for rank in range(world)}
    assert set(tables["probe_stats"].column("host").to_pylist()) == {f"host-{h}" for h in range(HOSTS)}

    # compaction did its work under the writers: it replaced files in commits of its own, and
    # writers committed after it
    log = log_actions(url, options, "routes")
    assert log["compacted_removes"] > 0, log
    assert log["first_compaction"] < log["last_append"], log
    assert len(set(tables["routes"].column("file").to_pylist())) < log["adds"], log


# -- the processes' entry points -------------------------------------------------------------------------

def _location(args: argparse.Namespace) -> Any:
    from moescope.store.location import open_location

    return open_location(args.store, args.option or None)


def _stdin_closed(timeout_s: float) -> bool:
    """Whether stdin reached its end within `timeout_s` (the parent's signal to stop)."""
    readable, _, _ = select.select([sys.stdin], [], [], max(0.0, timeout_s))
    return bool(readable) and not sys.stdin.readline()


def _said(word: str) -> bool:
    """Whether the parent has written `word` on stdin (a line), without waiting for it."""
    readable, _, _ = select.select([sys.stdin], [], [], 0.0)
    return bool(readable) and sys.stdin.readline().strip() in (word, "")


def writer_main(args: argparse.Namespace) -> int:
    """Record forwards of a tiny Mixtral into the store from the parent's "go" until its "stop" (or
    `--seconds`, a cap); prints the run, rank, host, forwards and rows written as it exits."""
    import torch

    import moescope
    from tests.support.zoo import tiny_model

    torch.set_num_threads(1)
    model = tiny_model("mixtral", seed=0)  # one model on every rank
    rank = int(os.environ["RANK"])
    generator = torch.Generator().manual_seed(rank)
    forwards = 0
    session = moescope.attach(model, store=args.store, storage_options=args.option or None, routes=True,
                              flush_interval_s=args.flush)
    try:
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return 1
        deadline = time.monotonic() + args.seconds
        with torch.no_grad():
            while time.monotonic() < deadline and not _said("stop"):
                model(torch.randint(0, 128, (BATCH, SEQ), generator=generator))
                forwards += 1
                if forwards == 1:
                    print("first-forward", flush=True)
                time.sleep(args.sleep)
    finally:
        session.close()
    written, dropped = session.probe_stats()
    print("result " + json.dumps({
        "run_id": session.run.run_id, "rank": session.run.rank, "host": session.run.host, "pid": os.getpid(),
        "forwards": forwards, "moe_layers": len(session.run.layers), "written": written,
        "dropped": {f"{t}/{r}": n for (t, r), n in dropped.items()}}), flush=True)
    return 0


def compactor_main(args: argparse.Namespace) -> int:
    """Compact the run every `--every` seconds until stdin closes; prints how many compactions
    merged files and every error (an error is counted, never stops the loop)."""
    from moescope.store.compact import compact

    location = _location(args)
    compactions, errors, first_errors, seconds = 0, 0, [], []
    while True:
        started = time.monotonic()
        try:
            results = compact(location, run_id=args.run)
            merged = any(getattr(r, "merged_files", 0) for r in results)
            if merged and not compactions:
                print("compacted", flush=True)  # the first compaction that merged files has committed
            compactions += merged
        except Exception:  # noqa: BLE001 - every failure is reported to the test
            errors += 1
            first_errors = (first_errors + [traceback.format_exc(limit=3)])[:3]
        seconds.append(round(time.monotonic() - started, 3))
        if _stdin_closed(args.every):
            break
    print("result " + json.dumps({"compactions": compactions, "errors": errors, "first_errors": first_errors,
                                  "seconds": seconds}),
          flush=True)
    return 0


def reader_main(args: argparse.Namespace) -> int:
    """Query the store in a loop until stdin closes: per rank, route rows and distinct route keys.
    Every exception is an error; a row seen twice, or a rank's count going back, is a problem."""
    from moescope.store import Store

    location = _location(args)
    store = None
    print("ready", flush=True)
    queries, errors, first_errors, problems, seconds = 0, 0, [], [], []
    last: dict[int, int] = {}
    while not _stdin_closed(0.0):
        started = time.monotonic()
        try:
            if store is None:
                store = Store(location)
            store.refresh()
            frame = store.sql("""SELECT rank, count(*) AS n, count(DISTINCT (step, layer, token)) AS d
                                 FROM routes GROUP BY rank""")
        except Exception:  # noqa: BLE001 - every failure is reported to the test
            errors += 1
            first_errors = (first_errors + [traceback.format_exc(limit=3)])[:3]
            time.sleep(0.2)
            continue
        queries += 1
        seconds.append(round(time.monotonic() - started, 3))
        for rank, n, d in zip(frame["rank"].tolist(), frame["n"].tolist(), frame["d"].tolist()):
            if n != d:
                problems.append(f"query {queries}: rank {rank}: {n - d} route rows seen twice")
            if n < last.get(rank, 0):
                problems.append(f"query {queries}: rank {rank}: {n} route rows, {last[rank]} before")
            last[rank] = n
    print("result " + json.dumps({"queries": queries, "errors": errors, "first_errors": first_errors,
                                  "problems": problems[:20], "last": last,
                                  "seconds": seconds}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the fleet test's processes (started by the test)")
    parser.add_argument("role", choices=("writer", "compactor", "reader"))
    parser.add_argument("--store", required=True)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--seconds", type=float, default=WRITE_S)
    parser.add_argument("--sleep", type=float, default=FORWARD_SLEEP_S)
    parser.add_argument("--flush", type=float, default=FLUSH_S)
    parser.add_argument("--run")
    parser.add_argument("--every", type=float, default=COMPACT_EVERY_S)
    args = parser.parse_args(argv)
    return {"writer": writer_main, "compactor": compactor_main, "reader": reader_main}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_fleet_benchmark_runs(kind, tmp_path, monkeypatch):
    """bench/fleet.py end to end, small: its figures add up (docs/benchmarks.md quotes its full run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_fleet", os.path.join(REPO, "bench", "fleet.py"))
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_fleet", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    store = ["--store", str(tmp_path / "store")] if kind == "local" else []
    saved = dict(os.environ)
    try:
        (out,) = bench.main([*store, "--writers", "2", "--hosts", "2", "--seconds", "4", "--phases", "paced",
                             "--rate", "8192", "--layers", "2", "--tokens", "256", "--compact-every", "2"])
    finally:  # the bench's own S3 server puts its credentials in the environment
        os.environ.clear()
        os.environ.update(saved)
    assert out["writers"] == 2 and out["hosts"] == 2 and out["dropped_rows"] == 0
    assert out["route_rows"] == out["snapshot_route_rows"] > 0
    assert out["commits"] > 0 and out["commit_p50_s"] > 0
    assert out["compactor"]["error_count"] == 0 and out["reader"]["error_count"] == 0
    assert out["reader"]["runs"] > 0
    if kind == "s3":  # every writer's data file and commit is a request the server counted
        assert out["requests_per_writer_per_minute"]["PUT"] > 0 and "conflicts_retried" in out
