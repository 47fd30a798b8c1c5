"""The expert-health score: 0-100 per (layer, expert) per window of recorded forwards.

Each window (`HealthConfig.window_steps` forwards of a layer) sums what the probe measured and
turns it into components, each 0-100 (100 = healthy), then into one score:

    score = 100 * prod_i (c_i / 100) ** (w_i / sum_j w_j)      over the components present

a weighted geometric mean, so one component at 0 (a NaN output, a thousandfold weight) takes the
score to 0 whatever the others say. Components (see `docs/health.md` for the defaults):

- load: share of the layer's assignments r = load_e * E / sum(load), against peers
  (`band_score(r, load_band)`) and, once the expert has a baseline, against its own baseline
  share (`band_score(r / r_base, load_baseline_band)`); the larger of the two counts, so an
  expert is a load anomaly only if it is unusual for the layer *and* for itself.
- confidence: mean gate weight when chosen, over the peers' median, `100 * min(1, ratio / floor)`.
- output: 0 if any sampled output held a NaN/inf, else the mean L2 norm of its sampled outputs
  against the peers' median and against its own baseline (the larger of the two band scores).
- weight: cosine of the weight sketch to the attach fingerprint, mapped linearly from
  `weight_cosine_floor` (0) to 1 (100), times `band_score(norm ratio, weight_norm_band)`;
  0 when non-finite.
- grad (training only, when the probe saw gradients): gradient norm against the peers' median;
  0 when it is NaN or inf. Under the training monitor these are the norms it took just before
  each optimizer update.

`band_score(r, band) = 100 * min(1, band / max(r, 1 / r))`: 100 inside [1/band, band], then
inversely proportional to how far outside. Load and confidence are left out for an expert whose
trust weight is below 1 (the gate, not the expert, decides its load then), so a gated expert is
judged by its outputs and weights alone, which the probe keeps measuring; they are also left out
for a whole layer in a window where tokens reached it already non-finite (the fault is upstream).

Baselines are exponential averages over windows that scored at least `baseline_min_score` with
the expert ungated; they count once `baseline_windows` such windows were seen.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field

import numpy as np

from moescope.probe.records import LayerStep, StepRecord

COMPONENTS = ("load", "confidence", "output", "weight", "grad")


@dataclass(frozen=True)
class HealthConfig:
    window_steps: int = 4
    weights: dict[str, float] = field(default_factory=lambda: dict(
        load=0.25, confidence=0.15, output=0.35, weight=0.25, grad=0.15))
    load_band: float = 8.0
    load_baseline_band: float = 4.0
    min_window_assignments: int = 16  # fewer assignments in a layer's window: no load/confidence component
    # ...nor when an expert's fair share of the window is under this many assignments: with 8
    # expected, an expert with a fair share stays empty by chance with probability ~e^-8 (3e-4),
    # so small decode batches do not read as dead experts.
    min_expected_per_expert: float = 8.0
    min_expert_assignments: int = 4  # fewer for this expert: no confidence component
    confidence_floor: float = 0.5
    output_band: float = 4.0
    output_baseline_band: float = 4.0
    weight_cosine_floor: float = 0.5
    weight_norm_band: float = 1.5
    grad_band: float = 10.0
    baseline_windows: int = 3
    baseline_decay: float = 0.8
    baseline_min_score: float = 70.0

    def __post_init__(self) -> None:
        if self.window_steps < 1:
            raise ValueError("window_steps must be at least 1")
        unknown = set(self.weights) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"unknown health components {sorted(unknown)}; known: {', '.join(COMPONENTS)}")


def band_score(ratio: float, band: float) -> float:
    """100 when 1/band <= ratio <= band, else 100 * band / max(ratio, 1/ratio); 0 for 0, inf, NaN."""
    if not math.isfinite(ratio) or ratio <= 0:
        return 0.0
    return 100.0 * min(1.0, band / max(ratio, 1.0 / ratio))


def load_component(share_ratio: float, baseline_ratio: float | None, config: HealthConfig) -> float:
    """share_ratio: load * E / total; baseline_ratio: the expert's own baseline share ratio."""
    peers = band_score(share_ratio, config.load_band)
    if baseline_ratio is None or baseline_ratio <= 0:
        return peers
    return max(peers, band_score(share_ratio / baseline_ratio, config.load_baseline_band))


def confidence_component(gate_mean: float, peer_median: float, config: HealthConfig) -> float:
    if not math.isfinite(gate_mean) or not math.isfinite(peer_median) or peer_median <= 0:
        return 0.0 if not math.isfinite(gate_mean) else 100.0
    return 100.0 * min(1.0, (gate_mean / peer_median) / config.confidence_floor)


def output_component(norm_mean: float, nonfinite: int, peer_median: float, baseline: float | None,
                     config: HealthConfig) -> float:
    if nonfinite > 0 or not math.isfinite(norm_mean):
        return 0.0
    if peer_median <= 0 and norm_mean <= 0:
        return 100.0  # every expert outputs zeros (e.g. zero-initialised): nothing stands out
    peers = band_score(norm_mean / peer_median, config.output_band) if peer_median > 0 else 0.0
    if baseline is None or baseline <= 0:
        return peers
    return max(peers, band_score(norm_mean / baseline, config.output_baseline_band))


def weight_component(cosine: float, norm_ratio: float, config: HealthConfig) -> float:
    if not (math.isfinite(cosine) and math.isfinite(norm_ratio)):
        return 0.0
    similar = min(1.0, max(0.0, (cosine - config.weight_cosine_floor) / (1.0 - config.weight_cosine_floor)))
    if norm_ratio == 0:
        return 0.0
    return 100.0 * similar * band_score(norm_ratio, config.weight_norm_band) / 100.0


def grad_component(grad_norm: float, peer_median: float, config: HealthConfig) -> float:
    if not math.isfinite(grad_norm):
        return 0.0
    if peer_median <= 0:
        return 100.0
    return band_score(max(grad_norm, 1e-30) / peer_median, config.grad_band) if grad_norm > 0 else 100.0


def combine(components: dict[str, float | None], weights: dict[str, float]) -> float:
    """Weighted geometric mean of the components present (None is left out); 100 when none is."""
    present = {k: v for k, v in components.items() if v is not None and weights.get(k, 0) > 0}
    if not present:
        return 100.0
    if any(v <= 0 for v in present.values()):
        return 0.0
    total = sum(weights[k] for k in present)
    return 100.0 * math.exp(sum(weights[k] / total * math.log(v / 100.0) for k, v in present.items()))


@dataclass(frozen=True)
class ExpertHealth:
    """One row of the `expert_health` table."""

    run_id: str
    window: int
    step_start: int
    step_end: int
    ts: dt.datetime
    layer: int
    expert: int
    score: float
    load: float | None
    confidence: float | None
    output: float | None
    weight: float | None
    grad: float | None
    load_share_ratio: float | None
    gate_weight_mean: float | None
    output_norm_mean: float | None
    output_nonfinite_fraction: float | None
    weight_cosine: float | None
    weight_norm_ratio: float | None
    grad_norm: float | None
    trust_weight: float
    reasons: str

    def as_row(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class _Window:
    def __init__(self, experts: int):
        self.steps: list[int] = []
        self.ts: dt.datetime | None = None
        self.load = np.zeros(experts, dtype=np.float64)
        self.gate_sum = np.zeros(experts, dtype=np.float64)
        self.samples = np.zeros(experts, dtype=np.float64)
        self.norm_sum = np.zeros(experts, dtype=np.float64)
        self.nonfinite = np.zeros(experts, dtype=np.float64)
        self.cosine: np.ndarray | None = None
        self.norm_ratio: np.ndarray | None = None
        self.grad: np.ndarray | None = None
        self.trust = np.ones(experts, dtype=np.float64)
        self.input_nonfinite = 0
        self.forwards = 0
        self.step_end = 0

    def add(self, step: int, ts: dt.datetime, ls: LayerStep, experts: int, step_end: int | None = None) -> None:
        self.steps.append(step)
        self.step_end = step if step_end is None else step_end
        self.forwards += max(int(ls.forwards), 1)
        self.ts = ts
        self.load += ls.expert_load[:experts]
        self.gate_sum += ls.gate_weight_sum[:experts]
        if ls.expert_output_samples is not None:
            # sampled: the norms and non-finite counts of the samples come with them
            assert ls.expert_output_norm_sum is not None and ls.expert_output_nonfinite is not None
            self.samples += ls.expert_output_samples
            self.norm_sum += ls.expert_output_norm_sum
            self.nonfinite += ls.expert_output_nonfinite
        if ls.expert_weight_cosine is not None:  # the latest check of the window counts
            assert ls.expert_weight_norm_ratio is not None  # a weight check measures both
            self.cosine = ls.expert_weight_cosine.astype(np.float64)
            self.norm_ratio = ls.expert_weight_norm_ratio.astype(np.float64)
        if ls.expert_grad_norm is not None:
            self.grad = ls.expert_grad_norm.astype(np.float64)
        if ls.nonfinite_input_tokens:
            self.input_nonfinite += ls.nonfinite_input_tokens
        if ls.trust_weight is not None:
            self.trust = np.minimum(self.trust, ls.trust_weight)  # gated at any time in the window


class HealthScorer:
    """Feeds on `StepRecord`s; returns the `ExpertHealth` rows of each window as it closes."""

    def __init__(self, config: HealthConfig | None = None):
        self.config = config or HealthConfig()
        self._windows: dict[int, _Window] = {}
        self._count: dict[int, int] = {}
        self._baseline_share: dict[int, np.ndarray] = {}
        self._baseline_norm: dict[int, np.ndarray] = {}
        self._baseline_seen: dict[int, np.ndarray] = {}
        self._experts: dict[int, int] = {}
        # The last measured output and weight components per (layer, expert): the sampler visits
        # each expert's outputs every few forwards and its weights every `weight_every`, and an
        # expert's own computation does not change between visits unless its weights do (which
        # the next visit sees), so a window without a visit reuses the last one.
        self._last: dict[tuple[int, int, str], tuple[float, str]] = {}

    def set_experts(self, layer: int, num_experts: int) -> None:
        """Routed experts with parameters (zero experts are not scored)."""
        self._experts[layer] = num_experts

    def observe(self, record: StepRecord) -> list[ExpertHealth]:
        rows: list[ExpertHealth] = []
        for ls in record.layers:
            experts = self._experts.get(ls.layer, len(ls.expert_load))
            window = self._windows.setdefault(ls.layer, _Window(experts))
            window.add(record.step, record.ts, ls, experts, record.step_end)
            if window.forwards >= self.config.window_steps:  # a windowed record counts its forwards
                rows.extend(self._score(record.run_id, ls.layer, window))
                self._windows[ls.layer] = _Window(experts)
        return rows

    def _score(self, run_id: str, layer: int, w: _Window) -> list[ExpertHealth]:
        """Score every expert of a closed window, then learn the baselines from the healthy ones."""
        index = self._count.get(layer, 0)
        self._count[layer] = index + 1
        experts = len(w.load)
        seen = self._baseline_seen.setdefault(layer, np.zeros(experts, dtype=np.int64))
        peers = _Peers.of(w, self.config)
        rows = []
        for e in range(experts):
            has_base = seen[e] >= self.config.baseline_windows
            comps, reasons = self._components(layer, e, w, peers, has_base)
            rows.append(self._row(run_id, index, layer, e, w, peers, comps, reasons))
            self._learn(layer, e, w, peers, rows[-1].score)
        return rows

    def _components(self, layer: int, e: int, w: _Window, peers: _Peers,
                    has_base: bool) -> tuple[dict[str, float | None], list[str]]:
        """One expert's components (None: not measured) and the reasons of those below 50, in order.

        Output and weight are measured only when the sampler visited the expert; a window without a
        visit reuses the last measured value and reason ("last measured")."""
        cfg = self.config
        base_share = self._baseline_share[layer] if layer in self._baseline_share else None
        base_norm = self._baseline_norm[layer] if layer in self._baseline_norm else None
        comps: dict[str, float | None] = dict.fromkeys(COMPONENTS)
        why: dict[str, str] = {}
        if peers.ungated[e] and peers.routed:
            share = peers.shares[e]
            base = base_share[e] if has_base and base_share is not None else None
            load = comps["load"] = load_component(share, base, cfg)
            if load < 50:
                why["load"] = f"load {'dead' if share < 1 else 'hot'}: {share:.2f}x its fair share"
            if peers.trusted[e]:
                confidence = comps["confidence"] = confidence_component(peers.gate_mean[e], peers.gate_median, cfg)
                if confidence < 50:
                    why["confidence"] = (f"low gate weight when chosen: {peers.gate_mean[e]:.3f} vs median "
                                         f"{peers.gate_median:.3f}")
        if w.samples[e] > 0:
            norm = peers.norm_mean[e] if peers.good[e] > 0 else float("nan")
            baseline = base_norm[e] if has_base and base_norm is not None else None
            output = comps["output"] = output_component(norm, int(w.nonfinite[e]), peers.norm_median, baseline, cfg)
            if w.nonfinite[e] > 0:
                why["output"] = f"non-finite outputs: {int(w.nonfinite[e])}/{int(w.samples[e])} sampled"
            elif output < 50:
                why["output"] = f"output norm outlier: {peers.norm_mean[e]:.3g} vs median {peers.norm_median:.3g}"
        if w.cosine is not None and w.norm_ratio is not None:  # set together, by a weight check
            weight = comps["weight"] = weight_component(w.cosine[e], w.norm_ratio[e], cfg)
            if weight < 50:
                why["weight"] = (f"weights drifted: cosine {w.cosine[e]:.3f}, "
                                 f"norm x{w.norm_ratio[e]:.3g} since attach")
        if w.grad is not None:
            grad = comps["grad"] = grad_component(w.grad[e], peers.grad_median, cfg)
            if not math.isfinite(w.grad[e]):
                why["grad"] = f"non-finite gradient: norm {w.grad[e]}"
            elif grad < 50:
                why["grad"] = f"gradient norm outlier: {w.grad[e]:.3g} vs median {peers.grad_median:.3g}"
        reasons = [why[name] for name in COMPONENTS if name in why]
        for name in ("output", "weight"):  # the sampled components carry over between visits
            measured = comps[name]
            if measured is not None:
                self._last[(layer, e, name)] = (measured, why.get(name, ""))
            elif (layer, e, name) in self._last:
                last, reason = self._last[(layer, e, name)]
                comps[name] = last
                if reason and last < 50:
                    reasons.append(f"{reason} (last measured)")
        return comps, reasons

    def _row(self, run_id: str, index: int, layer: int, e: int, w: _Window, peers: _Peers,
             comps: dict[str, float | None], reasons: list[str]) -> ExpertHealth:
        assert w.ts is not None  # a scored window holds a step
        return ExpertHealth(
            run_id=run_id, window=index, step_start=w.steps[0], step_end=w.step_end, ts=w.ts, layer=layer,
            expert=e, score=combine(comps, self.config.weights), load=comps["load"],
            confidence=comps["confidence"], output=comps["output"], weight=comps["weight"], grad=comps["grad"],
            load_share_ratio=float(peers.shares[e]) if peers.routed else None,
            gate_weight_mean=None if np.isnan(peers.gate_mean[e]) else float(peers.gate_mean[e]),
            output_norm_mean=None if np.isnan(peers.norm_mean[e]) else float(peers.norm_mean[e]),
            output_nonfinite_fraction=float(w.nonfinite[e] / w.samples[e]) if w.samples[e] else None,
            weight_cosine=None if w.cosine is None else float(w.cosine[e]),
            weight_norm_ratio=None if w.norm_ratio is None else float(w.norm_ratio[e]),
            grad_norm=None if w.grad is None else float(w.grad[e]), trust_weight=float(w.trust[e]),
            reasons="; ".join(reasons))

    def _learn(self, layer: int, e: int, w: _Window, peers: _Peers, score: float) -> None:
        """Learn the expert's baselines from healthy, ungated windows only, so a fault is never learnt."""
        cfg = self.config
        experts = len(w.load)
        seen = self._baseline_seen[layer]
        base_share = self._baseline_share.setdefault(layer, np.zeros(experts))
        base_norm = self._baseline_norm.setdefault(layer, np.zeros(experts))
        if score >= cfg.baseline_min_score and peers.ungated[e]:
            d = cfg.baseline_decay if seen[e] else 0.0
            if peers.routed:
                base_share[e] = d * base_share[e] + (1 - d) * peers.shares[e]
            if np.isfinite(peers.norm_mean[e]) and w.nonfinite[e] == 0:
                base_norm[e] = d * base_norm[e] + (1 - d) * peers.norm_mean[e]
            seen[e] += 1


@dataclass(frozen=True)
class _Peers:
    """What a window says about all experts of a layer, that each expert is judged against."""

    ungated: np.ndarray  # trust weight 1 all window
    shares: np.ndarray  # load * ungated experts / ungated load (1 = a fair share)
    routed: bool  # enough assignments, and no non-finite input, to judge routing at all
    gate_mean: np.ndarray  # mean gate weight when chosen (NaN: never chosen)
    trusted: np.ndarray  # ungated and chosen often enough to judge confidence
    gate_median: float
    good: np.ndarray  # finite sampled outputs
    norm_mean: np.ndarray  # mean L2 norm of the finite sampled outputs (NaN: none)
    norm_median: float
    grad_median: float

    @classmethod
    def of(cls, w: _Window, cfg: HealthConfig) -> _Peers:
        experts = len(w.load)
        ungated = w.trust >= 1.0
        total = w.load[ungated].sum()
        shares = w.load * ungated.sum() / total if total > 0 else np.zeros(experts)
        # Routing on non-finite inputs (a fault upstream) says nothing about this layer's experts.
        routed = bool(total >= max(cfg.min_window_assignments, cfg.min_expected_per_expert * max(ungated.sum(), 1))
                      and w.input_nonfinite == 0)
        gate_mean = np.divide(w.gate_sum, w.load, out=np.full(experts, np.nan), where=w.load > 0)
        trusted = ungated & (w.load >= cfg.min_expert_assignments)
        good = w.samples - w.nonfinite
        norm_mean = np.divide(w.norm_sum, good, out=np.full(experts, np.nan), where=good > 0)
        finite_norms = norm_mean[np.isfinite(norm_mean) & (w.nonfinite == 0)]
        grads = w.grad[np.isfinite(w.grad)] if w.grad is not None else np.zeros(0)
        return cls(ungated=ungated, shares=shares, routed=routed, gate_mean=gate_mean, trusted=trusted,
                   gate_median=float(np.median(gate_mean[trusted])) if trusted.any() else float("nan"),
                   good=good, norm_mean=norm_mean,
                   norm_median=float(np.median(finite_norms)) if finite_norms.size else 0.0,
                   grad_median=float(np.median(grads)) if grads.size else 0.0)
