"""A plain training loop on a tiny Mixtral, watched by the training monitor, until a SIGTERM.

    python -m tests.support.children.sigterm_training_child STORE MODE [GRACE_S]

Prints `step N` after each optimizer step. MODE:
- plain: the job has no SIGTERM handler of its own (the monitor drains, then exits 0);
- own-handler: the job installs its own SIGTERM handler before the monitor; the handler prints
  how many train_steps and probe_stats rows it finds in the store (raw Parquet) and asks the loop
  to stop, and the job then exits 75, its own way of saying "preempted";
- slow-drain: one more exporter takes 120 s to shut down, so the drain outlasts any grace period;
- slow-step: a pre-hook of the job's on the optimizer prints `in step N` and takes 0.5 s, so a
  signal sent then arrives while the optimizer step is under way.
The store flushes every 60 s only, so what is in it at exit was written by the drain.
"""

from __future__ import annotations

import signal
import sys
import time

import pyarrow.parquet as pq
import torch
from transformers import MixtralConfig, MixtralForCausalLM

import moescope.training
from tests.support.sigterm import parquet_files

store, mode = sys.argv[1], sys.argv[2]
grace_s = float(sys.argv[3]) if len(sys.argv) > 3 else None
VOCAB = 64


class SlowExporter:
    def export(self, records) -> bool:
        return True

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self) -> None:
        time.sleep(120)


stopping = False


def job_handler(signum, frame) -> None:
    global stopping
    stopping = True
    counts = {table: sum(pq.read_metadata(path).num_rows for path in parquet_files(store, table))
              for table in ("train_steps", "probe_stats")}
    print(f"job handler: {counts['train_steps']} train_steps rows, {counts['probe_stats']} probe_stats rows",
          flush=True)


if mode == "own-handler":
    signal.signal(signal.SIGTERM, job_handler)

torch.manual_seed(0)
config = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
                       output_router_logits=True, router_aux_loss_coef=0.02)
model = MixtralForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
extra = {"exporters": [SlowExporter()]} if mode == "slow-drain" else {}
monitor = moescope.training.watch(model, optimizer, store=store, run_id="sigterm", flush_interval_s=60.0,
                                  grace_period_s=grace_s, **extra)
if mode == "slow-step":
    def slow_update(optimizer, args, kwargs) -> None:
        print(f"in step {monitor.optimizer_step + 1}", flush=True)
        time.sleep(0.5)

    optimizer.register_step_pre_hook(slow_update)
generator = torch.Generator().manual_seed(1)
for _ in range(100_000):
    if stopping:
        break
    ids = torch.randint(0, VOCAB, (2, 12), generator=generator)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {monitor.optimizer_step}", flush=True)
monitor.close()
print("job: checkpoint saved, exiting 75", flush=True)
sys.exit(75)
