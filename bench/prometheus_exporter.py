"""What the Prometheus exporter costs per window at 64 experts x 48 layers (issue 35, parts 3 and 4).

A window is one record the probe hands the exporter (one forward, or the probe's window of several):
`export()` keeps it in each layer's history and, with K > 0, updates the layer's hottest and coldest
experts and their grace periods. A scrape (`generate_latest`, what `/metrics` answers) computes
every gauge from the histories. Both run on the probe's writer thread or the HTTP server's, never
on the model's. Three settings side by side:

- summaries: the per-layer gauges alone (`hot_cold_experts=0`, no placement);
- hot/cold K=4: plus the 4 hottest and 4 coldest experts per layer, dead experts and fairness
  (the default);
- + placement: plus the rank figures under a contiguous placement on 8 ranks.

The records are synthetic and fixed by a seed: 48 layers of 64 experts, 256 tokens a window, top-8,
expert popularities (Dirichlet 0.5) that drift every 50 windows so the hot and cold sets churn. The
histories are filled (`window_steps` records) before timing. Medians of `--windows` exports and of
`--scrapes` scrapes, with the process CPU time per call beside the wall time, since wall time on a
shared machine moves with its load; the ratios to the summaries' are of CPU time.

    python bench/prometheus_exporter.py
    python bench/prometheus_exporter.py --windows 200 --scrapes 10
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from moescope.analyses.placement import Placement
from moescope.core.records import LayerStep, StepRecord
from moescope.prometheus.exporter import PrometheusExporter

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def records(count: int, layers: int, experts: int, tokens: int, top_k: int, seed: int) -> list[StepRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for step in range(count):
        if step % 50 == 0:
            popularity = rng.dirichlet(np.full(experts, 0.5), size=layers)
        steps = []
        for layer in range(layers):
            load = rng.multinomial(tokens * top_k, popularity[layer]).astype(np.int64)
            steps.append(LayerStep(
                layer=layer, tokens=tokens, expert_load=load, gate_weight_sum=load / top_k,
                router_entropy_mean=1.5, router_entropy_p95=2.0, top1_margin_mean=0.1, dropped_tokens=0,
                dropped_assignments=0, capacity=None, capacity_use=None, active_params_per_token=1000.0))
        out.append(StepRecord(run_id="bench", step=step, ts=T0 + dt.timedelta(seconds=step), duration_s=0.01,
                              tokens=tokens, batch_size=1, seq_len=tokens, active_params=1e6, total_params=10**7,
                              layers=steps))
    return out


def timed(fn, calls) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds of `fn(i)` over `calls` calls."""
    walls, cpus = [], []
    for i in range(calls):
        wall, cpu = time.perf_counter(), time.process_time()
        fn(i)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--windows", type=int, default=500, help="exports timed per setting (default 500)")
    parser.add_argument("--scrapes", type=int, default=20, help="scrapes timed per setting (default 20)")
    parser.add_argument("--window-steps", type=int, default=32, help="the exporter's window (default 32)")
    args = parser.parse_args(argv)

    feed = records(args.window_steps + args.windows, args.layers, args.experts, 256, 8, seed=0)
    settings = {
        "summaries": dict(hot_cold_experts=0),
        "hot/cold K=4": dict(hot_cold_experts=4),
        "+ placement": dict(hot_cold_experts=4, placement=Placement.contiguous(args.ranks)),
    }
    print(f"{args.layers} layers x {args.experts} experts ({args.ranks} ranks for the placement), window of "
          f"{args.window_steps}; medians of {args.windows} exports and {args.scrapes} scrapes; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'setting':<14} {'export ms':>10} {'CPU ms':>8} {'scrape ms':>10} {'CPU ms':>8} {'series':>7} "
          f"{'export x':>9} {'scrape x':>9}")
    base = None
    for name, kwargs in settings.items():
        registry = CollectorRegistry()
        exporter = PrometheusExporter(registry=registry, window_steps=args.window_steps, **kwargs)
        exporter.export(feed[:args.window_steps])  # full histories
        export_wall, export_cpu = timed(lambda i: exporter.export([feed[args.window_steps + i]]), args.windows)
        scrape_wall, scrape_cpu = timed(lambda i: generate_latest(registry), args.scrapes)
        series = sum(len(m.samples) for m in registry.collect())
        base = base or (export_cpu, scrape_cpu)
        print(f"{name:<14} {1e3 * export_wall:>10.3f} {1e3 * export_cpu:>8.3f} {1e3 * scrape_wall:>10.1f} "
              f"{1e3 * scrape_cpu:>8.1f} {series:>7} {export_cpu / base[0]:>9.2f} {scrape_cpu / base[1]:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
