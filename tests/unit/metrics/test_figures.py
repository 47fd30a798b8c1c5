"""A layer's and a run's figures follow the stated rules: drops over the layers that record them,
token-weighted means, the hottest layer by its busiest expert's share of the slots."""

from __future__ import annotations

import math

import pytest

from moescope.metrics.figures import layer_figures, run_figures


def test_layer_and_run_figures_follow_the_rules():
    a = layer_figures(0, [6, 4, 0, 2, 5, 3], 4, 2, 10, 1.2, 1)
    b = layer_figures(1, [5, 5, 5, 5], 4, 0, 10, 0.9, None)  # drops not recorded
    assert a.dropped_token_rate == pytest.approx(0.1) and math.isnan(b.dropped_token_rate)
    assert a.entropy.normalized == pytest.approx(1.2 / math.log(6))
    run = run_figures([a, b])
    # the rate is over the layers that record drops: b's 10 tokens are unknown, not 10 kept
    assert run.layer_tokens == 20 and run.dropped_tokens == 1 and run.dropped_token_rate == pytest.approx(1 / 10)
    assert math.isnan(run_figures([b]).dropped_token_rate)
    assert run.load_cv == pytest.approx((a.spread.cv + 0.0) / 2)
    assert run.entropy.nats == pytest.approx((1.2 + 0.9) / 2)
    assert run.hottest is a
