"""One rank of a real gloo process group: a probed tiny model writing the shared run."""

from __future__ import annotations

import torch
import torch.distributed as dist

import moescope
from tests.support.zoo import tiny_model

STEPS, BATCH, SEQ = 4, 2, 8


def inputs(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 * rank + step))


def run(rank: int, world_size: int, port: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = tiny_model("mixtral")
        # No run_id given: attach takes rank 0's, so every rank writes the same run.
        with moescope.attach(model, store=store, routes=True, flush_interval_s=0.2, window=1) as session:
            for step in range(STEPS):
                with torch.no_grad():
                    model(inputs(rank, step))
                if step == 1:
                    session.flush()
                dist.barrier()
    finally:
        dist.destroy_process_group()
