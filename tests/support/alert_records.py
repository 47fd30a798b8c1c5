"""Hand-built StepRecords for the alerts tests: exact loads, so expected signals are known."""

from __future__ import annotations

import datetime as dt

import numpy as np

from moescope.core.records import LayerInfo, LayerStep, Routes, RunInfo, StepRecord
from moescope.store.writer import ParquetExporter

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
EXPERTS = 8
TOP_K = 2
PARAMS_PER_EXPERT = 1000
TOTAL_PARAMS = 100_000


def routes_for(load: np.ndarray, seq_len: int = 16, sticky: bool = False, rng=None) -> Routes:
    """Routes whose top-1 choices reproduce `load` exactly (second choice: the next expert)."""
    top1 = np.repeat(np.arange(load.size), load)
    if not sticky:
        (rng or np.random.default_rng(0)).shuffle(top1)
    ids = np.stack([top1, (top1 + 1) % load.size], axis=1).astype(np.int32)
    n = len(top1)
    return Routes(
        expert_ids=ids,
        gate_weights=np.full(ids.shape, 0.5, dtype=np.float32),
        kept=np.ones(ids.shape, dtype=bool),
        token_ids=None,
        sequence=(np.arange(n) // seq_len).astype(np.int32),
        position=(np.arange(n) % seq_len).astype(np.int32),
    )


def layer_step(layer: int, load, entropy: float = 1.5, dropped: int = 0, capacity_use=None, routes=False) -> LayerStep:
    load = np.asarray(load, dtype=np.int64)
    tokens = int(load.sum())
    return LayerStep(
        layer=layer,
        tokens=tokens,
        expert_load=load,
        gate_weight_sum=load.astype(np.float64) * 0.5,
        router_entropy_mean=entropy,
        router_entropy_p95=entropy * 1.2,
        top1_margin_mean=0.1,
        dropped_tokens=dropped,
        dropped_assignments=dropped,
        capacity=None if capacity_use is None else 100,
        capacity_use=capacity_use,
        active_params_per_token=TOP_K * PARAMS_PER_EXPERT,
        routes=routes_for(load) if routes else None,
    )


def step_record(step: int, layers: list[LayerStep], run_id: str = "run-a", seconds_per_step: float = 1.0) -> StepRecord:
    tokens = max((ls.tokens for ls in layers), default=0)
    return StepRecord(
        run_id=run_id,
        step=step,
        ts=T0 + dt.timedelta(seconds=step * seconds_per_step),
        duration_s=0.01,
        tokens=tokens,
        batch_size=1,
        seq_len=tokens,
        active_params=TOP_K * PARAMS_PER_EXPERT * len(layers) + 50_000,
        total_params=TOTAL_PARAMS,
        layers=layers,
    )


BALANCED = [16] * EXPERTS
SKEWED = [72, 8, 8, 8, 8, 8, 8, 8]  # max/mean = 72 / 16 = 4.5, same 128 tokens


def drift_per_1000(routes_per_step: list[Routes]) -> float:
    """Top-1 changes per 1000 adjacent token pairs, by a plain loop: two tokens are adjacent when they
    are neighbours in the same batch row of the same step."""
    pairs = changes = 0
    for routes in routes_per_step:
        where = {(int(s), int(p)): int(e) for s, p, e in zip(routes.sequence, routes.position, routes.expert_ids[:, 0])}
        for (sequence, position), expert in where.items():
            following = where.get((sequence, position + 1))
            if following is not None:
                pairs += 1
                changes += following != expert
    return changes * 1000 / pairs

def run_info(run_id="run-a"):
    layers = tuple(LayerInfo(layer=i, module=f"m.{i}", family="test", num_experts=EXPERTS, top_k=2,
                             params_per_expert=1000) for i in range(2))
    return RunInfo(run_id=run_id, started_at=T0, model_class="Tiny", total_params=100_000,
                   routed_expert_params=16_000, tags={}, layers=layers)


def write_steps(root, steps_loads, run_id="run-a", start=0, close=True):
    """Write the steps as a probe session would; `close=False` leaves the run going (no run_ends row)."""
    exporter = ParquetExporter(root, run_info(run_id), max_age_s=0)
    exporter.export([step_record(start + i, [layer_step(0, load, routes=True), layer_step(1, BALANCED, routes=True)],
                                 run_id=run_id) for i, load in enumerate(steps_loads)])
    if close:
        exporter.shutdown()
    else:
        exporter.force_flush()
    return exporter
