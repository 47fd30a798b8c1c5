"""A brute-force expert-cache simulation: the oracle the cache suites check the fast one against."""

from __future__ import annotations


def brute_force_hits(rows: list[list[int]], capacity: int, policy: str) -> int:
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



def replay_hits(rows: list[list[int]], capacity: int, policy: str) -> int:
    """The module's definition simulated directly, one capacity at a time (the module's own replay
    before the one-pass stack): resident set, recency, counts and next uses kept as the stream goes."""
    rows = [list(dict.fromkeys(e for e in row if e >= 0)) for row in rows]
    rows = [row for row in rows if row]
    upcoming: dict[int, float] = {}
    next_uses: list[list[float]] = [[] for _ in rows]
    for t in range(len(rows) - 1, -1, -1):
        next_uses[t] = [upcoming.get(e, float("inf")) for e in rows[t]]
        for e in rows[t]:
            upcoming[e] = t
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
            hits += e in resident
            recency[e] = (t, -slot)
            count[e] = count.get(e, 0) + 1
            next_use[e] = next_uses[t][slot]
        resident.update(row)
        excess = len(resident) - capacity
        if excess > 0:
            victims = sorted((e for e in resident if e not in row), key=order)[:excess]
            if len(victims) < excess:  # the token alone uses more than the cache holds
                victims += sorted(row, key=order)[:excess - len(victims)]
            resident.difference_update(victims)
    return hits
