"""How long `session.close()` takes, and where the time goes: one writer alone, then 8 closing at once.

    python bench/close.py                        # through a local S3 server (moto), 1 writer then 8
    python bench/close.py --store /tmp/close     # a local folder
    python bench/close.py --writers 1 4 8 --forwards 40

Each writer is a process of its own that attaches the probe (`moescope.attach`) to a small random
Mixtral (tests/support/zoo.py), with MOESCOPE_RUN_ID, RANK and WORLD_SIZE set as a launcher sets
them, runs `--forwards` forwards, then waits; the parent tells every writer of a round to close at
the same moment, and each times `session.close()`. Inside the close each writer times every Delta
commit, Parquet upload and table opening (`store.delta.commit`, `store.delta.write_part`,
`store.delta.create_table`: a table's first write in a process opens it, reading its log), so the
report says how much of a close is commits, uploads, opens and the rest, and how long the close
ran after its last commit ended.

A store a fleet has used for a while has a long log: `--history N` (default 40) first writes N
earlier one-step runs through the real writer (tests/support/deltafiles.py's `write_run`), so every
table holds N versions since its last checkpoint (one every 50 commits) when the writers start,
as the tables of a running fleet hold up to 49.

Printed per round: close wall time, median [min-max] over the writers; commits and uploads per
close and their seconds; the tail after the last commit. The load average is printed beside each
round (on a shared machine the figures move with it).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLOSE_GOAL_S = 2.0  # issue 34 part 4: one writer on a quiet machine


def _load() -> str:
    return "load " + "/".join(f"{x:.2f}" for x in os.getloadavg())


def writer_child(args: argparse.Namespace) -> int:
    """One writer: attach, forwards, "ready"; on "close" from the parent, time the close and print it."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import torch

    import moescope
    from moescope.store import delta
    from tests.support.zoo import tiny_model

    spans: list[tuple[str, float, float]] = []  # (what, start, end) during the close
    timing = {"on": False}
    commit, write_part = delta.commit, delta.write_part

    def timed(name: str, call: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*a, **k)
            finally:
                if timing["on"]:
                    spans.append((f"{name}:{a[1] if len(a) > 1 else k.get('table')}", started, time.perf_counter()))
        return wrapper

    create_table = delta.create_table
    delta.commit, delta.write_part = timed("commit", commit), timed("upload", write_part)
    delta.create_table = timed("open", create_table)  # a table's first write in the process opens it
    options = json.loads(args.storage_options) if args.storage_options else None
    model = tiny_model("mixtral", seed=int(os.environ.get("RANK", 0))).eval()
    session = moescope.attach(model, store=args.store, storage_options=options)
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    with torch.no_grad():
        for _ in range(args.forwards):
            model(ids)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "close":
        session.close()
        return 1
    timing["on"] = True
    started = time.perf_counter()
    session.close()
    ended = time.perf_counter()
    timing["on"] = False
    commits = [s for s in spans if s[0].startswith("commit:")]
    uploads = [s for s in spans if s[0].startswith("upload:")]
    opens = [s for s in spans if s[0].startswith("open:")]
    last_commit = max((s[2] for s in commits), default=started)
    print("result " + json.dumps({
        "close_s": ended - started, "commits": len(commits), "commit_s": sum(e - s for _, s, e in commits),
        "uploads": len(uploads), "upload_s": sum(e - s for _, s, e in uploads),
        "opens": len(opens), "open_s": sum(e - s for _, s, e in opens),
        "after_last_commit_s": ended - last_commit,
        "tables": [name.split(":", 1)[1] for name, _, _ in commits]}), flush=True)
    return 0


def _spread(values: list[float], fmt: str = "{:.2f}") -> str:
    return (f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}, "
            f"n={len(values)}]")


def _read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"a writer exited early (code {proc.wait()})")
            return line.strip()
    raise RuntimeError(f"a writer said nothing for {timeout_s:.0f} s")


def run_round(writers: int, store: str, storage_options: dict[str, str] | None, forwards: int) -> list[dict]:
    """`writers` processes of one fresh run; all close at once; their reports."""
    env = {**os.environ, "MOESCOPE_RUN_ID": f"close-{writers}-{uuid.uuid4().hex[:8]}", "WORLD_SIZE": str(writers),
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = []
    try:
        for rank in range(writers):
            command = [sys.executable, os.path.abspath(__file__), "--child", "--store", store, "--forwards",
                       str(forwards), "--storage-options", json.dumps(storage_options or {})]
            procs.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                          env={**env, "RANK": str(rank), "MOESCOPE_HOST": f"host-{rank // 2}"}))
        for proc in procs:
            while _read_line(proc, 600) != "ready":
                pass
        for proc in procs:  # all at once: each starts its clock when it reads the line
            assert proc.stdin is not None
            proc.stdin.write("close\n")
            proc.stdin.flush()
        reports = []
        for proc in procs:
            line = _read_line(proc, 600)
            while not line.startswith("result "):
                line = _read_line(proc, 600)
            reports.append(json.loads(line[len("result "):]))
        return reports
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> dict[int, list[dict]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", help="a local folder or a URL (default: a local S3 server, moto, started here)")
    parser.add_argument("--storage-options", default="", help=argparse.SUPPRESS)
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 8], help="writers per round (default 1 8)")
    parser.add_argument("--forwards", type=int, default=20, help="forwards each writer runs before closing")
    parser.add_argument("--history", type=int, default=40,
                        help="earlier one-step runs written first, a log version each per table (default 40)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        sys.exit(writer_child(args))
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    server = None
    store, options = args.store, None
    if store is None:
        from tests.support.s3server import S3Server

        server = S3Server(auth=False).start()
        location = server.location(f"close-{uuid.uuid4().hex[:8]}")
        store, options = location.url, dict(location.storage_options)
    elif "://" not in store:
        store = os.path.abspath(store or tempfile.mkdtemp(prefix="moescope-close-"))
    if server is None and args.history:
        from moescope.store.location import open_location

        location = open_location(store, options)
    results: dict[int, list[dict]] = {}
    try:
        if args.history:
            from tests.support.deltafiles import write_run

            started = time.perf_counter()
            for i in range(args.history):
                write_run(location, f"history-{i:03d}", steps=1)
            print(f"history: {args.history} earlier runs written in {time.perf_counter() - started:.1f} s", flush=True)
        print(f"close benchmark: {store} ({'moto S3' if server else 'as given'}), {args.forwards} forwards per "
              f"writer; {os.cpu_count()} CPUs", flush=True)
        for writers in args.writers:
            before = _load()
            reports = run_round(writers, store, options, args.forwards)
            results[writers] = reports
            closes = [r["close_s"] for r in reports]
            print(f"{writers} writer(s) closing at once ({before} -> {_load()}):\n"
                  f"  close            {_spread(closes)} s"
                  + (f"  (goal <= {CLOSE_GOAL_S:.0f} s alone on a quiet machine)" if writers == 1 else "") + "\n"
                  f"  commits          {_spread([float(r['commits']) for r in reports], '{:.0f}')} per close, "
                  f"{_spread([r['commit_s'] for r in reports])} s\n"
                  f"  uploads          {_spread([float(r['uploads']) for r in reports], '{:.0f}')} per close, "
                  f"{_spread([r['upload_s'] for r in reports])} s\n"
                  f"  table opens      {_spread([float(r['opens']) for r in reports], '{:.0f}')} per close, "
                  f"{_spread([r['open_s'] for r in reports])} s (a table's first write in the process)\n"
                  f"  after last commit {_spread([r['after_last_commit_s'] for r in reports])} s\n"
                  f"  tables committed {reports[0]['tables']} (the first writer's, in order)", flush=True)
    finally:
        if server is not None:
            server.stop()
    return results


if __name__ == "__main__":
    main()
