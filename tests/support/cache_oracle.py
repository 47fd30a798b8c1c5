"""A brute-force expert-cache simulation: the oracle the cache suites check the fast one against."""

from __future__ import annotations


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
