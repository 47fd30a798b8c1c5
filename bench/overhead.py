"""What the probe costs the model: bare forward vs probe variants, side by side in one run.

Each variant runs on its own copy of the same model, attached once. A round times one forward
of every variant, in an order that rotates each round, so drift in the machine's speed (other
processes, thermal) hits all of them alike. The figure is the median over rounds of the paired
ratio variant / bare, with its interquartile range.

    python bench/overhead.py                # the issue's shape: hidden 512, 8 layers, 16 experts top-2, 4x256
    python bench/overhead.py --health       # also health sampling and the trust gate
    python bench/overhead.py --rounds 10    # quicker
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

# Run as a file, bench/ would come first on sys.path and bench/store.py would shadow the store package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import probe  # noqa: E402
from probe.zoo import tiny_model  # noqa: E402

VARIANTS: dict[str, dict] = {
    "bare": {},
    "aggregates": dict(routes=False),
    "routes to Parquet": dict(routes=True),
}
# --health: expert-health sampling (docs/health.md), and the same with the trust gate installed
# (auto policy; no expert is gated in a healthy run, so this is the cost of watching).
HEALTH_VARIANTS: dict[str, dict] = {
    "health": dict(health=True),
    "health + trust gate": dict(trust_gate="auto"),
}


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    return tiny_model("mixtral", hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_local_experts=args.experts, num_experts_per_tok=args.top_k,
                      num_attention_heads=8, num_key_value_heads=8, vocab_size=1024, max_position_embeddings=512)


def measure(args: argparse.Namespace, variants: dict[str, dict],
            attach: Callable[..., probe.ProbeSession] = probe.attach) -> dict[str, list[float]]:
    """Seconds per forward of each variant. Every variant has its own copy of the same model,
    attached once; a round runs one forward of each, in an order that rotates every round, so
    the machine's drift hits all variants alike and each round gives a paired sample."""
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = build_model(args)
    batch = torch.randint(0, 1024, (args.batch, args.seq))
    names = list(variants)
    models = {name: model if i == 0 else copy.deepcopy(model) for i, name in enumerate(names)}
    times: dict[str, list[float]] = {name: [] for name in names}
    store = tempfile.mkdtemp(prefix="moescope-bench-")
    sessions = []
    try:
        for name in names:
            if variants[name]:
                sessions.append(attach(models[name], store=store, **variants[name]))
        with torch.no_grad():
            for _ in range(args.warmup):
                for name in names:
                    models[name](batch)
            for round_ in tqdm(range(args.rounds), desc="rounds", unit="round"):
                order = names[round_ % len(names):] + names[: round_ % len(names)]
                for name in order:
                    start = time.perf_counter()
                    models[name](batch)
                    times[name].append(time.perf_counter() - start)
    finally:
        for session in sessions:
            session.close()
        shutil.rmtree(store, ignore_errors=True)
    return times


def report(times: dict[str, list[float]], targets: dict[str, float]) -> str:
    """Median time per variant, and the median over rounds of the paired ratio to bare."""
    bare = times["bare"]
    lines = [f"{'variant':<22} {'median ms':>10} {'ratio':>7} {'IQR':>13} {'target':>7}  n"]
    for name, values in times.items():
        ratios = sorted(v / b for v, b in zip(values, bare))
        ratio = statistics.median(ratios)
        q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        target = targets.get(name)
        verdict = "" if target is None else ("ok" if ratio <= target else "MISS")
        lines.append(f"{name:<22} {statistics.median(values) * 1e3:>10.1f} {ratio:>7.3f} "
                     f"{f'{q1:.3f}-{q3:.3f}':>13} {'' if target is None else f'{target:.2f}':>7}  "
                     f"{len(values)} {verdict}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1792)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int, default=30, help="forwards per variant (one per round)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--health", action="store_true", help="also time health sampling and the trust gate (target 1.03)")
    return p


def main() -> None:
    args = parser().parse_args()
    print(f"Mixtral-shaped: hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.top_k}, "
          f"{args.batch}x{args.seq} tokens, {args.threads} threads")
    times = measure(args, {**VARIANTS, **(HEALTH_VARIANTS if args.health else {})})
    print()
    print(report(times, {"aggregates": 1.01, "routes to Parquet": 1.05, "health": 1.03, "health + trust gate": 1.03}))


if __name__ == "__main__":
    main()
