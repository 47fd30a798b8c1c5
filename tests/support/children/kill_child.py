"""A real probed model writing a store until it is killed: prints each step after its forward."""

from __future__ import annotations

import sys
import time

import torch

import moescope
from tests.support.zoo import tiny_model

store, run_id, flush = sys.argv[1], sys.argv[2], float(sys.argv[3])
torch.manual_seed(0)
model = tiny_model("mixtral")
session = moescope.attach(model, store=store, routes=True, run_id=run_id, flush_interval_s=flush, window=1)
generator = torch.Generator().manual_seed(1)
step = 0
with torch.no_grad():
    while True:
        model(torch.randint(0, 128, (2, 8), generator=generator))
        print(f"emitted {step} {time.monotonic():.6f}", flush=True)
        step += 1
        time.sleep(0.01)
