"""The training monitor: the probe attached for a training run, one record per optimizer step (see
`moescope.training`); training/records.py turns each record into a `TrainingStep` and `train_steps` rows."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import moescope
from moescope.core.lifecycle import GracefulStop
from moescope.probe.accumulate import TOTAL_FORWARDS
from moescope.probe.health_sampling import ExpertGradients
from moescope.probe.optim import OptimizerLike, SchedulerLike, torch_optimizer, torch_scheduler
from moescope.probe.options import Recording
from moescope.probe.router_cooldown import COOLDOWN_STATE, take_saved
from moescope.probe.session import ProbeSession
from moescope.probe.window import PinnedPool
from moescope.store.location import StoreLocation, open_location
from moescope.training.records import StepInfo, TrainingExporter, TrainingStep
from moescope.training.sinks import sinks_for

if TYPE_CHECKING:  # the cooldown's modules load only when a monitor turns it on
    from moescope.alerts.cooldown_policy import CooldownConfig, CooldownPolicy
    from moescope.alerts.engine import TransitionSink

log = logging.getLogger(__name__)

FOREVER = 2**62  # a window that only the optimizer step closes
# The monitor's counts saved with the optimizer's state_dict (a key of its first param group, as the
# cooldown's state: see probe/router_cooldown.py), so a run resumed under its run id goes on counting.
TRAINING_STATE = "moescope_training"


class TrainingMonitor:
    """The probe attached for a training run, one record per optimizer step. See the module doc.

    Resuming: `optimizer.state_dict()` carries the monitor's counts (run id, optimizer steps,
    forwards; the `moescope_training` key of the first param group, plain values that
    `torch.load(weights_only=True)` reads). A checkpoint of the same run id loaded into the optimizer,
    before or after `watch`, continues them: the next update is numbered after the checkpoint's
    last, and the forwards too, so the resumed process's `train_steps`, `layer_steps` and routes rows
    follow the first one's. A checkpoint of another run id (a fine-tune started from it), or one
    saved without the monitor, leaves the new run counting from 1. With `cooldown="auto"` the
    cooldowns in force come back too (probe/router_cooldown.py). Sharp edges: steps redone after a crash
    past the last checkpoint get the numbers they had (they are the same updates, done again); the
    dead-expert window starts empty; a checkpoint loaded into a plain optimizer and saved again
    keeps the old counts.

    Per-expert gradient norms are NaN where torch's gradients were (a NaN or inf in an expert's
    weights' gradients), None where the experts had none (frozen); they go into the step's record,
    so the health score (`health=True`) judges each update's own gradients.

    SIGTERM (`stop_on_sigterm`, default True): when the job gets SIGTERM (a scheduler's preemption,
    `kill`, Kubernetes), the monitor closes first: at once if the training thread is between a
    forward and an optimizer step, else as soon as the forward or the optimizer step under way ends,
    so every optimizer step taken before the signal is written, with the final `probe_stats`. Then
    the job ends as it would have: the SIGTERM handler the job had installed before the monitor is
    called; without one the process exits 0. If closing takes longer than `grace_period_s` the
    process exits 1; a second SIGTERM exits at once (143). See `moescope.core.lifecycle`. Sharp
    edges: the handler is installed only when the monitor is made on the main thread and SIGTERM is
    not ignored; a handler the job installs after the monitor replaces it (call `monitor.close()`
    from it); SIGINT (Ctrl-C) is left alone.

    Args:
        model: the model that trains.
        optimizer: its optimizer (the torch optimizer under any wrapper).
        store: where the records and `train_steps` go, a folder or a URL (`s3://bucket/prefix`, ...);
            None: no store.
        storage_options: how to reach a URL store (`moescope.attach`'s; credentials come from the
            environment). Needs `store`.
        scheduler: the LR scheduler, which the cooldown's parameter-group split keeps in step.
        tensorboard: a `SummaryWriter`, or a folder for one; None: no TensorBoard scalars.
        wandb: a W&B run, or True for `wandb.run`; None: no W&B scalars.
        dead_window: optimizer steps over which an expert with no token counts as dead.
        grad_norms: measure per-expert gradient norms at each update.
        measure_gradients: "step" (just before the optimizer's update; right for loops and
            `Trainer`) or "manual" (call `measure_gradients()` yourself after backward; Lightning's
            callback does, as Lightning runs forward and backward inside `optimizer.step`).
        cooldown: None (off), or "auto" for the routing cooldown (docs/cooldown.md).
        cooldown_config: the cooldown's `CooldownConfig` (None: the defaults).
        cooldown_sink: where the cooldown's alert transitions go (a `TransitionSink`, e.g. an `Outbox`).
        stop_on_sigterm: close the monitor when the job gets SIGTERM (above); False leaves SIGTERM to
            the job.
        grace_period_s: the most seconds closing may take after SIGTERM before the process exits 1;
            None: `$MOESCOPE_GRACE_PERIOD_S`, else 10. A value that is not a positive number is refused.
        **options: `moescope.attach`'s (routes, health, tags, run_id, recording, ...), except the
            window: a training record always covers one optimizer step.

    Raises:
        ValueError: for a `measure_gradients` or `cooldown` mode it does not know, `dead_window`
            below 1, `window` or `window_s` among the options, or `storage_options` without a store;
            and what `moescope.attach` raises.
    """

    def __init__(self, model: nn.Module, optimizer: OptimizerLike, *,
                 store: str | os.PathLike | StoreLocation | None = None,
                 storage_options: Mapping[str, Any] | None = None, scheduler: SchedulerLike | None = None,
                 tensorboard: Any = None, wandb: Any = None,
                 dead_window: int = 64, grad_norms: bool = True, measure_gradients: str = "step",
                 cooldown: str | None = None, cooldown_config: CooldownConfig | None = None,
                 cooldown_sink: TransitionSink | None = None, stop_on_sigterm: bool = True,
                 grace_period_s: float | None = None, **options: Any):
        if measure_gradients not in ("step", "manual"):
            raise ValueError(f"measure_gradients must be 'step' or 'manual', not {measure_gradients!r}")
        if cooldown not in (None, "auto"):
            raise ValueError(f"cooldown must be None (off) or 'auto', not {cooldown!r}")
        if dead_window < 1:
            raise ValueError("dead_window counts optimizer steps and must be at least 1")
        for name in ("window", "window_s"):
            if name in options:
                raise ValueError(f"{name} is set by the training monitor: a training record covers one optimizer "
                                 "step; leave it out")
        self.optimizer = torch_optimizer(optimizer)
        self.scheduler = torch_scheduler(scheduler)
        # A checkpoint loaded before the watch: its counts (and, without a cooldown, its cooldown
        # state, which would go stale) leave the live param groups before anything copies them.
        resumed = take_saved(self.optimizer, TRAINING_STATE)
        if cooldown is None and take_saved(self.optimizer, COOLDOWN_STATE) is not None:
            log.warning("moescope: the checkpoint's routing cooldown state is dropped: cooldown is off")
        self.measure_mode = measure_gradients
        recording = dataclasses.replace(options.pop("recording", None) or Recording(), window=FOREVER, window_s=None)
        tags = {"phase": "train", **{str(k): str(v) for k, v in (options.pop("tags", None) or {}).items()}}
        sinks = sinks_for(tensorboard, wandb)
        if storage_options and store is None:
            raise ValueError("storage_options without a store: give store= (a folder or a URL) too")
        store = None if store is None else open_location(store, storage_options)  # once, for every writer below
        self.session: ProbeSession = moescope.attach(model, store, recording=recording, tags=tags, **options)
        self.optimizer_step = 0
        self.cooldown: CooldownPolicy | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._eval_tags: contextlib.AbstractContextManager[None] | None = None  # session.tag(phase="eval"), open
        self._info: StepInfo | None = None
        self._groups: tuple[int, dict[int, int]] = (-1, {})
        self._pool = PinnedPool()
        self._sigterm: GracefulStop | None = None
        self._busy = 0  # forwards and optimizer steps under way: SIGTERM waits for them to end
        self._signalled: tuple[int, Any] | None = None  # (signum, frame) of a SIGTERM not yet acted on
        self._last_counts: dict[str, Any] = {}  # the counts at close, for a checkpoint saved after it
        try:
            if stop_on_sigterm:  # the first of the optimizer's pre-hooks (the cooldown's come next)
                self._handles.append(self.optimizer.register_step_pre_hook(self._step_begins))
            self.exporter = TrainingExporter(self.session, store, dead_window, sinks)
            # First in the pipeline: it puts the step's gradient norms into the record, where the
            # health score (the trust policy's exporter) reads them.
            self.session.add_exporter(self.exporter, first=True)
            self._resume(resumed)  # first: a cooldown resumed below is written with the counts continued
            if cooldown == "auto":
                from moescope.alerts.cooldown_policy import bind_cooldown

                self.cooldown = bind_cooldown(self.session, self.optimizer, self.scheduler, cooldown_config,
                                              store, cooldown_sink)
                assert self.cooldown.actuator is not None  # bind_cooldown binds one
                self.cooldown.actuator.set_optimizer_steps(self.optimizer_step)
            self._gradients = [ExpertGradients(layer) for layer in self.session.layers
                               if grad_norms and layer.experts is not None]
            self._routers = {layer.index: [id(p) for p in layer.router.parameters()] for layer in self.session.layers}
            # Registered after the cooldown's hooks: the pre-hook sees the learning rate in force.
            self._handles.append(self.optimizer.register_step_pre_hook(self._before_update))
            self._handles.append(self.optimizer.register_step_post_hook(self._after_update))
            self._handles.append(model.register_forward_pre_hook(self._phase, prepend=True))
            # After the cooldown's: a checkpoint's cooldown state is loaded before the counts align it.
            self._handles.append(self.optimizer.register_load_state_dict_post_hook(self._loaded))
            self.optimizer.register_state_dict_post_hook(_save_counts(self))  # stays after close
            if stop_on_sigterm:
                self._install_sigterm(model, grace_period_s)
        except BaseException:
            self.close()
            raise

    # -- hooks (training thread) -----------------------------------------------------------------

    def _phase(self, module: nn.Module, args: tuple) -> None:
        try:
            if not module.training and self._eval_tags is None:
                self._eval_tags = self.session.tag(phase="eval")
                self._eval_tags.__enter__()
            elif module.training and self._eval_tags is not None:
                tags, self._eval_tags = self._eval_tags, None
                tags.__exit__(None, None, None)
        except Exception:
            log.exception("moescope: switching the training monitor's phase failed")

    def _router_groups(self) -> dict[int, int]:
        """MoE layer -> index of the parameter group holding its router (rebuilt when groups change)."""
        groups = self.optimizer.param_groups
        if self._groups[0] != len(groups):
            where = {id(p): i for i, group in enumerate(groups) for p in group["params"]}
            self._groups = (len(groups), {layer: where[ids[0]] for layer, ids in self._routers.items()
                                          if ids and ids[0] in where})
        return self._groups[1]

    def measure_gradients(self) -> None:
        """Take this step's per-expert gradient norms and learning rates now (after backward, before the update).

        Called by the optimizer pre-hook unless measure_gradients="manual".
        """
        try:
            groups = self.optimizer.param_groups
            lr = float(groups[0]["lr"]) if groups else None
            router_lr = {layer: float(groups[i]["lr"]) for layer, i in self._router_groups().items()}
            grads, event, sizes = None, None, []
            norms: list[torch.Tensor] = []
            for gradients in self._gradients:
                norm = gradients.norms()
                if norm is None:  # no expert weight has a gradient (frozen experts): no figure, not NaN
                    continue
                norms.append(norm.to(torch.float32))
                sizes.append((gradients.layer.index, gradients.layer.num_experts))
            if norms:
                device = next((n.device for n in norms if n.device.type != "cpu"), torch.device("cpu"))
                flat = torch.cat([n.to(device) for n in norms])
                if flat.is_cuda:  # a pooled page-locked buffer, given back once the writer has read it
                    grads = self._pool.take(flat.numel(), flat.dtype)
                    grads.copy_(flat, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                else:
                    grads = flat.clone()
            self._info = StepInfo(self.optimizer_step + 1, lr, router_lr, grads, event, sizes,
                                   self._pool if event is not None else None)
        except Exception:
            log.exception("moescope: measuring gradients for the training record failed")

    def _before_update(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.measure_mode == "step":
            self.measure_gradients()

    def _after_update(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.optimizer_step += 1
        try:
            info, self._info = self._info, None
            if self.session.closed:
                return
            if info is None:  # "manual" and not measured: the step still gets its record
                info = StepInfo(self.optimizer_step, None, {}, None, None, [])
            info.optimizer_step = self.optimizer_step
            if self._eval_tags is None and self.session.forwards_in_window:
                self.exporter.expect(self.session.step - 1, info)
            self.session.end_window()
        except Exception:
            log.exception("moescope: closing the training step's window failed")

    # -- resuming (the counts saved with the optimizer) --------------------------------------------

    def training_state(self) -> dict[str, Any]:
        """What a checkpoint of the optimizer keeps of this monitor.

        Returns:
            The run id, the optimizer steps and the forwards counted (plain values).
        """
        return {"run_id": self.session.run.run_id, "optimizer_step": int(self.optimizer_step),
                "forward_step": int(self.session.step)}

    def _loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's load_state_dict post-hook: continue from the checkpoint's counts."""
        if self.cooldown is None and take_saved(self.optimizer, COOLDOWN_STATE) is not None:
            log.warning("moescope: the checkpoint's routing cooldown state is dropped: cooldown is off")
        self._resume(take_saved(self.optimizer, TRAINING_STATE))

    def _resume(self, saved: Any) -> None:
        """Continue a run from a checkpoint's counts (`training_state()`): the next update is
        `optimizer_step + 1` and the next forward `forward_step`, so a resumed run's rows follow
        the first process's instead of numbering them again. A checkpoint of another run id (a
        fine-tune started from it) leaves the counts as they are; so does one without counts."""
        if saved is not None:
            try:
                run_id, optimizer_step, forward_step = (str(saved["run_id"]), int(saved["optimizer_step"]),
                                                        int(saved["forward_step"]))
            except (KeyError, TypeError, ValueError) as e:
                log.warning("moescope: the checkpoint's training counts (%s) cannot be read (%r); counting goes on "
                            "from %d", TRAINING_STATE, e, self.optimizer_step)
                saved = None
        if saved is not None and run_id != self.session.run.run_id:
            log.info("moescope: the checkpoint was saved by run %r; run %r counts its own optimizer steps",
                     run_id, self.session.run.run_id)
        elif saved is not None:
            self.optimizer_step = optimizer_step
            if forward_step > self.session.step:  # never back: a forward number is a row's key
                _skip_forwards(self.session, forward_step - self.session.step)
        actuator = None if self.cooldown is None else self.cooldown.actuator
        if actuator is not None:  # its events count the same optimizer steps as train_steps
            actuator.set_optimizer_steps(self.optimizer_step)

    # -- SIGTERM (see the class doc) ---------------------------------------------------------------

    def _install_sigterm(self, model: nn.Module, grace_period_s: float | None) -> None:
        """Count what is under way (forwards: their first pre-hook and last hook; optimizer steps:
        their first pre-hook and last post-hook; flush and close), and handle SIGTERM from now on."""
        eager = torch.compiler.disable  # bookkeeping stays out of any compiled graph, as the session's
        self._handles.append(model.register_forward_pre_hook(eager(self._forward_begins), prepend=True))
        self._handles.append(model.register_forward_hook(eager(self._forward_ends), always_call=True))
        self._step_ends_handle = self.optimizer.register_step_post_hook(self._step_ends)
        self._handles.append(self._step_ends_handle)
        if signal.getsignal(signal.SIGTERM) is None:  # a handler installed from C: it could not be called after us
            log.info("moescope: SIGTERM has a handler installed outside Python; the training monitor leaves it be")
            return
        self._sigterm = GracefulStop(grace_s=grace_period_s, what="moescope training monitor",
                                     signals=(signal.SIGTERM,), on_signal=self._on_sigterm)
        if not self._sigterm.install().installed:  # not the main thread, or SIGTERM is ignored
            self._sigterm = None

    def _forward_begins(self, module: nn.Module, args: tuple) -> None:
        self._at_safe_point()  # a SIGTERM deferred by an optimizer step that was not the last to end
        self._busy += 1

    def _forward_ends(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._busy = max(self._busy - 1, 0)
        self._at_safe_point()

    def _step_begins(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self._busy += 1

    def _step_ends(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self._busy = max(self._busy - 1, 0)
        # torch iterates the post-hooks' dict itself: closing removes hooks from it, which is safe
        # only when no hook comes after this one; else the next forward (or flush, close) closes
        hooks = self._step_ends_handle.hooks_dict_ref()
        if hooks is not None and next(reversed(hooks), None) == self._step_ends_handle.id:
            self._at_safe_point()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """The first SIGTERM, in the handler (the training thread, between two bytecodes)."""
        self._signalled = (signum, frame)
        self._at_safe_point()  # between steps nothing of the monitor's is half done: close now;
        # else the end of the forward, optimizer step, flush or close under way does

    def _at_safe_point(self) -> None:
        if self._signalled is not None and not self._busy:
            self._finish_after_sigterm()

    def _finish_after_sigterm(self) -> None:
        """Close (drain: train_steps, probe_stats, run_ends), then end the job as it would have ended:
        the job's own SIGTERM handler, or exit 0."""
        stop, signalled = self._sigterm, self._signalled
        self._signalled = None
        if stop is None or signalled is None:
            return
        signum, frame = signalled
        previous = stop.previous_handler(signum)
        try:
            self.close()  # puts the job's handler back and stops the watchdog once drained
        except Exception:
            log.exception("moescope: closing the training monitor on SIGTERM failed")
        if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
            previous(signum, frame)  # the job decides how it ends (it may raise here, in its training loop)
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(0)  # as SIGTERM's default action ends a process (no cleanup runs), but with status 0

    # -- API -------------------------------------------------------------------------------------

    @property
    def steps(self) -> list[TrainingStep]:
        """The last 1024 training steps scored; the store keeps them all.

        Call `flush()` first to include the latest.
        """
        return list(self.exporter.steps)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Close the current window and write everything recorded so far (`ProbeSession.flush`).

        A SIGTERM that arrives meanwhile waits for the flush, then closes the monitor.

        Args:
            timeout_s: how long to wait for the writer, in seconds (default 30).

        Returns:
            False if the writer did not finish in time, else True.
        """
        self._busy += 1  # a SIGTERM meanwhile waits for the flush, then closes
        try:
            return self.session.flush(timeout_s)
        finally:
            self._busy = max(self._busy - 1, 0)
            self._at_safe_point()

    def close(self) -> None:
        """Remove the hooks, end any cooldown, write everything, give SIGTERM back to the job; safe twice."""
        self._busy += 1  # a SIGTERM meanwhile waits for this drain to end
        try:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            if self._eval_tags is not None:
                tags, self._eval_tags = self._eval_tags, None
                tags.__exit__(None, None, None)
            self.session.close()
            self._last_counts["counts"] = self.training_state()
        finally:
            self._busy = max(self._busy - 1, 0)
            if self._sigterm is not None:
                self._sigterm.restore()  # after the drain, which its watchdog bounds
        self._at_safe_point()

    def __enter__(self) -> TrainingMonitor:
        """Return the monitor itself; leaving the block calls `close()`."""
        return self

    def __exit__(self, *exc: Any) -> None:
        """Close the monitor (`close()`); exceptions pass through."""
        self.close()


def _skip_forwards(session: ProbeSession, forwards: int) -> None:
    """Number the session's next forward `forwards` later: the host's count and each device
    buffer's own counter (the routes' and records' forward numbers come from it) move together.
    A window holding forwards is closed first: a deferred reduction numbers its forwards back from
    the counter, so the jump must come after them."""
    if session.forwards_in_window:
        session.end_window()
    session.step += forwards
    for buffer in session.buffers:
        buffer.flat[TOTAL_FORWARDS] += forwards


def _save_counts(monitor: TrainingMonitor) -> Any:
    """An optimizer state_dict post-hook: the monitor's counts into the first param group. It holds
    the monitor weakly; once the monitor is gone it saves the counts the monitor had at close."""
    ref = weakref.ref(monitor)
    last: dict[str, Any] = {}
    monitor._last_counts = last

    def hook(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict | None:
        alive = ref()
        counts = alive.training_state() if alive is not None else last.get("counts")
        groups = state_dict["param_groups"]
        if counts is None or not groups:
            return None
        return {**state_dict, "param_groups": [{**groups[0], TRAINING_STATE: counts}, *groups[1:]]}
    return hook


def watch(model: nn.Module, optimizer: OptimizerLike, store: str | os.PathLike | StoreLocation | None = None,
          **options: Any) -> TrainingMonitor:
    """Watch a plain training loop: a `TrainingMonitor` on `model` and `optimizer`.

    Args:
        model: the model that trains.
        optimizer: its optimizer (the torch optimizer under any wrapper).
        store: where the records and `train_steps` go, a folder or a URL; None: no store.
        **options: `TrainingMonitor`'s (tensorboard, wandb, dead_window, cooldown, ...) and
            `moescope.attach`'s.

    Returns:
        The monitor; call `close()` when training ends (or use it as a context manager).

    Raises:
        ValueError: for options the monitor refuses (see `TrainingMonitor`).
    """
    return TrainingMonitor(model, optimizer, store=store, **options)


