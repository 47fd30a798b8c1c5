"""`moescope demo`: record a run end to end and print what moescope saw."""

from __future__ import annotations

import argparse
import os

import torch
from tqdm import tqdm

import probe
from moescope.summary import format_summary
from probe.zoo import tiny_model

DESCRIPTION = """\
Build a small Mixtral-shaped model, attach the probe, run tagged traffic through it with
a progress bar, and print a per-layer summary: load spread, router entropy, dropped
tokens, the measured active-parameter fraction, where the Parquet files are and a DuckDB
query to try.

example:
  moescope demo --store runs/demo
  moescope demo --quick            # a few seconds, for tests
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default="runs/demo", help="folder to write the store into (default: runs/demo)")
    parser.add_argument("--steps", type=int, default=300, help="forward passes to run (default: 300)")
    parser.add_argument("--quick", action="store_true", help="a short run (30 forwards) for tests")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    steps = 30 if args.quick else args.steps
    torch.manual_seed(args.seed)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    model = tiny_model("mixtral", seed=args.seed, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       vocab_size=512)
    domains = {"code": (0, 128), "prose": (128, 384), "math": (384, 512)}
    generator = torch.Generator().manual_seed(args.seed)
    with probe.attach(model, store=args.store, routes=True, router_inputs=32, tags={"source": "demo"}) as session:
        for step in tqdm(range(steps), desc="forwards", unit="fwd"):
            domain = list(domains)[step % len(domains)]
            low, high = domains[domain]
            batch = int(torch.randint(1, 5, (1,), generator=generator))
            ids = torch.randint(low, high, (batch, 32), generator=generator)
            with session.tag(domain=domain), torch.no_grad():
                model(ids)
    print()
    print(format_summary(args.store, session.run.run_id))
    return 0
