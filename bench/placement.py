"""What a placement's figures and its what-if cost on a recorded run of 64 experts (issue 35, part 4).

    .venv/bin/python bench/placement.py                       # 64 experts x 48 layers, ~1 M routes rows
    .venv/bin/python bench/placement.py --store /tmp/pl-bench  # keep (or reuse) the recorded store
    .venv/bin/python bench/placement.py --rounds 5 --ranks 16

Records a run through the real write path (ParquetExporter): every step routes `--tokens` tokens
through `--layers` MoE layers of `--experts` experts, top-`--top-k`, with a Zipf-like popularity
whose order drifts (two neighbours swap per layer and step, so a fitted placement decays), and keeps
the per-token routes
(layers x tokens x steps rows: 48 x 512 x 41 = 1.0 M by default). Then times, median of `--rounds`:

- report, slots: `placement_report` over the run's `layer_steps` (one query, no routes);
- report, + tokens (even / vLLM / TensorRT-LLM): the same plus the distinct tokens per rank from
  every routes row under that engine's choice of copy (an EPLB placement with redundant slots, so
  copies are chosen);
- EPLB fit: `eplb.eplb` on one window's loads, all layers;
- what-if: `placement_whatif` with the default layout, EPLB, the load-aware mapping and EPLB
  refitted every window, over windows of `--window` steps.

Each line gives the median, the 90th percentile and the ratio to the slots-only report. The
Prometheus exporter's cost per window at 64 experts x 48 layers is measured by
bench/prometheus_exporter.py (the exporter's own benchmark), not here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":
    sys.path.insert(0, REPO)


def record_run(root: str, experts: int, layers: int, top_k: int, tokens: int, steps: int, seed: int = 0) -> int:
    """Write the run `bench` into `root`; returns the routes rows written."""
    from tqdm import tqdm

    from moescope.core.records import LayerInfo, LayerStep, Routes, RunInfo, StepRecord
    from moescope.store.writer import ParquetExporter

    rng = np.random.default_rng(seed)
    info = RunInfo(run_id="bench", started_at=dt.datetime.now(dt.timezone.utc), model_class="Synthetic",
                   total_params=10**9, routed_expert_params=9 * 10**8, tags={}, rank=0, world_size=1,
                   layers=tuple(LayerInfo(layer=i, module=f"layers.{i}.mlp", family="synthetic", num_experts=experts,
                                          top_k=top_k, params_per_expert=10**6) for i in range(layers)))
    exporter = ParquetExporter(root, info)
    ranks_of = [rng.permutation(experts) for _ in range(layers)]  # each layer's popularity order
    popularity = 1.0 / np.arange(1, experts + 1) ** 0.9
    for step in tqdm(range(steps), desc="recording", unit="step", leave=False):
        layer_steps = []
        for layer in range(layers):
            order = ranks_of[layer]  # traffic shifts: two neighbours in the popularity order swap, per layer and step
            i = rng.integers(0, experts - 1)
            order[[i, i + 1]] = order[[i + 1, i]]
            logp = np.log(popularity[np.argsort(order)])
            scores = logp + rng.gumbel(size=(tokens, experts))  # top-k without replacement, by popularity
            ids = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k].astype(np.int32)
            kept = np.ones((tokens, top_k), dtype=bool)
            load = np.bincount(ids.reshape(-1), minlength=experts).astype(np.int64)
            routes = Routes(expert_ids=ids, gate_weights=np.full((tokens, top_k), 1.0 / top_k, np.float32), kept=kept,
                            token_ids=rng.integers(0, 32000, tokens),
                            sequence=(np.arange(tokens) // 128).astype(np.int32),
                            position=(np.arange(tokens) % 128).astype(np.int32))
            layer_steps.append(LayerStep(
                layer=layer, tokens=tokens, expert_load=load, gate_weight_sum=load / top_k, router_entropy_mean=2.0,
                router_entropy_p95=3.0, top1_margin_mean=0.1, dropped_tokens=0, dropped_assignments=0, capacity=None,
                capacity_use=None, active_params_per_token=top_k * 1e6,
                router_prob_sum=np.full(experts, tokens / experts), coselection=None, routes=routes))
        exporter.export([StepRecord(run_id="bench", step=step, ts=dt.datetime.now(dt.timezone.utc), duration_s=0.05,
                                    tokens=tokens, batch_size=tokens // 128, seq_len=128, active_params=1e8,
                                    total_params=10**9, tags={}, layers=layer_steps)])
    exporter.shutdown()
    return layers * tokens * steps


def timed(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--store", help="where to record (reused when it holds the run); default: a temporary folder")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per step")
    parser.add_argument("--steps", type=int, default=41)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--redundant", type=int, default=8, help="EPLB's extra slots (default 8)")
    parser.add_argument("--window", type=int, default=8, help="what-if window, steps (default 8)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from moescope.analyses.placement import placement_report
    from moescope.analyses.placement_whatif import WhatIfSetup, placement_whatif
    from moescope.metrics.eplb import eplb
    from moescope.metrics.placement import Placement
    from moescope.store import Store

    root = args.store or os.path.join(tempfile.mkdtemp(prefix="moescope-placement-"), "store")
    routes = args.layers * args.tokens * args.steps
    fresh = not os.path.isdir(os.path.join(root, "routes"))
    if fresh:
        start = time.perf_counter()
        routes = record_run(root, args.experts, args.layers, args.top_k, args.tokens, args.steps)
        print(f"recorded {routes:,} routes rows ({args.layers} layers x {args.tokens} tokens x {args.steps} steps, "
              f"{args.experts} experts, top-{args.top_k}) in {time.perf_counter() - start:.1f} s into {root}")
    else:
        print(f"reusing the run in {root}")
    contiguous = Placement.contiguous(args.ranks)
    with Store(root) as store:
        totals = store.window_loads("bench", 10**9)
        loads = np.zeros((args.layers, args.experts))
        np.add.at(loads, (totals.layer.to_numpy(), totals.expert.to_numpy()), totals.load.to_numpy(float))
        fitted = eplb(loads, args.ranks, redundant=args.redundant)
        cases = {
            "report, slots": lambda: placement_report(store, "bench", contiguous, tokens=False),
            "report, + tokens (even)": lambda: placement_report(store, "bench", fitted, dispatch="even"),
            "report, + tokens (vllm)": lambda: placement_report(store, "bench", fitted, dispatch="vllm"),
            "report, + tokens (trtllm)": lambda: placement_report(store, "bench", fitted, dispatch="trtllm"),
            f"EPLB fit ({args.layers} layers)": lambda: eplb(loads, args.ranks, redundant=args.redundant),
            "what-if (4 candidates)": lambda: placement_whatif(
                store, "bench", args.window, WhatIfSetup(ranks=args.ranks, redundant=args.redundant, rebalance_every=1),
                dispatch="even"),
        }
        results = {name: timed(fn, args.rounds) for name, fn in cases.items()}
        report = placement_whatif(store, "bench", args.window,
                                  WhatIfSetup(ranks=args.ranks, redundant=args.redundant, rebalance_every=1))
    base = statistics.median(results["report, slots"])
    print(f"\n{args.rounds} rounds; {routes:,} routes rows, {args.experts} experts x {args.layers} layers, "
          f"{args.ranks} ranks, {args.redundant} redundant slots; {os.cpu_count()} CPUs")
    print(f"{'':<32}{'median s':>10}{'p90 s':>10}{'x slots':>10}")
    for name, times in results.items():
        p90 = sorted(times)[max(0, int(round(0.9 * len(times))) - 1)]
        print(f"{name:<32}{statistics.median(times):>10.3f}{p90:>10.3f}{statistics.median(times) / base:>10.2f}")
    print("\nwhat-if figures (balancedness of the whole forward):")
    print(report.figures().round(3).to_string(index=False))
    print("\nthe Prometheus exporter's cost per window at 64 x 48: bench/prometheus_exporter.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
