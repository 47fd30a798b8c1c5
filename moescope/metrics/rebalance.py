"""The engines' rebalancing policies replayed over recorded loads: when each would have refitted its
placement, what the placement then served, and what moving the experts cost.

`replay` walks the steps of a run's loads ([steps, layers, experts], a step being one forward or a
window of forwards) in order: the placement in force serves the step, the step's load enters the
policy's window, and where the policy says so a fresh placement is fitted on that window
(DeepSeek's EPLB, `moescope.metrics.eplb.eplb`, hierarchical when the nodes divide the groups) and
serves from the next step on, as a synchronous rearrangement does. The policies, each read from its
engine's code:

- *vLLM* (`vllm/distributed/eplb/eplb_state.py`, `EplbState.step`): every pass enters a ring buffer
  of `window_size` passes; a counter that starts at `step_interval - step_interval // 4` ("the
  initial progress of rearrangement to 3/4") is raised after every pass and, once it reaches
  `step_interval`, is reset and the experts are rearranged on the sum of the buffer (the current
  pass included). So the first rearrangement follows pass max(1, step_interval // 4) and the next
  ones come every `step_interval` passes; before the buffer has filled, its empty slots add nothing.
- *SGLang* (`python/sglang/srt/eplb/eplb_manager.py`, `EPLBManager._entrypoint`; the recorder in
  `expert_distribution.py`): the manager yields `eplb_rebalance_num_iterations` times and then
  rebalances on the pass that resumes it, so rebalances follow passes N + 1, 2N + 1, ...; the fit
  reads the recorder's circular buffer of `expert_distribution_recorder_buffer_size` passes (by
  default N). With `eplb_min_rebalancing_utilization_threshold` below 1 (exactly 1, `math.isclose`,
  turns the check off), a rebalance is skipped when the mean over the last 1000 passes (fewer at the
  start; the history is never cleared) of each pass's utilisation is strictly above it; a pass's
  utilisation is the mean over layers of (mean + 1e-5) / (max + 1e-5) of the slots per GPU under the
  placement that served it. SGLang takes that mean over every layer of its map, dense layers (always
  1) included; here it is over the MoE layers of the loads.
- *every N*: a refit after every N-th step on the N steps since the last one (`EveryN`);
- *never*: the initial placement throughout (`NEVER`).

Figures per step: `balancedness` (`moescope.metrics.ranks.balancedness_over_layers`: the forward's
mean/max over ranks, layers weighted by load); `overload`, the busiest rank over the mean, computed
per layer and step (a step is the micro-batch) and averaged over the layers, as Megatron-LM's
`MoEMetricsTracker` reduces a metric (recorded per layer and micro-batch, summed and scaled by
1 / micro-batches, then summed over the layers / MoE layers); `node_balancedness` (mean/max over
nodes of the slots per node, layers summed: the across-nodes figure) and `in_node_balancedness`
(over every layer and node, the sum of a node's mean rank over the sum of its busiest rank: the
within-node figure). Ranks r·R/N .. (r+1)·R/N - 1 are node r, as EPLB lays them out.

A rearrangement's cost (`moved_slots`): a physical slot whose logical expert changed must load that
expert's weights, `expert_bytes` each; `sent_slots` counts those whose rank held no copy of the
expert before (what crosses between GPUs when an engine copies locally what it can, as vLLM's
`rearrange_expert_weights_inplace` does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moescope.metrics.eplb import eplb
from moescope.metrics.placement import Placement, PlacementError
from moescope.metrics.ranks import balancedness_over_layers

SGLANG_UTILIZATION_HISTORY = 1000  # the recorder's longest window (`window_sizes = [10, 100, 1000]`)
SGLANG_EPSILON = 1e-5  # `compute_utilization_rate`: (mean + 1e-5) / (max + 1e-5)


@dataclass(frozen=True)
class VllmPolicy:
    """vLLM's EPLB schedule (`--eplb-config`): `window_size` passes of load, a rearrangement every
    `step_interval` passes, the first after max(1, step_interval // 4)."""

    window_size: int = 1000
    step_interval: int = 3000

    @property
    def name(self) -> str:
        return f"vllm(window={self.window_size},interval={self.step_interval})"


@dataclass(frozen=True)
class SglangPolicy:
    """SGLang's EPLB manager: a rebalance after passes N + 1, 2N + 1, ... (N =
    `rebalance_num_iterations`) on the last `buffer_size` passes (None: N, SGLang's default), skipped
    while the mean utilisation of the last 1000 passes is above `min_utilization` (1.0: never skipped)."""

    rebalance_num_iterations: int = 1000
    buffer_size: int | None = None
    min_utilization: float = 1.0

    @property
    def name(self) -> str:
        trigger = "" if math.isclose(self.min_utilization, 1.0) else f",min_utilization={self.min_utilization:g}"
        buffer = "" if self.buffer_size is None else f",buffer={self.buffer_size}"
        return f"sglang(iterations={self.rebalance_num_iterations}{buffer}{trigger})"


@dataclass(frozen=True)
class EveryN:
    """A refit every `steps` steps on the steps since the last one (math.inf: never)."""

    steps: float

    @property
    def name(self) -> str:
        return "never" if math.isinf(self.steps) else f"every-{int(self.steps)}"


NEVER = EveryN(math.inf)
Policy = VllmPolicy | SglangPolicy | EveryN


def check_policy(policy: Policy) -> Policy:
    """`policy` if its knobs are usable; raises ValueError naming the knob otherwise."""
    if isinstance(policy, VllmPolicy):
        if policy.window_size < 1 or policy.step_interval < 1:
            raise ValueError(f"{policy.name}: vLLM's window_size and step_interval must be at least 1")
    elif isinstance(policy, SglangPolicy):
        if policy.rebalance_num_iterations < 1 or (policy.buffer_size is not None and policy.buffer_size < 1):
            raise ValueError(f"{policy.name}: SGLang's rebalance iterations and buffer size must be at least 1")
        if policy.buffer_size is not None and policy.buffer_size > policy.rebalance_num_iterations:
            # SGLang's EPLBManager asserts it: a larger buffer would hold passes from before the last rebalance
            raise ValueError(f"{policy.name}: SGLang requires eplb_rebalance_num_iterations >= "
                             "expert_distribution_recorder_buffer_size")
        if not 0 < policy.min_utilization <= 1:
            raise ValueError(f"{policy.name}: the minimum utilisation is a balancedness in (0, 1]")
    elif not policy.steps >= 1:
        raise ValueError(f"every-N needs N >= 1, not {policy.steps}")
    return policy


@dataclass(frozen=True)
class Rearrangement:
    """One refit: after step `step` (0-based) on steps fit_start .. step, serving from step + 1."""

    step: int
    fit_start: int
    placement: Placement
    moved_slots: int
    sent_slots: int
    moved_bytes: float
    sent_bytes: float


@dataclass(frozen=True)
class Replay:
    """What `replay` found: per step the figures (np.ndarray of one value per step), and the refits."""

    policy: str
    balancedness: np.ndarray
    overload: np.ndarray
    node_balancedness: np.ndarray
    in_node_balancedness: np.ndarray
    rearrangements: list[Rearrangement] = field(default_factory=list)
    skipped: int = 0  # SGLang rebalances its utilisation trigger skipped

    @property
    def moved_bytes(self) -> float:
        return float(sum(r.moved_bytes for r in self.rearrangements))

    @property
    def sent_bytes(self) -> float:
        return float(sum(r.sent_bytes for r in self.rearrangements))


def slot_experts(placement: Placement, layers: Sequence[int], experts: int) -> list[np.ndarray]:
    """Per layer, the logical expert of each physical slot (rank by rank), the engine's
    physical-to-logical map."""
    return [placement.slots(layer, experts)[1] for layer in layers]


def moved(old: Placement, new: Placement, layers: Sequence[int], experts: int) -> tuple[int, int]:
    """(slots whose expert changed, those of them whose rank held no copy of the new expert) from `old`
    to `new` over `layers`; a slot either map lacks counts as changed (the maps' slot counts differ)."""
    changed = sent = 0
    for layer in layers:
        old_rank, old_expert = old.slots(layer, experts)
        new_rank, new_expert = new.slots(layer, experts)
        both = min(len(old_expert), len(new_expert))
        differs = np.ones(len(new_expert), dtype=bool)
        differs[:both] = old_expert[:both] != new_expert[:both]
        changed += int(differs.sum()) + max(0, len(old_expert) - len(new_expert))
        held = {(int(r), int(e)) for r, e in zip(old_rank, old_expert)}
        sent += sum((int(r), int(e)) not in held for r, e in zip(new_rank[differs], new_expert[differs]))
    return changed, sent


def _rank_loads(loads: np.ndarray, shares: list[np.ndarray]) -> np.ndarray:
    """[steps, layers, ranks] from loads [steps, layers, experts] and each layer's (E, R) shares."""
    return np.einsum("tle,ler->tlr", loads, np.stack(shares), optimize=True)  # every layer in one contraction


def step_figures(rank_loads: np.ndarray, nodes: int) -> dict[str, np.ndarray]:
    """Per step of rank_loads [steps, layers, ranks]: balancedness, overload, node_balancedness,
    in_node_balancedness (the module's definitions; NaN where a step served nothing)."""
    steps, layers, ranks = rank_loads.shape
    mean = rank_loads.mean(axis=2)
    peak = rank_loads.max(axis=2)
    with np.errstate(invalid="ignore", divide="ignore"):
        balanced = np.asarray(balancedness_over_layers(rank_loads))  # one figure per step
        ratio = np.where(mean > 0, peak / np.where(mean > 0, mean, 1), np.nan)
        served = np.isfinite(ratio)  # the layers that served anything in the step
        overload = np.where(served.any(axis=1),
                            np.where(served, ratio, 0).sum(axis=1) / np.maximum(served.sum(axis=1), 1), np.nan)
        per_node = rank_loads.reshape(steps, layers, nodes, ranks // nodes)
        node_load = per_node.sum(axis=3)
        node_peak = node_load.max(axis=2).sum(axis=1)
        node_bal = np.where(node_peak > 0, node_load.mean(axis=2).sum(axis=1) / np.where(node_peak > 0, node_peak, 1),
                            np.nan)
        in_peak = per_node.max(axis=3).sum(axis=(1, 2))
        in_bal = np.where(in_peak > 0, per_node.mean(axis=3).sum(axis=(1, 2)) / np.where(in_peak > 0, in_peak, 1),
                          np.nan)
    return dict(balancedness=balanced, overload=overload, node_balancedness=node_bal, in_node_balancedness=in_bal)


def sglang_utilization(rank_loads: np.ndarray) -> np.ndarray:
    """Per step of rank_loads [steps, layers, ranks], SGLang's utilisation: the mean over layers of
    (mean + 1e-5) / (max + 1e-5) of the slots per GPU (`compute_utilization_rate`)."""
    rate = (rank_loads.mean(axis=2) + SGLANG_EPSILON) / (rank_loads.max(axis=2) + SGLANG_EPSILON)
    return rate.mean(axis=1)


def _decisions(policy: Policy, steps: int):
    """For each step t (0-based): None, or the first step of the window a refit after t reads."""
    if isinstance(policy, VllmPolicy):
        counter = max(0, policy.step_interval - policy.step_interval // 4)
        for t in range(steps):
            counter += 1
            if counter >= policy.step_interval:
                counter = 0
                yield max(0, t + 1 - policy.window_size)
            else:
                yield None
    elif isinstance(policy, SglangPolicy):
        n = policy.rebalance_num_iterations
        buffer = policy.buffer_size or n
        for t in range(steps):
            passes = t + 1
            yield max(0, passes - buffer) if passes > n and (passes - 1) % n == 0 else None
    else:
        for t in range(steps):
            passes = t + 1
            due = not math.isinf(policy.steps) and passes % int(policy.steps) == 0
            yield passes - int(policy.steps) if due else None


def replay(loads: np.ndarray, initial: Placement, policy: Policy, layers: Sequence[int], *, nodes: int = 1,
           groups: int = 1, redundant: int = 0, split: str = "even", expert_bytes: float = 0.0) -> Replay:
    """Replay `policy` over `loads` ([steps, layers, experts], the layers `layers`) from `initial`.

    Args:
        loads: the load of each (step, layer, logical expert), steps in order.
        initial: the placement serving the first step (the engine's map at start).
        policy: `VllmPolicy`, `SglangPolicy` or `EveryN` (`NEVER`), knobs in steps of `loads`.
        layers: the layer number of each row of the layer axis.
        nodes: server nodes (EPLB's hierarchical policy; the node figures); the ranks are `initial.ranks`.
        groups: expert groups of the model (EPLB's).
        redundant: extra physical slots EPLB fills with copies of hot experts.
        split: how a redundant expert's load is split over its copies ("even" or "local",
            `Placement.shares`).
        expert_bytes: the bytes of one expert's parameters (what a changed slot loads).

    Returns:
        A `Replay`: per step the figures, and every rearrangement with its fitted placement.

    Raises:
        ValueError: bad knobs, loads that are not [steps, layers, experts], nodes that do not divide
            the ranks; PlacementError: a shape EPLB cannot place or an initial placement that does
            not fit the layers.
    """
    policy = check_policy(policy)
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 3 or loads.shape[1] != len(layers):
        raise ValueError(f"loads must be [steps, {len(layers)} layers, experts], got shape {loads.shape}")
    ranks = initial.ranks
    if nodes < 1 or ranks % nodes:
        raise PlacementError(f"{ranks} ranks do not split evenly over {nodes} nodes")
    steps, _, experts = loads.shape
    figures = {name: np.full(steps, np.nan) for name in
               ("balancedness", "overload", "node_balancedness", "in_node_balancedness")}
    utilization = np.full(steps, np.nan)
    done: list[Rearrangement] = []
    skipped = 0
    current = initial
    start = 0
    decisions = list(_decisions(policy, steps))
    cuts = sorted({t for t, d in enumerate(decisions) if d is not None} | ({steps - 1} if steps else set()))
    for t in cuts:
        # the placement in force serves steps start..t, vectorised over the segment
        if t >= start:
            shares = [current.shares(layer, experts, split) for layer in layers]
            segment = _rank_loads(loads[start:t + 1], shares)
            for name, values in step_figures(segment, nodes).items():
                figures[name][start:t + 1] = values
            utilization[start:t + 1] = sglang_utilization(segment)
            start = t + 1
        fit_start = decisions[t]
        if fit_start is None:
            continue
        if isinstance(policy, SglangPolicy) and not math.isclose(policy.min_utilization, 1.0):
            recent = utilization[max(0, t + 1 - SGLANG_UTILIZATION_HISTORY):t + 1]
            if float(np.mean(recent)) > policy.min_utilization:
                skipped += 1
                continue
        fitted = eplb(loads[fit_start:t + 1].sum(axis=0), ranks, nodes, groups, redundant, layers)
        changed, sent = moved(current, fitted, layers, experts)
        done.append(Rearrangement(step=t, fit_start=fit_start, placement=fitted, moved_slots=changed,
                                  sent_slots=sent, moved_bytes=changed * float(expert_bytes),
                                  sent_bytes=sent * float(expert_bytes)))
        current = fitted
    return Replay(policy=policy.name, rearrangements=done, skipped=skipped, **figures)


def staleness(load: np.ndarray, current: Placement, layers: Sequence[int], *, nodes: int = 1, groups: int = 1,
              redundant: int = 0, split: str = "even") -> tuple[float, float, float, np.ndarray]:
    """How far `current` is from a fresh EPLB fit on `load` ([layers, experts], the latest window).

    Returns:
        (staleness, the current map's balancedness, the fresh fit's, per layer staleness): both
        balancedness figures the forward's (`balancedness_over_layers`) on `load` itself, and
        staleness = 1 - current / fresh, the share of the MoE time a rearrangement now would win back
        (0: as good as a fresh fit; negative where the current map beats EPLB on its own window, e.g.
        with more redundant slots); per layer the same with each layer's mean/max over ranks. NaN
        where nothing was served.

    Raises:
        PlacementError: as `eplb` does.
    """
    load = np.asarray(load, dtype=np.float64)
    experts = load.shape[1]
    fresh = eplb(load, current.ranks, nodes, groups, redundant, layers)

    def served(placement: Placement) -> np.ndarray:
        return np.stack([load[i] @ placement.shares(layer, experts, split) for i, layer in enumerate(layers)])

    now, best = served(current), served(fresh)
    whole_now, whole_best = balancedness_over_layers(now), balancedness_over_layers(best)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_layer = 1.0 - (now.mean(axis=1) / now.max(axis=1)) / (best.mean(axis=1) / best.max(axis=1))
    whole = 1.0 - whole_now / whole_best if whole_best > 0 else float("nan")
    return whole, whole_now, whole_best, per_layer


def engine_initial(ranks: int, experts: int, redundant: int = 0) -> Placement:
    """The map an engine starts from: physical slot i holds logical expert i % experts, slots laid rank
    by rank (vLLM's `build_initial_global_physical_to_logical_map`, SGLang's trivial
    `init_expert_location`); with no redundant slot, the contiguous layout. Raises PlacementError when
    the slots do not split evenly over the ranks."""
    slots = experts + redundant
    if ranks < 1 or slots % ranks:
        raise PlacementError(f"{experts} experts + {redundant} redundant slots do not split evenly over {ranks} ranks")
    if not redundant:
        return Placement.contiguous(ranks)
    per_rank = slots // ranks
    physical = [i % experts for i in range(slots)]
    layout = tuple(tuple(physical[r * per_rank:(r + 1) * per_rank]) for r in range(ranks))
    return Placement(ranks=ranks, default=layout, source=f"the engines' initial map ({redundant} redundant slots)")


POLICY_FORMS = ("vllm:WINDOW:INTERVAL", "sglang:ITERATIONS[:BUFFER[:MIN_UTILIZATION]]", "every:N", "never")


def parse_policy(spec: str) -> Policy:
    """A policy from its command-line form (`POLICY_FORMS`, knobs in steps): "vllm:1000:3000" (vLLM's
    `window_size` and `step_interval`), "sglang:1000", "sglang:1000:500:0.9" (rebalance iterations,
    recorder buffer, minimum utilisation), "every:100", "never". Raises ValueError naming the forms."""
    parts = str(spec).strip().lower().split(":")
    try:
        if parts == ["never"]:
            return NEVER
        if parts[0] == "every" and len(parts) == 2:
            return check_policy(EveryN(int(parts[1])))
        if parts[0] == "vllm" and len(parts) == 3:
            return check_policy(VllmPolicy(int(parts[1]), int(parts[2])))
        if parts[0] == "sglang" and 2 <= len(parts) <= 4:
            buffer = int(parts[2]) if len(parts) > 2 and parts[2] else None
            threshold = float(parts[3]) if len(parts) > 3 else 1.0
            return check_policy(SglangPolicy(int(parts[1]), buffer, threshold))
    except ValueError as e:
        raise ValueError(f"policy {spec!r}: {e}") from e
    raise ValueError(f"unknown policy {spec!r}: give one of {', '.join(POLICY_FORMS)} (knobs in steps)")


def scaled(policy: Policy, window_steps: int) -> Policy:
    """`policy` with its knobs counted in windows of `window_steps` steps (the replay's steps when the
    loads are read per window). Raises ValueError when a knob is not a multiple of the window."""
    w = int(window_steps)
    if w == 1 or policy == NEVER:
        return policy

    def windows(steps: int, knob: str) -> int:
        if steps % w:
            raise ValueError(f"{policy.name}: {knob} {steps} is not a multiple of the window of {w} steps; give a "
                             "--window that divides every policy's knobs (1 replays the engines pass by pass)")
        return steps // w

    if isinstance(policy, VllmPolicy):
        return VllmPolicy(windows(policy.window_size, "window_size"), windows(policy.step_interval, "step_interval"))
    if isinstance(policy, SglangPolicy):
        buffer = None if policy.buffer_size is None else windows(policy.buffer_size, "buffer_size")
        return SglangPolicy(windows(policy.rebalance_num_iterations, "rebalance_num_iterations"), buffer,
                            policy.min_utilization)
    return EveryN(windows(int(policy.steps), "N"))
