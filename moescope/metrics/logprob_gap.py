"""The rollout/training log-prob gap: AReaL's figures over per-token log-prob differences.

For every generated token, Δ = reference log-prob − engine log-prob of the sampled token (the
trainer's "proximal" log-prob minus the inference engine's "behaviour" one). The figures follow
inclusionAI/AReaL's code: `areal/utils/data.py` (`KLEstimator._compute_approx_kl`, estimator "k3",
as `areal/utils/functional/functional.py`'s `apply_rejection_sampling` calls it with the proximal
log-probs as `log_probs` and the engine's as `log_probs_base`): log_ratio = Δ, k3 = exp(−Δ) − 1 + Δ
(non-negative, Schulman's k3 with r = π_engine / π_reference), unclamped as the rejection sampling
uses it. The importance weight is exp(Δ); a token is "extreme" at τ when the weight leaves
[1/τ, τ], that is |Δ| > ln τ (τ = 2 and 5: `EXTREME_TAUS`).

`gap_figures` turns Δ into the figures every report, row and page shows (`GapFigures`): tokens,
mean k3, mean |Δ|, mean Δ², and the shares above ln 2 and ln 5 — means over tokens, each token
counting once. `removed_share` is the share of the k3 KL that a change (routing replay) removes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["EXTREME_TAUS", "GapFigures", "gap_figures", "k3", "removed_share"]

EXTREME_TAUS: tuple[float, ...] = (2.0, 5.0)  # importance weights outside [1/τ, τ]: |Δ| > ln τ


def k3(delta: np.ndarray) -> np.ndarray:
    """AReaL's k3 of each token, exp(−Δ) − 1 + Δ, in float64 (expm1 keeps small Δ exact)."""
    delta = np.asarray(delta, dtype=np.float64)
    return np.expm1(-delta) + delta


@dataclass(frozen=True)
class GapFigures:
    """AReaL's figures of a set of tokens (NaN for none).

    tokens: tokens measured; k3_mean: mean k3 KL (nats per token); abs_mean: mean |Δ|; sq_mean:
    mean Δ²; extreme_2 / extreme_5: share of tokens with |Δ| > ln 2 / ln 5.
    """

    tokens: int
    k3_mean: float
    abs_mean: float
    sq_mean: float
    extreme_2: float
    extreme_5: float


def gap_figures(delta: np.ndarray) -> GapFigures:
    """The figures of Δ (reference − engine log-prob per token; a non-finite Δ raises ValueError:
    a token either engine gave probability 0 has no finite ratio, leave it out first)."""
    delta = np.asarray(delta, dtype=np.float64).reshape(-1)
    if not np.isfinite(delta).all():
        raise ValueError("log-prob differences must be finite: leave out tokens with an infinite log-prob")
    n = len(delta)
    if n == 0:
        nan = float("nan")
        return GapFigures(0, nan, nan, nan, nan, nan)
    size = np.abs(delta)
    return GapFigures(n, float(k3(delta).mean()), float(size.mean()), float(np.square(delta).mean()),
                      float((size > math.log(EXTREME_TAUS[0])).mean()),
                      float((size > math.log(EXTREME_TAUS[1])).mean()))


def removed_share(before: float, after: float) -> float:
    """The share of the k3 KL removed: 1 − after / before (NaN when before is 0 or NaN; negative
    when the change made the gap wider)."""
    if not before or math.isnan(before) or math.isnan(after):
        return float("nan")
    return 1.0 - after / before
