"""AReaL's log-prob gap figures, against hand computations and AReaL's own worked values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moescope.metrics.logprob_gap import gap_figures, k3, removed_share


def test_k3_follows_areal_sign_convention():
    # AReaL's tests/test_rejection_sampling.py: log_ratio 0.5 -> exp(-0.5) - 1 + 0.5 = 0.1065, -0.5 -> 0.1487
    assert k3(np.array([0.5]))[0] == pytest.approx(math.exp(-0.5) - 0.5, abs=1e-12)
    assert k3(np.array([-0.5]))[0] == pytest.approx(math.exp(0.5) - 1.5, abs=1e-12)
    assert k3(np.array([1e-9]))[0] == pytest.approx(5e-19, rel=1e-6)  # exact for tiny gaps, never negative


def test_figures_by_hand():
    deltas = [0.0, 0.1, -0.8, 2.0, -0.69]
    f = gap_figures(np.array(deltas))
    assert f.tokens == 5
    assert f.k3_mean == pytest.approx(sum(math.exp(-d) - 1 + d for d in deltas) / 5, rel=1e-12)
    assert f.abs_mean == pytest.approx(sum(abs(d) for d in deltas) / 5, rel=1e-12)
    assert f.sq_mean == pytest.approx(sum(d * d for d in deltas) / 5, rel=1e-12)
    assert f.extreme_2 == pytest.approx(2 / 5)  # 0.8 and 2.0 exceed ln 2 = 0.693; 0.69 does not
    assert f.extreme_5 == pytest.approx(1 / 5)  # 2.0 exceeds ln 5 = 1.609
    assert math.isnan(gap_figures(np.array([])).k3_mean)
    with pytest.raises(ValueError, match="finite"):
        gap_figures(np.array([0.1, math.inf]))


def test_removed_share():
    # AReaL's Moonlight-16B-A3B R3 run: k3 KL 0.00958 without replay, 0.000373 with
    assert removed_share(0.00958, 0.000373) == pytest.approx(1 - 0.000373 / 0.00958)
    assert math.isnan(removed_share(0.0, 0.0))
    assert removed_share(0.01, 0.02) == pytest.approx(-1.0)
