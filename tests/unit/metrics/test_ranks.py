"""Rank balance under a placement, against hand counts."""

from __future__ import annotations

import numpy as np
import pytest

from moescope.metrics import ranks as ranks_module
from moescope.metrics.dispatch import slot_ranks
from moescope.metrics.placement import Placement
from moescope.metrics.ranks import expected_rank_tokens, replica_shares
from moescope.store.queries import RoutePage


def test_replica_shares_split_a_redundant_expert_evenly():
    # slots: rank 0 holds experts 0, 2; rank 1 holds 1, 2, 2 (two copies of 2 on rank 1)
    shares = replica_shares(np.array([0, 0, 1, 1, 1]), np.array([0, 2, 1, 2, 2]), 3, 2)
    np.testing.assert_allclose(shares, [[1, 0], [0, 1], [1 / 3, 2 / 3]])
    with pytest.raises(ValueError, match=r"expert\(s\) 1 have no slot"):
        replica_shares(np.array([0, 1]), np.array([0, 2]), 3, 2)
    with pytest.raises(ValueError, match="rank 2, outside 0..1"):
        replica_shares(np.array([0, 2]), np.array([0, 1]), 2, 2)


def _static_unknown_home(ids: np.ndarray, layout: tuple, experts: int, chunk: int | None = None, monkeypatch=None):
    ranks = len(layout)
    page = RoutePage(step=np.zeros(len(ids), dtype=np.int64), rank=np.zeros(len(ids), dtype=np.int64),
                     token=np.arange(len(ids)), expert_ids=ids, kept=np.ones(ids.shape, dtype=bool))
    found = slot_ranks(page, Placement(ranks, default=layout, source="t"), 0, experts, "sglang-static", False)
    if chunk is not None:
        monkeypatch.setattr(ranks_module, "HOME_CHUNK", chunk)
    return expected_rank_tokens(found.row, found.rank, found.prob, ranks, unknown_home=found.unknown_home)


def test_sglang_static_unknown_home_counts_a_token_once_over_ranks_holding_all_its_experts():
    # experts 0 and 1 both sit on both ranks: from either home the token runs on that home alone
    tokens, slots = _static_unknown_home(np.array([[0, 1]]), ((0, 1), (0, 1)), 2)
    np.testing.assert_allclose(tokens[0], [0.5, 0.5])  # one token, not 1.5
    np.testing.assert_allclose(slots[0], [1.0, 1.0])


@pytest.mark.parametrize("chunk", [None, 5])  # 5 (entry, home) cells at a time: the chunking's edges too
def test_sglang_static_unknown_home_matches_an_enumeration_over_homes(chunk, monkeypatch):
    rng = np.random.default_rng(5)
    layout = ((0, 1, 5, 6), (2, 3, 5, 0), (4, 5, 3, 3), (6, 7, 0, 2))  # 1 to 3 ranks an expert; 3 twice on 2
    experts, ranks, k = 8, len(layout), 3
    ids = np.stack([rng.choice(experts, size=k, replace=False) for _ in range(300)])
    tokens, slots = _static_unknown_home(ids, layout, experts, chunk, monkeypatch)
    copies = {e: [r for r, held in enumerate(layout) for x in held if x == e] for e in range(experts)}
    expected_tokens, expected_slots = np.zeros(ranks), np.zeros(ranks)
    for row in ids:
        for home in range(ranks):  # the token's home, each alike; SGLang's copy is a function of it
            miss = np.ones(ranks)
            for e in row:
                for r in range(ranks):
                    p = float(r == home) if home in copies[e] else copies[e].count(r) / len(copies[e])
                    expected_slots[r] += p / ranks
                    miss[r] *= 1 - p
            expected_tokens += (1 - miss) / ranks
    np.testing.assert_allclose(tokens[0], expected_tokens)
    np.testing.assert_allclose(slots[0], expected_slots)
    assert tokens[0].sum() <= len(ids) * k
