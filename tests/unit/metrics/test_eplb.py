"""Fitted placements: DeepSeek's EPLB against an independent implementation written in the tests
(tests/support/eplb_reference.py) on small cases, and the seeds' load-aware mapping on the seeds' own
shape of loads (four hot experts, mid ones, cold ones)."""

from __future__ import annotations

import numpy as np
import pytest

from moescope.metrics.eplb import eplb, load_aware
from moescope.metrics.placement import PlacementError
from tests.support.eplb_reference import reference_eplb


@pytest.mark.parametrize("experts, ranks, nodes, groups, redundant", [
    (8, 4, 2, 4, 4),     # hierarchical: 4 groups onto 2 nodes, 12 slots, 3 per GPU
    (16, 4, 1, 1, 4),    # global
    (12, 4, 2, 3, 0),    # 3 groups do not divide over 2 nodes: the global policy
    (16, 8, 2, 4, 8),
    (6, 3, 1, 2, 3),
])
def test_eplb_matches_an_independent_implementation(experts, ranks, nodes, groups, redundant):
    rng = np.random.default_rng(experts * 100 + ranks)
    loads = rng.gamma(0.7, 100.0, size=(3, experts))  # skewed, no ties
    placement = eplb(loads, ranks, nodes, groups, redundant, layer_ids=[5, 6, 7])
    for row, layer in enumerate([5, 6, 7]):
        expected = reference_eplb(loads[row], ranks, nodes, groups, redundant)
        assert [list(r) for r in placement.rank_experts(layer, experts)] == expected
        slots = [len(r) for r in expected]
        assert slots == [(experts + redundant) // ranks] * ranks
        assert sorted(set(e for r in expected for e in r)) == list(range(experts))


def test_eplb_evens_out_a_skewed_layer_better_than_the_default_layout():
    load = np.array([900.0, 800, 50, 40, 30, 20, 10, 5])  # the two hot experts side by side on rank 0
    placement = eplb(load[None, :], ranks=4, redundant=4)
    per_rank = [sum(load[e] / list(np.concatenate(placement.rank_experts(0, 8))).count(e) for e in r)
                for r in placement.rank_experts(0, 8)]
    contiguous = [load[0:2].sum(), load[2:4].sum(), load[4:6].sum(), load[6:8].sum()]
    assert max(per_rank) / np.mean(per_rank) < 1.3 < max(contiguous) / np.mean(contiguous)


@pytest.mark.parametrize("kwargs, message", [
    (dict(ranks=3, redundant=0), "do not split evenly over 3 ranks"),
    (dict(ranks=4, nodes=3), "do not split evenly over 3 nodes"),
    (dict(ranks=4, groups=3), "do not split into 3 equal groups"),
])
def test_eplb_refuses_shapes_it_cannot_place(kwargs, message):
    with pytest.raises(PlacementError, match=message):
        eplb(np.ones((1, 8)), **kwargs)


def test_load_aware_is_the_seeds_rule():
    # four hot experts (each over half a card's fair load), four mid ones, six cold ones, seven cards
    load = np.array([40.0, 38, 36, 34, 12, 11, 10, 9, 2, 2, 1, 1, 1, 1])
    fair = load.sum() / 7
    assert (load[:4] >= fair / 2).all() and ((load[4:8] >= fair / 4) & (load[4:8] < fair / 2)).all()
    assert (load[8:] < fair / 4).all()
    placement = load_aware(load[None, :], ranks=7)
    cards = [sorted(r) for r in placement.rank_experts(0, 14)]
    assert cards == [[0], [1], [2], [3], [4, 7], [5, 6], [8, 9, 10, 11, 12, 13]]


def test_load_aware_puts_what_does_not_fit_on_the_lightest_card():
    load = np.array([10.0, 9, 8, 1])  # three hot experts, two cards
    cards = load_aware(load[None, :], ranks=2).rank_experts(0, 4)
    # the two hottest alone first; expert 2 onto the lighter card (9 -> 17), expert 3 then onto the other (10)
    assert [list(card) for card in cards] == [[0, 3], [1, 2]]
