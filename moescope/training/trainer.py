"""The Hugging Face `Trainer` callback: a `TrainingMonitor` for the Trainer's model, optimizer and scheduler."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from moescope.store.location import StoreLocation
from moescope.training.monitor import TrainingMonitor

if TYPE_CHECKING:
    from transformers import TrainingArguments

try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - transformers is a dependency
    TrainerCallback = object  # type: ignore[assignment,misc]


class MoescopeCallback(TrainerCallback):
    """A `transformers.TrainerCallback` that watches the routing for the training run.

    Attaches at `on_train_begin` (to the Trainer's model, optimizer and scheduler) and closes at
    `on_train_end`. The monitor is at `callback.monitor` while training runs.

    Args:
        store: where the records go: a folder or a URL (`store="s3://bucket/prefix"`, with
            `storage_options=` among the options); None: no store.
        tensorboard: "auto" (default) logs the scalars where the Trainer's `report_to` does:
            TensorBoard into `$TENSORBOARD_LOGGING_DIR` or `<output_dir>/runs/moescope`; or what
            `TrainingMonitor` takes (a `SummaryWriter`, a folder, None).
        wandb: "auto" (default) logs into the run the Trainer's W&B callback opened, where
            `report_to` has W&B; or what `TrainingMonitor` takes.
        **options: `TrainingMonitor`'s, `storage_options=` among them.
    """

    def __init__(self, store: str | os.PathLike | StoreLocation | None = None, *, tensorboard: Any = "auto",
                 wandb: Any = "auto", **options: Any):
        self.store = store
        self.tensorboard = tensorboard
        self.wandb = wandb
        self.options = options
        self.monitor: TrainingMonitor | None = None

    def _loggers(self, args: TrainingArguments) -> tuple[Any, Any]:
        report_to = getattr(args, "report_to", None) or []
        report_to = [report_to] if isinstance(report_to, str) else list(report_to)
        tensorboard, wandb = self.tensorboard, self.wandb
        if tensorboard == "auto":
            tensorboard = None
            if "tensorboard" in report_to or "all" in report_to:
                assert args.output_dir is not None  # TrainingArguments gives it a default
                tensorboard = os.getenv("TENSORBOARD_LOGGING_DIR") or os.path.join(args.output_dir, "runs", "moescope")
        if wandb == "auto":
            wandb = None
            if "wandb" in report_to or "all" in report_to:
                import wandb as wandb_module

                wandb = wandb_module.run
        return tensorboard, wandb

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        """Start the `TrainingMonitor` on the Trainer's model, optimizer and scheduler (once).

        Args:
            args (TrainingArguments): the Trainer's arguments (`report_to`, `output_dir`).
            state (TrainerState): the Trainer's state.
            control (TrainerControl): the Trainer's control flags.
            model (torch.nn.Module): the model that trains.
            optimizer (torch.optim.Optimizer): its optimizer.
            lr_scheduler (Any): its LR scheduler.
            **kwargs (Any): the rest of what the Trainer passes.

        Raises:
            ValueError: for options the monitor refuses.
        """
        if self.monitor is not None:
            return
        tensorboard, wandb = self._loggers(args)
        self.monitor = TrainingMonitor(model, optimizer, store=self.store, scheduler=lr_scheduler,
                                       tensorboard=tensorboard, wandb=wandb, **self.options)

    def on_train_end(self, args, state, control, **kwargs):
        """Close the monitor: remove its hooks and write everything.

        Args:
            args (TrainingArguments): the Trainer's arguments.
            state (TrainerState): the Trainer's state.
            control (TrainerControl): the Trainer's control flags.
            **kwargs (Any): the rest of what the Trainer passes.
        """
        if self.monitor is not None:
            self.monitor.close()

