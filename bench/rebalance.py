"""What replaying a rebalancing policy costs (issue 51, part 1): `moescope.metrics.rebalance.replay`.

    .venv/bin/python bench/rebalance.py                         # 4000 steps x 48 layers x 64 experts, 8 ranks
    .venv/bin/python bench/rebalance.py --steps 20000 --experts 256 --ranks 32 --rounds 1

The loads are synthetic (no store): per step and layer a Zipf-like popularity over the experts whose
order rotates every 500 steps, with Poisson noise. Times, median of `--rounds`, each policy replayed
from the contiguous layout:

- never: the figures alone (every step served by one placement: rank loads, balancedness, overload,
  node figures; vectorised over the run);
- every:N and vLLM's and SGLang's schedules: the same plus a DeepSeek EPLB fit of every layer at
  each refit, and the slots it moved.

Each line gives the median, the refits and the ratio to never: what the refits add. A refit costs
one `moescope.metrics.eplb.eplb` call over all layers (pure Python packing per layer), so a policy's
cost grows with its refits, not with the steps between them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":
    sys.path.insert(0, REPO)


def synthetic_loads(steps: int, layers: int, experts: int, tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, experts + 1) ** 0.8
    popularity /= popularity.sum()
    loads = np.empty((steps, layers, experts))
    for t in range(steps):
        shift = (t // 500) % experts
        loads[t] = rng.poisson(np.roll(popularity, shift) * tokens, size=(layers, experts))
    return loads


def main() -> int:
    from moescope.metrics.placement import Placement
    from moescope.metrics.rebalance import NEVER, EveryN, SglangPolicy, VllmPolicy, replay

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096, help="slots per layer and step")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    loads = synthetic_loads(args.steps, args.layers, args.experts, args.tokens)
    layers = list(range(args.layers))
    initial = Placement.contiguous(args.ranks)
    policies = [NEVER, EveryN(1000), EveryN(100), VllmPolicy(1000, 400), SglangPolicy(500)]
    print(f"replay over {args.steps} steps x {args.layers} layers x {args.experts} experts, {args.ranks} ranks; "
          f"median of {args.rounds}")
    base = None
    for policy in policies:
        times, refits = [], 0
        for _ in range(args.rounds):
            start = time.perf_counter()
            result = replay(loads, initial, policy, layers, expert_bytes=1.0)
            times.append(time.perf_counter() - start)
            refits = len(result.rearrangements)
        median = statistics.median(times)
        base = base or median
        print(f"  {policy.name:<40} {median:8.3f} s  {refits:>4} refits  x{median / base:6.2f} never")
    return 0


if __name__ == "__main__":
    sys.exit(main())
