"""Routing signals: pure functions of recorded expert loads and routes.

Every function here takes numpy arrays (or plain numbers) and returns a float or a small dict; no
I/O, no state. The rules engine and the Prometheus exporter compute the same numbers through
these functions, and the tests check each one against scipy or a brute-force loop.

Conventions, stated once:

- A *load* is a vector of token counts per expert (the `expert_load` column), summed over a
  window of steps by the caller.
- Logarithms are natural (nats). Normalised entropies divide by the log of the number of
  outcomes, so they lie in [0, 1].
- KL divergence needs every expert of the reference to be non-zero. `kl_divergence` therefore
  adds `alpha` pseudo-tokens to every expert of *both* loads before normalising (additive
  smoothing; `alpha=0.5` is the Jeffreys prior). With that, an empty expert costs a large but
  finite amount instead of infinity. Jensen-Shannon is bounded by ln 2 without smoothing, so
  `js_divergence` smooths nothing unless asked.
- An empty window (no tokens at all) has no distribution: those functions return NaN, which a
  rule treats as "no data" (never fires, never resolves on it).

The derived metrics every view shows (`moescope summary`, the dashboard, Prometheus, the rules)
are defined here once, with two rules:

- **Weighting: by tokens.** A mean of per-row means (router entropy, active-parameter fraction)
  weights each row (a forward, a window of forwards, a layer) by its tokens, so a prefill of 4096
  tokens counts 4096 times a one-token decode step; rates are sums over sums (dropped tokens /
  tokens). `token_weighted_mean` is the rule; `store` computes the same in SQL.
- **Zero experts** (identity experts, e.g. LongCat-Flash's: the router may choose them, they
  hold no parameters) are left out of every *load* metric (spread, dead experts, load entropy,
  divergences): they have no compute to balance and no capacity to fill (`routed_load`). Their
  share of the slots is its own number (`zero_expert_share`). *Router entropy* is measured over
  the router's whole softmax, zero experts included, so it is normalised by the log of that
  width (E + zero experts; `normalized_entropy`).
- *Tokens* and *slots* differ: a token routed to k experts fills k slots. `expert_load[e]` counts
  the tokens that chose expert e (a token chooses an expert at most once), so an expert's share
  of the layer's *tokens* is load / tokens (the top-k shares sum to k), its share of the
  *slots* is load / sum(load) (they sum to 1).

At the end, a few signals over a whole query result (the store's frames in, a table out):
specialisation per layer and divergence per window, so that every view reads them from here.

The other ideas of the metrics room have modules of their own, built on these: rank balance under
a placement (`moescope.metrics.ranks`), the capacity what-if (`moescope.metrics.capacity`) and the
figures of a layer and a run (`moescope.metrics.figures`). Their names are still found here
(`signals.run_figures`, `signals.replica_shares`, ...), loaded on first use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moescope.core.lazy import lazy_exports

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "balancedness", "coefficient_of_variation", "dead_expert_count", "dead_expert_fraction", "DEFAULT_SMOOTHING",
    "divergence_over_time", "dropped_token_rate", "expert_tag_contingency", "extreme_experts", "imbalance",
    "jain_fairness", "js_divergence", "kl_divergence", "load_balancing_loss", "load_distribution", "load_entropy",
    "load_spread", "LoadSpread", "LOST_ALONE_MAX_REST_KL", "LOST_EXPERT_MIN_EXPECTED", "lost_expert_alone_fraction",
    "lost_expert_fraction", "max_mean_ratio",
    "normalized_entropy", "normalized_mutual_information",
    "routed_load", "router_entropy", "router_z_loss", "RouterEntropy", "routing_drift_rate",
    "specialisation_by_layer", "switch_entropy", "token_weighted_mean", "uniform_load", "zero_expert_share",
]

DEFAULT_SMOOTHING = 0.5

# Names that moved to a module of their own (issue 46): still read here, each defined once there, and
# loaded on first use, as those modules import this one.
_MOVED = {
    **dict.fromkeys(("REPLICA_SPLITS", "replica_shares", "expected_rank_tokens", "balancedness_over_layers",
                     "rank_load"), "moescope.metrics.ranks"),
    **dict.fromkeys(("CAPACITY_FACTORS", "WhatIfCapacity", "expert_capacity", "whatif_capacity"),
                    "moescope.metrics.capacity"),
    **dict.fromkeys(("LayerFigures", "layer_figures", "RunFigures", "run_figures", "RunCounts", "run_counts",
                     "layer_figures_of"), "moescope.metrics.figures"),
}

if TYPE_CHECKING:
    from moescope.metrics.capacity import (  # noqa: F401
        CAPACITY_FACTORS,
        WhatIfCapacity,
        expert_capacity,
        whatif_capacity,
    )
    from moescope.metrics.figures import (  # noqa: F401
        LayerFigures,
        RunCounts,
        RunFigures,
        layer_figures,
        layer_figures_of,
        run_counts,
        run_figures,
    )
    from moescope.metrics.ranks import (  # noqa: F401
        REPLICA_SPLITS,
        balancedness_over_layers,
        expected_rank_tokens,
        rank_load,
        replica_shares,
    )
else:
    __getattr__, __dir__ = lazy_exports(__name__, _MOVED)


def _as_load(load: np.ndarray | list[float]) -> np.ndarray:
    arr = np.asarray(load, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"an expert load must be a non-empty 1-D vector, got shape {arr.shape}")
    if np.any(arr < 0) or not np.all(np.isfinite(arr)):
        raise ValueError("an expert load must hold finite, non-negative token counts")
    return arr


def load_distribution(load: np.ndarray | list[float], alpha: float = 0.0) -> np.ndarray:
    """Return the load as a probability vector after adding `alpha` to every expert.

    Returns an all-NaN vector when the load (plus smoothing) sums to zero.
    """
    arr = _as_load(load) + alpha
    total = arr.sum()
    if total <= 0:
        return np.full(arr.shape, np.nan)
    return arr / total


def uniform_load(num_experts: int) -> np.ndarray:
    """Return the load vector of a perfectly balanced router (one token per expert)."""
    if num_experts < 1:
        raise ValueError("num_experts must be at least 1")
    return np.ones(num_experts, dtype=np.float64)


def _pair(load: np.ndarray, reference: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray] | None:
    """Both loads as smoothed distributions; None when either is undefined (empty, alpha 0)."""
    p = load_distribution(load, alpha)
    q = load_distribution(reference, alpha)
    if p.shape != q.shape:
        raise ValueError(f"loads differ in number of experts: {p.size} vs {q.size}")
    if np.isnan(p).any() or np.isnan(q).any():
        return None
    return p, q


def kl_divergence(load: np.ndarray, reference: np.ndarray, alpha: float = DEFAULT_SMOOTHING) -> float:
    """Return KL(load || reference) in nats, both smoothed by `alpha` pseudo-tokens per expert.

    Raises ValueError when the two vectors differ in length. NaN when either load is empty and
    `alpha` is 0.
    """
    pair = _pair(load, reference, alpha)
    if pair is None:
        return float("nan")
    p, q = pair
    mask = p > 0
    if np.any(q[mask] == 0):
        return float("inf")
    return float(np.sum(p[mask] * np.log(p[mask] / q[mask])))


def js_divergence(load: np.ndarray, reference: np.ndarray, alpha: float = 0.0) -> float:
    """Return the Jensen-Shannon divergence (nats, in [0, ln 2]) between two loads.

    This is the divergence itself, the square of scipy's `jensenshannon` distance.
    """
    pair = _pair(load, reference, alpha)
    if pair is None:
        return float("nan")
    p, q = pair
    m = 0.5 * (p + q)

    def _kl(a: np.ndarray) -> float:
        mask = a > 0
        return float(np.sum(a[mask] * np.log(a[mask] / m[mask])))

    return max(0.0, 0.5 * _kl(p) + 0.5 * _kl(q))


def coefficient_of_variation(load: np.ndarray) -> float:
    """Return std/mean of the load (population std, ddof=0); NaN for an empty load."""
    arr = _as_load(load)
    mean = arr.mean()
    return float(arr.std() / mean) if mean > 0 else float("nan")


def max_mean_ratio(load: np.ndarray) -> float:
    """Return max/mean load: 1.0 is perfect balance; this is MaxVio + 1. NaN for an empty load."""
    arr = _as_load(load)
    mean = arr.mean()
    return float(arr.max() / mean) if mean > 0 else float("nan")


def balancedness(load: np.ndarray) -> float:
    """Return mean/max load in (0, 1], as SGLang and vLLM report expert balancedness."""
    arr = _as_load(load)
    peak = arr.max()
    return float(arr.mean() / peak) if peak > 0 else float("nan")


def imbalance(load: np.ndarray) -> float:
    """Return (max - mean) / mean of `load`: 0 when even, (n - 1) when one of n entries holds it all.

    TensorRT-LLM's name and definition for the imbalance of per-rank (or per-expert) loads; the
    same loads' `balancedness` (mean / max, vLLM's and SGLang's) is 1 / (1 + imbalance). NaN when
    the load is all zero.
    """
    arr = _as_load(load)
    mean = arr.mean()
    return float((arr.max() - mean) / mean) if mean > 0 else float("nan")


def normalized_entropy(entropy_nats: float, num_choices: int) -> float:
    """Return an entropy in nats divided by ln(num_choices), i.e. in [0, 1].

    A router that spreads its probability evenly over all experts scores 1; one that always puts
    all of it on a single expert scores 0. With one choice the entropy is 0 by definition.
    """
    if num_choices < 1:
        raise ValueError("num_choices must be at least 1")
    if num_choices == 1:
        return 0.0
    return float(entropy_nats) / math.log(num_choices)


def load_entropy(load: np.ndarray) -> float:
    """Return the normalised entropy of the load distribution itself."""
    p = load_distribution(load)
    if np.isnan(p).any():
        return float("nan")
    nz = p[p > 0]
    return normalized_entropy(float(-np.sum(nz * np.log(nz))), p.size)


def dead_expert_count(load: np.ndarray) -> float:
    """Return how many experts received no token in the window's summed load (a float, so it can be NaN).

    NaN when the window holds no token at all: then nothing can be called dead.
    """
    arr = _as_load(load)
    if arr.sum() <= 0:
        return float("nan")
    return float(np.count_nonzero(arr == 0))


def dead_expert_fraction(load: np.ndarray) -> float:
    """Return the fraction of experts that received no token in the window's summed load
    (`dead_expert_count` / experts). NaN when the window holds no token at all."""
    arr = _as_load(load)
    return dead_expert_count(arr) / arr.size


# Expected tokens under which an expert's empty window is not news: a Poisson count of mean 16 is 0
# with probability e^-16, about 1e-7.
LOST_EXPERT_MIN_EXPECTED = 16.0


def lost_expert_fraction(load: np.ndarray, baseline_load: np.ndarray,
                         min_expected: float = LOST_EXPERT_MIN_EXPECTED) -> float:
    """Return the fraction of experts that received no token in the window although their baseline
    share predicted at least `min_expected` of the window's slots.

    An expert the baseline barely routed to (expected count under `min_expected`) is not newly dead
    when a window leaves it empty: under the baseline's own routing that happens by chance. NaN when
    the window or the baseline holds no token, or their sizes differ.
    """
    arr, base = _as_load(load), np.asarray(baseline_load, dtype=np.float64).reshape(-1)
    if arr.size != base.size or arr.sum() <= 0 or base.sum() <= 0:
        return float("nan")
    return float(np.count_nonzero(_lost_experts(arr, base, min_expected))) / arr.size


def _lost_experts(load: np.ndarray, baseline_load: np.ndarray, min_expected: float) -> np.ndarray:
    expected = baseline_load / baseline_load.sum() * load.sum()
    return (load == 0) & (expected >= min_expected)


# KL (nats) within which the other experts' load keeps its baseline shape while an expert is lost (see
# `lost_expert_alone_fraction`): twice the largest KL of a whole healthy layer over 64 forwards against its
# baseline on the alert benchmark's models (0.015: long context), below the smallest a domain shift left on
# the experts it kept using (0.051). The rest of a layer whose one expert the router no longer chooses
# stayed within 0.013.
LOST_ALONE_MAX_REST_KL = 0.03


def lost_expert_alone_fraction(load: np.ndarray, baseline_load: np.ndarray,
                               min_expected: float = LOST_EXPERT_MIN_EXPECTED,
                               max_rest_kl: float = LOST_ALONE_MAX_REST_KL) -> float:
    """Return the fraction of experts lost (`lost_expert_fraction`) while the rest of the layer's routing
    kept its baseline shape: 0 when the other experts' load, renormalised, is more than `max_rest_kl`
    nats (KL, 0.5-token smoothing) from their baseline load, renormalised.

    An expert the router no longer chooses loses its tokens to each token's next choice, and the other
    experts' shares stay near their baseline's. A change of traffic moves them all: the experts the new
    traffic does not use are part of that drift, which `kl_baseline` measures, not experts gone.

    Args:
        load: (E,) tokens per expert over the window.
        baseline_load: (E,) the same over the baseline.
        min_expected: as in `lost_expert_fraction`.
        max_rest_kl: how far the other experts' shares may move, in nats.

    Returns:
        The fraction of the E experts; NaN when the window or the baseline holds no token, or their sizes
        differ.
    """
    arr, base = _as_load(load), np.asarray(baseline_load, dtype=np.float64).reshape(-1)
    if arr.size != base.size or arr.sum() <= 0 or base.sum() <= 0:
        return float("nan")
    lost = _lost_experts(arr, base, min_expected)
    kept = ~lost
    if not lost.any() or not kept.any() or kl_divergence(arr[kept], base[kept]) > max_rest_kl:
        return 0.0
    return float(np.count_nonzero(lost)) / arr.size


def jain_fairness(load: np.ndarray) -> float:
    """Return Jain's fairness index of the load: (sum x)^2 / (n * sum x^2), in [1/n, 1].

    1 when all n experts carry the same load, k/n when k of them share it evenly and the rest get
    nothing (so 1/n when one expert takes it all): the fraction of experts the load is "fairly"
    spread over. It equals 1 / (1 + cv^2) with cv = `coefficient_of_variation` (Jain, Chiu and
    Hawe, 1984). NaN for a load with no token.
    """
    arr = _as_load(load)
    squares = float(np.sum(arr * arr))
    return float(arr.sum() ** 2 / (arr.size * squares)) if squares > 0 else float("nan")


def extreme_experts(load: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (hottest, coldest): the ids of the `k` experts with the most tokens (most first) and the
    `k` with the fewest (fewest first). Ties go to the lower expert id, so the choice is stable from
    one window to the next. With 2k > experts the two overlap; k above the experts returns them all.

    `load` may also be 2-D, one load per row (layers of the same width): then both are (rows, k).
    Raises ValueError for k < 0 or a load that is empty, negative or not finite.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, not {k}")
    arr = np.asarray(load, dtype=np.float64)
    if arr.ndim not in (1, 2) or arr.shape[-1] == 0:
        raise ValueError(f"an expert load must be a non-empty 1-D vector (or 2-D, one per row), got shape {arr.shape}")
    if np.any(arr < 0) or not np.all(np.isfinite(arr)):
        raise ValueError("an expert load must hold finite, non-negative token counts")
    k = min(int(k), arr.shape[-1])
    # a stable sort keeps equal loads in id order: ties go to the lower id on both ends
    return np.argsort(-arr, axis=-1, kind="stable")[..., :k], np.argsort(arr, axis=-1, kind="stable")[..., :k]


def dropped_token_rate(dropped_tokens: float, tokens: float) -> float:
    """Return dropped/processed tokens; NaN when no token was processed."""
    if tokens < 0 or dropped_tokens < 0:
        raise ValueError("token counts must be non-negative")
    return float(dropped_tokens) / float(tokens) if tokens > 0 else float("nan")


def load_balancing_loss(topk_load: np.ndarray | list[float], prob_sum: np.ndarray | list[float],
                        tokens: float) -> float:
    """The auxiliary load-balancing loss (Switch Transformer eq. 4-6, as transformers'
    `load_balancing_loss_func` computes it for Mixtral and its kin): N * sum_e f_e * P_e.

    topk_load[e]: tokens whose top-k router probabilities hold e (`router_topk_load`); prob_sum[e]:
    sum over tokens of the router's softmax (`router_prob_sum`); N = len(prob_sum), the router's
    width. f_e = topk_load[e] / tokens (summing to k), P_e = prob_sum[e] / tokens. Sums over several
    layers give transformers' model-level loss, which pools every layer's tokens; one layer's sums
    give that layer's own. NaN for no tokens. Not the coefficient-weighted term added to the loss:
    multiply by `router_aux_loss_coef` for that.
    """
    f = np.asarray(topk_load, dtype=np.float64)
    p = np.asarray(prob_sum, dtype=np.float64)
    if f.shape != p.shape or f.ndim != 1:
        raise ValueError(f"topk_load and prob_sum must be 1-D vectors of one length, got {f.shape} and {p.shape}")
    if tokens <= 0:
        return float("nan")
    return float(p.size * np.sum((f / tokens) * (p / tokens)))


def router_z_loss(z_sum: float, tokens: float) -> float:
    """The router z-loss (ST-MoE; transformers' `router_z_loss_func`): the mean over tokens of
    logsumexp(router logits)^2, from its sum over tokens (`router_z_sum`). NaN for no tokens."""
    return float(z_sum) / float(tokens) if tokens > 0 else float("nan")


def _adjacent_pairs(top1: np.ndarray, sequence: np.ndarray, position: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (previous, next) top-1 experts of tokens adjacent in the same sequence."""
    top1 = np.asarray(top1)
    sequence = np.asarray(sequence)
    position = np.asarray(position)
    if not (top1.shape == sequence.shape == position.shape) or top1.ndim != 1:
        raise ValueError("top1, sequence and position must be 1-D arrays of one length")
    order = np.lexsort((position, sequence))
    e, s, p = top1[order], sequence[order], position[order]
    adjacent = (s[1:] == s[:-1]) & (p[1:] == p[:-1] + 1)
    return e[:-1][adjacent], e[1:][adjacent]


def routing_drift_rate(top1: np.ndarray, sequence: np.ndarray, position: np.ndarray) -> float:
    """Return how often the top-1 expert changes between adjacent tokens, per 1000 token pairs.

    `sequence` identifies a sequence (callers combine step and batch row into one key); two
    tokens are adjacent when they share a sequence and their positions differ by one. NaN when
    there is no adjacent pair.
    """
    prev, nxt = _adjacent_pairs(top1, sequence, position)
    if prev.size == 0:
        return float("nan")
    return float(np.count_nonzero(prev != nxt) * 1000.0 / prev.size)


def switch_entropy(
    top1: np.ndarray, sequence: np.ndarray, position: np.ndarray, num_experts: int, last_n: int | None = None
) -> float:
    """Return the normalised entropy of expert-to-expert transitions over the last `last_n` tokens.

    Tokens are taken in the order given (callers pass them in recording order); of the last
    `last_n`, each adjacent pair in a sequence is a transition (a -> b), including a == b. The
    Shannon entropy of the transition frequencies is divided by ln(num_experts**2). Near 0: the
    router follows a few fixed paths; near 1: every transition is as likely as any other.
    NaN when there is no adjacent pair.
    """
    top1 = np.asarray(top1)
    if last_n is not None:
        if last_n < 2:
            raise ValueError("last_n must be at least 2 tokens")
        top1, sequence, position = top1[-last_n:], np.asarray(sequence)[-last_n:], np.asarray(position)[-last_n:]
    prev, nxt = _adjacent_pairs(top1, sequence, position)
    if prev.size == 0:
        return float("nan")
    codes = prev.astype(np.int64) * num_experts + nxt.astype(np.int64)
    counts = np.unique(codes, return_counts=True)[1].astype(np.float64)
    p = counts / counts.sum()
    return normalized_entropy(float(-np.sum(p * np.log(p))), num_experts * num_experts)


# -- the rules every derived figure follows (`moescope.metrics.figures` applies them) -------------


def token_weighted_mean(values: np.ndarray | list[float], tokens: np.ndarray | list[float]) -> float:
    """Return sum(value * tokens) / sum(tokens) over the rows that have a value and tokens.

    Rows whose value is NaN (not recorded, e.g. an imported run has no router entropy) or whose
    tokens are 0 are left out of both sums; NaN when no row is left.
    """
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    t = np.asarray(tokens, dtype=np.float64).reshape(-1)
    if v.shape != t.shape:
        raise ValueError(f"values and tokens differ in length: {v.size} vs {t.size}")
    keep = np.isfinite(v) & (t > 0)
    total = t[keep].sum()
    return float(np.sum(v[keep] * t[keep]) / total) if total > 0 else float("nan")


def routed_load(load: np.ndarray | list[float], num_experts: int | None) -> np.ndarray:
    """Return the load of the routed experts (with parameters): the first `num_experts` entries.

    `expert_load` lists routed experts first, then zero experts; None keeps every entry.
    """
    arr = np.asarray(load, dtype=np.float64)
    return arr if num_experts is None else arr[: int(num_experts)]


def zero_expert_share(load: np.ndarray | list[float], num_experts: int) -> float:
    """Return the share of the slots that went to zero (identity) experts; NaN for no slot."""
    arr = np.asarray(load, dtype=np.float64)
    total = arr.sum()
    return float(arr[int(num_experts):].sum() / total) if total > 0 else float("nan")


@dataclass(frozen=True)
class LoadSpread:
    """How evenly one layer's routed experts were loaded (zero experts left out, see `routed_load`)."""

    cv: float  # std / mean of tokens per expert; 0 is perfectly even
    max_mean: float  # busiest / mean (MaxVio + 1)
    balancedness: float  # mean / busiest
    dead_experts: int  # routed experts that got no token
    dead_fraction: float
    hottest: int  # the busiest routed expert (-1 when no token)
    hottest_load: int  # tokens that chose it
    hottest_token_share: float  # of the layer's tokens that chose it (top-k shares sum to k)
    hottest_slot_share: float  # of the layer's slots it filled, zero experts' slots included (shares sum to 1)


def load_spread(load: np.ndarray | list[float], num_experts: int | None = None,
                tokens: float | None = None) -> LoadSpread:
    """Return the load spread of one layer's summed `expert_load` (any window).

    `num_experts` cuts the zero experts off; `tokens` (the layer's tokens over the same window)
    gives the token share, NaN without it. Every number is NaN (-1, 0) for a load with no token.
    """
    slots = float(np.asarray(load, dtype=np.float64).sum())  # every kept slot, zero experts' too
    arr = routed_load(load, num_experts)
    if arr.size == 0 or arr.sum() <= 0:
        nan = float("nan")
        return LoadSpread(nan, nan, nan, 0, nan, -1, 0, nan, nan)
    hottest = int(arr.argmax())
    return LoadSpread(
        cv=coefficient_of_variation(arr), max_mean=max_mean_ratio(arr), balancedness=balancedness(arr),
        dead_experts=int(dead_expert_count(arr)), dead_fraction=dead_expert_fraction(arr), hottest=hottest,
        hottest_load=int(arr[hottest]),
        hottest_token_share=float(arr[hottest] / tokens) if tokens else float("nan"),
        hottest_slot_share=float(arr[hottest] / slots))


@dataclass(frozen=True)
class RouterEntropy:
    """Mean per-token router entropy, in nats and normalised (H / ln router width, in [0, 1])."""

    nats: float
    normalized: float


def router_entropy(entropy_nats: np.ndarray | list[float], tokens: np.ndarray | list[float],
                   router_width: np.ndarray | list[int] | int) -> RouterEntropy:
    """Return the token-weighted mean router entropy of rows (steps, windows or layers).

    Each row's mean entropy (nats) is weighted by its tokens; the normalised figure divides each
    row by ln of its router's width (routed + zero experts) before weighting, so layers or models
    with different expert counts compare on one [0, 1] scale. NaN where nothing was recorded.
    """
    h = np.asarray(entropy_nats, dtype=np.float64).reshape(-1)
    widths = np.broadcast_to(np.asarray(router_width, dtype=np.float64), h.shape)
    logs = np.log(np.where(widths > 1, widths, np.e))
    normalized = np.where(widths > 1, h / logs, 0.0)
    return RouterEntropy(token_weighted_mean(h, tokens), token_weighted_mean(normalized, tokens))


def normalized_mutual_information(contingency: np.ndarray) -> float:
    """Return I(A; B) / mean(H(A), H(B)) of a table of joint counts `contingency[a, b]`, in [0, 1].

    The project's one specialisation measure (expert x tag value counts in, 0: the expert choice
    says nothing about the tag; 1: each tag value has experts of its own). The normalisation is
    the arithmetic mean of the two entropies, the default of scikit-learn's
    `normalized_mutual_info_score`, with its limit cases: 1.0 when both sides have a single class,
    0.0 when the mutual information is 0. Rows and columns with no count are left out.
    Raises ValueError for a table that is not 2-D, has negative counts, or holds no count.
    """
    counts = np.asarray(contingency, dtype=np.float64)
    if counts.ndim != 2:
        raise ValueError(f"contingency must be a 2-D table of counts, got shape {counts.shape}")
    if (counts < 0).any():
        raise ValueError("contingency counts must not be negative")
    total = counts.sum()
    if total == 0:
        raise ValueError("contingency is empty: there are no labelled items to compare")
    counts = counts[counts.sum(axis=1) > 0][:, counts.sum(axis=0) > 0]
    if counts.shape[0] == 1 and counts.shape[1] == 1:
        return 1.0
    joint = counts / total
    marginal_a = joint.sum(axis=1)
    marginal_b = joint.sum(axis=0)
    nonzero = joint > 0
    mutual_info = float(np.sum(joint[nonzero] * np.log(joint[nonzero] / np.outer(marginal_a, marginal_b)[nonzero])))
    if mutual_info <= 1e-15:  # rounding leaves a tiny negative value where the true figure is 0
        return 0.0
    entropy_a = -float(np.sum(marginal_a * np.log(marginal_a)))
    entropy_b = -float(np.sum(marginal_b * np.log(marginal_b)))
    return min(1.0, mutual_info / ((entropy_a + entropy_b) / 2))



# -- signals over the store's frames -----------------------------------------------------------
# pandas is imported where a frame is built: importing the signals stays numpy-only for those that
# need nothing else (the Prometheus exporter, the demo's capacity block).

def expert_tag_contingency(expert_tag_load: pd.DataFrame, layer: int) -> tuple[np.ndarray, list[int], list[str]]:
    """Return one layer's (experts x tag values) slot counts from `Store.expert_tag_load` rows, with
    the experts and tag values of its rows and columns (sorted): the table that specialisation
    (`normalized_mutual_information`) is measured on."""
    rows = expert_tag_load[expert_tag_load.layer == layer]
    table = rows.pivot_table(index="expert", columns="value", values="load", aggfunc="sum", fill_value=0)
    return table.to_numpy(dtype=np.float64), [int(e) for e in table.index], [str(v) for v in table.columns]


def specialisation_by_layer(expert_tag_load: pd.DataFrame) -> pd.DataFrame:
    """Return the specialisation of each layer from `Store.expert_tag_load` rows: columns layer, nmi
    (NMI(expert; tag), in [0, 1]), tokens (slots counted). Layers with no count are left out."""
    import pandas as pd

    rows = []
    for layer in sorted(set(expert_tag_load.layer)):
        counts = expert_tag_contingency(expert_tag_load, layer)[0]
        if counts.sum() > 0:
            rows.append({"layer": int(layer), "nmi": normalized_mutual_information(counts),
                         "tokens": int(counts.sum())})
    return pd.DataFrame(rows, columns=["layer", "nmi", "tokens"])


def divergence_over_time(drift: pd.DataFrame) -> pd.DataFrame:
    """Return the KL and JS divergence (nats; `kl_divergence` smoothed as the rules smooth it,
    `js_divergence` unsmoothed) of each window's load against its layer's baseline, from
    `Store.drift_windows` rows: columns layer, window_start, window_end (exclusive), step_end (the
    last step recorded in the window), kl, js. Windows whose load or baseline is empty, or whose
    baseline has another width, are left out."""
    import pandas as pd

    rows = []
    for r in drift.itertuples():
        load = np.asarray(r.expert_load, dtype=np.float64)
        ref = np.asarray(r.baseline_load, dtype=np.float64)
        if ref.size != load.size or ref.sum() <= 0 or load.sum() <= 0:
            continue
        rows.append({"layer": int(r.layer), "window_start": int(r.window_start), "window_end": int(r.window_end),
                     "step_end": int(getattr(r, "last_step", r.window_end - 1)),
                     "kl": kl_divergence(load, ref), "js": js_divergence(load, ref)})
    return pd.DataFrame(rows, columns=["layer", "window_start", "window_end", "step_end", "kl", "js"])
