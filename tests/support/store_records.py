"""Synthetic but complete probe records, and a writer process, for the store tests and benchmark.

Records are built the way the probe builds them (loads are the bincount of the kept route slots,
co-selection counts the pairs), so brute-force checks can recompute every aggregate from them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time

import numpy as np

from moescope.core.records import LayerInfo, LayerStep, Routes, RunInfo, StepRecord


def run_info(run_id: str, layers: int = 3, experts: int = 6, top_k: int = 2, rank: int = 0,
             world_size: int = 1, tags: dict | None = None) -> RunInfo:
    return RunInfo(run_id=run_id, started_at=dt.datetime.now(dt.timezone.utc), model_class="Synthetic",
                   total_params=1000, routed_expert_params=600, tags=dict(tags or {}), rank=rank,
                   world_size=world_size,
                   layers=tuple(LayerInfo(layer=i, module=f"layers.{i}.moe", family="synthetic", num_experts=experts,
                                          top_k=top_k, params_per_expert=100) for i in range(layers)))


def make_record(run_id: str, step: int, rng: np.random.Generator, layers: int = 3, experts: int = 6,
                top_k: int = 2, tokens: int = 16, tags: dict | None = None, skew: float = 0.0,
                drop_rate: float = 0.1) -> StepRecord:
    layer_steps = []
    for layer in range(layers):
        p = np.ones(experts) + skew * np.arange(experts)
        p /= p.sum()
        ids = np.stack([rng.choice(experts, size=top_k, replace=False, p=p) for _ in range(tokens)]).astype(np.int32)
        weights = rng.random((tokens, top_k)).astype(np.float32)
        kept = rng.random((tokens, top_k)) >= drop_rate
        load = np.bincount(ids[kept], minlength=experts).astype(np.int64)
        cosel = np.zeros((experts, experts), dtype=np.int64)
        for row in ids:
            cosel[np.ix_(row, row)] += 1
        entropy = float(rng.random() * 2)
        routes = Routes(expert_ids=ids, gate_weights=weights, kept=kept,
                        token_ids=rng.integers(0, 1000, tokens), sequence=(np.arange(tokens) // 8).astype(np.int32),
                        position=(np.arange(tokens) % 8).astype(np.int32))
        layer_steps.append(LayerStep(
            layer=layer, tokens=tokens, expert_load=load, gate_weight_sum=np.zeros(experts),
            router_entropy_mean=entropy, router_entropy_p95=entropy, top1_margin_mean=0.1,
            dropped_tokens=int((~kept).all(axis=1).sum()), dropped_assignments=int((~kept).sum()),
            capacity=None, capacity_use=None, active_params_per_token=float(kept.sum()) / tokens * 100,
            router_prob_sum=np.ones(experts), coselection=cosel, routes=routes))
    active = 400 + sum(ls.active_params_per_token for ls in layer_steps)
    return StepRecord(run_id=run_id, step=step, ts=dt.datetime.now(dt.timezone.utc), duration_s=0.01, tokens=tokens,
                      batch_size=tokens // 8, seq_len=8, active_params=active, total_params=1000,
                      tags=dict(tags or {}), layers=layer_steps)


def main(argv: list[str] | None = None) -> int:
    """A writer process: emits `--steps` records of one run through the real write path."""
    from moescope.core.pipeline import BatchProcessor
    from moescope.store.exporter import DeltaExporter

    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--flush", type=float, default=0.2)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.rank)
    run = run_info(args.run, rank=args.rank)
    processor = BatchProcessor([], flush_interval_s=args.flush)
    processor.add_exporter(DeltaExporter(args.store, run, max_age_s=args.flush, processor=processor))
    for step in range(args.steps):
        processor.emit(make_record(args.run, step, rng))
        print(f"emitted {step} {time.monotonic():.6f}", flush=True)
        time.sleep(args.sleep)
    processor.shutdown()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
