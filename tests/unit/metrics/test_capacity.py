"""The capacity what-if against a plain loop over GShard's admission order."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moescope.metrics.capacity import CAPACITY_FACTORS, whatif_capacity

RNG = np.random.default_rng(1234)


def _whatif_loop(ids, experts, cf):
    tokens, k = ids.shape
    cap = math.ceil(cf * tokens * k / experts)
    used = [0] * experts
    kept = [[False] * k for _ in range(tokens)]
    for slot in range(k):
        for t in range(tokens):
            e = ids[t, slot]
            if used[e] < cap:
                used[e] += 1
                kept[t][slot] = True
    dropped_tokens = sum(1 for row in kept if not any(row))
    dropped_assign = sum(1 for row in kept for x in row if not x)
    return cap, dropped_tokens, dropped_assign


@pytest.mark.parametrize("k", [1, 2])
def test_whatif_capacity_against_loop(k):
    experts, tokens = 8, 300
    # skewed routes: expert 0 is hot
    probs = np.array([0.4] + [0.6 / (experts - 1)] * (experts - 1))
    ids = np.stack([RNG.choice(experts, size=k, replace=False, p=probs) for _ in range(tokens)]).astype(np.int32)
    result = whatif_capacity(ids, experts)
    assert set(result) == set(CAPACITY_FACTORS)
    for cf, got in result.items():
        cap, dt, da = _whatif_loop(ids, experts, cf)
        assert (got.capacity, got.dropped_tokens, got.dropped_assignments) == (cap, dt, da)
        assert got.dropped_token_rate == dt / tokens
    assert result[1.0].dropped_assignments > 0  # the hot expert overflows at cf 1.0
    rates = [result[cf].dropped_assignments for cf in CAPACITY_FACTORS]
    assert rates == sorted(rates, reverse=True)
