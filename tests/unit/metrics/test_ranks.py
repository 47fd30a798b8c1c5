"""Rank balance under a placement, against hand counts."""

from __future__ import annotations

import numpy as np
import pytest

from moescope.metrics.ranks import replica_shares


def test_replica_shares_split_a_redundant_expert_evenly():
    # slots: rank 0 holds experts 0, 2; rank 1 holds 1, 2, 2 (two copies of 2 on rank 1)
    shares = replica_shares(np.array([0, 0, 1, 1, 1]), np.array([0, 2, 1, 2, 2]), 3, 2)
    np.testing.assert_allclose(shares, [[1, 0], [0, 1], [1 / 3, 2 / 3]])
    with pytest.raises(ValueError, match=r"expert\(s\) 1 have no slot"):
        replica_shares(np.array([0, 1]), np.array([0, 2]), 3, 2)
    with pytest.raises(ValueError, match="rank 2, outside 0..1"):
        replica_shares(np.array([0, 2]), np.array([0, 1]), 2, 2)
