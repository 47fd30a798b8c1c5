"""How long `moescope whatif cache` takes to replay one layer: 1 M route rows of a 64-expert, top-8
layer through LRU, LFU and Belady at every capacity from 1 to 64 (issue 23's target: under 30 s for
the three together).

The routes are synthetic and fixed by a seed: each token takes 8 distinct experts of 64 by a
Gumbel top-k over skewed expert popularities (Dirichlet 0.5) that drift every 50 000 tokens, on
one rank, in pages of 65 536 rows as `Store.routes_in_order` yields them. What is timed is
`moescope.metrics.expert_cache.replay_routes` (access building, the per-rank split and the one pass per policy);
reading the store is not. Each policy runs alone, `--repeat` times; the median is printed with
the process CPU time beside it, since wall time on a shared machine moves with its load.

The replay the module had before the one pass (one simulation per capacity, kept as the oracle in
tests/unit/metrics/test_expert_cache.py) is timed on the first `--old-tokens` tokens, beside the one pass on
the same tokens, and both must give the same hits.

    python bench/whatif.py                      # 1 M rows, 3 runs each, old replay on 10 000 tokens
    python bench/whatif.py --rows 200000 --repeat 1 --old-tokens 0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from moescope.metrics.expert_cache import POLICIES, cache_curves, expert_accesses, replay_routes
from moescope.store.queries import RoutePage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE_ROWS = 65_536


def routes(rows: int, experts: int, top_k: int, seed: int, drift: int = 50_000) -> np.ndarray:
    """(rows, top_k) expert ids: Gumbel top-k over popularities that change every `drift` tokens."""
    rng = np.random.default_rng(seed)
    ids = np.empty((rows, top_k), dtype=np.int64)
    for lo in range(0, rows, drift):
        hi = min(rows, lo + drift)
        log_popularity = np.log(rng.dirichlet(np.full(experts, 0.5)))
        scores = rng.gumbel(size=(hi - lo, experts)) + log_popularity
        ids[lo:hi] = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
    return ids


def pages(ids: np.ndarray) -> list[RoutePage]:
    """The rows as the store pages them: one rank, 8 tokens a step, whole steps per page."""
    out = []
    for lo in range(0, len(ids), PAGE_ROWS):
        chunk = ids[lo:lo + PAGE_ROWS]
        index = np.arange(lo, lo + len(chunk))
        out.append(RoutePage(step=index // 8, rank=np.zeros(len(chunk), dtype=np.int32),
                             token=(index % 8).astype(np.int32), expert_ids=chunk,
                             kept=np.ones(chunk.shape, dtype=bool)))
    return out


def timed(fn, repeat: int) -> tuple[float, float, object]:
    """(median wall seconds, median CPU seconds, last result) of `repeat` calls."""
    walls, cpus, result = [], [], None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="route rows of the layer (default 1 M)")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="runs per policy; the median is printed")
    parser.add_argument("--old-tokens", type=int, default=10_000,
                        help="tokens for the old per-capacity replay, beside the one pass (0: skip it)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    ids = routes(args.rows, args.experts, args.top_k, args.seed)
    layer = pages(ids)
    print(f"{args.rows:,} route rows, {args.experts} experts, top-{args.top_k}, every capacity 1..{args.experts}; "
          f"median of {args.repeat}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'policy':<8} {'wall s':>8} {'CPU s':>8}  hit rate at C = 8 / 16 / 32")
    wall_total = cpu_total = 0.0
    for policy in POLICIES:
        wall, cpu, (curves, _) = timed(lambda: replay_routes(layer, args.experts, [policy], max_tokens=None),
                                       args.repeat)
        curve = curves[policy]
        rates = " / ".join(f"{100 * curve.hit_rate[c - 1]:.1f}%" for c in (8, 16, 32) if c <= args.experts)
        print(f"{policy:<8} {wall:>8.2f} {cpu:>8.2f}  {rates}")
        wall_total, cpu_total = wall_total + wall, cpu_total + cpu
    print(f"{'all 3':<8} {wall_total:>8.2f} {cpu_total:>8.2f}")

    if args.old_tokens > 0:
        if REPO not in sys.path:
            sys.path.insert(0, REPO)
        from tests.support.cache_oracle import replay_hits

        accesses = expert_accesses(ids[:args.old_tokens], args.experts)
        rows = accesses.tolist()
        capacities = range(1, args.experts + 1)
        print(f"\nold replay (one simulation per capacity) beside the one pass, first {args.old_tokens:,} tokens:")
        print(f"{'policy':<8} {'old s':>8} {'new s':>8} {'x faster':>9}")
        for policy in POLICIES:
            old_wall, _, old_hits = timed(lambda: [replay_hits(rows, c, policy) for c in capacities], 1)
            new_wall, _, new = timed(lambda: cache_curves(accesses, args.experts, [policy]), args.repeat)
            if new[policy].hits.tolist() != old_hits:
                print(f"{policy}: the one pass and the old replay disagree", file=sys.stderr)
                return 1
            print(f"{policy:<8} {old_wall:>8.2f} {new_wall:>8.3f} {old_wall / new_wall:>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
