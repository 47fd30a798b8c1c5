"""The expert-health score: 0-100 per (layer, expert) per window of recorded forwards.

Each window (`HealthConfig.window_steps` forwards of a layer) sums what the probe measured and
turns it into components, each 0-100 (100 = healthy), then into one score:

    score = 100 * prod_i (c_i / 100) ** (w_i / sum_j w_j)      over the components present

a weighted geometric mean, so one component at 0 (a NaN output, a thousandfold weight) takes the
score to 0 whatever the others say. A component of weight 0 is measured and reported, not
scored: by default load and confidence, which are what the router does with the expert. An
expert whose load or gate weight fell because the traffic changed is routing news (the rules
engine's drift and dead-expert alerts say it), not a sick expert: an expert is unhealthy for what
it computes. Components (see `docs/health.md` for the defaults):

- load (reported, weight 0 by default): share of the layer's assignments r = load_e * E / sum(load), against peers
  (`band_score(r, load_band)`) and, once the expert has a baseline, against its own baseline
  share (`band_score(r / r_base, load_baseline_band)`); the larger of the two counts, so an
  expert is a load anomaly only if it is unusual for the layer *and* for itself.
- confidence (reported, weight 0 by default): mean gate weight when chosen, over the peers'
  median, `100 * min(1, ratio / floor)`.
- output: 0 if any sampled output held a NaN/inf, else the mean L2 norm of its sampled outputs
  against the median of the *other* experts' last measured norms (`output_band` above them,
  `output_low_band` below) and against its own baseline (the larger of the two band scores). The
  sampler visits one or two experts per window, so the peers are each expert's latest measurement,
  carried across windows, never the expert itself; fewer than `min_output_peers` of them: no peer
  verdict (a median of three stands one faulty expert, a median of two does not).
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
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from moescope.core.records import LayerStep, StepRecord

COMPONENTS = ("load", "confidence", "output", "weight", "grad")


@dataclass(frozen=True)
class HealthConfig:
    window_steps: int = 4
    # Load and confidence are measured and reported but not scored (weight 0): they are what the
    # router does with the expert, and a traffic shift moves both (an expert left idle, or still
    # sent its share at a lower gate weight): routing news, which the rules' drift and dead-expert
    # alerts say once. The score is what the expert itself computes. Give them a weight to score them.
    weights: dict[str, float] = field(default_factory=lambda: dict(
        load=0.0, confidence=0.0, output=0.35, weight=0.25, grad=0.15))
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
    # Below the peers the band is wider: a trained model's barely-routed expert computes an order of
    # magnitude quieter than its peers (the demo's never-routed expert: 0.085x), which is the model
    # as trained; a zeroed or vanishing expert sits at 0 or orders of magnitude below.
    output_low_band: float = 16.0
    min_output_peers: int = 3  # other experts' measured norms needed to judge an output against peers
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
        if self.min_output_peers < 1:
            raise ValueError("min_output_peers must be at least 1 (other experts an output is judged against)")
        unknown = set(self.weights) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"unknown health components {sorted(unknown)}; known: {', '.join(COMPONENTS)}")


# The component functions take a float or an array of the experts' values (and return the same):
# the scorer judges a layer's experts all at once. NaN in `combine`'s components is "not measured".

def _out(value: np.ndarray) -> float | np.ndarray:
    return float(value) if value.ndim == 0 else value


def band_score(ratio: float | np.ndarray, band: float) -> float | np.ndarray:
    """100 when 1/band <= ratio <= band, else 100 * band / max(ratio, 1/ratio); 0 for 0, inf, NaN."""
    r = np.asarray(ratio, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        score = 100.0 * np.minimum(1.0, band / np.maximum(r, 1.0 / r))
    return _out(np.where(np.isfinite(r) & (r > 0), score, 0.0))


def load_component(share_ratio: float | np.ndarray, baseline_ratio: float | np.ndarray | None,
                   config: HealthConfig) -> float | np.ndarray:
    """share_ratio: load * E / total; baseline_ratio: the expert's own baseline share ratio
    (None, NaN or <= 0: none yet)."""
    share = np.asarray(share_ratio, dtype=np.float64)
    peers = np.asarray(band_score(share, config.load_band))
    if baseline_ratio is None:
        return _out(peers)
    base = np.asarray(baseline_ratio, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        own = np.asarray(band_score(share / base, config.load_baseline_band))
    return _out(np.where(np.isfinite(base) & (base > 0), np.maximum(peers, own), peers))


def confidence_component(gate_mean: float | np.ndarray, peer_median: float,
                         config: HealthConfig) -> float | np.ndarray:
    gate = np.asarray(gate_mean, dtype=np.float64)
    if not math.isfinite(peer_median) or peer_median <= 0:
        return _out(np.where(np.isfinite(gate), 100.0, 0.0))
    with np.errstate(invalid="ignore"):
        score = 100.0 * np.minimum(1.0, (gate / peer_median) / config.confidence_floor)
    return _out(np.where(np.isfinite(gate), score, 0.0))


def output_component(norm_mean: float | np.ndarray, nonfinite: int | np.ndarray, peer_median: float | np.ndarray,
                     baseline: float | np.ndarray | None, config: HealthConfig) -> float | np.ndarray:
    """The output component: 0 for any non-finite sampled output, else the larger of the band
    scores of the mean norm against `peer_median` and against `baseline`; NaN (not judged) when
    neither reference exists.

    peer_median: the median norm of the *other* experts (one for all, or one per expert; NaN: too
    few measured to judge against); baseline: the expert's own baseline norm (None, NaN or <= 0:
    none yet)."""
    norm = np.asarray(norm_mean, dtype=np.float64)
    reference = np.broadcast_to(np.asarray(peer_median, dtype=np.float64), norm.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = norm / reference
        # every other expert outputs zeros (e.g. zero-initialised) and so does this one: nothing stands out
        peers = np.where(np.isnan(reference), np.nan,
                         np.where(reference > 0, np.where(norm >= reference, band_score(ratio, config.output_band),
                                                          band_score(ratio, config.output_low_band)),
                                  np.where(norm <= 0, 100.0, 0.0)))
        if baseline is not None:
            base = np.asarray(baseline, dtype=np.float64)
            own = np.asarray(band_score(norm / base, config.output_baseline_band))
            peers = np.where(np.isfinite(base) & (base > 0), np.fmax(peers, own), peers)
    return _out(np.where((np.asarray(nonfinite) > 0) | ~np.isfinite(norm), 0.0, peers))


def others_median(values: np.ndarray, least: int) -> np.ndarray:
    """Per entry, the median of the *other* entries' finite values; NaN where fewer than `least`
    of them are finite. An expert is never its own peer."""
    values = np.asarray(values, dtype=np.float64)
    others = np.where(np.eye(values.size, dtype=bool), np.nan, np.broadcast_to(values, (values.size, values.size)))
    counts = np.isfinite(others).sum(axis=1)
    out = np.full(values.size, np.nan)
    enough = counts >= least
    if enough.any():
        out[enough] = np.nanmedian(np.where(np.isfinite(others[enough]), others[enough], np.nan), axis=1)
    return out


def weight_component(cosine: float | np.ndarray, norm_ratio: float | np.ndarray,
                     config: HealthConfig) -> float | np.ndarray:
    c = np.asarray(cosine, dtype=np.float64)
    r = np.asarray(norm_ratio, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        floor = config.weight_cosine_floor
        similar = np.minimum(1.0, np.maximum(0.0, (c - floor) / (1.0 - floor)))
        score = 100.0 * similar * np.asarray(band_score(r, config.weight_norm_band)) / 100.0
    return _out(np.where(np.isfinite(c) & np.isfinite(r) & (r != 0), score, 0.0))


def grad_component(grad_norm: float | np.ndarray, peer_median: float, config: HealthConfig) -> float | np.ndarray:
    grad = np.asarray(grad_norm, dtype=np.float64)
    if peer_median <= 0:
        return _out(np.where(np.isfinite(grad), 100.0, 0.0))
    outlier = np.asarray(band_score(np.maximum(grad, 1e-30) / peer_median, config.grad_band))
    return _out(np.where(~np.isfinite(grad), 0.0, np.where(grad > 0, outlier, 100.0)))


def combine(components: Mapping[str, float | np.ndarray | None], weights: dict[str, float]) -> float | np.ndarray:
    """Weighted geometric mean of the components present (None or NaN is left out); 100 when none
    is. Floats or arrays (one value per expert)."""
    values = {k: np.asarray(np.nan if v is None else v, dtype=np.float64) for k, v in components.items()
              if weights.get(k, 0) > 0}
    shape = np.broadcast_shapes(*(v.shape for v in values.values())) if values else ()
    total, logs = np.zeros(shape), np.zeros(shape)
    present_any, zero = np.zeros(shape, dtype=bool), np.zeros(shape, dtype=bool)
    for k, v in values.items():  # in the components' order: the same sums as one expert at a time
        present = ~np.isnan(v)
        present_any |= present
        zero |= present & (v <= 0)
        total = total + np.where(present, weights[k], 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        for k, v in values.items():
            logs = logs + np.where(~np.isnan(v) & ~zero, weights[k] / total * np.log(v / 100.0), 0.0)
        score = 100.0 * np.exp(logs)
    return _out(np.where(~present_any, 100.0, np.where(zero, 0.0, score)))


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
        self._baseline_norm_seen: dict[int, np.ndarray] = {}  # healthy windows with the output sampled
        # Each expert's last measured mean output norm (NaN: never measured, or last non-finite): the
        # peers an output is judged against, carried across windows because a window samples only
        # one or two experts of a layer.
        self._last_norm: dict[int, np.ndarray] = {}
        self._experts: dict[int, int] = {}
        # The last measured output and weight components per (layer, expert): the sampler visits
        # each expert's outputs every few forwards and its weights every `weight_every`, and an
        # expert's own computation does not change between visits unless its weights do (which
        # the next visit sees), so a window without a visit reuses the last one.
        self._last: dict[tuple[int, str], tuple[np.ndarray, list[str]]] = {}  # (layer, component) -> per expert

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
        norm_seen = self._baseline_norm_seen.setdefault(layer, np.zeros(experts, dtype=np.int64))
        last = self._last_norm.setdefault(layer, np.full(experts, np.nan))
        sampled = w.samples > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            last[sampled] = np.where(w.nonfinite[sampled] > 0, np.nan, w.norm_sum[sampled] / w.samples[sampled])
        peers = _Peers.of(w, self.config, others_median(last, self.config.min_output_peers))
        comps, reasons = self._components(layer, w, peers, seen >= self.config.baseline_windows,
                                          norm_seen >= self.config.baseline_windows)
        scores = np.asarray(combine(comps, self.config.weights))
        rows = self._rows(run_id, index, layer, w, peers, comps, reasons, scores)
        self._learn(layer, w, peers, scores, comps["load"])
        return rows

    def _components(self, layer: int, w: _Window, peers: _Peers, has_base: np.ndarray,
                    has_norm_base: np.ndarray) -> tuple[dict[str, np.ndarray], list[list[str]]]:
        """Every expert's components (NaN: not measured) and the reasons of those below 50, in order.

        Output and weight are measured only when the sampler visited the expert; a window without a
        visit reuses the last measured value and reason ("last measured")."""
        cfg = self.config
        experts = len(w.load)
        missing = np.full(experts, np.nan)
        base_share = self._baseline_share.get(layer)
        base_norm = self._baseline_norm.get(layer)
        comps = dict.fromkeys(COMPONENTS, missing)
        if peers.routed:
            base = None if base_share is None else np.where(has_base, base_share, np.nan)
            comps["load"] = np.where(peers.ungated, load_component(peers.shares, base, cfg), np.nan)
            comps["confidence"] = np.where(peers.trusted, confidence_component(peers.gate_mean, peers.gate_median, cfg),
                                           np.nan)
        sampled = w.samples > 0
        if sampled.any():
            norm = np.where(peers.good > 0, peers.norm_mean, np.nan)
            baseline = None if base_norm is None else np.where(has_norm_base, base_norm, np.nan)
            comps["output"] = np.where(sampled, output_component(norm, w.nonfinite, peers.norm_median, baseline, cfg),
                                       np.nan)
        if w.cosine is not None and w.norm_ratio is not None:  # set together, by a weight check
            comps["weight"] = np.asarray(weight_component(w.cosine, w.norm_ratio, cfg))
        if w.grad is not None:
            comps["grad"] = np.asarray(grad_component(w.grad, peers.grad_median, cfg))
        why: list[dict[str, str]] = [{} for _ in range(experts)]
        with np.errstate(invalid="ignore"):
            for e in np.flatnonzero(comps["load"] < 50):
                share = peers.shares[e]
                why[e]["load"] = f"load {'dead' if share < 1 else 'hot'}: {share:.2f}x its fair share"
            for e in np.flatnonzero(comps["confidence"] < 50):
                why[e]["confidence"] = (f"low gate weight when chosen: {peers.gate_mean[e]:.3f} vs median "
                                        f"{peers.gate_median:.3f}")
            for e in np.flatnonzero(sampled & ((w.nonfinite > 0) | (comps["output"] < 50))):
                why[e]["output"] = (f"non-finite outputs: {int(w.nonfinite[e])}/{int(w.samples[e])} sampled"
                                    if w.nonfinite[e] > 0 else
                                    f"output norm outlier: {peers.norm_mean[e]:.3g} vs the other experts' median "
                                    f"{peers.norm_median[e]:.3g}")
            if w.cosine is not None and w.norm_ratio is not None:
                for e in np.flatnonzero(comps["weight"] < 50):
                    why[e]["weight"] = (f"weights drifted: cosine {w.cosine[e]:.3f}, "
                                        f"norm x{w.norm_ratio[e]:.3g} since attach")
            if w.grad is not None:
                for e in np.flatnonzero(~np.isfinite(w.grad) | (comps["grad"] < 50)):
                    why[e]["grad"] = (f"non-finite gradient: norm {w.grad[e]}" if not math.isfinite(w.grad[e]) else
                                      f"gradient norm outlier: {w.grad[e]:.3g} vs median {peers.grad_median:.3g}")
        reasons = [[reason[name] for name in COMPONENTS if name in reason] for reason in why]
        for name in ("output", "weight"):  # the sampled components carry over between visits
            last, last_why = self._last.setdefault((layer, name), (np.full(experts, np.nan), [""] * experts))
            measured = ~np.isnan(comps[name])
            for e in np.flatnonzero(measured):
                last_why[e] = why[e].get(name, "")
            last[measured] = comps[name][measured]
            carried = ~measured & ~np.isnan(last)
            comps[name] = np.where(carried, last, comps[name])
            for e in np.flatnonzero(carried & (last < 50)):
                if last_why[e]:
                    reasons[e].append(f"{last_why[e]} (last measured)")
        return comps, reasons

    def _rows(self, run_id: str, index: int, layer: int, w: _Window, peers: _Peers, comps: dict[str, np.ndarray],
              reasons: list[list[str]], scores: np.ndarray) -> list[ExpertHealth]:
        assert w.ts is not None  # a scored window holds a step

        def column(values: np.ndarray | None, present: np.ndarray | None = None) -> list[float | None]:
            if values is None:
                return [None] * len(w.load)
            keep = ~np.isnan(values) if present is None else present
            return [v if k else None for v, k in zip(values.astype(np.float64).tolist(), keep.tolist())]

        c = {name: column(comps[name]) for name in COMPONENTS}
        with np.errstate(divide="ignore", invalid="ignore"):
            nonfinite_fraction = column(w.nonfinite / w.samples, w.samples > 0)
        shares = column(peers.shares, np.full(len(w.load), peers.routed))
        gate_mean, norm_mean = column(peers.gate_mean), column(peers.norm_mean)
        cosine = column(w.cosine, None if w.cosine is None else np.ones(len(w.load), dtype=bool))
        norm_ratio = column(w.norm_ratio, None if w.norm_ratio is None else np.ones(len(w.load), dtype=bool))
        grad = column(w.grad, None if w.grad is None else np.ones(len(w.load), dtype=bool))
        score, trust = scores.tolist(), w.trust.tolist()
        return [ExpertHealth(
            run_id=run_id, window=index, step_start=w.steps[0], step_end=w.step_end, ts=w.ts, layer=layer,
            expert=e, score=score[e], load=c["load"][e], confidence=c["confidence"][e], output=c["output"][e],
            weight=c["weight"][e], grad=c["grad"][e], load_share_ratio=shares[e], gate_weight_mean=gate_mean[e],
            output_norm_mean=norm_mean[e], output_nonfinite_fraction=nonfinite_fraction[e],
            weight_cosine=cosine[e], weight_norm_ratio=norm_ratio[e], grad_norm=grad[e], trust_weight=trust[e],
            reasons="; ".join(reasons[e])) for e in range(len(w.load))]

    def _learn(self, layer: int, w: _Window, peers: _Peers, scores: np.ndarray, load: np.ndarray) -> None:
        """Learn the experts' baselines from healthy, ungated windows only, so a fault is never learnt."""
        cfg = self.config
        experts = len(w.load)
        seen = self._baseline_seen[layer]
        norm_seen = self._baseline_norm_seen[layer]
        base_share = self._baseline_share.setdefault(layer, np.zeros(experts))
        base_norm = self._baseline_norm.setdefault(layer, np.zeros(experts))
        healthy = (scores >= cfg.baseline_min_score) & peers.ungated
        d = np.where(seen > 0, cfg.baseline_decay, 0.0)
        with np.errstate(invalid="ignore", over="ignore"):
            if peers.routed:  # a share is learnt only where the load was normal too, scored or not
                learn = healthy & ~(load < cfg.baseline_min_score)
                base_share[:] = np.where(learn, d * base_share + (1 - d) * peers.shares, base_share)
            norm = healthy & np.isfinite(peers.norm_mean) & (w.nonfinite == 0)
            # the norm's own count: an expert's first sampled window starts its average, whatever
            # windows without a sample came before
            d_norm = np.where(norm_seen > 0, cfg.baseline_decay, 0.0)
            base_norm[:] = np.where(norm, d_norm * base_norm + (1 - d_norm) * peers.norm_mean, base_norm)
        seen += healthy
        norm_seen += norm


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
    norm_median: np.ndarray  # per expert, the other experts' last measured norms' median (NaN: too few)
    grad_median: float

    @classmethod
    def of(cls, w: _Window, cfg: HealthConfig, norm_median: np.ndarray) -> _Peers:
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
        grads = w.grad[np.isfinite(w.grad)] if w.grad is not None else np.zeros(0)
        return cls(ungated=ungated, shares=shares, routed=routed, gate_mean=gate_mean, trusted=trusted,
                   gate_median=float(np.median(gate_mean[trusted])) if trusted.any() else float("nan"),
                   good=good, norm_mean=norm_mean,
                   norm_median=norm_median,
                   grad_median=float(np.median(grads)) if grads.size else 0.0)
