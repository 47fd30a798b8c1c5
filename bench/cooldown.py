"""Proof on a real run: does the routing cooldown keep a collapsing router healthier?

Trains the demo model (moescope/demo/train.py: its shape, corpus, tokenizer, batches and expert
capacity) twice from the same seed, with a router learning rate high enough to collapse the
routing, once watched by `moescope.training` without the cooldown and once with
`cooldown="auto"`. Both runs see the same batches in the same order. At the end, the routing of
each is measured on the same held-out batches from the model's own router logits (not from the
probe): router entropy (normalised), dead experts, max/mean load and dropped tokens per layer, and
the held-out loss. It also checks, step by step, that the aux loss the monitor recorded equals
the model's own `aux_loss`.

    python bench/cooldown.py                       # 300 steps, router lr 20x, about 3 CPU-minutes
    python bench/cooldown.py --steps 100 --json out.json

Prints a table; `--json` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace

import numpy as np
import torch
from tqdm import tqdm

import moescope.training as training
from moescope.alerts.cooldown_policy import CooldownConfig
from moescope.demo.data import DOMAINS
from moescope.demo.train import (
    FULL_RECIPE,
    QUICK_RECIPE,
    build_model,
    build_optimizer,
    learning_rate_at,
    sample_batch,
    token_losses,
    token_streams,
    train_tokenizer,
    training_documents,
)


def run_variant(name: str, recipe, tokenizer, streams, seed: int, steps: int, cooldown: CooldownConfig | None,
                store: str, eval_batches: list[torch.Tensor]) -> dict:
    model = build_model(recipe, tokenizer, seed)
    model.train()
    optimizer = build_optimizer(model, recipe)
    generator = torch.Generator().manual_seed(seed)
    options = dict(cooldown="auto", cooldown_config=cooldown) if cooldown is not None else {}
    monitor = training.watch(model, optimizer, store=store, tags={"variant": name}, **options)
    own_aux, started, cpu = [], time.perf_counter(), time.process_time()
    try:
        for step in tqdm(range(steps), desc=name, unit="step"):
            input_ids, _ = sample_batch(streams, step, recipe.batch_size, recipe.sequence_length, generator,
                                        recipe.rows_per_domain)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate_at(step, recipe) * group["lr_scale"]
            out = model(input_ids=input_ids, output_router_logits=True)
            loss = token_losses(out.logits, input_ids).mean() + model.router_aux_loss_coef * out.aux_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            own_aux.append(float(out.aux_loss.detach()))
        monitor.flush()
        steps_seen = monitor.steps
        events = []
        if monitor.cooldown is not None:
            events = [(e.get("action"), e.get("layer"), e.get("step")) for e in _event_rows(store)]
    finally:
        monitor.close()
    recorded = [s.aux_loss for s in steps_seen]
    aux_error = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(recorded, own_aux))
    tail = steps_seen[-50:]
    return dict(
        name=name, seconds=round(time.perf_counter() - started, 1), cpu_seconds=round(time.process_time() - cpu, 1),
        aux_loss_max_relative_error=aux_error, steps_recorded=len(steps_seen),
        cooldown_events=events,
        last50_router_entropy=float(np.mean([[layer.router_entropy for layer in s.layers] for s in tail])),
        last50_dead_expert_fraction=float(np.mean([[layer.dead_expert_fraction for layer in s.layers] for s in tail])),
        held_out=held_out_routing(model, eval_batches))


def _event_rows(store: str) -> list[dict]:
    import glob

    import pyarrow.parquet as pq

    rows = [r for f in sorted(glob.glob(os.path.join(store, "routing_cooldown_events", "*", "*.parquet")))
            for r in pq.ParquetFile(f).read().to_pylist()]
    return sorted(rows, key=lambda r: (r["step"], r["layer"]))


@torch.no_grad()
def held_out_routing(model, batches: list[torch.Tensor]) -> dict:
    """Routing figures from the model's own router logits and its capacity blocks' kept slots."""
    model.eval()
    experts, k = model.config.num_local_experts, model.config.num_experts_per_tok
    layers = model.config.num_hidden_layers
    load = np.zeros((layers, experts))
    entropy_sum, tokens, loss_sum, loss_count = np.zeros(layers), 0, 0.0, 0
    dropped, slots = np.zeros(layers), np.zeros(layers)
    for ids in batches:
        out = model(input_ids=ids, output_router_logits=True)
        losses = token_losses(out.logits, ids)
        loss_sum += float(losses.sum())
        loss_count += losses.numel()
        tokens += ids.numel()
        for layer, decoder in enumerate(model.model.layers):  # the capacity blocks' own decisions
            kept = decoder.mlp.dispatch.kept
            dropped[layer] += float((~kept).sum())
            slots[layer] += kept.numel()
        for layer, logits in enumerate(out.router_logits):
            probs = torch.softmax(logits.double(), dim=-1)
            entropy_sum[layer] += float(-(probs * torch.log(probs.clamp_min(1e-300))).sum())
            top = probs.topk(k, dim=-1).indices
            load[layer] += np.bincount(top.reshape(-1).numpy(), minlength=experts)
    model.train()
    entropy = entropy_sum / tokens / math.log(experts)
    max_mean = load.max(axis=1) / load.mean(axis=1)
    dead = (load == 0).mean(axis=1)
    return dict(router_entropy=entropy.round(4).tolist(), max_mean_load=max_mean.round(3).tolist(),
                dead_expert_fraction=dead.round(4).tolist(), held_out_loss=round(loss_sum / loss_count, 4),
                mean_router_entropy=round(float(entropy.mean()), 4),
                mean_max_mean_load=round(float(max_mean.mean()), 3),
                mean_dead_expert_fraction=round(float(dead.mean()), 4),
                dropped_slot_share=(dropped / slots).round(4).tolist(),
                mean_dropped_slot_share=round(float((dropped / slots).mean()), 4))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    parser.add_argument("--router-lr-scale", type=float, default=20.0,
                        help="router lr / base lr (default 20; the demo model trains with 10)")
    parser.add_argument("--aux-coef", type=float, default=None,
                        help="router_aux_loss_coef (default: the demo recipe's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--period", type=int, default=150, help="cooldown period in optimizer steps (default 150)")
    parser.add_argument("--gap", type=int, default=0, help="minimum gap between a layer's cooldowns (default 0)")
    parser.add_argument("--max-share", type=float, default=0.5, help="most layers cooling at once (default 0.5)")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--quick", action="store_true",
                        help="train_demo's tiny recipe (a smoke test of this script, not a proof)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = QUICK_RECIPE if args.quick else FULL_RECIPE
    aux = base.router_aux_loss_coef if args.aux_coef is None else args.aux_coef
    recipe = replace(base, steps=args.steps, router_lr_scale=args.router_lr_scale, router_aux_loss_coef=aux,
                     warmup_steps=min(base.warmup_steps, args.steps // 5))
    documents = training_documents(recipe, args.seed)
    tokenizer = train_tokenizer(documents, recipe.vocab_size, recipe.tokenizer_chars_per_domain, recipe.split_digits)
    streams = token_streams(tokenizer, documents)
    held_out = torch.Generator().manual_seed(10_000 + args.seed)
    eval_batches = [sample_batch(streams, 10_000 + i, recipe.batch_size, recipe.sequence_length, held_out,
                                 recipe.rows_per_domain)[0] for i in range(4)]
    cooldown = CooldownConfig(for_duration="0s", window=8, period_steps=args.period, min_gap_steps=args.gap,
                              max_share=args.max_share)
    results = {}
    with tempfile.TemporaryDirectory(prefix="moescope-cooldown-") as root:
        for name, config in (("without cooldown", None), ("with cooldown", cooldown)):
            results[name] = run_variant(name, recipe, tokenizer, streams, args.seed, args.steps, config,
                                        os.path.join(root, name.replace(" ", "_")), eval_batches)
    print(f"\ndemo model, {args.steps} steps, router lr {args.router_lr_scale}x, "
          f"aux coef {recipe.router_aux_loss_coef}, seed {args.seed}; held-out routing from the model's own "
          f"router logits ({len(eval_batches)} batches)")
    print(f"{'figure':<42} {'without':>12} {'with':>12}")
    a, b = results["without cooldown"], results["with cooldown"]
    for label, key in (("router entropy (normalised, mean of layers)", "mean_router_entropy"),
                       ("max/mean load (mean of layers)", "mean_max_mean_load"),
                       ("dead experts (share, mean of layers)", "mean_dead_expert_fraction"),
                       ("slots dropped at capacity (share)", "mean_dropped_slot_share"),
                       ("held-out loss (nats)", "held_out_loss")):
        print(f"{label:<42} {a['held_out'][key]:>12} {b['held_out'][key]:>12}")
    print(f"{'cooldown starts':<42} {0:>12} {sum(1 for e in b['cooldown_events'] if e[0] == 'start'):>12}")
    for r in (a, b):
        print(f"{r['name']}: aux loss recorded vs model's own, max relative error "
              f"{r['aux_loss_max_relative_error']:.1e} over {r['steps_recorded']} steps; {r['cpu_seconds']} CPU-s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), recipe=asdict(recipe), domains=list(DOMAINS), results=results), f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
