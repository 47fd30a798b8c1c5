"""What watching the routing costs a training step, on the demo model's shape, on a CPU.

Variants, each on its own copy of the same random-initialised demo-shaped model with its own
AdamW optimizer, side by side in one run:

- bare: forward (with the model's own aux loss), backward, optimizer step;
- monitor: the same under `moescope.training.watch` (a record per optimizer step to a Parquet
  store, aux/z-loss, per-expert gradient norms, learning rates);
- monitor + cooldown: the same with `cooldown="auto"` (routers in their own parameter groups,
  the optimizer step hooks and the router jitter hooks installed; nothing fires in a healthy run,
  so this is the cost of being ready).

A round times one training step of every variant, in an order that rotates each round; the
figure is the median over rounds of the paired ratio variant / bare, with its interquartile range.

    python bench/training.py               # demo shape: batch 16 x 128 tokens, 30 rounds
    python bench/training.py --rounds 10   # quicker
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from tqdm import tqdm
from transformers import MixtralConfig, MixtralForCausalLM

import moescope.training as training

DEMO_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "moescope", "demo", "model",
                           "config.json")
VARIANTS = {"bare": None, "monitor": {}, "monitor + cooldown": {"cooldown": "auto"}}
# issue 26: the monitor costs at most 2% of a training step, 3% with the cooldown ready
TARGETS = {"monitor": 1.02, "monitor + cooldown": 1.03}


def demo_shaped_model() -> torch.nn.Module:
    """A random-initialised model of the committed demo model's config (its expert capacity included)."""
    with open(DEMO_CONFIG) as f:
        fields = json.load(f)
    config = MixtralConfig(**{k: v for k, v in fields.items() if k not in ("architectures", "transformers_version")})
    config.output_router_logits = True  # training adds the model's own aux loss
    model = MixtralForCausalLM(config)
    if getattr(config, "capacity_factor", None):
        from moescope.demo.capacity import install_capacity

        install_capacity(model, config.capacity_factor)
    return model


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    base = demo_shaped_model()
    names = list(VARIANTS)
    models = {name: copy.deepcopy(base) for name in names}
    del base
    optimizers = {name: torch.optim.AdamW(models[name].parameters(), lr=1e-4) for name in names}
    store = tempfile.mkdtemp(prefix="moescope-bench-training-")
    monitors = []
    g = torch.Generator().manual_seed(0)
    vocab = models["bare"].config.vocab_size
    batch = torch.randint(0, vocab, (args.batch, args.seq), generator=g)

    def step(name: str) -> None:
        out = models[name](input_ids=batch, labels=batch)
        out.loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {name: [] for name in names}
    try:
        for name in names:
            if VARIANTS[name] is not None:
                monitors.append(training.watch(models[name], optimizers[name], store=os.path.join(store, name),
                                               **VARIANTS[name]))
        for _ in range(args.warmup):
            for name in names:
                step(name)
        for round_ in tqdm(range(args.rounds), desc="rounds", unit="round"):
            order = names[round_ % len(names):] + names[: round_ % len(names)]
            for name in order:
                start = time.perf_counter()
                step(name)
                times[name].append(time.perf_counter() - start)
    finally:
        for monitor in monitors:
            monitor.close()
        shutil.rmtree(store, ignore_errors=True)
    return times


def report(times: dict[str, list[float]]) -> str:
    bare = times["bare"]
    lines = [f"{'variant':<22} {'median step':>12} {'ratio':>7} {'IQR':>15} {'target':>7}"]
    for name, samples in times.items():
        ratios = [t / b for t, b in zip(samples, bare)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 4 else [float("nan")] * 3
        target = f"{TARGETS[name]:.2f}" if name in TARGETS else ""
        lines.append(f"{name:<22} {statistics.median(samples) * 1e3:>10.1f}ms {statistics.median(ratios):>7.3f} "
                     f"{q[0]:>7.3f}-{q[2]:<7.3f} {target:>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16, the demo recipe's)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128, the demo recipe's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    print(f"training step, demo model shape ({DEMO_CONFIG}), batch {args.batch} x {args.seq}, "
          f"{args.threads} thread(s), {args.rounds} rounds")
    before = os.getloadavg()[0]
    print(report(measure(args)))
    print(f"load average {before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
