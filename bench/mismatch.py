"""What `moescope mismatch` costs with log-probs, per 1 000 generated tokens, on the demo model
(issue 48, part 4, the mismatch half).

The rollout is the demo's (`moescope.demo.rollout`): a bfloat16 copy of the demo model samples
`--new-tokens` tokens for `--prompts` held-out prompts and returns vLLM responses with routed
experts and log-probs, imported once into a store. Then, side by side in one process, each
`--repeat` times (median; the process CPU time beside the wall time, since wall time on a shared
machine moves with its load):

- routing only: the same run with its `engine_logprobs` withheld (`logprobs={}`), the check as it
  was before log-probs (one reference forward per batch);
- with log-probs: the gap with the reference's own routing and with the engine's replayed (two
  more forwards per batch);
- with --per-layer: one more forward per MoE layer (the demo model has 4).

Nothing is written to the store (`write=False`): the rows are a few dozen and the cost is the
forwards. Printed: seconds per 1 000 generated tokens for each, and the ratios to routing only.

    python bench/mismatch.py                       # 6 prompts x 16 new tokens, 3 runs each
    python bench/mismatch.py --prompts 12 --new-tokens 32 --repeat 1
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


def _timed(run, repeat: int) -> tuple[float, float]:
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6, help="held-out prompts (default 6)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens sampled per prompt (default 16)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each variant (default 3)")
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
    measured = {name: _timed(run, args.repeat) for name, run in variants.items()}
    base_wall, base_cpu = measured["routing only"]
    print(f"demo model, {args.prompts} prompts x {args.new_tokens} generated tokens ({generated} generated, "
          f"{args.repeat} runs each, median; torch threads {args.threads}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    for name, (wall, cpu) in measured.items():
        print(f"  {name:<18} {1000 * wall / generated:8.2f} s wall per 1 000 generated tokens "
              f"({1000 * cpu / generated:8.2f} s CPU)   x{wall / base_wall:.2f} wall, x{cpu / base_cpu:.2f} CPU "
              "of routing only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
