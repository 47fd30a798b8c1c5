"""When to rebalance: the engines' rebalancing policies replayed over a run's recorded loads, and how
stale the live placement is.

`rebalance_report` reads the per-window loads the placement what-if reads (`store.Store.window_loads`,
kept slots per layer, window and expert), replays every policy over them from the engine's initial
map (`moescope.metrics.rebalance.replay`: vLLM's, SGLang's, a fixed every-N schedule, never; each
refit DeepSeek's EPLB) and puts beside each other, per policy, the balancedness it kept and the bytes
it moved: the curve an operator chooses a rebalance frequency from (`moescope placement --rebalance`,
the dashboard's Placement page). The staleness of the live map (`--placement FILE`, else the
contiguous layout of `--ranks`) is `moescope.metrics.rebalance.staleness` on the run's latest window.

An expert's bytes are what `moescope.analyses.summary` counts as its parameters: the run's
`routed_expert_params` over its MoE layers and experts, times the bytes per parameter (2: bf16),
unless given. The report is plain dataclasses of numbers and lists, so a JSON writer takes it as it is
(`dataclasses.asdict`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from moescope.analyses.placement import dispatch_of_run, placement_for_run
from moescope.analyses.placement_whatif import _layer_loads
from moescope.metrics.dispatch import DISPATCH, check_dispatch
from moescope.metrics.placement import Placement, PlacementError
from moescope.metrics.rebalance import (
    NEVER,
    Policy,
    SglangPolicy,
    VllmPolicy,
    engine_initial,
    replay,
    scaled,
    staleness,
)
from moescope.store import Store

__all__ = ["DEFAULT_POLICIES", "STALENESS_STEPS", "PolicyResult", "RebalanceReport", "RebalanceSetup", "Staleness",
           "rebalance_report"]

DEFAULT_POLICIES: tuple[Policy, ...] = (VllmPolicy(), SglangPolicy(), NEVER)  # the engines' defaults, and never
STALENESS_STEPS = 1000  # the latest window a fresh fit reads: vLLM's default eplb window_size


@dataclass(frozen=True)
class RebalanceSetup:
    """The cluster the policies place experts on, and what moving one costs.

    Attributes:
        ranks: expert-parallel ranks (GPUs).
        nodes: server nodes (EPLB's hierarchical policy; the across- and in-node figures).
        groups: expert groups of the model (DeepSeek-V3: 8; 1 when it has none).
        redundant: extra physical slots the engines fill with copies of hot experts.
        window_steps: steps per replayed step (1: pass by pass, the engines' own granularity; a
            policy's knobs must then be multiples of it).
        expert_bytes: bytes of one expert's parameters; None: from the run's recorded parameters.
        bytes_per_param: bytes per parameter when the expert's bytes come from the run (2: bf16).
        staleness_steps: the latest window the staleness fit reads, in steps.
    """

    ranks: int
    nodes: int = 1
    groups: int = 1
    redundant: int = 0
    window_steps: int = 1
    expert_bytes: float | None = None
    bytes_per_param: float = 2.0
    staleness_steps: int = STALENESS_STEPS


@dataclass(frozen=True)
class PolicyResult:
    """One policy over the run.

    Attributes:
        policy: its name with its knobs in steps (e.g. "vllm(window=1000,interval=3000)").
        rearrangements: refits made; skipped: SGLang rebalances its utilisation trigger skipped.
        rearrangement_steps: the step after which each refit was made (its new map serves from the next).
        mean_balancedness, min_balancedness: the forward's mean/max over ranks per replayed step
            (`moescope.metrics.ranks.balancedness_over_layers`), averaged and at its worst.
        mean_overload: busiest rank / mean rank per layer and step, averaged (Megatron's reduction).
        mean_node_balancedness, mean_in_node_balancedness: across nodes and within them, averaged.
        moved_slots, sent_slots: physical slots that loaded another expert, and those whose rank held
            no copy of it (moved over the network).
        moved_bytes, sent_bytes: the same times an expert's bytes.
        moved_bytes_per_hour: moved_bytes over the hours the run spans (NaN when it spans none).
        balancedness: per replayed step, the balancedness (the report's `steps`).
    """

    policy: str
    rearrangements: int
    skipped: int
    rearrangement_steps: list[int]
    mean_balancedness: float
    min_balancedness: float
    mean_overload: float
    mean_node_balancedness: float
    mean_in_node_balancedness: float
    moved_slots: int
    sent_slots: int
    moved_bytes: float
    sent_bytes: float
    moved_bytes_per_hour: float
    balancedness: list[float]


@dataclass(frozen=True)
class Staleness:
    """How far the live map is from a fresh EPLB fit on the latest window.

    Attributes:
        source: the live map (a placement file, the contiguous layout).
        window_start, window_end: the steps of the latest window (end exclusive).
        staleness: 1 - current / fresh balancedness: the share of MoE time a rearrangement now wins back.
        current_balancedness, fresh_balancedness: both on the latest window.
        layers, layer_staleness: per MoE layer, the same share with that layer's mean/max over ranks
            (what the `PlacementStale` rule of alerts/placement_rules.yaml reads).
    """

    source: str
    window_start: int
    window_end: int
    staleness: float
    current_balancedness: float
    fresh_balancedness: float
    layers: list[int]
    layer_staleness: list[float]


@dataclass(frozen=True)
class RebalanceReport:
    """What `rebalance_report` found: the setup, the replayed steps (the first step of each), the run's
    span in hours, an expert's bytes, each policy's `PolicyResult` and the live map's `Staleness`."""

    run_id: str
    setup: RebalanceSetup
    dispatch: str
    steps: list[int]
    hours: float
    expert_bytes: float
    policies: list[PolicyResult]
    staleness: Staleness

    def curve(self) -> pd.DataFrame:
        """The operator's curve: per policy, mean balancedness against bytes moved per hour."""
        return pd.DataFrame([dict(policy=p.policy, mean_balancedness=p.mean_balancedness,
                                  moved_bytes_per_hour=p.moved_bytes_per_hour, rearrangements=p.rearrangements)
                             for p in self.policies])


def _expert_bytes(store: Store, run_id: str, layers: int, experts: int, setup: RebalanceSetup) -> float:
    if setup.expert_bytes is not None:
        return float(setup.expert_bytes)
    params = (store.run_info(run_id) or {}).get("routed_expert_params")
    if params is None or pd.isna(params) or not params or not layers or not experts:
        return float("nan")  # the slots moved are still counted
    return float(params) / (layers * experts) * float(setup.bytes_per_param)


def _hours(store: Store, run_id: str, tags: dict[str, str] | None) -> float:
    totals = store.step_totals(run_id, tags)
    first, last = totals.get("first_ts"), totals.get("last_ts")
    if first is None or last is None or pd.isna(first) or pd.isna(last):
        return float("nan")
    seconds = (pd.Timestamp(last) - pd.Timestamp(first)).total_seconds()
    return seconds / 3600.0 if seconds > 0 else float("nan")


def rebalance_report(store: Store, run_id: str, setup: RebalanceSetup, policies: Sequence[Policy] = DEFAULT_POLICIES,
                     current: Placement | None = None, tags: dict[str, str] | None = None,
                     dispatch: str | None = None) -> RebalanceReport:
    """Replay `policies` over the run's loads (windows of `setup.window_steps` steps) and measure the
    live map's staleness.

    Args:
        store: the store.
        run_id: the run.
        setup: ranks, nodes, groups, redundant slots, window and an expert's bytes.
        policies: `moescope.metrics.rebalance` policies, knobs in steps (`parse_policy` reads them).
        current: the live map (None: the engines' initial map on `setup.ranks`); it is also where every
            policy starts.
        tags: only the steps carrying these tags.
        dispatch: how a redundant expert's load is split over its copies (None: the run's engine).

    Returns:
        A `RebalanceReport`.

    Raises:
        PlacementError: a run without loads, layers of different expert counts, a shape EPLB cannot
            place, a live map on other ranks than `setup.ranks`, or a policy knob that is not a
            multiple of the window (the message says what to change).
    """
    dispatch = check_dispatch(dispatch or dispatch_of_run(store, run_id))
    split = DISPATCH[dispatch][0]
    totals = store.layer_totals(run_id, tags=tags)
    experts_of = {int(r.layer): int(r.num_experts) if pd.notna(r.num_experts) else len(r.expert_load)
                  for r in totals.itertuples()}
    if len(set(experts_of.values())) > 1:
        raise PlacementError(f"the run's layers have different expert counts ({sorted(set(experts_of.values()))}); "
                             "the replay places one expert count")
    starts, layers, loads = _layer_loads(store.window_loads(run_id, setup.window_steps, tags), experts_of)
    if not starts:
        raise PlacementError(f"run {run_id} recorded no expert load (under these tags)")
    experts = loads.shape[2]
    if current is not None and current.ranks != setup.ranks:
        raise PlacementError(f"the live map places experts on {current.ranks} ranks, not {setup.ranks}")
    live = placement_for_run(store, run_id, current) if current is not None else \
        engine_initial(setup.ranks, experts, setup.redundant)
    expert_bytes = _expert_bytes(store, run_id, len(layers), experts, setup)
    hours = _hours(store, run_id, tags)
    results = []
    for policy in policies:
        try:
            per_window = scaled(policy, setup.window_steps)
            run = replay(loads, live, per_window, layers, nodes=setup.nodes, groups=setup.groups,
                         redundant=setup.redundant, split=split, expert_bytes=expert_bytes)
        except ValueError as e:  # a knob, or a shape: PlacementError is one too
            raise PlacementError(str(e)) from e
        done = run.rearrangements
        with np.errstate(all="ignore"):
            results.append(PolicyResult(
                policy=policy.name, rearrangements=len(done), skipped=run.skipped,
                rearrangement_steps=[starts[r.step] + setup.window_steps - 1 for r in done],
                mean_balancedness=float(np.nanmean(run.balancedness)),
                min_balancedness=float(np.nanmin(run.balancedness)),
                mean_overload=float(np.nanmean(run.overload)),
                mean_node_balancedness=float(np.nanmean(run.node_balancedness)),
                mean_in_node_balancedness=float(np.nanmean(run.in_node_balancedness)),
                moved_slots=sum(r.moved_slots for r in done), sent_slots=sum(r.sent_slots for r in done),
                moved_bytes=run.moved_bytes, sent_bytes=run.sent_bytes,
                moved_bytes_per_hour=run.moved_bytes / hours if hours > 0 else float("nan"),
                balancedness=[float(v) for v in run.balancedness]))
    windows = max(1, math.ceil(setup.staleness_steps / setup.window_steps))
    latest = loads[-windows:].sum(axis=0)
    stale, now, fresh, per_layer = staleness(latest, live, layers, nodes=setup.nodes, groups=setup.groups,
                                             redundant=setup.redundant, split=split)
    first = starts[-windows] if len(starts) >= windows else starts[0]
    return RebalanceReport(run_id=run_id, setup=setup, dispatch=dispatch, steps=[int(s) for s in starts],
                           hours=hours, expert_bytes=expert_bytes, policies=results,
                           staleness=Staleness(source=live.source, window_start=int(first),
                                               window_end=int(starts[-1] + setup.window_steps), staleness=stale,
                                               current_balancedness=now, fresh_balancedness=fresh,
                                               layers=[int(v) for v in layers],
                                               layer_staleness=[float(v) for v in per_layer]))



def expert_bytes_from_config(path: str) -> float:
    """One routed expert's bytes from a transformers `config.json`: 3 x hidden_size x the expert's
    intermediate size (`moe_intermediate_size`, else `intermediate_size`: a gated MLP's gate, up and
    down projections) x the bytes of `torch_dtype` (bf16 when absent). Raises PlacementError for a
    file without those sizes."""
    import json

    from moescope.analyses.traffic import DTYPE_BYTES

    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PlacementError(f"{path}: cannot read a model config (a transformers config.json): {e}") from e
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    hidden = text.get("hidden_size")
    inner = text.get("moe_intermediate_size") or text.get("intermediate_size")
    if not isinstance(hidden, int) or not isinstance(inner, int) or hidden < 1 or inner < 1:
        raise PlacementError(f"{path}: no hidden_size and moe_intermediate_size; give --expert-bytes")
    dtype = str(text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16").replace("torch.", "")
    return 3.0 * hidden * inner * float(DTYPE_BYTES.get(dtype, 2))
