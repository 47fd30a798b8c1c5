"""The Placement page's rebalance curve (`rebalance_curve_figure`): a point per policy at the bytes it
moved per hour and the mean balancedness it kept, as the frame hands them over."""

from __future__ import annotations

import numpy as np
import pandas as pd

from moescope.dashboard.figures import rebalance_curve_figure


def test_a_point_per_policy_at_its_bytes_per_hour_and_balancedness():
    curve = pd.DataFrame(dict(policy=["every-1", "every-6", "never"], mean_balancedness=[0.95, 0.9, 0.5],
                              moved_bytes_per_hour=[9e9, 2e9, 0.0], rearrangements=[24, 4, 0]))
    trace = rebalance_curve_figure(curve).data[0]
    assert list(trace.text) == ["every-1", "every-6", "never"]
    np.testing.assert_array_equal(trace.x, [9e9, 2e9, 0.0])
    np.testing.assert_array_equal(trace.y, [0.95, 0.9, 0.5])
    np.testing.assert_array_equal(trace.customdata, [24, 4, 0])


def test_no_policy_draws_the_empty_figure():
    figure = rebalance_curve_figure(pd.DataFrame())
    assert not figure.data
