"""Expert-cache simulation checked against textbook cases, two replays written here (a brute-force
one and the direct per-capacity simulation the module used before its one-pass stack), and an
exhaustive search for the offline optimum."""

from __future__ import annotations

import itertools
import random
from functools import lru_cache

import numpy as np
import pytest

from moescope.metrics.expert_cache import (
    MAX_EXPERTS,
    POLICIES,
    CacheCurve,
    cache_curves,
    cache_hit_rate,
    cache_hits,
    expert_accesses,
)
from tests.support.cache_oracle import brute_force_hits, replay_hits

# Silberschatz's reference string (Operating System Concepts, ch. 9): with 3 frames, OPT takes 9
# page faults, LRU 12. Every page here is one expert, one token each (k = 1).
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]






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
        want = [brute_force_hits(rows, c, policy) for c in range(1, experts + 1)]
        assert [replay_hits(rows, c, policy) for c in range(1, experts + 1)] == want, (case, rows)
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
        for curve in curves.values():  # all three are stack policies here: more room never hurts
            assert np.all(np.diff(curve.hits) >= 0), curve


def _stream(rng: random.Random, tokens: int, experts: int, k: int) -> np.ndarray:
    """Raw routes as a router gives them: k slots a token, skewed or bursty choices, repeats within a
    token, padding (-1) and zero experts (ids >= experts) mixed in, whole tokens of them included."""
    weights = [1 + rng.choice([0.0, 1.0, 6.0]) * e for e in range(experts)]
    ids = np.empty((tokens, k), dtype=np.int64)
    previous = [0] * k
    for t in range(tokens):
        if t and rng.random() < 0.2:  # a burst: the same choices again (ties in recency order)
            ids[t] = previous
            continue
        for slot in range(k):
            draw = rng.random()
            ids[t, slot] = -1 if draw < 0.05 else experts + 1 if draw < 0.1 else rng.choices(range(experts), weights)[0]
        previous = list(ids[t])
    return ids


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("policy", POLICIES)
def test_one_pass_equals_the_replay_at_every_capacity(policy, seed):
    """The stack (every capacity at once) against the direct replay of each capacity, exactly: C < k,
    C = E, capacities above E, short lists of capacities, LFU's equal counts and Belady's equal next
    uses (several experts of one token next used together, or never again) broken as the rules say."""
    rng = random.Random(seed)
    for case in range(25):
        experts = rng.randint(1, 12)
        k = rng.randint(1, min(experts, 6) + 2)  # k above E too: repeats fill the extra slots
        ids = _stream(rng, rng.randint(0, 90), experts, k)
        accesses = expert_accesses(ids, experts)
        rows = accesses.tolist()
        want = [replay_hits(rows, c, policy) for c in range(1, experts + 1)]
        curve = cache_curves(accesses, experts, [policy])[policy]
        assert curve.capacities.tolist() == list(range(1, experts + 1))
        assert curve.hits.tolist() == want, (case, ids.tolist())
        chosen = rng.sample(range(1, experts + 3), rng.randint(1, experts + 2))
        some = cache_curves(accesses, experts, [policy], capacities=chosen)[policy]
        assert some.capacities.tolist() == sorted(chosen)
        assert some.hits.tolist() == [want[min(c, experts) - 1] for c in sorted(chosen)], (case, chosen)
        assert some.accesses == curve.accesses == int((accesses >= 0).sum())
    # a longer skewed stream, top-6 of 24, where stacks run deep
    ids = _stream(rng, 600, 24, 6)
    accesses = expert_accesses(ids, 24)
    curve = cache_curves(accesses, 24, [policy])[policy]
    assert curve.hits.tolist() == [replay_hits(accesses.tolist(), c, policy) for c in range(1, 25)]


@pytest.mark.parametrize("policy", ["lfu", "belady"])
def test_standings_too_large_to_pack_go_through_the_stack_as_ranks(policy):
    """The stack packs standing x E + expert into one int64; standings too large for that are replaced
    by their ranks (the same order), and the depths stay the same."""
    from moescope.metrics.expert_cache import _flat, _priorities, _stack_depth_counts

    experts = 12
    accesses = expert_accesses(_stream(random.Random(5), 300, experts, 4), experts)
    token, column, expert, width = _flat(accesses)
    priority = _priorities(token, column, expert, width, int(token[-1]) + 1, policy)
    want = _stack_depth_counts(token, column, expert, priority, width, experts, experts)
    # the same order, and int64 still holds it; standing x E + expert would overflow for the largest
    huge = priority * ((1 << 64) // experts // int(np.abs(priority).max()))
    assert int(np.abs(huge).max()) < 1 << 63 and int(np.abs(huge).max()) * experts >= 1 << 63
    assert _stack_depth_counts(token, column, expert, huge, width, experts, experts).tolist() == want.tolist()
    rows = accesses.tolist()
    assert np.cumsum(want).tolist() == [replay_hits(rows, c, policy) for c in range(1, experts + 1)]


def test_capacities_choose_the_points_of_the_curve():
    accesses = expert_accesses(np.array(TEXTBOOK), num_experts=8)
    curves = cache_curves(accesses, 8, capacities=[3, 20, 1, 3])
    for policy, curve in curves.items():
        assert curve.capacities.tolist() == [1, 3, 20]  # sorted, once each; 20 holds all 8
        assert curve.hits.tolist() == [replay_hits([[e] for e in TEXTBOOK], c, policy) for c in (1, 3, 8)]
    assert curves["belady"].hits[1] == 20 - 9 and curves["lru"].hits[1] == 20 - 12
    assert cache_hits(accesses, 50, "lfu") == (20 - 6, 20)  # above E: everything resident, first uses miss
    with pytest.raises(ValueError, match="at least 1"):
        cache_curves(accesses, 8, capacities=[2, 0])
    with pytest.raises(ValueError, match="at least 1"):
        cache_curves(accesses, 8, capacities=[])
    left, right = cache_curves(accesses, 8, ["lru"], [1, 2])["lru"], cache_curves(accesses, 8, ["lru"], [1, 3])["lru"]
    with pytest.raises(ValueError, match="capacities"):
        left + right


def test_the_number_of_experts_is_bounded():
    accesses = expert_accesses(np.array([[0, 1], [1, 2]]), num_experts=3)
    # one bad imported id made a layer of 10^7 experts; the replay refuses it at once and says why
    with pytest.raises(ValueError, match=r"10,000,000 experts is more than the cache replay takes \(4,096\)"):
        cache_curves(accesses, 10**7, ["lru"])
    assert MAX_EXPERTS == 4096
    big = cache_curves(accesses, 5000, capacities=[1, 2, 5000], max_experts=5000)
    # raised on purpose, it runs: at C = 1 only Belady keeps expert 1 (next used) over the router's first choice
    assert {p: c.hits.tolist() for p, c in big.items()} == {"lru": [0, 1, 1], "lfu": [0, 1, 1], "belady": [1, 1, 1]}


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
