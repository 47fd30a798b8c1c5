"""Expert-cache what-if: with C experts of a layer resident in device memory, how often is a
token's chosen expert already there?

Offloaded serving keeps a few experts per layer on the device and fetches the rest from host
memory. The functions here replay recorded routes (one layer, in recording order) through a
cache of every size and policy. All but the last two are pure (arrays in, numbers out);
`replay_routes` consumes the pages `Store.routes_in_order` streams and `cache_report` asks a
store for them. `moescope whatif cache` and the dashboard's Expert cache page draw the curves,
and the Prometheus exporter serves one capacity live.

Definitions, stated once:

- An *access* is one (token, expert) pair the layer computed: each distinct routed expert of a
  token whose slot was kept. Zero (identity) experts hold no weights and a slot dropped at
  capacity runs no expert, so neither is an access (`expert_accesses` marks them -1).
- The cache holds at most C experts of the layer and starts empty, so first uses are misses
  (compulsory misses): even C = E hits less than 100%, namely 1 - distinct experts / accesses.
- A token's experts are needed *at once*. Each of its accesses is a hit when the expert is
  resident before the token, a miss otherwise (the miss loads it). Afterwards, if more than C
  experts are resident, the cache evicts in the policy's order, first among the experts this
  token did not use; only when the token itself uses more than C experts (C < k) does it evict
  some of the token's own, whose weights were streamed past the cache.
- Policy order (who is evicted first):
  - ``lru``: the expert used least recently (by token); among one token's experts, the router's
    later choice (higher slot) first.
  - ``lfu``: the expert with the fewest accesses since the stream began, counted whether or not
    it was resident ("perfect" LFU); ties as lru.
  - ``belady``: the expert whose next access is farthest in the future (never again: first);
    ties as lru. It needs the whole stream, so it is an offline bound, not a policy a server can
    run. With C at least the token's experts it is the offline optimum under the all-at-once
    rule (the tests check it against an exhaustive search); with C < k it is the same rule.
- Hit rate = hits / accesses: a share of *accesses* (slots that ran an expert), not of tokens.

Under these rules all three are stack algorithms: the cache of C after a token is the best C of
(the cache before it, plus the token's experts), the token's experts first and then by the
policy's order, an order that does not depend on C. So the caches of every size nest, and one pass
over the stream gives every capacity at once (`_stack_depth_counts`, a Python loop whose work
grows with accesses x min(E, the largest capacity asked for); LRU's stack depths are computed in
numpy instead, tokens x E). So E is bounded (MAX_EXPERTS, unless `max_experts` raises it) and the
capacities can be a short list.
"""

from __future__ import annotations

from array import array
from bisect import insort
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

POLICIES: tuple[str, ...] = ("lru", "lfu", "belady")
# The most routed experts per layer the replay takes unless told otherwise: the work grows with
# accesses x experts, and a count far above any real model's is an expert id out of range.
MAX_EXPERTS = 4096


def expert_accesses(expert_ids: np.ndarray, num_experts: int, kept: np.ndarray | None = None) -> np.ndarray:
    """The (tokens, k) int64 access array of recorded routes: each token's kept, distinct, routed
    experts in slot order, -1 where a slot is no access.

    A slot is no access when its id is negative or at least `num_experts` (a zero expert, or
    padding), when `kept` is False there, or when an earlier slot of the same token chose the
    same expert. Raises ValueError for a `kept` of another shape or `num_experts` < 1.
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be at least 1, got {num_experts}")
    ids = np.asarray(expert_ids)
    if ids.ndim == 1:
        ids = ids[:, None]
    if ids.ndim != 2:
        raise ValueError(f"expert_ids must be a (tokens, k) array, got shape {ids.shape}")
    out = ids.astype(np.int64, copy=True)
    invalid = (out < 0) | (out >= num_experts)
    if kept is not None:
        kept = np.asarray(kept, dtype=bool)
        if kept.size != out.size:
            raise ValueError(f"kept must have the shape of expert_ids {ids.shape}, got {kept.shape}")
        invalid |= ~kept.reshape(out.shape)
    out[invalid] = -1
    for slot in range(1, out.shape[1]):
        repeated = (out[:, slot:slot + 1] == out[:, :slot]).any(axis=1) & (out[:, slot] >= 0)
        out[repeated, slot] = -1
    return out


@dataclass(frozen=True)
class CacheCurve:
    """Hits of one policy at each capacity over one stream of accesses (or several, summed)."""

    policy: str
    hits: np.ndarray  # (len(capacities),) int64: hits[i] with capacities[i] experts resident
    accesses: int
    tokens: int  # tokens with at least one access
    capacities: np.ndarray | None = None  # experts resident, ascending; None: 1..len(hits)

    def __post_init__(self) -> None:
        if self.capacities is None:
            object.__setattr__(self, "capacities", np.arange(1, len(self.hits) + 1))

    @property
    def hit_rate(self) -> np.ndarray:
        """hits / accesses per capacity; NaN everywhere when there was no access."""
        if self.accesses == 0:
            return np.full(len(self.hits), np.nan)
        return self.hits / self.accesses

    def __add__(self, other: CacheCurve) -> CacheCurve:
        """Two streams served by separate caches (two ranks): hits and accesses add up."""
        if other.policy != self.policy or not np.array_equal(np.asarray(other.capacities),
                                                             np.asarray(self.capacities)):
            raise ValueError("only curves of the same policy and capacities add up")
        return CacheCurve(self.policy, self.hits + other.hits, self.accesses + other.accesses,
                          self.tokens + other.tokens, self.capacities)


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown cache policy {policy!r}; choose one of {', '.join(POLICIES)}")


def capacity_grid(capacities: Iterable[int] | None, num_experts: int) -> np.ndarray:
    """The capacities asked for, sorted and unique (1..num_experts when None)."""
    if capacities is None:
        return np.arange(1, num_experts + 1)
    chosen = sorted({int(c) for c in capacities})
    if not chosen or chosen[0] < 1:
        raise ValueError(f"capacities (experts resident per layer) must be at least 1, got {list(capacities)}")
    return np.array(chosen, dtype=np.int64)


def _check_experts(num_experts: int, max_experts: int) -> None:
    if num_experts > max_experts:
        raise ValueError(f"{num_experts:,} experts is more than the cache replay takes ({max_experts:,}): the "
                         "work grows with tokens x experts. An expert id out of range (a bad import) makes a "
                         "layer look this large; if it really has that many, raise max_experts")


def _flat(accesses: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The accesses in replay order: (token, column, expert) of every access, and the row width."""
    arr = np.asarray(accesses)
    if arr.ndim != 2:
        raise ValueError(f"accesses must be a (tokens, k) array from expert_accesses, got shape {arr.shape}")
    token, column = np.nonzero(arr >= 0)  # row-major: by token, then slot
    return token, column, arr[token, column].astype(np.int64), arr.shape[1]


def _lru_depth_counts(token: np.ndarray, column: np.ndarray, expert: np.ndarray, width: int, tokens: int,
                      num_experts: int) -> np.ndarray:
    """How many accesses found their expert at each LRU stack depth (0: most recent), vectorised.

    The LRU stack before a token orders the experts by their last access, later tokens first and
    within a token the router's earlier choice first; an access's depth is the number of experts
    whose last access is more recent than its expert's. First uses have no depth (they miss at any C).
    """
    counts = np.zeros(num_experts, dtype=np.int64)
    last = np.full(num_experts, -1, dtype=np.int64)  # recency code of each expert's last access
    recency = token * width + (width - 1 - column)  # higher: more recent
    block = max(1, (1 << 22) // (width * num_experts))  # tokens per block: bounded memory
    starts = np.searchsorted(token, np.arange(0, tokens + block, block))
    for lo, hi in zip(starts[:-1], starts[1:]):
        if lo == hi:
            continue
        first = token[lo]
        rows = token[lo:hi] - first
        seen = np.full((rows[-1] + 2, num_experts), -1, dtype=np.int64)
        seen[0] = last
        seen[rows + 1, expert[lo:hi]] = recency[lo:hi]
        np.maximum.accumulate(seen, axis=0, out=seen)  # row t: last access before token t of the block
        last = seen[-1].copy()
        before = seen[:-1]
        # depth = experts used more recently; the codes are distinct except -1 (never used), the lowest
        rank = np.empty_like(before)
        np.put_along_axis(rank, np.argsort(before, axis=1), np.arange(num_experts)[None, :], axis=1)
        own = before[rows, expert[lo:hi]]
        depth = num_experts - 1 - rank[rows, expert[lo:hi]]
        counts += np.bincount(depth[own >= 0], minlength=num_experts)[:num_experts]
    return counts


def _priorities(token: np.ndarray, column: np.ndarray, expert: np.ndarray, width: int, tokens: int,
                policy: str) -> np.ndarray:
    """Each access's standing after it (higher: evicted later), one int64: the policy's key, then recency."""
    recency = token * width + (width - 1 - column)
    scale = (tokens + 1) * width  # above every recency code
    # each expert's accesses in replay order; numpy's stable sort of 16-bit ids is a radix sort
    narrow = expert.astype(np.uint16) if expert.max() < (1 << 16) else expert
    order = np.argsort(narrow, kind="stable")
    sizes = np.bincount(expert)  # accesses of each expert
    rank = np.arange(len(order)) - np.repeat(np.cumsum(sizes) - sizes, sizes)  # accesses of the expert before this one
    if policy == "lfu":
        count = np.empty(len(order), dtype=np.int64)
        count[order] = rank + 1  # accesses since the stream began, this one included
        return count * scale + recency
    next_use = np.full(len(order), tokens, dtype=np.int64)  # never again: farther than any token
    follows = rank[1:] > 0  # the next access in sorted order is the same expert's
    next_use[order[:-1][follows]] = token[order[1:][follows]]
    return -next_use * scale + recency


def _best_first(token: np.ndarray, column: np.ndarray, width: int, priority: np.ndarray) -> np.ndarray:
    """The accesses' indices in replay order, each token's best standing (highest priority) first.

    A sort within each token's row of `width` slots (the standings in a (tokens, width) grid, empty
    slots last), not of the whole stream by (token, standing): on the benchmark's 8 M accesses 0.3 s
    of CPU instead of 1.2 to 2.4 s for np.lexsort.
    """
    rows = int(token[-1]) + 1
    slot = token * width + column  # each access's place in the grid
    key = np.full(rows * width, np.iinfo(np.int64).max, dtype=np.int64)  # ascending: best first, empty last
    key[slot] = -priority
    grid = np.argsort(key.reshape(rows, width), axis=1)
    del key  # one grid-sized array less at the peak
    grid += np.arange(0, rows * width, width)[:, None]
    if len(slot) == rows * width:  # every slot an access: slot and access numbers agree
        return grid.ravel()
    index = np.full(rows * width, -1, dtype=np.int64)  # the access in each slot
    index[slot] = np.arange(len(slot))
    order = index[grid.ravel()]
    return order[order >= 0]


def _stack_codes(expert: np.ndarray, priority: np.ndarray, order: np.ndarray,
                 num_experts: int) -> tuple[array, array]:
    """The accesses' experts and stack codes (standing x E + expert), in replay `order`, as arrays of
    int64 (8 bytes an access instead of a Python int each)."""
    if int(np.abs(priority).max()) >= (1 << 62) // num_experts:
        # the codes could overflow int64 (they stay within +-2**62 + E); the ranks of the standings keep
        # their order, all the stack needs
        ranks = np.empty_like(priority)
        ranks[np.argsort(priority)] = np.arange(len(priority))
        priority = ranks
    experts = array("q", expert[order].tobytes())
    codes = array("q", (priority[order] * num_experts + expert[order]).tobytes())
    return experts, codes


def _stack_depth_counts(token: np.ndarray, column: np.ndarray, expert: np.ndarray, priority: np.ndarray,
                        width: int, num_experts: int, deepest: int) -> np.ndarray:
    """How many accesses found their expert at each stack depth below `deepest`, in one pass.

    Under the all-at-once rule every policy here is a stack algorithm: the cache of C after a
    token is the best C of (the cache of C before it, plus the token's experts), the token's
    experts first and then by the policy's standing (`priority`, higher kept), which does not
    depend on C. So the caches of every size nest, and one list (the stack) holds them all: the
    cache of C is its first C experts, and an access hits at C exactly when its expert's depth is
    below C. After a token, its experts go on top, best first; below them each depth takes the
    best of what was above it in the old stack and not yet placed (a carried pool, never more than
    the token's experts), down to the deepest of the token's experts; below that nothing moves.
    Only the first `deepest` depths are kept: deeper ones change no cache of that size or less.

    Most of the walk down passes slots that keep their expert, so that case is one comparison: a
    stack entry is one int, the expert's *code* (its standing x E + the expert: the codes sort as
    the standings do, and code % E is the expert), and the slots the token's experts left hold a
    hole value below every code, so a slot changes exactly when its code is not above the pool's best.
    """
    order = _best_first(token, column, width, priority)
    bounds = np.r_[0, np.flatnonzero(np.diff(token)) + 1, len(token)].tolist()
    experts, codes = _stack_codes(expert, priority, order, num_experts)
    hole = -(1 << 63)  # below every code
    depths = array("q")  # every access's depth before its token, -1 for none
    depth_of = [-1] * num_experts  # each expert's place in the stack; -1: not in it
    stack: list[int] = []  # the experts' codes
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        row = experts[lo:hi]
        k = hi - lo  # the token's experts
        found = [depth_of[e] for e in row]
        depths.fromlist(found)
        found.sort()
        missing = found.count(-1)  # experts not in the stack, sorted first
        # the stack changes down to the deepest of the token's experts, or to the bottom after a first
        # use (or a use from below `deepest`), which carries an expert all the way down
        if missing:
            end = deepest
            del found[:missing]
        else:
            end = max(found[-1] + 1, k)
        size = len(stack)
        for depth in found:  # the slots the token's experts leave
            stack[depth] = hole
        pool = sorted(stack[:k])  # carried down: the old top's experts the token does not use
        del pool[:pool.count(hole)]
        stack[:k] = codes[lo:hi]
        for depth, e in enumerate(row):
            depth_of[e] = depth
        if pool and size > k:
            best = pool[-1]  # ascending: the best carried is last
            for i, code in enumerate(stack[k:min(end, size)], k):
                if code > best:  # better than all carried: stays
                    continue
                if code == hole:  # a slot the token's expert left: the pool's best takes it
                    stack[i] = pool.pop()
                    depth_of[best % num_experts] = i
                    if not pool:
                        break
                else:  # the pool's best takes the slot, this one is carried further down
                    insort(pool, code)
                    stack[i] = pool.pop()
                    depth_of[best % num_experts] = i
                best = pool[-1]
        if pool:  # the old stack ran out: what is still carried goes below it, best first
            for code in reversed(pool):
                depth_of[code % num_experts] = len(stack)
                stack.append(code)
        if len(stack) > deepest:
            for code in stack[deepest:]:
                depth_of[code % num_experts] = -1
            del stack[deepest:]
    every = np.frombuffer(depths, dtype=np.int64)
    return np.bincount(every[every >= 0], minlength=deepest)[:deepest]


def cache_curves(accesses: np.ndarray, num_experts: int, policies: Iterable[str] = POLICIES,
                 capacities: Iterable[int] | None = None, max_experts: int | None = None) -> dict[str, CacheCurve]:
    """Hits at each capacity (default every one from 1 to `num_experts`) for each policy, over one
    stream of accesses (from :func:`expert_accesses`, in recording order; one cache, so one rank's
    stream). Every capacity comes from one pass per policy (the stack of `_stack_depth_counts`;
    LRU's depths vectorised); LFU's and Belady's work grows with accesses x min(num_experts,
    largest capacity), LRU's with tokens x num_experts. A capacity above `num_experts` holds every
    expert.

    Returns {policy: CacheCurve}. Raises ValueError for an unknown policy, a capacity below 1, an
    expert id at or above `num_experts`, or `num_experts` above `max_experts` (default MAX_EXPERTS).
    """
    policies = tuple(policies)
    for policy in policies:
        check_policy(policy)
    _check_experts(num_experts, MAX_EXPERTS if max_experts is None else max_experts)
    wanted = capacity_grid(capacities, num_experts)
    token, column, expert, width = _flat(accesses)
    if len(expert) and expert.max() >= num_experts:
        raise ValueError(f"an expert id is at or above num_experts={num_experts}; build the accesses with "
                         "expert_accesses(ids, num_experts)")
    tokens = int(token[-1]) + 1 if len(token) else 0
    with_access = int(np.count_nonzero(np.diff(token))) + 1 if len(token) else 0  # token is sorted
    deepest = int(min(wanted[-1], num_experts))
    depth_index = np.minimum(wanted, num_experts) - 1
    curves = {}
    for policy in policies:
        if not len(expert):
            counts = np.zeros(0, dtype=np.int64)
        elif policy == "lru":
            counts = _lru_depth_counts(token, column, expert, width, tokens, num_experts)
        else:
            priority = _priorities(token, column, expert, width, tokens, policy)
            counts = _stack_depth_counts(token, column, expert, priority, width, num_experts, deepest)
        hits = np.cumsum(counts)[depth_index] if len(counts) else np.zeros(len(wanted), dtype=np.int64)
        curves[policy] = CacheCurve(policy, hits.astype(np.int64), len(expert), with_access, wanted)
    return curves


def cache_hits(accesses: np.ndarray, capacity: int, policy: str) -> tuple[int, int]:
    """(hits, accesses) of one policy with `capacity` experts resident, over an access array
    from :func:`expert_accesses` in recording order (see the module's definitions).

    Raises ValueError for an unknown policy or a capacity below 1.
    """
    check_policy(policy)
    if capacity < 1:
        raise ValueError(f"capacity (experts resident per layer) must be at least 1, got {capacity}")
    arr = np.asarray(accesses)
    experts = int(arr.max()) + 1 if arr.size and arr.max() >= 0 else 1
    curve = cache_curves(arr, experts, [policy], [capacity], max_experts=experts)[policy]
    return int(curve.hits[0]), curve.accesses


def cache_hit_rate(accesses: np.ndarray, capacity: int, policy: str) -> float:
    """hits / accesses of :func:`cache_hits`; NaN when there is no access."""
    hits, total = cache_hits(accesses, capacity, policy)
    return hits / total if total else float("nan")


# -- replaying a store's routes --------------------------------------------------------------

REPORT_COLUMNS = ["layer", "policy", "capacity", "hit_rate", "hits", "accesses", "tokens", "truncated"]
# Tokens replayed per layer unless told otherwise: the work grows with tokens x experts.
DEFAULT_MAX_TOKENS = 200_000


def replay_routes(pages: Iterable, num_experts: int, policies: Iterable[str] = POLICIES,
                  max_tokens: int | None = DEFAULT_MAX_TOKENS, capacities: Iterable[int] | None = None,
                  max_experts: int | None = None) -> tuple[dict[str, CacheCurve], bool]:
    """The curves of one layer's routes, one cache per rank: ({policy: CacheCurve}, truncated).

    `pages` are `store.queries.RoutePage`s in recording order (`Store.routes_in_order`). Each
    rank serves its own tokens from its own device memory, so each rank's tokens go through a
    cache of their own, in recording order; hits and accesses are summed over the ranks. At most
    `max_tokens` rows are replayed (the first ones; None: all); `truncated` says whether more
    were recorded. `capacities` and `max_experts` are :func:`cache_curves`'. Raises ValueError
    for an unknown policy, max_tokens < 1, a capacity below 1, or num_experts above max_experts.
    """
    policies = tuple(policies)
    for policy in policies:
        check_policy(policy)
    _check_experts(num_experts, MAX_EXPERTS if max_experts is None else max_experts)
    wanted = capacity_grid(capacities, num_experts)
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    per_rank: dict[int, list[np.ndarray]] = {}
    taken, truncated = 0, False
    for page in pages:
        rows = len(page.step)
        if max_tokens is not None and taken + rows > max_tokens:
            rows, truncated = max_tokens - taken, True
        accesses = expert_accesses(page.expert_ids[:rows], num_experts, page.kept[:rows]).astype(np.int32)
        ranks = page.rank[:rows]
        for rank in np.unique(ranks):
            per_rank.setdefault(int(rank), []).append(accesses[ranks == rank])
        taken += rows
        if truncated:
            break
    total = {policy: CacheCurve(policy, np.zeros(len(wanted), dtype=np.int64), 0, 0, wanted) for policy in policies}
    for parts in per_rank.values():
        curves = cache_curves(np.concatenate(parts), num_experts, policies, wanted, max_experts=num_experts)
        for policy, curve in curves.items():
            total[policy] = total[policy] + curve
    return total, truncated
