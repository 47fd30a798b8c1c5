"""The per-layer summary printed by `moescope summary STORE` and at the end of the demo.

Every figure comes from a `store.Store` query and an `alerts.signals` definition, the same the
dashboard shows under the same label.
"""

from __future__ import annotations

import math
import os

from moescope.alerts import signals
from moescope.store import Store


def layer_rows(store: Store, run_id: str) -> list[dict]:
    """Per MoE layer of a run: tokens, load spread (routed experts), router entropy (token-weighted,
    nats and H / ln E), dropped tokens and their rate. See `alerts.signals.layer_figures`."""
    rows = []
    for f in signals.layer_figures_of(store.layer_totals(run_id).itertuples()):
        rows.append(dict(
            layer=f.layer, tokens=f.tokens, max_over_mean=f.spread.max_mean, load_cv=f.spread.cv,
            dead_experts=f.spread.dead_experts, entropy=f.entropy.nats, entropy_norm=f.entropy.normalized,
            dropped_tokens=f.dropped_tokens, dropped_rate=f.dropped_token_rate))
    return rows


def _cell(value: float, spec: str, width: int) -> str:
    return f"{'—':>{width}}" if isinstance(value, float) and math.isnan(value) else f"{value:>{width}{spec}}"


def format_summary(root: str | os.PathLike, run_id: str | None = None) -> str:
    """A plain-text report of one run (the latest by default); raises EmptyStoreError if none."""
    store = Store(root)
    run_id = run_id or store.latest_run()
    info = store.run_info(run_id) or {"model_class": "?", "total_params": 0}
    steps = store.step_totals(run_id)
    total = int(info["total_params"] or 0)
    active = float(steps["active_params"]) if steps["steps"] and steps["active_params"] is not None else math.nan
    layers = signals.layer_figures_of(store.layer_totals(run_id).itertuples())
    run = signals.run_figures(layers)
    lines = [
        f"run {run_id}: {info['model_class']}, {total:,} parameters",
        f"{int(steps['steps']):,} forwards, {int(steps['tokens']):,} tokens; "
        f"active parameters per token {active:,.0f} = {100 * active / total:.1f}% of the model" if total else
        f"{int(steps['steps']):,} forwards, {int(steps['tokens']):,} tokens",
        "",
        f"{'layer':>5} {'tokens':>10} {'max/mean':>9} {'load CV':>8} {'dead':>5} {'entropy':>8} "
        f"{'H/ln E':>8} {'dropped':>8} {'drop %':>7}",
    ]
    for r in layer_rows(store, run_id):
        lines.append(f"{r['layer']:>5} {r['tokens']:>10,} {_cell(r['max_over_mean'], '.2f', 9)} "
                     f"{_cell(r['load_cv'], '.2f', 8)} {r['dead_experts']:>5} {_cell(r['entropy'], '.3f', 8)} "
                     f"{_cell(r['entropy_norm'], '.3f', 8)} {r['dropped_tokens']:>8,} "
                     f"{_cell(100 * r['dropped_rate'], '.2f', 7)}")
    if layers:
        lines.append(f"{'all':>5} {run.layer_tokens:>10,} {'':>9} {_cell(run.load_cv, '.2f', 8)} {'':>5} "
                     f"{_cell(run.entropy.nats, '.3f', 8)} {_cell(run.entropy.normalized, '.3f', 8)} "
                     f"{run.dropped_tokens:>8,} {_cell(100 * run.dropped_token_rate, '.2f', 7)}")
        lines.append("(load figures over routed experts; entropy and rates token-weighted; 'all' sums the "
                     "layers' tokens)")
    tags = store.tag_totals(run_id)
    if not tags.empty:
        lines += ["", "by tag:"]
        lines += [f"  {r.key}={r.value}: {r.steps:,} forwards, active fraction {100 * r.active_fraction:.2f}%"
                  for r in tags.itertuples()]
    root = os.path.abspath(os.fspath(root))
    lines += [
        "",
        f"files: {root}/<table>/run_id={run_id}/*.parquet",
        "try:  moescope query " + f"{os.fspath(root)} \"SELECT layer, expert_ids, count(*) FROM routes "
        "GROUP BY ALL ORDER BY 3 DESC LIMIT 10\"",
    ]
    return "\n".join(lines)
