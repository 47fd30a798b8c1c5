"""What `moescope mismatch` costs with log-probs, per 1 000 generated tokens, on the demo model
(issue 48, part 4, the mismatch half).

The rollout is the demo's (`moescope.demo.rollout`): a bfloat16 copy of the demo model samples
`--new-tokens` tokens for `--prompts` held-out prompts and returns vLLM responses with routed
experts and log-probs, imported once into a store. Then, side by side in one process, after one
untimed call of each, `--repeat` rounds that run every variant once in a rotating order (median; the
process CPU time beside the wall time, since wall time on a shared machine moves with its load):

- routing only: the same run with its `engine_logprobs` withheld (`logprobs={}`), the check as it
  was before log-probs (one reference forward per batch);
- with log-probs: the gap with the reference's own routing and with the engine's replayed (two
  more forwards per batch);
- with --per-layer: one more forward per MoE layer (the demo model has 4).

Nothing is written to the store (`write=False`): the rows are a few dozen and the cost is the
forwards. Printed: seconds per 1 000 generated tokens for each, and the ratios to routing only.

    python bench/mismatch.py                       # 12 prompts x 32 new tokens, 6 rounds
    python bench/mismatch.py --prompts 6 --new-tokens 16 --repeat 2   # quicker
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from moescope.analyses.mismatch import mismatch
from moescope.demo import rollout
from moescope.demo.data import DOMAINS, domain_windows, load_demo_model
from moescope.ingest.importers import import_files


def _timed(variants: dict, repeat: int) -> dict[str, tuple[float, float]]:
    """Median wall and CPU seconds of each variant: one untimed call of each first (imports, the
    allocator's first pages), then `repeat` rounds, each running every variant once in a rotating
    order, so that a slow minute of a shared machine falls on all of them alike."""
    for run in variants.values():
        run()
    names = list(variants)
    walls: dict[str, list[float]] = {name: [] for name in names}
    cpus: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeat):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            wall, cpu = time.perf_counter(), time.process_time()
            variants[name]()
            walls[name].append(time.perf_counter() - wall)
            cpus[name].append(time.process_time() - cpu)
    return {name: (statistics.median(walls[name]), statistics.median(cpus[name])) for name in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=12, help="held-out prompts (default 12)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens sampled per prompt (default 32)")
    parser.add_argument("--repeat", type=int, default=6, help="rounds; each runs every variant once (default 6)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2, as the demo)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rollout.NEW_TOKENS = args.new_tokens
    model, tokenizer = load_demo_model()
    per_domain = -(-args.prompts // len(DOMAINS))
    windows = {d: domain_windows(tokenizer, d, 64, 128, seed=0) for d in DOMAINS}
    prompts = [list(windows[d][-1 - i][:rollout.PROMPT_TOKENS]) for i in range(per_domain) for d in DOMAINS]
    prompts = prompts[:args.prompts]
    folder = tempfile.mkdtemp(prefix="bench-mismatch-")
    path = os.path.join(folder, "rollout.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write(rollout.engine_responses(model, prompts, 0, int(tokenizer.pad_token_id or 0)))
    root = os.path.join(folder, "store")
    import_files("vllm", [path], root, run_id="engine")
    generated = args.prompts * args.new_tokens

    variants = {
        "routing only": lambda: mismatch(model, store=root, run="engine", write=False, logprobs={}),
        "with log-probs": lambda: mismatch(model, store=root, run="engine", write=False),
        "with --per-layer": lambda: mismatch(model, store=root, run="engine", write=False, per_layer=True),
    }
    measured = _timed(variants, args.repeat)
    base_wall, base_cpu = measured["routing only"]
    print(f"demo model, {args.prompts} prompts x {args.new_tokens} generated tokens ({generated} generated, "
          f"{args.repeat} rounds, median; torch threads {args.threads}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    for name, (wall, cpu) in measured.items():
        print(f"  {name:<18} {1000 * wall / generated:8.2f} s wall per 1 000 generated tokens "
              f"({1000 * cpu / generated:8.2f} s CPU)   x{wall / base_wall:.2f} wall, x{cpu / base_cpu:.2f} CPU "
              "of routing only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
