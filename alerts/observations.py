"""Windows of recent layer steps, and the rule signals computed over them.

The rules engine (over the store or the live stream) and the Prometheus exporter both keep a
bounded history of `LayerObservation`s per (run, layer) and call `compute_signals` on a slice
of it, so the numbers an alert fires on are the numbers `/metrics` shows.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from moescope.alerts.rules import SIGNALS, Window
from moescope.core.records import LayerStep, StepRecord
from moescope.metrics import signals as sig
from moescope.metrics import traffic as wire

SWITCH_ENTROPY_TOKENS = 1024
_WHATIF = {
    "whatif_drop_rate_cf1": 1.0,
    "whatif_drop_rate_cf1_25": 1.25,
    "whatif_drop_rate_cf1_5": 1.5,
    "whatif_drop_rate_cf2": 2.0,
}


@dataclass
class LayerObservation:
    """One layer over one recorded row (one forward, or a window of `forwards` forwards starting at
    `step`), reduced to what the signals need."""

    run_id: str
    layer: int
    step: int
    ts: dt.datetime
    tokens: int
    expert_load: np.ndarray  # (experts,) int64
    router_entropy_mean: float  # nats
    dropped_tokens: int
    capacity_use: float | None
    active_param_fraction: float | None
    expert_ids: np.ndarray | None = None  # (tokens, k) routes, where recorded
    sequence: np.ndarray | None = None  # (tokens,) batch row
    position: np.ndarray | None = None  # (tokens,)
    forwards: int = 1
    route_step: np.ndarray | None = None  # (tokens,) the forward of each route row, where a window spans several
    kept: np.ndarray | None = None  # (tokens, k) False where a capacity limit dropped the slot, where recorded
    token: np.ndarray | None = None  # (tokens,) row in its forward's batch (the routes' `token`), where known
    rank: np.ndarray | None = None  # (tokens,) the rank that recorded each row; None: one process's records

    @classmethod
    def from_layer_step(cls, record: StepRecord, layer: LayerStep) -> LayerObservation:
        routes = layer.routes
        return cls(
            run_id=record.run_id,
            layer=layer.layer,
            step=record.step,
            ts=record.ts,
            tokens=int(layer.tokens),
            expert_load=np.asarray(layer.expert_load, dtype=np.int64),
            router_entropy_mean=float(layer.router_entropy_mean),
            dropped_tokens=int(layer.dropped_tokens),
            capacity_use=None if layer.capacity_use is None else float(layer.capacity_use),
            active_param_fraction=(
                float(layer.active_params_per_token) / record.total_params if record.total_params else None
            ),
            expert_ids=None if routes is None else np.asarray(routes.expert_ids),
            sequence=None if routes is None else np.asarray(routes.sequence),
            position=None if routes is None else np.asarray(routes.position),
            forwards=int(layer.forwards),
            route_step=None if routes is None or routes.step is None else np.asarray(routes.step),
            kept=None if routes is None else np.asarray(routes.kept),
            # rows are numbered from 0 where the record does not say (as the store numbers them)
            token=None if routes is None else (np.arange(len(routes.expert_ids)) if routes.token is None
                                               else np.asarray(routes.token)),
        )


def observations_from_record(record: StepRecord) -> list[LayerObservation]:
    return [LayerObservation.from_layer_step(record, layer) for layer in record.layers]


class LayerHistory:
    """The last `max_steps` observations of one (run, layer), oldest first.

    A rule's window of n steps is the newest observations covering n forwards: n rows of a
    per-forward store, fewer rows of a windowed one (a row is never split).
    """

    def __init__(self, max_steps: int):
        self.items: deque[LayerObservation] = deque(maxlen=max(1, max_steps))

    def append(self, obs: LayerObservation) -> None:
        self.items.append(obs)

    def window(self, window: Window) -> list[LayerObservation]:
        """Return the observations a rule's window covers, ending at the latest one."""
        items = list(self.items)
        if not items:
            return []
        if window.steps is not None:
            return last_forwards(items, window.steps)
        start = items[-1].ts - dt.timedelta(seconds=window.seconds or 0)
        return [o for o in items if o.ts > start]


def last_forwards(items: Sequence[LayerObservation], steps: int) -> list[LayerObservation]:
    """The newest observations that together cover at least `steps` forwards (all if fewer)."""
    covered, start = 0, len(items)
    while start > 0 and covered < steps:
        start -= 1
        covered += max(int(items[start].forwards), 1)
    return list(items[start:])


def latest_half(observations: Sequence[LayerObservation]) -> list[LayerObservation]:
    """The newest observations covering half of the window's forwards (at least one row; a row is never
    split): what `kl_baseline_latest_half` judges."""
    forwards = sum(max(int(o.forwards), 1) for o in observations)
    return last_forwards(observations, max(forwards // 2, 1))


def _token_weighted(values: Iterable[tuple[float | None, int]]) -> float:
    """Token-weighted mean of per-row means (rows with no value or no tokens are left out)."""
    kept = [(v, t) for v, t in values if v is not None and not math.isnan(v) and t > 0]
    total = sum(t for _, t in kept)
    return float(sum(v * t for v, t in kept) / total) if total else float("nan")


def summed_load(observations: Sequence[LayerObservation]) -> np.ndarray:
    return np.sum([o.expert_load for o in observations], axis=0).astype(np.int64)


def _nanmax(values: Iterable[float | None]) -> float:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.max(kept)) if kept else float("nan")


def _routes(observations: Sequence[LayerObservation]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Return (top1, sequence key, position) over the window in recording order, or None."""
    top1s, seqs, positions = [], [], []
    for o in observations:
        if o.expert_ids is None or not len(o.expert_ids):
            continue
        assert o.sequence is not None and o.position is not None  # routes carry both (from_layer_step, storage)
        top1s.append(o.expert_ids[:, 0])
        # a sequence is a batch row of one step: tokens of different steps are never adjacent
        seqs.append((o.step if o.route_step is None else o.route_step.astype(np.int64)) * (1 << 20)
                    + o.sequence.astype(np.int64))
        positions.append(o.position.astype(np.int64))
    if not top1s:
        return None
    return np.concatenate(top1s).astype(np.int64), np.concatenate(seqs), np.concatenate(positions)


# traffic signal -> its figure in `metrics.traffic.TrafficTally.figures`
TRAFFIC_SIGNALS = {
    "remote_ranks_per_token": "remote_ranks_mean",
    "remote_nodes_per_token": "remote_nodes_mean",
    "intra_node_share": "intra_node_share",
}


def _traffic(observations: Sequence[LayerObservation], layout: wire.WireLayout) -> dict | None:
    """The window's traffic figures under `layout` (None without routes)."""
    tally = wire.TrafficTally.for_layout(layout)
    routed = [o for o in observations if o.expert_ids is not None and len(o.expert_ids) and o.token is not None]
    recording = {int(r) for o in routed if o.rank is not None for r in np.unique(o.rank)}
    # the rule `moescope traffic` defaults to; where the run has more ranks than the placement (which
    # the command refuses), its tokens are spread by their rows rather than the rules engine stopping
    rule = wire.default_home(len(recording) if max(recording, default=0) < layout.ranks else 1)
    for o in routed:
        assert o.expert_ids is not None and o.token is not None  # `routed` holds only those
        ids = np.asarray(o.expert_ids)
        kept = np.ones(ids.shape, dtype=bool) if o.kept is None else np.asarray(o.kept, dtype=bool)
        recorded = np.zeros(len(ids), dtype=np.int64) if o.rank is None else o.rank
        home = wire.home_ranks(rule, layout.ranks, recorded, o.sequence, o.token)
        tally.add(layout, home, wire.token_fanout(layout, home, ids, kept), np.zeros(len(home), dtype=np.int64))
    return tally.figures() if tally.tokens else None


def compute_signals(
    observations: Sequence[LayerObservation],
    names: Iterable[str] | None = None,
    baseline_load: np.ndarray | None = None,
    num_experts: int | None = None,
    rank_shares: np.ndarray | None = None,
    wire_layout: wire.WireLayout | None = None,
    baseline: Sequence[LayerObservation] | None = None,
) -> dict[str, float]:
    """Return {signal: value} over the observations (one layer, oldest first).

    Values are NaN where the window lacks what a signal needs (no tokens, no routes, no
    capacity, no baseline). `names` limits the work to the signals asked for. `num_experts` is the
    layer's routed experts: load signals leave its zero experts out, router entropy is normalised
    by the router's whole width (`moescope.metrics.signals`' zero-expert rule); None counts every entry.
    `rank_shares` ((routed experts, ranks), `signals.replica_shares`) places the experts on
    expert-parallel ranks for the rank signals; None: they are no data. `wire_layout` (the same
    placement with its ranks' nodes, `metrics.traffic.WireLayout`) is what the traffic signals count
    with, a token's home rank by the rule every view defaults to (`metrics.traffic.default_home`:
    the recording rank where several ranks recorded the rows, else the row in its forward's batch
    modulo the ranks); None, or no routes: they are no data. `baseline` (the run's own baseline
    rows) is what the `_rise` signals compare with; None (a baseline from another run, whose load
    alone is loaded): they are no data.
    """
    wanted = set(SIGNALS if names is None else names)
    unknown = wanted - set(SIGNALS)
    if unknown:
        raise ValueError(f"unknown signals: {', '.join(sorted(unknown))}")
    out: dict[str, float] = {name: float("nan") for name in wanted}
    if not observations:
        return out
    width = summed_load(observations).size  # the router's choices: routed + zero experts
    load = sig.routed_load(summed_load(observations), num_experts)
    if baseline_load is not None:
        baseline_load = sig.routed_load(baseline_load, num_experts)
    tokens = sum(o.tokens for o in observations)
    has_load = load.sum() > 0
    experts = load.size
    if "window_tokens" in wanted:
        out["window_tokens"] = float(tokens)
    if has_load:
        uniform = sig.uniform_load(experts)
        table = {
            "load_cv": lambda: sig.coefficient_of_variation(load),
            "load_max_mean": lambda: sig.max_mean_ratio(load),
            "load_balancedness": lambda: sig.balancedness(load),
            "load_entropy": lambda: sig.load_entropy(load),
            "kl_uniform": lambda: sig.kl_divergence(load, uniform),
            "js_uniform": lambda: sig.js_divergence(load, uniform),
            "dead_expert_fraction": lambda: sig.dead_expert_fraction(load),
        }
        if baseline_load is not None and np.size(baseline_load) == experts and np.sum(baseline_load) > 0:
            table["kl_baseline"] = lambda: sig.kl_divergence(load, baseline_load)
            table["kl_baseline_latest_half"] = lambda: sig.kl_divergence(
                sig.routed_load(summed_load(latest_half(observations)), num_experts), baseline_load)
            table["js_baseline"] = lambda: sig.js_divergence(load, baseline_load)
            table["lost_expert_fraction"] = lambda: sig.lost_expert_fraction(load, baseline_load)
            table["lost_expert_alone_fraction"] = lambda: sig.lost_expert_alone_fraction(load, baseline_load)
        if rank_shares is not None and np.shape(rank_shares)[0] == experts:
            rank_load = sig.rank_load(load, rank_shares)  # slots per rank
            table["rank_balancedness"] = lambda: sig.balancedness(rank_load)
            table["rank_imbalance"] = lambda: sig.imbalance(rank_load)
        for name, fn in table.items():
            if name in wanted:
                out[name] = fn()
    def router_entropy(rows: Sequence[LayerObservation]) -> float:
        return _token_weighted((sig.normalized_entropy(o.router_entropy_mean, width), o.tokens) for o in rows)

    def dropped_rate(rows: Sequence[LayerObservation]) -> float:
        routed = sum(o.tokens for o in rows)
        return sig.dropped_token_rate(sum(o.dropped_tokens for o in rows), routed) if routed > 0 else float("nan")
    if "router_entropy" in wanted:
        out["router_entropy"] = router_entropy(observations)
    if "dropped_token_rate" in wanted:
        out["dropped_token_rate"] = dropped_rate(observations)
    if baseline:
        if "router_entropy_rise" in wanted:
            out["router_entropy_rise"] = router_entropy(observations) - router_entropy(baseline)
        if "dropped_token_rate_rise" in wanted:
            out["dropped_token_rate_rise"] = dropped_rate(observations) - dropped_rate(baseline)
    if "capacity_use" in wanted:
        out["capacity_use"] = _nanmax(o.capacity_use for o in observations)  # the fullest forward
    if "active_param_fraction" in wanted:
        out["active_param_fraction"] = _token_weighted((o.active_param_fraction, o.tokens) for o in observations)
    if wanted & set(TRAFFIC_SIGNALS) and wire_layout is not None:
        figures = _traffic(observations, wire_layout)
        for name, figure in TRAFFIC_SIGNALS.items():
            if name in wanted and figures is not None:
                out[name] = float(figures[figure])
    route_names = {"routing_drift_rate", "switch_entropy"} | set(_WHATIF)
    if wanted & route_names:
        routes = _routes(observations)
        if routes is not None:
            top1, seq, pos = routes
            if "routing_drift_rate" in wanted:
                out["routing_drift_rate"] = sig.routing_drift_rate(top1, seq, pos)
            if "switch_entropy" in wanted:
                out["switch_entropy"] = sig.switch_entropy(top1, seq, pos, width, last_n=SWITCH_ENTROPY_TOKENS)
            asked = [(name, cf) for name, cf in _WHATIF.items() if name in wanted]
            if asked:
                dropped = {cf: 0 for _, cf in asked}
                routed = 0
                for o in observations:
                    if o.expert_ids is None or not len(o.expert_ids):
                        continue
                    routed += len(o.expert_ids)
                    for cf, result in sig.whatif_capacity(o.expert_ids, width, tuple(dropped)).items():
                        dropped[cf] += result.dropped_tokens
                for name, cf in asked:
                    out[name] = dropped[cf] / routed if routed else float("nan")
    return out
