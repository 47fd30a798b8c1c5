"""Store benchmark: writer throughput, bytes per route row, query latency after compaction.

    python bench/store.py                 # 50 M route rows (about 2 minutes and 1 GB of disk)
    python bench/store.py --rows 2000000  # a quick look

Records are synthetic but complete (`StepRecord`s with routes, loads that are the bincount of the
routes), generated vectorised off the clock and written through the real exporter on
one pinned core. Targets: writer >= 2 M route rows/s on one core; p50 <= 300 ms for the heatmap,
drift and token-lookup queries after compaction.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from moescope.probe.records import LayerInfo, LayerStep, Routes, RunInfo, StepRecord
from moescope.store import Store
from moescope.store.compact import compact
from moescope.store.writer import ParquetExporter

WRITER_TARGET = 2_000_000
QUERY_TARGET_MS = 300.0


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


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _p50(fn, repeats: int) -> float:
    fn()  # the first run warms the footer cache, as a dashboard's would be
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=float, default=50e6, help="route rows to write (default 50e6)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step and layer")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per query (median reported)")
    parser.add_argument("--root", help="store folder (default: a temporary folder, removed after)")
    parser.add_argument("--keep", action="store_true", help="keep the store folder")
    args = parser.parse_args(argv)

    root = args.root or tempfile.mkdtemp(prefix="moescope-bench-")
    shutil.rmtree(root, ignore_errors=True)
    per_step = args.layers * args.tokens
    steps = max(1, int(args.rows) // per_step)
    rows = steps * per_step
    run_id = "bench"
    rng = np.random.default_rng(0)
    skews = rng.dirichlet(np.ones(args.experts) * 0.5, size=args.layers)
    run = RunInfo(run_id=run_id, started_at=dt.datetime.now(dt.timezone.utc), model_class="Bench",
                  total_params=10**8, routed_expert_params=9 * 10**7, tags={"bench": "store"},
                  layers=tuple(LayerInfo(i, f"layers.{i}", "bench", args.experts, args.top_k, 10**6)
                               for i in range(args.layers)))
    print(f"store benchmark: {rows:,} route rows = {steps} steps x {args.layers} layers x {args.tokens} tokens, "
          f"{args.experts} experts, top-{args.top_k}; store at {root}")

    # 1. writer: the exporter's work (records -> Arrow -> Parquet, fsync, rename) on one core
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    exporter = ParquetExporter(root, run, max_age_s=1e9)
    written = 0
    busy = 0.0
    try:
        for step in range(steps):
            record = _record(run_id, step, args.layers, args.experts, args.top_k, args.tokens, skews, rng,
                             {"split": "train" if step % 10 else "eval"})  # generated off the clock
            started = time.perf_counter()
            exporter.export([record])
            busy += time.perf_counter() - started
            written += per_step
        started = time.perf_counter()
        exporter.shutdown()
        busy += time.perf_counter() - started
    finally:
        os.sched_setaffinity(0, cores)
    writer_rate = rows / busy
    routes_bytes = _du(os.path.join(root, "routes"))
    files_before = len(os.listdir(os.path.join(root, "routes", f"run_id={run_id}")))
    print(f"writer: {writer_rate / 1e6:.2f} M route rows/s on one core "
          f"({writer_rate / WRITER_TARGET:.2f}x the 2 M/s target); {files_before} route files, "
          f"{routes_bytes / rows:.2f} bytes/route row as written")

    # 2. compaction
    started = time.perf_counter()
    compact(root, retention_hours=0.0)
    compact_s = time.perf_counter() - started
    compacted_bytes = _du(os.path.join(root, "routes"))
    files_after = len(os.listdir(os.path.join(root, "routes", f"run_id={run_id}")))
    print(f"compaction: {compact_s:.1f} s ({rows / compact_s / 1e6:.2f} M rows/s), {files_before} -> {files_after} "
          f"route files, {compacted_bytes / rows:.2f} bytes/route row after ({compacted_bytes / 1e6:.0f} MB)")

    # 3. queries
    store = Store(root)
    layer, expert = args.layers // 2, 7 % args.experts
    window = max(1, steps // 20)
    queries = {
        "heatmap (load_matrix, 1 layer, 100 buckets)":
            lambda: store.load_matrix(run_id, layer, bucket_steps=max(1, steps // 100)),
        "drift (drift_windows, all layers, 20 windows)": lambda: store.drift_windows(run_id, window),
        "token lookup (expert_routes, 1000 tokens)": lambda: store.expert_routes(run_id, layer, expert, limit=1000),
        "token lookup in a 100-step window": lambda: store.expert_routes(
            run_id, layer, expert, step_from=steps // 2, step_to=steps // 2 + 100, limit=1000),
    }
    figures = {"writer_rows_per_s": writer_rate, "bytes_per_route_row": compacted_bytes / rows,
               "bytes_per_route_row_written": routes_bytes / rows, "compact_s": compact_s}
    for name, query in queries.items():
        p50 = _p50(query, args.repeats)
        figures[name] = p50
        print(f"query p50 {p50:8.1f} ms  {name}  ({p50 / QUERY_TARGET_MS:.2f}x the 300 ms budget)")
    assert len(store.expert_routes(run_id, layer, expert, limit=1000)) == 1000 or rows < 1_000_000
    store.close()
    if not args.keep and not args.root:
        shutil.rmtree(root, ignore_errors=True)
    return figures


if __name__ == "__main__":
    main()
