"""The training records and their exporter: `TrainingStep` (one optimizer step) and its `TrainingLayer`s
(one per MoE layer), and `TrainingExporter`, which turns each training window's record into a
`TrainingStep`, logs its scalars and writes its `train_steps` rows, on the writer's thread. The
monitor that makes the windows and hands over what only the training thread knows (`StepInfo`) is
training/monitor.py."""

from __future__ import annotations

import collections
import datetime as dt
import logging
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from moescope.core.exporters import Exporter
from moescope.core.records import StepRecord
from moescope.metrics import signals
from moescope.probe.session import ProbeSession
from moescope.probe.window import PinnedPool
from moescope.store.location import StoreLocation
from moescope.training.sinks import ScalarSink

if TYPE_CHECKING:
    from moescope.store.writer import RunWriter

log = logging.getLogger(__name__)

ROWS_PER_WRITE = 64  # train_steps rows are written in parts of this many steps (and on every flush)


@dataclass
class TrainingLayer:
    """One MoE layer over one optimizer step.

    Attributes:
        layer: 0-based index of the MoE layer in module order.
        tokens: tokens the layer routed over the step's forwards.
        aux_loss: the layer's own load-balancing loss.
        z_loss: the layer's router z-loss.
        dead_expert_fraction: routed experts with no token over the last `dead_window` optimizer steps.
        router_entropy: token-weighted mean router entropy, normalised to [0, 1] (H / ln E).
        load_max_mean: the busiest routed expert's load over the mean (1.0 is perfect balance; MaxVio + 1).
        router_lr: the learning rate the router's parameters were updated with, or None.
        expert_grad_norm: (E,) per-expert gradient norms; None when the experts had no gradient; NaN
            where it was NaN.
    """

    layer: int
    tokens: int
    aux_loss: float
    z_loss: float
    dead_expert_fraction: float  # over the last `dead_window` optimizer steps
    router_entropy: float  # normalised to [0, 1]
    load_max_mean: float
    router_lr: float | None  # the learning rate the router's parameters were updated with
    expert_grad_norm: np.ndarray | None  # (E,), None when the experts had no gradient; NaN where it was NaN

    def scalars(self) -> dict[str, float]:
        """The layer's scalars, by metric name.

        Returns:
            {name: value} for aux_loss, z_loss, dead_expert_fraction, router_entropy, load_max_mean, and
                router_lr and expert_grad_norm_max / expert_grad_norm_min where known (the max is NaN when any
                expert's norm is NaN).
        """
        out = {"aux_loss": self.aux_loss, "z_loss": self.z_loss, "dead_expert_fraction": self.dead_expert_fraction,
               "router_entropy": self.router_entropy, "load_max_mean": self.load_max_mean}
        if self.router_lr is not None:
            out["router_lr"] = self.router_lr
        if self.expert_grad_norm is not None and self.expert_grad_norm.size:
            out["expert_grad_norm_max"] = float(np.max(self.expert_grad_norm))  # NaN when any expert's is NaN
            out["expert_grad_norm_min"] = float(np.min(self.expert_grad_norm))
        return out


@dataclass
class TrainingStep:
    """One optimizer step: its forwards (`step`..`step_end`), and per-layer figures.

    Attributes:
        optimizer_step: 1-based: the number of updates made so far.
        step: the step's first forward.
        step_end: its last forward.
        ts: when its record's window closed (UTC).
        tokens: tokens in the step's forwards' main input.
        lr: the first parameter group's learning rate, or None.
        aux_loss: all layers pooled, as the model's own aux_loss.
        z_loss: all layers pooled.
        layers: one `TrainingLayer` per MoE layer.
    """

    optimizer_step: int  # 1-based: the number of updates made so far
    step: int
    step_end: int
    ts: dt.datetime
    tokens: int
    lr: float | None
    aux_loss: float  # all layers pooled, as the model's own aux_loss
    z_loss: float  # all layers pooled
    layers: list[TrainingLayer] = field(default_factory=list)

    def scalars(self) -> dict[str, float]:
        """The TensorBoard / W&B scalars: `moe/<metric>/layer_<i>` and `moe/<metric>/all_layers`.

        A figure that could not be computed (NaN) is left out, except the gradient norms: a NaN
        gradient is what they measured, and is logged as NaN.

        Returns:
            {scalar name: value}, with `moe/lr` where the learning rate is known.
        """
        out = {"moe/aux_loss/all_layers": self.aux_loss, "moe/z_loss/all_layers": self.z_loss}
        if self.lr is not None:
            out["moe/lr"] = self.lr
        for layer in self.layers:
            for name, value in layer.scalars().items():
                out[f"moe/{name}/layer_{layer.layer}"] = value
        return {k: float(v) for k, v in out.items()
                if v is not None and (math.isfinite(v) or k.startswith("moe/expert_grad_norm_"))}


@dataclass
class StepInfo:
    """What the training thread knows of a step and the record does not: taken at the update."""

    optimizer_step: int
    lr: float | None
    router_lr: dict[int, float]
    grads: torch.Tensor | None  # (sum of E,) on the host, filled once `event` has completed
    event: torch.cuda.Event | None
    sizes: list[tuple[int, int]]  # (layer, E) in the order of `grads`: the layers whose experts had gradients
    pool: PinnedPool | None = None  # where `grads` goes back to once read (CUDA), or None


class TrainingExporter(Exporter[StepRecord]):
    """Turns each training window's record into a `TrainingStep`, on the writer's thread.

    Losses from the recorded router statistics, dead experts over the last steps, the step's
    learning rates and gradient norms; writes `train_steps` rows and logs the scalars. The
    `TrainingMonitor` makes one and adds it to its session; it is not meant to be built by hand.

    Args:
        session: the probe session whose records it reads.
        store: where the `train_steps` rows go (None: nowhere).
        dead_window: optimizer steps over which an expert with no token counts as dead.
        sinks: where the scalars are logged (TensorBoard, W&B).
        keep_steps: training steps kept in `steps` (default 1024).
    """

    def __init__(self, session: ProbeSession, store: str | os.PathLike | StoreLocation | None, dead_window: int,
                 sinks: Sequence[ScalarSink] = (), keep_steps: int = 1024):
        self.run_id = session.run.run_id
        self.rank = session.run.rank
        self.num_experts = {layer.index: layer.num_experts for layer in session.layers}
        self.sinks = list(sinks)
        self.steps: collections.deque[TrainingStep] = collections.deque(maxlen=keep_steps)
        self._loads: dict[int, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=dead_window))
        self._pending: dict[int, StepInfo] = {}
        self._rows: list[dict] = []
        self._lock = threading.Lock()
        self.unmatched_windows = 0  # training windows that no optimizer step closed (e.g. split by an eval)
        self.tables: RunWriter | None = None  # the run's one writer: train_steps rows go through its pipeline
        if store is not None:
            from moescope.store.writer import run_writer

            self.tables = run_writer(store, self.run_id, self.rank)

    def expect(self, step_end: int, info: StepInfo) -> None:
        """Hand over what the training thread knows of a step (learning rates, gradients) for its record.

        Args:
            step_end: the last forward of the step: the record it belongs to.
            info: what was taken at the update.
        """
        with self._lock:
            self._pending[step_end] = info

    def export(self, records: Sequence[StepRecord]) -> bool:
        """Score each training record (eval-phase records are skipped), log its scalars, buffer its rows.

        Args:
            records: a batch from the pipeline.

        Returns:
            True.
        """
        for record in records:
            if record.tags.get("phase") == "eval":
                continue
            step_end = record.step_end
            assert step_end is not None  # StepRecord fills it in
            with self._lock:
                info = self._pending.pop(step_end, None)
                for stale in [k for k in self._pending if k < step_end]:  # its record was dropped
                    del self._pending[stale]
            if info is None:
                self.unmatched_windows += 1
                continue
            step = self._score(record, info)
            self.steps.append(step)
            for sink in self.sinks:
                try:
                    sink.log(step.scalars(), step.optimizer_step)
                except Exception:
                    log.exception("moescope: logging training scalars to %s failed", type(sink).__name__)
        if len(self._rows) >= ROWS_PER_WRITE * max(len(self.num_experts), 1):
            self._write()
        return True

    def _score(self, record: StepRecord, info: StepInfo) -> TrainingStep:
        assert record.step_end is not None  # StepRecord fills it in
        grads: dict[int, np.ndarray] = {}
        if info.grads is not None:
            if info.event is not None:
                info.event.synchronize()
            flat = info.grads.numpy()
            start = 0
            for layer, width in info.sizes:
                grads[layer] = flat[start: start + width].astype(np.float64)  # a copy: the buffer is reused
                start += width
            if info.pool is not None:
                info.pool.give(info.grads)
        layers = []
        topk = prob = None
        z_sum = tokens_all = 0.0
        for ls in record.layers:
            if ls.layer in grads:  # the step's own gradients (health scores them next: see TrainingMonitor)
                ls.expert_grad_norm = grads[ls.layer]
            experts = self.num_experts.get(ls.layer, ls.expert_load.size)
            routed = signals.routed_load(ls.expert_load, experts)
            history = self._loads[ls.layer]
            history.append(routed)
            if ls.router_topk_load is not None and ls.router_prob_sum is not None:
                aux = signals.load_balancing_loss(ls.router_topk_load, ls.router_prob_sum, ls.tokens)
                topk = ls.router_topk_load.astype(np.float64) if topk is None else topk + ls.router_topk_load
                prob = ls.router_prob_sum.copy() if prob is None else prob + ls.router_prob_sum
            else:
                aux = float("nan")
            z = signals.router_z_loss(ls.router_z_sum, ls.tokens) if ls.router_z_sum is not None else float("nan")
            z_sum += ls.router_z_sum or 0.0
            tokens_all += ls.tokens
            grad = grads.get(ls.layer)
            layers.append(TrainingLayer(
                layer=ls.layer, tokens=ls.tokens, aux_loss=aux, z_loss=z,
                dead_expert_fraction=signals.dead_expert_fraction(np.sum(history, axis=0)),
                router_entropy=signals.normalized_entropy(ls.router_entropy_mean, ls.router_prob_sum.size
                                                          if ls.router_prob_sum is not None else experts),
                load_max_mean=signals.max_mean_ratio(routed), router_lr=info.router_lr.get(ls.layer),
                expert_grad_norm=grad))
        step = TrainingStep(
            optimizer_step=info.optimizer_step, step=record.step, step_end=record.step_end, ts=record.ts,
            tokens=record.tokens, lr=info.lr,
            aux_loss=(signals.load_balancing_loss(topk, prob, tokens_all) if topk is not None and prob is not None
                      else float("nan")),
            z_loss=signals.router_z_loss(z_sum, tokens_all), layers=layers)
        self._rows.extend(dict(
            run_id=self.run_id, optimizer_step=step.optimizer_step, step=step.step, step_end=step.step_end,
            ts=step.ts, layer=layer.layer, tokens=layer.tokens, lr=step.lr, router_lr=layer.router_lr,
            expert_grad_norm=None if layer.expert_grad_norm is None else layer.expert_grad_norm.tolist(),
            rank=self.rank) for layer in layers)
        return step

    def _write(self) -> None:
        rows, self._rows = self._rows, []
        if rows and self.tables is not None:
            try:
                self.tables.emit("train_steps", rows)  # written on the writer's thread; a refused write is counted
            except Exception:
                log.exception("moescope: could not write %d train_steps rows", len(rows))

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Write the buffered `train_steps` rows and flush the sinks (a sink that fails is logged).

        Args:
            timeout_s: how long to wait for the run's writer, in seconds (default 30).

        Returns:
            False if the writer did not finish in time, else True.
        """
        self._write()
        for sink in self.sinks:
            try:
                sink.flush()
            except Exception:
                log.exception("moescope: flushing %s failed", type(sink).__name__)
        return self.tables.flush(timeout_s) if self.tables is not None else True

    def shutdown(self) -> None:
        """Flush, close the sinks and give the run's writer back."""
        self.force_flush()
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:
                log.exception("moescope: closing %s failed", type(sink).__name__)
        if self.tables is not None:
            tables, self.tables = self.tables, None
            tables.release()
