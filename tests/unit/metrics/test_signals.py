"""Each signal against an independent oracle: scipy, numpy, or a brute-force loop."""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter

import numpy as np
import pytest
from scipy import stats
from scipy.spatial.distance import jensenshannon

from moescope.metrics import signals as sig

RNG = np.random.default_rng(1234)
LOADS = [
    np.array([10, 0, 3, 7, 0, 1, 40, 2]),
    RNG.integers(0, 100, size=16),
    np.array([5, 5, 5, 5]),
    np.array([0, 0, 9, 0]),
]


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_kl_matches_scipy_with_stated_smoothing(load, alpha):
    ref = RNG.integers(0, 50, size=load.size)
    p = (load + alpha) / (load + alpha).sum()
    q = (ref + alpha) / (ref + alpha).sum()
    assert sig.kl_divergence(load, ref, alpha=alpha) == pytest.approx(stats.entropy(p, q), rel=1e-12)
    u = np.full(load.size, 1.0 / load.size)  # smoothing a uniform load leaves it uniform
    assert sig.kl_divergence(load, sig.uniform_load(load.size), alpha=alpha) == pytest.approx(
        stats.entropy(p, u), rel=1e-12
    )


def test_kl_of_identical_loads_is_zero_and_empty_expert_is_finite():
    load = np.array([3, 0, 5])
    assert sig.kl_divergence(load, load) == pytest.approx(0.0, abs=1e-15)
    assert math.isfinite(sig.kl_divergence(np.array([0, 10]), np.array([10, 0])))
    assert math.isinf(sig.kl_divergence(np.array([0, 10]), np.array([10, 0]), alpha=0.0))
    assert math.isnan(sig.kl_divergence(np.array([0, 0]), np.array([1, 1]), alpha=0.0))
    with pytest.raises(ValueError, match="differ in number of experts"):
        sig.kl_divergence(np.array([1, 2]), np.array([1, 2, 3]))


@pytest.mark.parametrize("load", LOADS)
def test_js_matches_scipy(load):
    ref = RNG.integers(0, 50, size=load.size)
    expected = jensenshannon(load / load.sum(), ref / ref.sum()) ** 2
    assert sig.js_divergence(load, ref) == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert sig.js_divergence(load, ref) <= math.log(2) + 1e-12


@pytest.mark.parametrize("load", LOADS)
def test_cv_max_mean_balancedness_against_numpy(load):
    assert sig.coefficient_of_variation(load) == pytest.approx(stats.variation(load), rel=1e-12)
    mean = sum(load) / len(load)
    assert sig.max_mean_ratio(load) == pytest.approx(max(load) / mean, rel=1e-12)
    assert sig.balancedness(load) == pytest.approx(mean / max(load), rel=1e-12)
    assert math.isnan(sig.max_mean_ratio(np.zeros(4)))


def test_normalized_entropy_against_scipy():
    probs = RNG.dirichlet(np.ones(8), size=50)
    ent = stats.entropy(probs, axis=1).mean()
    assert sig.normalized_entropy(ent, 8) == pytest.approx(ent / math.log(8))
    assert sig.normalized_entropy(math.log(8), 8) == pytest.approx(1.0)
    assert sig.normalized_entropy(0.0, 1) == 0.0
    load = np.array([4, 0, 4, 8])
    assert sig.load_entropy(load) == pytest.approx(stats.entropy(load / 16) / math.log(4))


def test_dead_expert_fraction_and_dropped_rate_by_counting():
    load = np.array([0, 3, 0, 0, 1])
    assert sig.dead_expert_fraction(load) == sum(1 for x in load if x == 0) / 5
    assert math.isnan(sig.dead_expert_fraction(np.zeros(3)))
    assert sig.dropped_token_rate(3, 200) == 0.015
    assert math.isnan(sig.dropped_token_rate(0, 0))


def _random_routes(n_seq=5, seq_len=40, experts=6):
    top1, seq, pos = [], [], []
    for s in range(n_seq):
        for p in range(seq_len):
            # sticky routing: often keep the previous expert
            top1.append(top1[-1] if p and RNG.random() < 0.6 else int(RNG.integers(experts)))
            seq.append(s)
            pos.append(p)
    perm = RNG.permutation(len(top1))  # order must not matter to the drift rate
    return np.array(top1)[perm], np.array(seq)[perm], np.array(pos)[perm], experts


def test_routing_drift_rate_against_loop():
    top1, seq, pos, _ = _random_routes()
    by_key = {(s, p): e for e, s, p in zip(top1, seq, pos)}
    changes = pairs = 0
    for (s, p), e in by_key.items():
        if (s, p + 1) in by_key:
            pairs += 1
            changes += by_key[(s, p + 1)] != e
    assert sig.routing_drift_rate(top1, seq, pos) == pytest.approx(changes * 1000 / pairs)
    # a gap in positions is not an adjacency
    assert math.isnan(sig.routing_drift_rate(np.array([1, 2]), np.array([0, 0]), np.array([0, 2])))
    assert sig.routing_drift_rate(np.array([1, 2, 2]), np.array([0, 0, 0]), np.array([0, 1, 2])) == 500


def test_switch_entropy_against_loop():
    top1, seq, pos, experts = _random_routes()
    order = np.lexsort((pos, seq))
    top1, seq, pos = top1[order], seq[order], pos[order]
    last_n = 100
    t, s, p = top1[-last_n:], seq[-last_n:], pos[-last_n:]
    counts = Counter()
    for i in range(len(t) - 1):
        if s[i] == s[i + 1] and p[i + 1] == p[i] + 1:
            counts[(t[i], t[i + 1])] += 1
    total = sum(counts.values())
    h = -sum(c / total * math.log(c / total) for c in counts.values())
    assert sig.switch_entropy(top1, seq, pos, experts, last_n=last_n) == pytest.approx(h / math.log(experts**2))


def test_bad_loads_are_rejected():
    with pytest.raises(ValueError, match="non-negative"):
        sig.max_mean_ratio(np.array([1, -1]))
    with pytest.raises(ValueError, match="1-D"):
        sig.coefficient_of_variation(np.zeros((2, 2)))


# -- derived metrics: the weighting rule (tokens) and the zero-expert rule --------------------


def test_token_weighted_mean_weights_by_tokens_and_skips_what_is_missing():
    # a 4096-token prefill and 64 one-token decode steps: the unweighted mean of row means is wrong
    values = [0.5] + [2.0] * 64
    tokens = [4096] + [1] * 64
    assert sig.token_weighted_mean(values, tokens) == pytest.approx((0.5 * 4096 + 2.0 * 64) / 4160)
    assert abs(sig.token_weighted_mean(values, tokens) - np.mean(values)) > 1.0
    assert sig.token_weighted_mean([1.0, float("nan"), 3.0], [1, 5, 3]) == pytest.approx(2.5)
    assert math.isnan(sig.token_weighted_mean([float("nan")], [3]))
    assert math.isnan(sig.token_weighted_mean([1.0], [0]))


def test_load_spread_leaves_zero_experts_out_and_says_tokens_and_slots():
    # 4 routed experts and 2 zero experts; top-2 over 10 tokens = 20 slots
    load = [6, 4, 0, 2, 5, 3]
    spread = sig.load_spread(load, num_experts=4, tokens=10)
    routed = np.array([6, 4, 0, 2], dtype=float)
    assert spread.cv == pytest.approx(routed.std() / routed.mean())
    assert spread.max_mean == pytest.approx(6 / routed.mean())
    assert spread.dead_experts == 1 and spread.dead_fraction == pytest.approx(0.25)
    assert spread.hottest == 0 and spread.hottest_load == 6
    assert spread.hottest_token_share == pytest.approx(0.6)  # 6 of 10 tokens chose it
    assert spread.hottest_slot_share == pytest.approx(6 / 20)  # 6 of the 20 slots, zero experts' included
    assert sig.zero_expert_share(load, 4) == pytest.approx(8 / 20)
    empty = sig.load_spread([0, 0, 0], num_experts=2)
    assert math.isnan(empty.cv) and empty.hottest == -1


def test_router_entropy_normalises_by_the_routers_width_then_weights_by_tokens():
    # a layer of 8 routed + 2 zero experts (width 10) and one of 4 experts (width 4)
    got = sig.router_entropy([1.0, 0.5], [30, 10], [10, 4])
    assert got.nats == pytest.approx((1.0 * 30 + 0.5 * 10) / 40)
    assert got.normalized == pytest.approx((1.0 / math.log(10) * 30 + 0.5 / math.log(4) * 10) / 40)


def test_compute_signals_leave_zero_experts_out_of_load_signals():
    from moescope.alerts.observations import LayerObservation, compute_signals

    obs = [LayerObservation(run_id="r", layer=0, step=0, ts=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
                            tokens=10, expert_load=np.array([6, 4, 0, 2, 5, 3]), router_entropy_mean=1.2,
                            dropped_tokens=0, capacity_use=None, active_param_fraction=None)]
    values = compute_signals(obs, ["load_cv", "dead_expert_fraction", "router_entropy"], num_experts=4)
    spread = sig.load_spread([6, 4, 0, 2, 5, 3], 4)
    assert values["load_cv"] == pytest.approx(spread.cv)
    assert values["dead_expert_fraction"] == pytest.approx(0.25)
    assert values["router_entropy"] == pytest.approx(1.2 / math.log(6))  # the router's width: 4 + 2


def test_imbalance_is_tensorrt_llms_max_minus_mean_over_mean():
    load = np.array([3.0, 1.0, 0.0, 4.0])
    assert sig.imbalance(load) == pytest.approx((4.0 - 2.0) / 2.0)
    assert sig.balancedness(load) == pytest.approx(1 / (1 + sig.imbalance(load)))
    assert math.isnan(sig.imbalance(np.zeros(3)))


def _rest_kl_by_hand(load, baseline, keep):
    """KL of the kept experts' load against their baseline, each renormalised with 0.5-token smoothing."""
    p = np.array([load[e] + 0.5 for e in keep])
    q = np.array([baseline[e] + 0.5 for e in keep])
    p, q = p / p.sum(), q / q.sum()
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))


def test_an_expert_lost_alone_counts_a_traffic_change_does_not():
    baseline = [100] * 8
    # the router stops choosing expert 3: its 100 slots go to the next choices, spread over the others
    gone = [114, 115, 114, 0, 114, 115, 114, 114]
    assert _rest_kl_by_hand(gone, baseline, [0, 1, 2, 4, 5, 6, 7]) < sig.LOST_ALONE_MAX_REST_KL
    assert sig.lost_expert_alone_fraction(gone, baseline) == sig.lost_expert_fraction(gone, baseline) == 1 / 8
    # a narrow domain: experts 3 and 5 get nothing because the new traffic never wants them, and the
    # others' shares move too (expert 0 takes twice its share): the drift's news, not experts gone
    shifted = [300, 100, 60, 0, 120, 0, 80, 140]
    rest = _rest_kl_by_hand(shifted, baseline, [0, 1, 2, 4, 6, 7])
    assert rest > sig.LOST_ALONE_MAX_REST_KL
    assert sig.lost_expert_fraction(shifted, baseline) == 2 / 8
    assert sig.lost_expert_alone_fraction(shifted, baseline) == 0.0
    # the boundary is the rest's KL: a looser bound counts the shifted experts as gone
    assert sig.lost_expert_alone_fraction(shifted, baseline, max_rest_kl=rest * 1.01) == 2 / 8
    # nothing lost: 0; an expert the baseline barely routed to is not lost (expected 1.4 slots < 16)
    assert sig.lost_expert_alone_fraction(baseline, baseline) == 0.0
    assert sig.lost_expert_alone_fraction([114, 115, 114, 114, 114, 115, 128, 0], [100] * 7 + [2]) == 0.0
    assert math.isnan(sig.lost_expert_alone_fraction([0] * 8, baseline))
