"""Expert-cache simulation checked against textbook cases, a brute-force replay written here, and an
exhaustive search for the offline optimum."""

from __future__ import annotations

import itertools
import random
from functools import lru_cache

import numpy as np
import pytest

from moescope.alerts.cache import POLICIES, CacheCurve, cache_curves, cache_hit_rate, cache_hits, expert_accesses

# Silberschatz's reference string (Operating System Concepts, ch. 9): with 3 frames, OPT takes 9
# page faults, LRU 12. Every page here is one expert, one token each (k = 1).
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]


def _brute_force_hits(rows: list[list[int]], capacity: int, policy: str) -> int:
    """The module's definition replayed naively: every ordering key recomputed from the raw history."""
    resident: list[int] = []
    hits = 0
    for t, row in enumerate(rows):
        needed = list(dict.fromkeys(e for e in row if e >= 0))
        hits += sum(e in resident for e in needed)

        def recency(e: int) -> tuple[int, int]:
            for u in range(t, -1, -1):  # the latest token that used e, and e's slot there
                used = list(dict.fromkeys(x for x in rows[u] if x >= 0))
                if e in used:
                    return u, -used.index(e)
            raise AssertionError("resident expert never used")

        def key(e: int) -> tuple:
            if policy == "lru":
                return recency(e)
            if policy == "lfu":
                return sum(e in set(r) for r in rows[:t + 1]), recency(e)
            later = [u for u in range(t + 1, len(rows)) if e in rows[u]]
            return -(later[0] if later else float("inf")), recency(e)

        for e in needed:
            if e not in resident:
                resident.append(e)
        while len(resident) > capacity:
            others = [e for e in resident if e not in needed]
            victim = min(others or [e for e in needed if e in resident], key=key)
            resident.remove(victim)
    return hits


def _optimum_hits(rows: list[list[int]], capacity: int) -> int:
    """The most hits any eviction schedule gets (every token's experts resident together, loading
    only what a token needs), by exhaustive search over the resident sets."""
    needed = [frozenset(e for e in row if e >= 0) for row in rows]

    @lru_cache(maxsize=None)
    def best(t: int, resident: frozenset) -> int:
        if t == len(needed):
            return 0
        hits = len(needed[t] & resident)
        pool = resident | needed[t]
        keep_extra = [e for e in pool if e not in needed[t]]
        room = capacity - len(needed[t])
        options = [needed[t] | frozenset(extra) for n in range(0, min(room, len(keep_extra)) + 1)
                   for extra in itertools.combinations(keep_extra, n)]
        return hits + max(best(t + 1, option) for option in options)

    return best(0, frozenset())


def _random_rows(rng: random.Random, tokens: int, experts: int, k: int, skew: float) -> list[list[int]]:
    weights = [1 + skew * e for e in range(experts)]
    rows = []
    for _ in range(tokens):
        row: list[int] = []
        while len(row) < k:
            e = rng.choices(range(experts), weights)[0]
            if e not in row:
                row.append(e)
        rows.append(row)
    return rows


def test_textbook_reference_string():
    accesses = expert_accesses(np.array(TEXTBOOK), num_experts=8)
    assert cache_hits(accesses, 3, "belady") == (20 - 9, 20)
    assert cache_hits(accesses, 3, "lru") == (20 - 12, 20)
    curves = cache_curves(accesses, 8)
    assert curves["belady"].hits[2] == 11 and curves["lru"].hits[2] == 8
    # With every expert resident, only first uses miss (6 distinct pages).
    for curve in curves.values():
        assert curve.hits[-1] == 20 - 6
        assert curve.hit_rate[-1] == pytest.approx(14 / 20)


def test_a_token_needs_its_experts_at_once():
    # k = 2, one expert resident: the pair (0, 1) can never be resident together.
    accesses = expert_accesses(np.array([[0, 1], [0, 1], [0, 1]]), num_experts=4)
    # lru keeps the router's first choice (slot 0) of the last token: expert 0 hits from token 2 on.
    assert cache_hits(accesses, 1, "lru") == (2, 6)
    # With two resident, every token after the first hits twice, whatever the policy.
    for policy in POLICIES:
        assert cache_hits(accesses, 2, policy) == (4, 6)
    # A resident expert the token does not use is evicted before the token's own.
    accesses = expert_accesses(np.array([[2, 3], [0, 1], [0, 2]]), num_experts=4)
    assert cache_hits(accesses, 2, "lru") == (1, 6)  # 2 and 3 make room for 0 and 1; 0 then hits


@pytest.mark.parametrize("policy", POLICIES)
def test_every_capacity_equals_the_brute_force_replay(policy):
    rng = random.Random(7)
    for case in range(40):
        experts, k = rng.randint(2, 7), rng.randint(1, 3)
        k = min(k, experts)
        rows = _random_rows(rng, rng.randint(1, 45), experts, k, skew=rng.choice([0.0, 1.0, 4.0]))
        curve = cache_curves(expert_accesses(np.array(rows), experts), experts, [policy])[policy]
        assert curve.accesses == len(rows) * k and curve.tokens == len(rows)
        want = [_brute_force_hits(rows, c, policy) for c in range(1, experts + 1)]
        assert curve.hits.tolist() == want, (case, rows)
        for c in range(1, experts + 1):
            assert cache_hits(expert_accesses(np.array(rows), experts), c, policy) == (want[c - 1], len(rows) * k)


def test_belady_is_the_optimum_and_bounds_the_others():
    rng = random.Random(3)
    for case in range(60):
        experts, k = rng.randint(2, 5), rng.randint(1, 2)
        rows = _random_rows(rng, rng.randint(1, 14), experts, k, skew=rng.choice([0.0, 2.0]))
        curves = cache_curves(expert_accesses(np.array(rows), experts), experts)
        for c in range(k, experts + 1):
            optimum = _optimum_hits(rows, c)
            assert curves["belady"].hits[c - 1] == optimum, (case, c, rows)
            assert curves["lru"].hits[c - 1] <= optimum and curves["lfu"].hits[c - 1] <= optimum
        for curve in curves.values():  # more room never hurts a stack policy, nor the optimum
            if curve.policy != "lfu":
                assert np.all(np.diff(curve.hits) >= 0), curve


def test_accesses_skip_zero_experts_drops_and_repeats():
    ids = np.array([[0, 9], [3, 3], [1, 2], [-1, 4]])
    kept = np.array([[True, True], [True, True], [True, False], [True, True]])
    accesses = expert_accesses(ids, num_experts=8, kept=kept)
    # 9 is a zero expert (ids >= 8), the repeated 3 runs once, 2 was dropped, -1 is padding.
    assert accesses.tolist() == [[0, -1], [3, -1], [1, -1], [-1, 4]]
    curve = cache_curves(accesses, 8, ["lru"])["lru"]
    assert curve.accesses == 4 and curve.tokens == 4 and curve.hits[-1] == 0
    only_zero = expert_accesses(np.array([[8, 9]]), num_experts=8)
    assert np.isnan(cache_hit_rate(only_zero, 2, "belady"))
    assert np.isnan(cache_curves(only_zero, 8)["lfu"].hit_rate).all()


def test_curves_of_two_ranks_add_up_and_bad_input_is_refused():
    a = cache_curves(expert_accesses(np.array([[0], [1], [0]]), 2), 2, ["lru"])["lru"]
    b = cache_curves(expert_accesses(np.array([[1], [1]]), 2), 2, ["lru"])["lru"]
    total = a + b
    assert isinstance(total, CacheCurve) and total.hits.tolist() == [1, 2] and total.accesses == 5
    with pytest.raises(ValueError, match="unknown cache policy"):
        cache_hits(np.zeros((1, 1), dtype=np.int64), 1, "fifo")
    with pytest.raises(ValueError, match="at least 1"):
        cache_hits(np.zeros((1, 1), dtype=np.int64), 0, "lru")
    with pytest.raises(ValueError, match="num_experts"):
        cache_curves(np.array([[5]]), 4)
    with pytest.raises(ValueError, match="shape"):
        expert_accesses(np.zeros((2, 2)), 4, kept=np.ones(3, dtype=bool))
