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

LRU is a stack policy (a cache of C holds the C most recent experts), so one pass gives every
capacity; LFU and Belady are replayed once per capacity.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

POLICIES: tuple[str, ...] = ("lru", "lfu", "belady")
NEVER = float("inf")


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
    """Hits of one policy at every capacity 1..E over one stream of accesses (or several, summed)."""

    policy: str
    hits: np.ndarray  # (E,) int64: hits[c - 1] with c experts resident
    accesses: int
    tokens: int  # tokens with at least one access

    @property
    def capacities(self) -> np.ndarray:
        """The capacities 1..E, aligned with `hits`."""
        return np.arange(1, len(self.hits) + 1)

    @property
    def hit_rate(self) -> np.ndarray:
        """hits / accesses per capacity; NaN everywhere when there was no access."""
        if self.accesses == 0:
            return np.full(len(self.hits), np.nan)
        return self.hits / self.accesses

    def __add__(self, other: CacheCurve) -> CacheCurve:
        """Two streams served by separate caches (two ranks): hits and accesses add up."""
        if other.policy != self.policy or len(other.hits) != len(self.hits):
            raise ValueError("only curves of the same policy and number of experts add up")
        return CacheCurve(self.policy, self.hits + other.hits, self.accesses + other.accesses,
                          self.tokens + other.tokens)


def _rows(accesses: np.ndarray) -> list[tuple[int, ...]]:
    arr = np.asarray(accesses)
    if arr.ndim != 2:
        raise ValueError(f"accesses must be a (tokens, k) array from expert_accesses, got shape {arr.shape}")
    return [row for row in (tuple(e for e in r if e >= 0) for r in arr.tolist()) if row]


def _next_uses(rows: Sequence[tuple[int, ...]]) -> list[tuple[float, ...]]:
    """For every access, the index of the next token that accesses the same expert (NEVER if none)."""
    seen: dict[int, float] = {}
    out: list[tuple[float, ...]] = [()] * len(rows)
    for t in range(len(rows) - 1, -1, -1):
        row = rows[t]
        out[t] = tuple(seen.get(e, NEVER) for e in row)
        for e in row:
            seen[e] = t
    return out


def _lru_hits(rows: Sequence[tuple[int, ...]], num_experts: int) -> np.ndarray:
    """LRU hits at every capacity 1..E in one pass: an access hits a cache of C when its expert is
    among the C most recently used before the token (its stack depth is below C)."""
    depth_counts = np.zeros(num_experts + 1, dtype=np.int64)
    stack: list[int] = []  # most recent first; one token's experts in slot order
    for row in rows:
        for e in row:
            if e in stack:
                depth_counts[stack.index(e)] += 1
        stack = list(row) + [e for e in stack if e not in row]
    return np.cumsum(depth_counts)[:num_experts]


def _replay(rows: Sequence[tuple[int, ...]], capacity: int, policy: str,
            next_uses: Sequence[tuple[float, ...]] | None) -> int:
    """Hits of one policy with `capacity` experts resident, by direct simulation."""
    resident: set[int] = set()
    recency: dict[int, tuple[int, int]] = {}  # expert -> (token, -slot) of its last access
    count: dict[int, int] = {}
    next_use: dict[int, float] = {}
    if policy == "lru":
        def order(e: int) -> tuple:
            return recency[e]
    elif policy == "lfu":
        def order(e: int) -> tuple:
            return count[e], recency[e]
    else:
        def order(e: int) -> tuple:
            return -next_use[e], recency[e]
    hits = 0
    for t, row in enumerate(rows):
        for slot, e in enumerate(row):
            if e in resident:
                hits += 1
            recency[e] = (t, -slot)
            count[e] = count.get(e, 0) + 1
            if next_uses is not None:
                next_use[e] = next_uses[t][slot]
        resident.update(row)
        excess = len(resident) - capacity
        if excess > 0:
            victims = sorted((e for e in resident if e not in row), key=order)[:excess]
            if len(victims) < excess:  # the token alone uses more than the cache holds
                victims += sorted(row, key=order)[:excess - len(victims)]
            resident.difference_update(victims)
    return hits


def _check(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown cache policy {policy!r}; choose one of {', '.join(POLICIES)}")


def cache_hits(accesses: np.ndarray, capacity: int, policy: str) -> tuple[int, int]:
    """(hits, accesses) of one policy with `capacity` experts resident, over an access array
    from :func:`expert_accesses` in recording order (see the module's definitions).

    Raises ValueError for an unknown policy or a capacity below 1.
    """
    _check(policy)
    if capacity < 1:
        raise ValueError(f"capacity (experts resident per layer) must be at least 1, got {capacity}")
    rows = _rows(accesses)
    total = sum(len(row) for row in rows)
    return _replay(rows, int(capacity), policy, _next_uses(rows) if policy == "belady" else None), total


def cache_hit_rate(accesses: np.ndarray, capacity: int, policy: str) -> float:
    """hits / accesses of :func:`cache_hits`; NaN when there is no access."""
    hits, total = cache_hits(accesses, capacity, policy)
    return hits / total if total else float("nan")


def cache_curves(accesses: np.ndarray, num_experts: int,
                 policies: Iterable[str] = POLICIES) -> dict[str, CacheCurve]:
    """Hits at every capacity 1..`num_experts` for each policy, over one stream of accesses
    (from :func:`expert_accesses`, in recording order; one cache, so one rank's stream).

    Returns {policy: CacheCurve}. Raises ValueError for an unknown policy, or an expert id at or
    above `num_experts`.
    """
    policies = tuple(policies)
    for policy in policies:
        _check(policy)
    rows = _rows(accesses)
    if rows and max(max(row) for row in rows) >= num_experts:
        raise ValueError(f"an expert id is at or above num_experts={num_experts}; build the accesses with "
                         "expert_accesses(ids, num_experts)")
    total = sum(len(row) for row in rows)
    next_uses = _next_uses(rows) if "belady" in policies else None
    curves = {}
    for policy in policies:
        if policy == "lru":
            hits = _lru_hits(rows, num_experts)
        else:
            hits = np.array([_replay(rows, c, policy, next_uses) for c in range(1, num_experts + 1)],
                            dtype=np.int64)
        curves[policy] = CacheCurve(policy, hits, total, len(rows))
    return curves


# -- replaying a store's routes --------------------------------------------------------------

REPORT_COLUMNS = ["layer", "policy", "capacity", "hit_rate", "hits", "accesses", "tokens", "truncated"]
# Tokens replayed per layer unless told otherwise: LFU and Belady replay the stream once per
# capacity, so the work grows with tokens x experts.
DEFAULT_MAX_TOKENS = 200_000


def replay_routes(pages: Iterable, num_experts: int, policies: Iterable[str] = POLICIES,
                  max_tokens: int | None = DEFAULT_MAX_TOKENS) -> tuple[dict[str, CacheCurve], bool]:
    """The curves of one layer's routes, one cache per rank: ({policy: CacheCurve}, truncated).

    `pages` are `store.queries.RoutePage`s in recording order (`Store.routes_in_order`). Each
    rank serves its own tokens from its own device memory, so each rank's tokens go through a
    cache of their own, in recording order; hits and accesses are summed over the ranks. At most
    `max_tokens` rows are replayed (the first ones; None: all); `truncated` says whether more
    were recorded. Raises ValueError for an unknown policy or max_tokens < 1.
    """
    policies = tuple(policies)
    for policy in policies:
        _check(policy)
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
    total = {policy: CacheCurve(policy, np.zeros(num_experts, dtype=np.int64), 0, 0) for policy in policies}
    for parts in per_rank.values():
        for policy, curve in cache_curves(np.concatenate(parts), num_experts, policies).items():
            total[policy] = total[policy] + curve
    return total, truncated


def cache_report(store, run_id: str | None = None, layer: int | None = None, tags: dict[str, str] | None = None,
                 policies: Iterable[str] = POLICIES, max_tokens: int | None = DEFAULT_MAX_TOKENS):
    """Hit rates of every MoE layer of a run (or one layer) at every capacity, as a long DataFrame.

    Columns: layer, policy, capacity (experts resident per layer, 1..E routed experts), hit_rate
    (hits / accesses), hits, accesses, tokens (replayed tokens with an access), truncated (more
    routes were recorded than `max_tokens`). Layers without routes have no rows, so a run that
    recorded none gives an empty frame. `run_id` defaults to the latest run; `tags` keeps the
    steps carrying every given tag (that traffic alone goes through the cache). Raises
    ValueError for a layer the run does not have, or an unknown policy.
    """
    import pandas as pd

    policies = tuple(policies)
    run_id = run_id or store.latest_run()
    layers = store.layers(run_id)
    if layer is not None:
        if int(layer) not in set(layers.layer.astype(int)):
            raise ValueError(f"run {run_id!r} has no MoE layer {layer}; its layers are "
                             f"{', '.join(map(str, layers.layer.astype(int))) or 'none'}")
        layers = layers[layers.layer == int(layer)]
    rows = []
    for info in layers.itertuples():
        curves, truncated = replay_routes(store.routes_in_order(run_id, int(info.layer), tags=tags),
                                          int(info.num_experts), policies, max_tokens)
        for policy, curve in curves.items():
            if curve.tokens == 0:
                continue
            for capacity, hits, rate in zip(curve.capacities, curve.hits, curve.hit_rate):
                rows.append((int(info.layer), policy, int(capacity), float(rate), int(hits), curve.accesses,
                             curve.tokens, truncated))
    return pd.DataFrame(rows, columns=REPORT_COLUMNS)
