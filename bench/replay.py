"""What routing replay costs the model on a CPU: a plain forward vs the same forward under
`moescope.replay`, side by side in one run.

The workloads, presets, rounds and copies are bench/overhead.py's (its `measure`: a round times one
block of each variant in a rotating order, every variant on its own copy of the model, the copies
rotating among the variants): prefill, 4 forwards of 4x256 tokens, hidden 512, 8 MoE layers, 16
experts top-2; decode, 4 x 16 one-token steps of a batch of 32 after a 16-token prompt, 16 MoE
layers. The replayed routing is a random one (distinct experts per token, another than the
model's own), shaped as each forward: (4, 256) tokens for prefill, (32, 1) for a decode step, so
the same routing serves every step. The figure is the median over rounds of the paired ratio
replay / plain, with its interquartile range; the goal is within 5%.

    python bench/replay.py                  # prefill
    python bench/replay.py --preset decode  # decode
    python bench/replay.py --rounds 7       # quicker
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

import moescope

_BENCH = os.path.dirname(os.path.abspath(__file__))
if _BENCH not in sys.path:  # run as a script or imported by a test: overhead.py sits beside this file
    sys.path.insert(0, _BENCH)
import overhead  # noqa: E402

REPLAY = "replay"
TARGETS = {"prefill": {REPLAY: 1.05}, "decode": {REPLAY: 1.05}}


def random_routing(args: argparse.Namespace, seed: int = 0) -> np.ndarray:
    """(batch, tokens, layers, top_k) distinct random experts per token and layer; tokens: one per
    decode step, else the prompt's."""
    tokens = 1 if args.decode_steps else args.seq
    rng = np.random.default_rng(seed)
    order = np.argsort(rng.random((args.batch, tokens, args.layers, args.experts)), axis=-1)
    return order[..., : args.top_k].astype(np.int16)  # as an engine's export holds them


class Replaying:
    """`moescope.replay` shaped as overhead.measure drives a session: installed when made, removed
    at `close`; it has no writer's thread to wait for."""

    def __init__(self, model: torch.nn.Module, routes: np.ndarray):
        self._replay = moescope.replay(model, routes)
        self._replay.__enter__()
        self.processor = self

    def wait_idle(self) -> None:
        pass

    def close(self) -> None:
        self._replay.__exit__(None, None, None)


def main(argv: list[str] | None = None) -> None:
    args = overhead.arguments(argv)
    routes = random_routing(args)
    variants: dict[str, dict] = {"bare": {}, REPLAY: dict(routes=routes)}
    work = (f"{args.decode_steps} one-token decode steps after a {args.seq}-token prompt" if args.decode_steps
            else f"a forward of {args.batch}x{args.seq} tokens")
    print(f"{args.preset}, Mixtral-shaped: hidden {args.hidden}, {args.layers} layers, {args.experts} experts "
          f"top-{args.top_k}, batch {args.batch}; a block per variant and round: {args.steps} x {work}; "
          f"{args.threads} threads")
    before = os.getloadavg()[0]
    times = overhead.measure(args, variants, attach=lambda model, store, routes: Replaying(model, routes))
    print()
    print(overhead.report(times, TARGETS[args.preset]))
    print(f"load average {before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
