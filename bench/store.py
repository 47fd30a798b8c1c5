"""Store benchmark: writer throughput, query latency and compaction, on local disk and on S3, side by side.

    python bench/store.py                      # 50 M route rows to a temporary folder
    python bench/store.py --s3                 # the same, and beside it the same to a local S3 server (moto)
    python bench/store.py --store s3           # only the local S3 server
    python bench/store.py --store s3://bucket/prefix --storage-option endpoint=http://host:9000
    python bench/store.py --rows 2000000 --s3  # a quick look

Each store (`--store`, repeatable: a folder, an object-storage URL, or `s3` for a moto server this
script starts in its own process from tests/support/s3server.py and stops at the end) gets the same run:

1. writer: synthetic but complete `StepRecord`s (routes, loads that are the bincount of the routes),
   generated off the clock, written through the real exporter (`ParquetExporter`: Arrow, Parquet with
   page checksums, one Delta commit per part) in this one process, pinned to one core. Reported as
   route rows/s of wall time spent in the exporter, median and range over `--segments` consecutive
   stretches of the run, and as rows per CPU-second of this process. Targets: >= 2 M/s to local disk,
   >= 1 M/s to S3.
2. compaction: the run's small files (one per 256 K rows, as the probe flushes them) merged into
   large sorted ones and committed (`moescope.store.compact`); one timing, it cannot be repeated on
   the same files; wall time (it reads sources on several threads, not pinned) and this process's
   CPU-seconds, the data files it read and wrote (`CompactResult.io`) and, on the local S3 server,
   every request it made (GET, PUT, ... counted at the server's door by tests/support/s3faults.py's
   proxy, whose hop is in its time). Target: <= 1.5 x the previous release's 27.6 s for 191 -> <= 8
   files (50 M rows).
3. queries after compaction: first the heatmap from a fresh process (its wall time from start to
   answer: interpreter, imports, every file checked, the query; median of three fresh processes
   straight to the server; goal <= 5 s through S3), then each
   query on a fresh `Store` (heatmap, drift, token lookup): median and range over `--repeats` timed
   runs after one warm-up. Targets: p50 <= 300 ms locally, <= 1 s through S3. On the local S3
   server (`s3`) the queries go through tests/support/s3faults.py's proxy, which counts every
   request at the server's door: a fourth fresh process's requests per data file (goal <= 3) and each
   query's requests are printed beside the times (the proxy's hop is in the times too).

The load average (`os.getloadavg()`) is printed beside each phase: on a shared machine the figures
move with it. Every store the script made is removed at the end (`--keep` keeps it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import numpy as np

from moescope.core.records import LayerInfo, LayerStep, Routes, RunInfo, StepRecord
from moescope.store import Store, delta
from moescope.store.compact import CompactIO, compact
from moescope.store.location import StoreLocation, open_location, parse_storage_options
from moescope.store.writer import ParquetExporter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRITER_TARGET = {"local": 2_000_000, "object": 1_000_000}
QUERY_TARGET_MS = {"local": 300.0, "object": 1000.0}
COMPACT_BEFORE_S = 27.6  # the previous release: 191 -> <= 8 route files of 50 M rows
COMPACT_TARGET_S = 1.5 * COMPACT_BEFORE_S
RUN_ID = "bench"
DEFAULT_MAX_ROWS = 256 * 1024  # ParquetExporter's: a part per 256 K rows of a table


def _layer_routes(tokens: int, experts: int, top_k: int, skew: np.ndarray, rng: np.random.Generator) -> Routes:
    """Fresh routing of one layer in one step: skewed expert choice, softmax-like gate weights."""
    first = rng.choice(experts, size=tokens, p=skew)
    ids = np.stack([first, (first + 1 + rng.integers(0, experts - 1, tokens)) % experts], axis=1)[:, :top_k]
    weights = rng.dirichlet(np.ones(top_k), size=tokens).astype(np.float32)
    return Routes(expert_ids=ids.astype(np.int32), gate_weights=weights, kept=np.ones((tokens, top_k), bool),
                  token_ids=rng.integers(0, 32_000, tokens), sequence=(np.arange(tokens) // 512).astype(np.int32),
                  position=(np.arange(tokens) % 512).astype(np.int32))


def _record(run_id: str, step: int, layers: int, experts: int, top_k: int, tokens: int, skews: np.ndarray,
            rng: np.random.Generator, tags: dict) -> StepRecord:
    layer_steps = []
    for layer in range(layers):
        routes = _layer_routes(tokens, experts, top_k, skews[layer], rng)
        load = np.bincount(routes.expert_ids.reshape(-1), minlength=experts).astype(np.int64)
        layer_steps.append(LayerStep(
            layer=layer, tokens=tokens, expert_load=load, gate_weight_sum=load.astype(np.float64) / 2,
            router_entropy_mean=2.0, router_entropy_p95=3.0, top1_margin_mean=0.1, dropped_tokens=0,
            dropped_assignments=0, capacity=None, capacity_use=None, active_params_per_token=1e6,
            router_prob_sum=np.full(experts, tokens / experts), routes=routes))
    return StepRecord(run_id=run_id, step=step, ts=dt.datetime.now(dt.timezone.utc), duration_s=0.1,
                      tokens=tokens, batch_size=max(1, tokens // 512), seq_len=512, active_params=1e7,
                      total_params=10**8, tags=tags, layers=layer_steps)


def _load() -> str:
    return "load " + "/".join(f"{x:.2f}" for x in os.getloadavg())


def _spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """`median [min-max, n=N]`."""
    return (f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}, "
            f"n={len(values)}]")


def _pin_process(cpus: set[int]) -> dict[int, set[int]]:
    """Pin every thread of this process (delta-rs's runtime threads too) to `cpus`; returns what each had."""
    before = {}
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    return before


def _unpin_process(before: dict[int, set[int]], default: set[int]) -> None:
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, before.get(tid, default))
        except OSError:
            pass


def _times(fn: Callable[[], Any], repeats: int, proxy: Any = None) -> tuple[list[float], list[int]]:
    """Milliseconds of each timed run after one warm-up, and the requests each made (counted by
    `proxy`, a tests/support/s3faults.py FaultProxy in front of the server; [] without one)."""
    fn()  # the first run after the reader opened, as a dashboard's would be
    times, requests = [], []
    for _ in range(repeats):
        if proxy is not None:
            proxy.reset_counts()
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
        if proxy is not None:
            requests.append(sum(proxy.counts()["requests"].values()))
    return times, requests


def _requests(proxy: Any) -> tuple[int, dict[str, list[str]]]:
    """All requests the proxy forwarded since its last reset, and those of each data file ("GET 206", ...)."""
    from urllib.parse import unquote

    per_file: dict[str, list[str]] = {}
    for method, path, outcome in proxy.log():
        path = unquote(path.split("?", 1)[0])
        if path.endswith(".parquet") and "/_delta_log/" not in path:  # a data file, not a log checkpoint
            per_file.setdefault(path, []).append(f"{method} {outcome}")
    return sum(proxy.counts()["requests"].values()), per_file


def first_query(args: argparse.Namespace) -> None:
    """In a fresh process (`--first-query`): open the store, answer the heatmap query; print the
    seconds from this process's start (as the parent measured none of it) and the answer's rows."""
    import json

    started = time.perf_counter()
    location = open_location(args.store[0], parse_storage_options(args.storage_option))
    store = Store(location)
    opened = time.perf_counter()
    print("opened", flush=True)
    sys.stdin.readline()  # the parent counts the opening's requests apart; its wait is taken off the clock
    waited = time.perf_counter() - opened
    frame = store.load_matrix(RUN_ID, args.layers // 2, bucket_steps=max(1, args.steps // 100))
    print(json.dumps({"open_s": opened - started, "query_s": time.perf_counter() - opened - waited,
                      "waited_s": waited, "rows": len(frame)}), flush=True)


def _route_files(loc: StoreLocation) -> tuple[int, int, int]:
    """(files, bytes, rows) of the run's route files in the table's latest snapshot."""
    snap = delta.snapshot(loc, "routes")
    parts = [p for p in snap.files if p.run_id == RUN_ID] if snap else []
    return len(parts), sum(p.size for p in parts), sum(p.rows for p in parts)


def bench_store(label: str, loc: StoreLocation, args: argparse.Namespace, server: Any = None) -> dict[str, Any]:
    """The writer, compaction and queries on one (empty) store; prints as it goes, returns the figures.
    `server`: the local S3 server `loc` is on (its queries are then counted through a proxy)."""
    kind = "local" if loc.is_local else "object"
    per_step = args.layers * args.tokens
    steps = max(1, int(args.rows) // per_step)
    rows = steps * per_step
    rng = np.random.default_rng(0)  # the same records for every store
    skews = rng.dirichlet(np.ones(args.experts) * 0.5, size=args.layers)
    run = RunInfo(run_id=RUN_ID, started_at=dt.datetime.now(dt.timezone.utc), model_class="Bench",
                  total_params=10**8, routed_expert_params=9 * 10**7, tags={"bench": "store"},
                  layers=tuple(LayerInfo(i, f"layers.{i}", "bench", args.experts, args.top_k, 10**6)
                               for i in range(args.layers)))
    print(f"\n== {label}: {loc.redacted} ({_load()})", flush=True)

    # 1. writer: the exporter's work (records -> Arrow -> Parquet -> upload -> Delta commit) on one core
    # stretches end where the exporter flushes (every 256 K rows), so each holds its share of the commits
    per_flush = -(-DEFAULT_MAX_ROWS // per_step)
    flushes = max(1, steps // per_flush)
    segments = max(1, min(args.segments, flushes))
    bounds = [round(i * flushes / segments) * per_flush for i in range(segments)] + [steps]
    cores = os.sched_getaffinity(0)
    pinned = _pin_process({min(cores)})
    rates: list[float] = []
    busy_total = cpu_total = 0.0
    try:
        exporter = ParquetExporter(loc, run, max_rows=DEFAULT_MAX_ROWS, max_age_s=1e9)  # flushes by size
        for i in range(segments):
            busy = cpu = 0.0
            for step in range(bounds[i], bounds[i + 1]):
                record = _record(RUN_ID, step, args.layers, args.experts, args.top_k, args.tokens, skews, rng,
                                 {"split": "train" if step % 10 else "eval"})  # generated off the clock
                started, cpu_started = time.perf_counter(), time.process_time()
                exporter.export([record])
                if step == steps - 1:
                    exporter.shutdown()
                busy += time.perf_counter() - started
                cpu += time.process_time() - cpu_started
            if busy > 0:
                rates.append((bounds[i + 1] - bounds[i]) * per_step / busy)
            busy_total += busy
            cpu_total += cpu
    finally:
        _unpin_process(pinned, cores)
    files_before, bytes_before, rows_written = _route_files(loc)
    assert rows_written == rows, f"{rows_written} route rows in the snapshot, {rows} written"
    target = WRITER_TARGET[kind]
    print(f"writer: {_spread([r / 1e6 for r in rates])} M route rows/s per process on one core "
          f"(median {statistics.median(rates) / target:.2f}x the {target / 1e6:.0f} M/s target; "
          f"overall {rows / busy_total / 1e6:.2f} M/s, {rows / cpu_total / 1e6:.2f} M rows per CPU-s); "
          f"{files_before} route files, {bytes_before / rows:.2f} bytes/route row as written ({_load()})", flush=True)

    # On the local S3 server, compaction and queries go through a proxy that counts every request at
    # the server's door (tests/support/s3faults.py; its hop is in their times).
    proxy, counted = None, loc
    if server is not None:
        if REPO not in sys.path:
            sys.path.insert(0, REPO)
        from tests.support.s3faults import FaultProxy

        proxy = FaultProxy(server.endpoint, lifetime_s=3 * 3600)
        counted = StoreLocation(loc.url, {**loc.storage_options, "AWS_ENDPOINT_URL": proxy.url})

    # 2. compaction
    started, cpu_started = time.perf_counter(), time.process_time()
    results = compact(counted, run_id=RUN_ID, retention_hours=0.0)
    compact_s = time.perf_counter() - started
    compact_io = sum((r.io for r in results), CompactIO())
    compact_requests = dict(sorted(proxy.counts()["requests"].items())) if proxy is not None else {}
    compact_cpu_s = time.process_time() - cpu_started  # this process's threads; a local S3 server's not included
    files_after, bytes_after, rows_after = _route_files(loc)
    assert rows_after == rows, f"{rows_after} route rows after compaction, {rows} before"
    print(f"compaction: {compact_s:.1f} s, n=1 ({rows / compact_s / 1e6:.2f} M rows/s, {compact_cpu_s:.1f} CPU-s of "
          f"this process), {files_before} -> "
          f"{files_after} route files, {bytes_after / rows:.2f} bytes/route row after ({bytes_after / 1e6:.0f} MB); "
          f"goal <= {COMPACT_TARGET_S:.1f} s for 50 M rows ({_load()})\n"
          f"  data files {compact_io}" + (f"; requests at the server {compact_requests}" if proxy else ""), flush=True)

    # 3. queries: the first from a fresh process, then the rest on a fresh reader; through a local S3
    # server, behind a counting proxy that counts every request at the server's door
    # The first query is timed straight to the server, as a reader meets it; through the counting proxy
    # (its hop streams every byte through Python, so it is not what a reader waits) a second fresh
    # process counts the requests and gives its own time beside.
    query_loc = counted
    runs = sorted((_first_query_process(loc, args, steps, None) for _ in range(3)), key=lambda f: f["wall_s"])
    fresh = {**runs[1], "wall_runs_s": [f["wall_s"] for f in runs]}  # the median of three fresh processes
    print(f"first query from a fresh process: {_spread(fresh['wall_runs_s'], '{:.2f}')} s from its start (the "
          f"median's open {fresh['open_s']:.2f} s, heatmap {fresh['query_s']:.2f} s; goal <= 5 s through S3) "
          f"({_load()})", flush=True)
    if proxy is not None:
        proxy.reset_counts()
        counted_fresh = _first_query_process(query_loc, args, steps, proxy)
        fresh.update({key: value for key, value in counted_fresh.items() if key not in fresh},
                     wall_through_proxy_s=counted_fresh["wall_s"])
        print(f"  the same through the counting proxy: {counted_fresh['wall_s']:.2f} s; opening: "
              f"{fresh['open_requests']} requests, at most {fresh['per_file']} for each of {fresh['files']} data "
              f"files (goal <= 3; the most: {', '.join(fresh['worst'])}), the rest the tables' logs; the query: "
              f"{fresh['query_requests']} ({_load()})", flush=True)
    if proxy is not None:
        proxy.reset_counts()
    store = Store(query_loc)
    layer, expert = args.layers // 2, 7 % args.experts
    window = max(1, steps // 20)
    queries = {
        "heatmap": ("load_matrix, 1 layer, 100 buckets",
                    lambda: store.load_matrix(RUN_ID, layer, bucket_steps=max(1, steps // 100))),
        "drift": ("drift_windows, all layers, 20 windows", lambda: store.drift_windows(RUN_ID, window)),
        "token lookup": ("expert_routes, 1000 tokens", lambda: store.expert_routes(RUN_ID, layer, expert, limit=1000)),
        "token lookup, 100 steps": ("expert_routes in a 100-step window", lambda: store.expert_routes(
            RUN_ID, layer, expert, step_from=steps // 2, step_to=steps // 2 + 100, limit=1000)),
    }
    budget = QUERY_TARGET_MS[kind]
    figures: dict[str, Any] = {
        "store": loc.redacted, "rows": rows, "writer_rows_per_s": statistics.median(rates),
        "writer_rates": rates, "writer_rows_per_cpu_s": rows / cpu_total, "files_before": files_before,
        "files_after": files_after, "bytes_per_route_row_written": bytes_before / rows,
        "bytes_per_route_row": bytes_after / rows, "compact_s": compact_s, "compact_cpu_s": compact_cpu_s,
        "compact_io": str(compact_io), "compact_requests": compact_requests,
        "queries_ms": {}, "query_requests": {}, "first_query": fresh,
    }
    try:
        for name, (what, query) in queries.items():
            times, requests = _times(query, args.repeats, proxy)
            figures["queries_ms"][name] = times
            figures["query_requests"][name] = requests
            print(f"query {name:<24} p50 {_spread(times, '{:.1f}')} ms  ({what}; "
                  f"{statistics.median(times) / budget:.2f}x the {budget:.0f} ms budget)"
                  + (f"; {statistics.median(requests):.0f} requests" if requests else ""), flush=True)
        assert len(store.expert_routes(RUN_ID, layer, expert, limit=1000)) == 1000 or rows < 1_000_000
    finally:
        store.close()
        if proxy is not None:
            proxy.stop()
    figures["load"] = os.getloadavg()
    return figures


def _first_query_process(loc: StoreLocation, args: argparse.Namespace, steps: int, proxy: Any) -> dict[str, Any]:
    """`first_query` in a fresh interpreter; its figures, the wall time from its start to its answer,
    and, through `proxy`, the requests of its opening (per data file too) and of its query."""
    import json
    import subprocess

    command = [sys.executable, os.path.abspath(__file__), "--first-query", "--store", loc.url, "--layers",
               str(args.layers), "--steps", str(steps)]
    command += [f"--storage-option={k}={v}" for k, v in loc.storage_options.items()]
    started = time.perf_counter()
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert child.stdin is not None and child.stdout is not None
    if child.stdout.readline().strip() != "opened":
        raise RuntimeError(f"the first-query process failed (exit {child.wait()})")
    if proxy is not None:
        _, per_file = _requests(proxy)
        opening = sum(proxy.counts()["requests"].values())
    child.stdin.write("\n")
    child.stdin.flush()
    figures = json.loads(child.stdout.readline())
    child.wait()
    figures["wall_s"] = time.perf_counter() - started - figures.pop("waited_s")
    if proxy is not None:
        worst_path = max(per_file, key=lambda path: len(per_file[path]), default="")
        worst = [*per_file.get(worst_path, []), worst_path.rsplit("/", 3)[-3] if worst_path else ""]
        figures.update(open_requests=opening, files=len(per_file), per_file=len(worst) - 1, worst=worst,
                       query_requests=sum(proxy.counts()["requests"].values()) - opening)
    return figures


def _summary(results: dict[str, dict[str, Any]]) -> None:
    labels = list(results)
    width = max(14, *(len(label) for label in labels))

    def row(name: str, cell: Callable[[dict[str, Any]], str]) -> None:
        print(f"{name:<30}" + "".join(f"{cell(results[label]):>{width + 12}}" for label in labels))

    print("\n== side by side (medians [min-max, n])")
    row("store", lambda f: f["store"][-(width + 10):])
    row("route rows", lambda f: f"{f['rows']:,}")
    row("writer M rows/s per process", lambda f: _spread([r / 1e6 for r in f["writer_rates"]]))
    row("writer M rows per CPU-s", lambda f: f"{f['writer_rows_per_cpu_s'] / 1e6:.2f}")
    row("compaction s (files)", lambda f: f"{f['compact_s']:.1f} ({f['files_before']} -> {f['files_after']})")
    row("compaction CPU-s", lambda f: f"{f['compact_cpu_s']:.1f}")
    row("bytes/route row compacted", lambda f: f"{f['bytes_per_route_row']:.2f}")
    row("first query s, fresh process", lambda f: f"{f['first_query']['wall_s']:.2f}")
    for name in next(iter(results.values()))["queries_ms"]:
        row(f"{name} ms", lambda f, name=name: _spread(f["queries_ms"][name], "{:.1f}"))
        row(f"{name} requests", lambda f, name=name: (f"{statistics.median(f['query_requests'][name]):.0f}"
                                                      if f["query_requests"][name] else "-"))
    row("load average at end", lambda f: "/".join(f"{x:.2f}" for x in f["load"]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the first store's figures (all of them under "stores")."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=float, default=50e6, help="route rows to write per store (default 50e6)")
    parser.add_argument("--store", action="append", default=[],
                        help="a folder, an object-storage URL (a fresh prefix below it is used and removed), or "
                             "'s3' for a local moto S3 server started here; repeatable (default: a temporary folder)")
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="storage option for the --store URLs (endpoint, region, allow_http, ...)")
    parser.add_argument("--s3", action="store_true", help="also run on a local moto S3 server (same as --store s3)")
    parser.add_argument("--root", help="a local store folder (same as --store FOLDER)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step and layer")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per query after one warm-up")
    parser.add_argument("--segments", type=int, default=5, help="stretches of the write timed apart (spread)")
    parser.add_argument("--keep", action="store_true", help="keep the stores written")
    parser.add_argument("--first-query", action="store_true", help=argparse.SUPPRESS)  # the fresh process's part
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.first_query:
        first_query(args)
        return {}

    stores = list(args.store) + ([args.root] if args.root else []) or [""]  # "": a temporary folder
    if args.s3 and "s3" not in stores:
        stores.append("s3")
    options = parse_storage_options(args.storage_option)
    per_step = args.layers * args.tokens
    steps = max(1, int(args.rows) // per_step)
    print(f"store benchmark: {steps * per_step:,} route rows per store = {steps} steps x {args.layers} layers x "
          f"{args.tokens} tokens, {args.experts} experts, top-{args.top_k}; {os.cpu_count()} CPUs, {_load()}")

    results: dict[str, dict[str, Any]] = {}
    with ExitStack() as cleanup:
        for spec in stores:
            server = None
            if spec == "s3":
                server = _s3_server(cleanup)
                loc = server.location(f"bench-{uuid.uuid4().hex[:8]}")
                label = f"S3 (moto at {server.endpoint})"
            elif "://" in spec:
                base = open_location(spec, options)
                loc = StoreLocation(f"{base.url}/bench-{uuid.uuid4().hex[:8]}", base.storage_options)
                label = spec
                if not args.keep:
                    cleanup.callback(_remove_prefix, loc)
            else:
                folder = spec or tempfile.mkdtemp(prefix="moescope-bench-")
                shutil.rmtree(folder, ignore_errors=True)
                loc = open_location(folder)
                label = "local disk"
                if not args.keep and not spec:
                    cleanup.callback(shutil.rmtree, folder, True)
            results[label if label not in results else f"{label} #{len(results)}"] = bench_store(label, loc, args,
                                                                                                  server)
        if len(results) > 1:
            _summary(results)
    first = dict(next(iter(results.values())))
    first["stores"] = results
    return first


def _s3_server(cleanup: ExitStack) -> Any:
    """tests/support/s3server.py's moto server in its own process, stopped when `cleanup` closes."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from tests.support.s3server import S3Server

    server = S3Server(auth=False)  # signatures not checked: moto's Python would be the bottleneck twice over
    cleanup.callback(server.stop)
    return server.start()


def _remove_prefix(loc: StoreLocation) -> None:
    try:
        loc.filesystem().delete_dir(loc.join())
    except OSError as error:
        print(f"could not remove {loc.redacted}: {error}", file=sys.stderr)


if __name__ == "__main__":
    main()
