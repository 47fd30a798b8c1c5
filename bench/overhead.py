"""What the probe costs the model: bare forward vs probe variants, side by side in one run.

Variants run in blocks that rotate order every round, so drift in the machine's speed (other
processes, thermal) spreads over all of them; each forward is timed on its own and the figure is
the median, reported as a ratio to the bare forward's median.

    python bench/overhead.py                # the issue's shape: hidden 512, 8 layers, 16 experts top-2, 4x256
    python bench/overhead.py --rounds 3     # quicker
"""

from __future__ import annotations

import argparse
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
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = build_model(args)
    batch = torch.randint(0, 1024, (args.batch, args.seq))
    times: dict[str, list[float]] = {name: [] for name in variants}
    store = tempfile.mkdtemp(prefix="moescope-bench-")
    names = list(variants)
    try:
        with torch.no_grad():
            for _ in range(args.warmup):
                model(batch)
            for round_ in range(args.rounds):
                order = names[round_ % len(names):] + names[: round_ % len(names)]
                for name in order:
                    options = variants[name]
                    session = attach(model, store=store, **options) if options else None
                    for _ in range(args.repeat):
                        start = time.perf_counter()
                        model(batch)
                        times[name].append(time.perf_counter() - start)
                    if session is not None:
                        session.close()
                print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(
                    f"{n} {statistics.median(t) * 1e3:.0f} ms" for n, t in times.items()), flush=True)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return times


def report(times: dict[str, list[float]], targets: dict[str, float]) -> str:
    bare = statistics.median(times["bare"])
    lines = [f"{'variant':<22} {'median ms':>10} {'ratio':>7} {'target':>7}  n"]
    for name, values in times.items():
        median = statistics.median(values)
        target = targets.get(name)
        verdict = "" if target is None else ("ok" if median / bare <= target else "MISS")
        lines.append(f"{name:<22} {median * 1e3:>10.1f} {median / bare:>7.3f} "
                     f"{'' if target is None else f'{target:.2f}':>7}  {len(values)} {verdict}")
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
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeat", type=int, default=3, help="timed forwards per variant per round")
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
