"""The per-layer summary printed by `moescope summary STORE` and at the end of the demo."""

from __future__ import annotations

import math
import os

import numpy as np

from store import Store
from store.queries import STEPS


def layer_rows(store: Store, run_id: str) -> list[dict]:
    """Per MoE layer of a run: tokens, load spread, entropy, drops. Computed from the store."""
    layers = store.layers(run_id)
    summary = store.layer_summary(run_id)
    experts = dict(zip(layers.layer, layers.num_experts))
    rows = []
    for row in summary.itertuples():
        load = np.asarray(row.expert_load, dtype=np.float64)[: experts.get(row.layer, len(row.expert_load))]
        mean = load.mean() if load.size else 0.0
        rows.append(dict(
            layer=int(row.layer), tokens=int(row.tokens or 0),
            max_over_mean=float(load.max() / mean) if mean else math.nan,
            load_cv=float(load.std() / mean) if mean else math.nan,
            dead_experts=int((load == 0).sum()),
            entropy=float(row.router_entropy_mean),
            entropy_norm=float(row.router_entropy_mean / math.log(len(load))) if len(load) > 1 else math.nan,
            dropped_tokens=int(row.dropped_tokens or 0)))
    return rows


def format_summary(root: str | os.PathLike, run_id: str | None = None) -> str:
    """A plain-text report of one run (the latest by default); raises EmptyStoreError if none."""
    store = Store(root)
    run_id = run_id or store.latest_run()
    run = store.sql("SELECT model_class, total_params FROM runs WHERE run_id = ? LIMIT 1", [run_id])
    steps = store.sql(f"""SELECT {STEPS} AS steps, coalesce(sum(tokens), 0) AS tokens,
                                sum(active_params * tokens) / nullif(sum(tokens), 0) AS active_params
                         FROM steps WHERE run_id = ?""", [run_id])
    total = int(run.total_params[0])
    active = float(steps.active_params[0]) if steps.steps[0] else math.nan
    lines = [
        f"run {run_id}: {run.model_class[0]}, {total:,} parameters",
        f"{int(steps.steps[0]):,} forwards, {int(steps.tokens[0]):,} tokens; "
        f"active parameters per token {active:,.0f} = {100 * active / total:.1f}% of the model",
        "",
        f"{'layer':>5} {'tokens':>10} {'max/mean':>9} {'load CV':>8} {'dead':>5} {'entropy':>8} "
        f"{'H/log E':>8} {'dropped':>8}",
    ]
    for r in layer_rows(store, run_id):
        lines.append(f"{r['layer']:>5} {r['tokens']:>10,} {r['max_over_mean']:>9.2f} {r['load_cv']:>8.2f} "
                     f"{r['dead_experts']:>5} {r['entropy']:>8.3f} {r['entropy_norm']:>8.3f} "
                     f"{r['dropped_tokens']:>8,}")
    tags = store.sql(f"""SELECT t.key AS key, t.value AS value, {STEPS} AS steps,
                               sum(active_param_fraction * tokens) / sum(tokens) AS active
                        FROM (SELECT unnest(map_entries(tags)) AS t, active_param_fraction, tokens, forwards, rank
                              FROM steps WHERE run_id = ?)
                        GROUP BY key, value ORDER BY key, value LIMIT 50""", [run_id])
    if not tags.empty:
        lines += ["", "by tag:"]
        lines += [f"  {r.key}={r.value}: {r.steps:,} forwards, active fraction {100 * r.active:.2f}%"
                  for r in tags.itertuples()]
    root = os.path.abspath(os.fspath(root))
    lines += [
        "",
        f"files: {root}/<table>/run_id={run_id}/*.parquet",
        "try:  duckdb -c \"SELECT layer, expert_ids, count(*) FROM read_parquet("
        f"'{root}/routes/**/*.parquet') GROUP BY ALL ORDER BY 3 DESC LIMIT 10\"",
    ]
    return "\n".join(lines)
