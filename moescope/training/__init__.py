"""Watching routing while a MoE model trains: a record per optimizer step, what training adds to
it (auxiliary losses, per-expert gradient norms, dead experts, the learning rate in force), the
same scalars in TensorBoard and W&B, and the routing cooldown.

A plain loop needs two lines:

    monitor = moescope.training.watch(model, optimizer, store="runs/")
    ...                                  # the training loop, unchanged
    monitor.close()

Hugging Face `Trainer`: `Trainer(..., callbacks=[moescope.training.MoescopeCallback(store="runs/")])`.
PyTorch Lightning: `moescope.training.lightning.MoescopeLightningCallback(store="runs/")`.

How a step is recorded. The monitor hooks the optimizer (`register_step_pre_hook` /
`register_step_post_hook` on the torch optimizer under any wrapper): just before each update it
takes the per-expert gradient norms (after accumulation and, in `Trainer`, after clipping), just
after it closes the probe's window. So a record covers exactly the forwards of one optimizer step:
with gradient accumulation every micro-batch's tokens once; gradient checkpointing's recomputed
forwards run inside the layers, not through the model, so the probe never sees them (it records
forwards of the model it is attached to). Forwards in eval mode (`model.training` False, e.g. an
evaluation between steps) are tagged `phase=eval` and kept out of the training figures.

Per optimizer step and MoE layer (`TrainingStep`, the `train_steps` table, the scalars):
- `aux_loss`: the load-balancing loss recomputed from the recorded router statistics with
  transformers' own formula (`moescope.metrics.signals.load_balancing_loss`; the model-level value pools all
  layers' tokens as `load_balancing_loss_func` does, and equals the model's `aux_loss`);
- `z_loss`: the router z-loss (`moescope.metrics.signals.router_z_loss`);
- `expert_grad_norm`: L2 norm of each expert's weight gradients (`moescope.probe.health_sampling.expert_grad_norms`,
  the health score's gradient component); NaN where the gradients held a NaN, None where the
  experts had no gradient (frozen);
- `dead_expert_fraction`: experts with no token over the last `dead_window` optimizer steps;
- `router_lr`: the learning rate the router's parameters were updated with (a cooldown's factor
  included), and `lr`, the first parameter group's.
A run resumed from a checkpoint under its run id goes on counting optimizer steps and forwards
from the checkpoint's (`TrainingMonitor`, "Resuming").
The store keeps what cannot be recomputed (`train_steps`: learning rates and gradient norms per
step and layer); losses and dead experts derive from `layer_steps`, which carries their inputs.
"""

from __future__ import annotations

from moescope.training.monitor import TrainingMonitor, watch
from moescope.training.records import TrainingExporter, TrainingLayer, TrainingStep
from moescope.training.sinks import TensorBoardSink, WandbSink
from moescope.training.trainer import MoescopeCallback

__all__ = ["MoescopeCallback", "TensorBoardSink", "TrainingExporter", "TrainingLayer", "TrainingMonitor",
           "TrainingStep", "WandbSink", "watch"]
