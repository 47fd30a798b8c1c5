"""Compaction through S3: a store of tens of small files, then a compaction with nothing to merge.

    python bench/compact.py               # 24 flushes of one run (about 24 small files per table)
    python bench/compact.py --flushes 48
    python bench/compact.py --command 5   # also `moescope compact URL` with nothing to merge, 5 fresh processes

A moto S3 server (tests/support/s3server.py) in its own process, behind the counting proxy
(tests/support/s3faults.py): every request the compaction makes (data files and the Delta log) is
counted by method at the server's door. Prints the wall time, GETs, PUTs and the data bytes read
and written (`CompactResult.io`) of each compaction. With `--command N`, then the command an operator
or a cron job runs, `moescope compact URL`, with nothing to merge, N times in a fresh process each
(wall time from its start to its exit, median [min-max], its CPU, its requests by kind and the CPU
the S3 server and the proxy spent answering them), beside
`moescope --help` (the command line's start alone) in the same rounds. The processes run in this
environment: with PYTHONDONTWRITEBYTECODE set and no `__pycache__` in the checkout, each compiles
moescope's modules at its start, which an installed package does not (`env -u PYTHONDONTWRITEBYTECODE`
and a first round to write them measures that start).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import subprocess
import sys
import time
import uuid
from urllib.parse import unquote

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flushes", type=int, default=24, help="writer flushes (one small file per table each)")
    parser.add_argument("--command", type=int, default=0, metavar="N",
                        help="also time `moescope compact URL` with nothing to merge, N fresh processes")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    from moescope.store.compact import CompactIO, compact
    from moescope.store.location import StoreLocation
    from tests.support.deltafiles import parts, write_run
    from tests.support.s3faults import FaultProxy
    from tests.support.s3server import S3Server

    server = S3Server(auth=False).start()
    try:
        loc = server.location(f"bench-{uuid.uuid4().hex[:8]}")
        write_run(loc, "r", steps=args.flushes, max_rows=48)  # a flush per step, as a fleet's writers leave them
        files = sum(len(parts(loc, t)) for t in ("routes", "layer_steps", "steps", "runs", "layers"))
        print(f"store: {files} data files in 5 tables, through S3 (moto at {server.endpoint})")
        with FaultProxy(loc.storage_options["AWS_ENDPOINT_URL"]) as proxy:
            through = StoreLocation(loc.url, {**loc.storage_options, "AWS_ENDPOINT_URL": proxy.url})
            for label in ("tens of small files", "nothing to merge"):
                proxy.reset_counts()
                started = time.perf_counter()
                results = compact(through, retention_hours=None)
                wall = time.perf_counter() - started
                requests = proxy.counts()["requests"]
                data_gets = sum(1 for m, path, _ in proxy.log() if m == "GET" and path.endswith(".parquet")
                                and "_delta_log" not in path)
                io = sum((r.io for r in results), CompactIO())
                merged = sum(r.merged_files for r in results)
                print(f"{label}: {wall:.2f} s, {merged} files merged; requests {dict(sorted(requests.items()))} "
                      f"({data_gets} GETs of data files); data files {io}")
            if args.command:
                command_rounds(through, proxy, args.command, [server._proc.pid, proxy._proc.pid])
    finally:
        server.stop()


def process_cpu(pids: list[int]) -> float:
    """CPU seconds (user and system) the processes `pids` have spent (Linux: /proc/<pid>/stat)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (the 14th and 15th fields)
    return total / os.sysconf("SC_CLK_TCK")


def command_rounds(location, proxy, rounds: int, servers: list[int]) -> None:
    """`moescope compact URL` (nothing to merge) and `moescope --help`, `rounds` fresh processes each;
    with the CPU the S3 server and the counting proxy (`servers`) spent answering each compact."""
    options = [f"--storage-option={key}={value}" for key, value in location.storage_options.items()]
    argvs = {"moescope compact URL (nothing to merge)": [sys.executable, "-m", "moescope.cli", "compact",
                                                         location.url, *options],
             "moescope --help (start alone)": [sys.executable, "-m", "moescope.cli", "--help"]}
    walls: dict[str, list[float]] = {label: [] for label in argvs}
    cpus: dict[str, list[float]] = {label: [] for label in argvs}
    requests: list[int] = []
    server_cpus: list[float] = []
    loads = []
    for _ in range(rounds):
        for label, argv in argvs.items():
            proxy.reset_counts()
            before, served = os.times(), process_cpu(servers)
            started = time.perf_counter()
            subprocess.run(argv, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
            walls[label].append(time.perf_counter() - started)
            after = os.times()
            cpus[label].append(after.children_user - before.children_user
                               + after.children_system - before.children_system)
            if "compact" in argv:
                requests.append(sum(proxy.counts()["requests"].values()))
                server_cpus.append(process_cpu(servers) - served)
                kinds = request_kinds(proxy.log())
            loads.append(os.getloadavg()[0])
    bytecode = "not written" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "written"
    print(f"fresh processes, {rounds} each, load average (1 min) {min(loads):.1f}-{max(loads):.1f}, "
          f"bytecode {bytecode}:")
    for label, values in walls.items():
        print(f"  {label:<42} {statistics.median(values):.2f} s [{min(values):.2f}-{max(values):.2f}], "
              f"CPU {statistics.median(cpus[label]):.2f} s")
    print(f"  requests of each compact: {sorted(requests)}; the last by kind: {dict(kinds)}")
    print(f"  the S3 server's and the proxy's CPU per compact: {statistics.median(server_cpus):.2f} s "
          f"[{min(server_cpus):.2f}-{max(server_cpus):.2f}]")


def request_kinds(log: list[tuple[str, str, str]]) -> collections.Counter[str]:
    """The requests of a compaction by what they ask for: the root's listing, a table log's listing,
    its checkpoint pointer, its commit entries, its checkpoint, a data file, anything else."""
    kinds: collections.Counter[str] = collections.Counter()
    for method, path, _ in log:
        path = unquote(path)
        if "list-type=2" in path:
            kinds["listing of the root" if "delimiter=/" in path else "listing of a log"] += 1
        elif path.endswith("/_delta_log/_last_checkpoint"):
            kinds["_last_checkpoint"] += 1
        elif re.search(r"/_delta_log/\d{20}\.json$", path):
            kinds["commit entry"] += 1
        elif ".checkpoint." in path:
            kinds["checkpoint (ranges)"] += 1
        elif path.endswith(".parquet"):
            kinds["data file"] += 1
        else:
            kinds[f"{method} other"] += 1
    return kinds


if __name__ == "__main__":
    main()
