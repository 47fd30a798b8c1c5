"""Where the training scalars go besides the store: TensorBoard and W&B."""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

log = logging.getLogger(__name__)


class ScalarSink(Protocol):
    """Where the training monitor's exporter sends each optimizer step's scalars (writer thread)."""

    def log(self, scalars: dict[str, float], step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class TensorBoardSink(ScalarSink):
    """Scalars into a `torch.utils.tensorboard.SummaryWriter` (given, or opened on a folder).

    Args:
        writer: a `SummaryWriter`, or a folder to open one on (closed with the sink; a given writer
            is only flushed).
    """

    def __init__(self, writer: Any):
        if isinstance(writer, (str, os.PathLike)):
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=os.fspath(writer))
            self._owned = True
        else:
            self._owned = False
        self.writer = writer

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Log one optimizer step's scalars.

        Args:
            scalars: {name: value} (`TrainingStep.scalars`).
            step: the optimizer step, as the x axis.
        """
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        """Flush the writer."""
        self.writer.flush()

    def close(self) -> None:
        """Flush the writer, and close it when the sink opened it."""
        self.writer.flush()
        if self._owned:
            self.writer.close()


class WandbSink(ScalarSink):
    """Scalars into a W&B run (`wandb.run`, or one given), with the optimizer step as a metric.

    Args:
        run: the W&B run.
    """

    def __init__(self, run: Any):
        self.run = run

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Log one optimizer step's scalars, with the step as `moe/optimizer_step`.

        Args:
            scalars: {name: value} (`TrainingStep.scalars`).
            step: the optimizer step.
        """
        self.run.log({**scalars, "moe/optimizer_step": step})

    def flush(self) -> None:
        """Nothing to do: the run is the caller's."""
        pass

    def close(self) -> None:
        """Nothing to do: the run is the caller's."""
        pass


def sinks_for(tensorboard: Any, wandb: Any) -> list[ScalarSink]:
    """The sinks for the monitor's `tensorboard=` and `wandb=` options (see `TrainingMonitor`);
    each option is one of several kinds (a switch, a folder, a writer or a run), checked here."""
    sinks: list[ScalarSink] = []
    if tensorboard is not None and tensorboard is not False:
        if not (isinstance(tensorboard, (str, os.PathLike)) or hasattr(tensorboard, "add_scalar")):
            raise TypeError("tensorboard= takes a torch.utils.tensorboard.SummaryWriter or a folder to write "
                            f"event files into, not {type(tensorboard).__name__}")
        sinks.append(TensorBoardSink(tensorboard))
    if wandb is not None and wandb is not False:
        if wandb is True:
            import wandb as wandb_module

            if wandb_module.run is None:
                raise ValueError("wandb=True logs into the active W&B run, and there is none: call wandb.init() "
                                 "first, or pass the run")
            wandb = wandb_module.run
        sinks.append(WandbSink(wandb))
    return sinks


