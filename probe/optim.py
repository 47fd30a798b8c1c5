"""The torch optimizer and scheduler under the wrappers training frameworks put around them.

The training monitor (`moescope.training`) and the routing cooldown (`moescope.probe.router_cooldown`) both need
the `torch.optim.Optimizer` that really updates the parameters, and every scheduler that sets its
learning rates. accelerate wraps them (`AcceleratedOptimizer.optimizer`,
`AcceleratedScheduler.scheduler`), Lightning too (`LightningOptimizer.optimizer`); one rule here
unwraps both for both callers.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["OptimizerLike", "SchedulerLike", "WrapsOptimizer", "WrapsScheduler", "schedulers", "torch_optimizer",
           "torch_scheduler"]

_MAX_DEPTH = 8  # wrappers of wrappers; a cycle or a pathological chain stops here


class WrapsOptimizer(Protocol):
    """A framework's wrapper holding the optimizer as `.optimizer` (accelerate, Lightning)."""

    @property
    def optimizer(self) -> torch.optim.Optimizer | WrapsOptimizer: ...


class WrapsScheduler(Protocol):
    """A framework's wrapper holding the LR scheduler as `.scheduler` (accelerate)."""

    @property
    def scheduler(self) -> LRScheduler | WrapsScheduler: ...


# What moescope takes as a training's optimizer and scheduler: torch's own, or a wrapper of one.
OptimizerLike = torch.optim.Optimizer | WrapsOptimizer
SchedulerLike = LRScheduler | WrapsScheduler


def torch_optimizer(optimizer: OptimizerLike) -> torch.optim.Optimizer:
    """The innermost `torch.optim.Optimizer` under wrappers that hold it as `.optimizer`.

    accelerate's `AcceleratedOptimizer` subclasses `Optimizer` without owning the parameter groups,
    so this unwraps to the innermost optimizer, not the first instance. Raises TypeError when there
    is no torch optimizer inside.
    """
    for _ in range(_MAX_DEPTH):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"moescope needs the torch optimizer that trains the model (a torch.optim.Optimizer, or a "
                        f"wrapper holding one as .optimizer), got {type(optimizer).__name__}")
    return optimizer


def torch_scheduler(scheduler: SchedulerLike | None) -> SchedulerLike | None:
    """The torch learning-rate scheduler under wrappers that hold it as `.scheduler` (None for None)."""
    for _ in range(_MAX_DEPTH):
        if scheduler is None or hasattr(scheduler, "base_lrs") or hasattr(scheduler, "_schedulers"):
            return scheduler
        inner = getattr(scheduler, "scheduler", None)
        if inner is None or inner is scheduler:
            return scheduler
        scheduler = inner
    return scheduler


def schedulers(scheduler: SchedulerLike) -> list[SchedulerLike]:
    """The scheduler and every scheduler inside it (SequentialLR, ChainedScheduler)."""
    out: list[SchedulerLike] = []
    stack = [scheduler]
    while stack:
        s = stack.pop()
        out.append(s)
        stack.extend(getattr(s, "_schedulers", None) or [])
    return out
