"""A PyTorch Lightning callback that watches the routing while a MoE model trains.

    trainer = lightning.pytorch.Trainer(..., callbacks=[MoescopeLightningCallback(store="runs/")])

Needs the optional extra: `pip install "moescope[lightning]"`. What it records is
`moescope.training`'s (one record per optimizer step, auxiliary losses, per-expert gradient
norms, dead experts, learning rates, optional routing cooldown). Lightning runs forward and
backward inside `optimizer.step(closure)`, so the gradients are measured at
`on_before_optimizer_step` (after backward and accumulation, before Lightning clips them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from torch import nn

from moescope.store.location import StoreLocation
from moescope.training.monitor import TrainingMonitor


def _watched_module(pl_module: pl.LightningModule) -> nn.Module:
    """The module whose forward the training step calls: the LightningModule when it defines
    `forward`, else its one child that holds MoE layers (`self.model(...)` in `training_step`)."""
    if type(pl_module).forward is not pl.LightningModule.forward:
        return pl_module
    from moescope.probe.adapters import NoMoELayersError, find_moe_layers

    holders = []
    for child in pl_module.children():
        try:
            find_moe_layers(child)
        except NoMoELayersError:
            continue
        holders.append(child)
    if len(holders) != 1:
        raise ValueError(f"{type(pl_module).__name__} defines no forward and has {len(holders)} children with MoE "
                         "layers: pass module= (the module your training_step calls, or a function of the "
                         "LightningModule returning it)")
    return holders[0]


class MoescopeLightningCallback(pl.Callback):
    """A Lightning callback that watches the routing while the Trainer fits.

    Attaches at `on_fit_start` to the LightningModule's MoE model, its first optimizer and LR
    scheduler, and closes at `on_fit_end` (or on an exception). Gradients are measured from
    `on_before_optimizer_step` (`measure_gradients="manual"`), as Lightning runs forward and backward
    inside `optimizer.step`. The monitor is at `callback.monitor` while fitting.

    Args:
        store: where the records go: a folder or a URL (`store="s3://bucket/prefix"`, with
            `storage_options=` among the options); None: no store.
        module: the module the training step calls (an attribute name, or a function of the
            LightningModule); None (default): the LightningModule if it defines `forward`, else its
            one child holding MoE layers.
        tensorboard: "auto" (default) logs the scalars through the Trainer's `TensorBoardLogger`
            where it has one; or what `TrainingMonitor` takes.
        wandb: "auto" (default) logs through the Trainer's `WandbLogger` where it has one; or what
            `TrainingMonitor` takes.
        **options: `moescope.training.TrainingMonitor`'s, `storage_options=` among them.
    """

    def __init__(self, store: str | os.PathLike | StoreLocation | None = None, *,
                 module: str | Callable | None = None,
                 tensorboard: Any = "auto", wandb: Any = "auto", **options: Any):
        self.store = store
        self.module = module
        self.tensorboard = tensorboard
        self.wandb = wandb
        self.options = options
        self.monitor: TrainingMonitor | None = None

    def _loggers(self, trainer: pl.Trainer) -> tuple[Any, Any]:
        tensorboard, wandb = self.tensorboard, self.wandb
        found_tb = found_wandb = None
        for logger in trainer.loggers:
            name = type(logger).__name__
            # matched by class name, so any TensorBoardLogger or WandbLogger counts: each has .experiment
            logger_any: Any = logger
            if name == "TensorBoardLogger":
                found_tb = logger_any.experiment
            elif name == "WandbLogger":
                found_wandb = logger_any.experiment
        return (found_tb if tensorboard == "auto" else tensorboard), (found_wandb if wandb == "auto" else wandb)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the `TrainingMonitor` on the watched module and the Trainer's first optimizer (once).

        Args:
            trainer: the Lightning Trainer.
            pl_module: the LightningModule.

        Raises:
            ValueError: when the Trainer has no optimizer, or no module can be chosen (no `forward` and
                not exactly one child with MoE layers: pass `module=`).
        """
        if self.monitor is not None:
            return
        if self.module is None:
            model = _watched_module(pl_module)
        elif isinstance(self.module, str):
            model = getattr(pl_module, self.module)
        else:
            model = self.module(pl_module)
        if not trainer.optimizers:
            raise ValueError("the Trainer has no optimizer: moescope's training callback needs configure_optimizers")
        configs = getattr(trainer, "lr_scheduler_configs", None) or []
        scheduler = configs[0].scheduler if configs else None
        tensorboard, wandb = self._loggers(trainer)
        self.monitor = TrainingMonitor(model, trainer.optimizers[0], store=self.store, scheduler=scheduler,
                                       tensorboard=tensorboard, wandb=wandb, measure_gradients="manual",
                                       **self.options)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """Take the step's per-expert gradient norms and learning rates (`TrainingMonitor.measure_gradients`).

        Args:
            trainer: the Lightning Trainer.
            pl_module: the LightningModule.
            optimizer: the optimizer about to step.
        """
        if self.monitor is not None:
            self.monitor.measure_gradients()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Close the monitor: remove its hooks and write everything.

        Args:
            trainer: the Lightning Trainer.
            pl_module: the LightningModule.
        """
        if self.monitor is not None:
            self.monitor.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Close the monitor as `on_fit_end` does, so what was recorded before the exception is written.

        Args:
            trainer: the Lightning Trainer.
            pl_module: the LightningModule.
            exception: what ended the fit.
        """
        self.on_fit_end(trainer, pl_module)
