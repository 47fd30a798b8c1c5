"""The routing cooldown: a lower learning rate and a little jitter for one layer's router, for a while.

`RouterCooldown` is the actuator the cooldown policy (alerts/cooldown_policy.py) drives while a
model trains; it can be driven by hand too. For a cooling layer it

- multiplies the learning rate of the layer's router parameters by `factor` (0.1 by default), and
- multiplies the router's *input* by noise drawn from U(1 - epsilon, 1 + epsilon) in training mode
  (epsilon 0.01 by default), which reaches the logits through the router.

The jitter is Switch Transformer's router jitter (transformers' SwitchTransformersTop1Router
multiplies its input the same way, with `router_jitter_noise` 0.01 by default). Mixtral's `router_jitter_noise` in
transformers multiplies the whole block input, so its experts see the noise too; here only the
router does (the noisy tensor is a new one, the experts get the clean input). Noise on the input
rather than on the logits keeps the perturbation relative to each token's own features, which is
what the Switch recipe tuned. The noise comes from this actuator's own generator (seeded), so
the training's random stream (dropout, sampling) is the same with and without a cooldown.

How the learning rate reaches the optimizer, once and for good at construction: each layer's
router parameters move out of whatever param group holds them into a param group of their own,
a copy of the parent group's hyperparameters (`initial_lr` included). Optimizer state is keyed by
parameter, so every state tensor stays where it is. A scheduler given here has its per-group lists
(`base_lrs`, `lr_lambdas`, `_last_lr`, `min_lrs`, `max_lrs`, momentum lists; the schedulers inside a
SequentialLR or ChainedScheduler too) extended with the parent's entries, so the new groups keep
following the schedule; a scheduler built after the split needs nothing. The factor itself is
applied around each optimizer step by step hooks: the cooling groups' lr is scaled just before
`optimizer.step()` and the scheduled value put back just after, so a scheduler neither overwrites
the factor nor compounds it.

Sharp edges:
- Between steps `param_groups[i]["lr"]` holds the *scheduled* lr, also for a cooling group (and
  `scheduler.get_last_lr()` too); `lr_in_force(layer)` is what the last and the next step use.
- The split stays after `close()` (the optimizer's state is never rebuilt): the router groups go on
  at the parent's lr. `optimizer.state_dict()` is saved in the layout the optimizer had before the
  split (hooks registered at the split), so a checkpoint loads into an optimizer built the usual
  way, with or without a cooldown attached; loading one into a split optimizer splits it the same
  way. The cooldowns in force, the steps counted and each layer's last end are saved with it (the
  `moescope_cooldown` key of the first param group: plain values, `torch.load(weights_only=True)`
  reads them) and restored by `load_state_dict`, before or after the attach: a layer cooling at the
  save cools on for the steps it had left.
- A scheduler's state_dict has no hooks and keeps the layout it was saved in. One saved without a
  cooldown (lists as long as the optimizer's groups before the split) loads into a split one in
  either order: the step hooks extend its lists again before its next step. One saved with a
  cooldown keeps the split's longer lists: resuming it needs the cooldown attached again (it then
  finds the lists already extended); a plain optimizer cannot step it.
- A step that raises between the hooks leaves the scaled lr in the groups until the next step's
  pre-hook puts the scheduled value back first.
- The jitter hook is Python on the router: under torch.compile a change of cooling state is a
  guard failure and a recompile.
- One split per optimizer: a second `RouterCooldown` on the same optimizer and routers reuses the
  split once the first is closed, and is refused while it is open.

Hooks never raise into the training loop: a failure is counted in `hook_errors`, logged once, and
the step or forward goes on as if the layer were not cooling.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
from torch import nn

from moescope.probe.adapters import MoELayer
from moescope.probe.optim import OptimizerLike, SchedulerLike, schedulers, torch_optimizer, torch_scheduler

log = logging.getLogger(__name__)

# moescope's state saved with an optimizer's state_dict: a key of the first param group, which torch
# carries through `load_state_dict` into the live groups (a top-level key it drops), so a checkpoint
# loaded before the cooldown is attached still restores it.
STATE_PREFIX = "moescope_"
COOLDOWN_STATE = "moescope_cooldown"

# Per-param-group lists kept by torch's schedulers; each gets the parent group's entry for a new group.
SCHEDULER_LISTS = ("base_lrs", "lr_lambdas", "_last_lr", "min_lrs", "max_lrs", "base_momentums", "max_momentums")


class RouterCooldownError(ValueError):
    """A cooldown cannot be set up or changed as asked; the message says what to do."""


@dataclass(frozen=True)
class CooldownChange:
    """One start or end of one layer's cooldown."""

    at: dt.datetime
    layer: int
    action: str  # "start" | "end"
    optimizer_step: int  # optimizer steps done when the change was made
    lr_factor: float
    epsilon: float
    lr_before: float  # the router's lr in force before the change ...
    lr_after: float  # ... and after it (the scheduled lr times the factor while cooling)
    reason: str
    source: str = "manual"  # "manual" (the API), "auto" (the policy)
    steps: int | None = None  # start: the planned length in optimizer steps (None: until end()); end: how long it ran


@dataclass(frozen=True)
class Cooling:
    """A layer's cooldown in force."""

    factor: float
    epsilon: float
    started_step: int
    ends_at_step: int | None
    source: str
    reason: str


@dataclass
class _Split:
    """What one optimizer's split did: kept with the optimizer, so a later actuator reuses it."""

    groups: dict[int, list[int]]  # layer -> its router param groups (largest first)
    parent: dict[int, int]  # new group index -> the parent group's index
    original: list[list[torch.Tensor]]  # each group's params before the split, in order
    layer_params: dict[int, list[int]] = field(default_factory=dict)  # layer -> id() of its router params
    owner: RouterCooldown | None = None  # the open RouterCooldown using this split, if any


_SPLITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> _Split
_SPLITS_LOCK = threading.Lock()


def _copy_value(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _hyperparameter(key: str) -> bool:
    """A param group's key that a split group copies: not its params, and not moescope's saved state."""
    return key not in ("params", "param_names") and not key.startswith(STATE_PREFIX)


def take_saved(optimizer: torch.optim.Optimizer, key: str) -> Any:
    """Remove `key` from every param group of `optimizer` and return the first group's value (None
    when absent): moescope's state rides in a checkpoint's first param group, and torch's
    `load_state_dict` puts the saved groups' keys into the live groups."""
    found = None
    for gi, group in enumerate(optimizer.param_groups):
        value = group.pop(key, None)
        if gi == 0:
            found = value
    return found


class RouterCooldown:
    """Cools chosen MoE layers' routers down during training; see the module docstring.

    layers: the probe session's `MoELayer`s (each with `.router` and `.index`). optimizer: the
    training's optimizer (an Accelerate wrapper is unwrapped), holding every router parameter.
    scheduler: its LR scheduler, if one exists already. seed: the jitter generator's seed.

    Raises RouterCooldownError when a router parameter is not in the optimizer (a frozen router,
    or an optimizer built over a subset), when a router has no parameters, when the optimizer was
    split for other routers or is in use by another open RouterCooldown, and when the scheduler's
    per-group lists do not match the optimizer's groups.
    """

    def __init__(self, layers: Sequence[MoELayer], optimizer: OptimizerLike, scheduler: SchedulerLike | None = None,
                 *, seed: int = 0, on_error: Callable[[], None] | None = None):
        try:
            self.optimizer = torch_optimizer(optimizer)
        except TypeError as e:
            raise RouterCooldownError(f"the cooldown: {e}") from None
        self.scheduler = torch_scheduler(scheduler)
        self.layers = {int(layer.index): layer for layer in layers}
        if not self.layers:
            raise RouterCooldownError("no MoE layers to cool: the probe found none")
        self.seed = seed
        self.on_error = on_error
        self.listeners: list[Callable[[CooldownChange], None]] = []
        self.changes: list[CooldownChange] = []
        self.optimizer_steps = 0
        self.hook_errors = 0
        self.closed = False
        self._lock = threading.RLock()
        self._cooling: dict[int, Cooling] = {}
        self._last_end: dict[int, int] = {}
        self._saved: dict[int, Any] = {}  # group index -> its scheduled lr, between the pre- and post-hook
        self._generators: dict[tuple[str, int], torch.Generator] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        if self.scheduler is not None and getattr(self.scheduler, "optimizer", self.optimizer) is not self.optimizer:
            raise RouterCooldownError("the scheduler drives another optimizer than the one given; pass the "
                                      "optimizer the scheduler was built with")
        with _SPLITS_LOCK:
            self._split = self._split_once()
            self._split.owner = self
        try:
            self.load_state(take_saved(self.optimizer, COOLDOWN_STATE))  # a checkpoint loaded before the attach
            self._handles.append(self.optimizer.register_step_pre_hook(self._pre_step))
            self._handles.append(self.optimizer.register_step_post_hook(self._post_step))
            for layer in self.layers.values():
                self._handles.append(layer.router.register_forward_pre_hook(
                    self._jitter_hook(int(layer.index)), with_kwargs=True))
        except BaseException:
            self.close()
            raise

    # -- the split, once per optimizer ---------------------------------------------------------

    def _router_params(self) -> dict[int, list[nn.Parameter]]:
        where = {id(p): i for i, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
        out: dict[int, list[nn.Parameter]] = {}
        owner: dict[int, int] = {}
        for index, layer in sorted(self.layers.items()):
            params = list(layer.router.parameters())
            if not params:
                raise RouterCooldownError(f"the router of MoE layer {index} ({type(layer.router).__name__}) has no "
                                          "parameters: there is no learning rate to cool; leave cooldown off")
            for p in params:
                if id(p) not in where:
                    frozen = "" if p.requires_grad else " (it is frozen: requires_grad=False)"
                    raise RouterCooldownError(
                        f"a parameter of MoE layer {index}'s router ({getattr(layer, 'name', '')}) is not in the "
                        f"optimizer{frozen}; build the optimizer over every router parameter (e.g. "
                        "model.parameters()), or leave cooldown off for a frozen router")
                if id(p) in owner:
                    raise RouterCooldownError(f"MoE layers {owner[id(p)]} and {index} share a router parameter; a "
                                              "shared router cannot be cooled per layer")
                owner[id(p)] = index
            out[index] = params
        return out

    def _split_once(self) -> _Split:
        params = self._router_params()
        ids = {index: sorted(id(p) for p in ps) for index, ps in params.items()}
        split = _SPLITS.get(self.optimizer)
        if split is not None:
            if split.owner is not None and not split.owner.closed:
                raise RouterCooldownError("this optimizer already has an open RouterCooldown; close it first (one "
                                          "split per optimizer)")
            if split.layer_params != ids:
                raise RouterCooldownError("this optimizer was split for other routers already; a RouterCooldown "
                                          "must cover the same MoE layers as the first one on this optimizer")
            self._check_scheduler(split, extend=False)
            return split
        groups = self.optimizer.param_groups
        original = [list(g["params"]) for g in groups]
        before = len(groups)
        # pieces: (layer, parent group, params in the parent's order)
        pieces: list[tuple[int, int, list[nn.Parameter]]] = []
        for index, ps in sorted(params.items()):
            mine = {id(p) for p in ps}
            for gi, group in enumerate(groups):
                inside = [p for p in group["params"] if id(p) in mine]
                if inside:
                    pieces.append((index, gi, inside))
        layer_groups: dict[int, list[int]] = {index: [] for index in params}
        parent: dict[int, int] = {}
        new_groups: list[tuple[int, dict]] = []
        for gi, group in enumerate(groups):
            here = [piece for piece in pieces if piece[1] == gi]
            if not here:
                continue
            moved = {id(p) for piece in here for p in piece[2]}
            if len(moved) == len(group["params"]):  # the group holds routers only: the first stays here
                layer_groups[here[0][0]].append(gi)
                here = here[1:]
                moved = {id(p) for piece in here for p in piece[2]}
            for index, _, inside in here:
                new = {k: _copy_value(v) for k, v in group.items() if _hyperparameter(k)}
                new["params"] = inside
                if "param_names" in group:
                    names = dict(zip(map(id, group["params"]), group["param_names"], strict=True))
                    new["param_names"] = [names[id(p)] for p in inside]
                new_groups.append((gi, new))
                layer_groups[index].append(before + len(new_groups) - 1)
            if "param_names" in group:
                group["param_names"] = [n for p, n in zip(group["params"], group["param_names"], strict=True)
                                        if id(p) not in moved]
            group["params"] = [p for p in group["params"] if id(p) not in moved]
        for gi, new in new_groups:
            parent[len(self.optimizer.param_groups)] = gi
            self.optimizer.add_param_group(new)
        for index in layer_groups:  # the group holding most of the router first: the one lr_in_force reports
            layer_groups[index].sort(key=lambda g: -sum(p.numel() for p in self.optimizer.param_groups[g]["params"]))
        split = _Split(groups=layer_groups, parent=parent, original=original, layer_params=ids)
        self._check_scheduler(split, extend=True, before=before)
        self.optimizer.register_state_dict_post_hook(_saved_unsplit(split))
        self.optimizer.register_load_state_dict_pre_hook(_loaded_split(split))
        self.optimizer.register_load_state_dict_post_hook(_loaded_state(split))
        _SPLITS[self.optimizer] = split
        return split

    def _check_scheduler(self, split: _Split, extend: bool, before: int = 0) -> None:
        """Extend (or check) the scheduler's per-group lists for the split's new groups."""
        if self.scheduler is None:
            return
        total = len(self.optimizer.param_groups)
        for scheduler in schedulers(self.scheduler):
            for name in SCHEDULER_LISTS:
                values = getattr(scheduler, name, None)
                if not isinstance(values, list) or len(values) == total:
                    continue
                if extend and len(values) == before:
                    values.extend(copy.copy(values[split.parent[gi]]) for gi in sorted(split.parent))
                    continue
                raise RouterCooldownError(
                    f"{type(scheduler).__name__}.{name} has {len(values)} entries for {total} param groups; pass "
                    "the scheduler built over this optimizer, or build it after the cooldown is attached")

    def fit_scheduler(self) -> None:
        """Give the split's groups their entries again in a scheduler whose lists have the length the
        optimizer had before the split: a scheduler state_dict saved without a cooldown, loaded after
        the attach. The step hooks call it, so the scheduler's next step finds every group."""
        if self.scheduler is None or not self._split.parent:
            return
        total = len(self.optimizer.param_groups)
        before = total - len(self._split.parent)
        for scheduler in schedulers(self.scheduler):
            for name in SCHEDULER_LISTS:
                values = getattr(scheduler, name, None)
                if isinstance(values, list) and len(values) == before:
                    values.extend(copy.copy(values[self._split.parent[gi]]) for gi in sorted(self._split.parent))

    # -- saved with the optimizer ----------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this cooldown (plain values: loads with `weights_only=True`):
        the optimizer steps counted, each cooling layer's cooldown, each layer's last end."""
        with self._lock:
            return {"optimizer_steps": int(self.optimizer_steps),
                    "cooling": {int(layer): {"factor": c.factor, "epsilon": c.epsilon, "started_step": c.started_step,
                                             "ends_at_step": c.ends_at_step, "source": c.source, "reason": c.reason}
                                for layer, c in self._cooling.items()},
                    "last_end": {int(layer): int(step) for layer, step in self._last_end.items()}}

    def load_state(self, state: dict[str, Any] | None) -> list[CooldownChange]:
        """Make the cooldowns of a checkpoint (`state()`) the ones in force: its step count and last
        ends; a layer cooling now and not in it ends ("checkpoint loaded"), a layer cooling in it
        starts again for the steps it had left (reason "resumed from a checkpoint: ..."). Layers this
        actuator does not cover are skipped with a warning. Returns the changes (also passed to each
        listener). None (a checkpoint without cooldown state) changes nothing."""
        if state is None or self.closed:
            return []
        try:
            steps = int(state["optimizer_steps"])
            saved = {int(layer): Cooling(factor=float(c["factor"]), epsilon=float(c["epsilon"]),
                                         started_step=int(c["started_step"]),
                                         ends_at_step=None if c["ends_at_step"] is None else int(c["ends_at_step"]),
                                         source=str(c["source"]), reason=str(c["reason"]))
                     for layer, c in state["cooling"].items()}
            last_end = {int(layer): int(step) for layer, step in state["last_end"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RouterCooldownError(f"the checkpoint's cooldown state ({COOLDOWN_STATE}) cannot be read ({e!r}); "
                                      f"remove the key from its first param group to resume without it") from None
        unknown = sorted(set(saved) - set(self.layers))
        if unknown:
            log.warning("routing cooldown: the checkpoint cools MoE layers %s that this cooldown does not cover; "
                        "they are left out", unknown)
        changes = [c for c in (self.end(layer, "checkpoint loaded") for layer in sorted(self.cooling()))
                   if c is not None]
        with self._lock:
            self.optimizer_steps = steps
            self._last_end = {layer: step for layer, step in last_end.items() if layer in self.layers}
            for layer, cooling in sorted(saved.items()):
                if layer not in self.layers or (cooling.ends_at_step is not None and cooling.ends_at_step <= steps):
                    continue
                self._cooling[layer] = cooling
                scheduled = self.scheduled_lr(layer)
                change = CooldownChange(
                    at=dt.datetime.now(dt.timezone.utc), layer=layer, action="start", optimizer_step=steps,
                    lr_factor=cooling.factor, epsilon=cooling.epsilon, lr_before=scheduled,
                    lr_after=scheduled * cooling.factor, reason=f"resumed from a checkpoint: {cooling.reason}",
                    source=cooling.source, steps=None if cooling.ends_at_step is None else cooling.ends_at_step - steps)
                self.changes.append(change)
                changes.append(change)
        for change in changes:
            if change.action == "start":
                self._notify(change)
        return changes

    def set_optimizer_steps(self, optimizer_steps: int) -> None:
        """Count from `optimizer_steps` updates done now (the training monitor's count, on a resume):
        the cooldowns in force and the last ends move with the count, so each keeps the steps it has
        left and the gap since its end."""
        with self._lock:
            shift = int(optimizer_steps) - self.optimizer_steps
            if not shift:
                return
            self.optimizer_steps += shift
            self._cooling = {layer: dataclasses.replace(
                c, started_step=c.started_step + shift,
                ends_at_step=None if c.ends_at_step is None else c.ends_at_step + shift)
                for layer, c in self._cooling.items()}
            self._last_end = {layer: step + shift for layer, step in self._last_end.items()}

    # -- reading -------------------------------------------------------------------------------

    def groups(self, layer: int) -> list[int]:
        """The indices of `layer`'s router param groups in `optimizer.param_groups` (largest first)."""
        return list(self._split.groups[self._check_layer(layer)])

    def scheduled_lr(self, layer: int) -> float:
        """The router's lr as scheduled, without a cooldown's factor."""
        gi = self._split.groups[self._check_layer(layer)][0]
        return float(self._saved.get(gi, self.optimizer.param_groups[gi]["lr"]))

    def lr_in_force(self, layer: int) -> float:
        """The router's lr the last (or next) optimizer step uses: the scheduled lr times the factor
        while the layer cools. A layer whose router params came from several groups (HF Trainer's
        decay / no-decay split) reports the group holding most of them."""
        cooling = self._cooling.get(self._check_layer(layer))
        return self.scheduled_lr(layer) * (cooling.factor if cooling is not None else 1.0)

    def cooling(self) -> dict[int, Cooling]:
        """The layers cooling now."""
        with self._lock:
            return dict(self._cooling)

    def last_end_step(self, layer: int) -> int | None:
        """The optimizer step at which `layer`'s last cooldown ended, or None if it never cooled."""
        return self._last_end.get(self._check_layer(layer))

    # -- changing ------------------------------------------------------------------------------

    def start(self, layer: int, factor: float = 0.1, epsilon: float = 0.01, reason: str = "", *,
              steps: int | None = None, source: str = "manual") -> CooldownChange:
        """Start cooling `layer`: lr times `factor`, router input jitter `epsilon`; for `steps`
        optimizer steps (ended by the step hook), or until `end` when steps is None.

        Returns the change (also passed to each listener). Raises RouterCooldownError for an
        unknown layer, a layer already cooling, a closed actuator, factor outside (0, 1], epsilon
        outside [0, 1) or steps below 1.
        """
        layer = self._check_layer(layer)
        factor, epsilon = float(factor), float(epsilon)
        if not 0.0 < factor <= 1.0:
            raise RouterCooldownError(f"factor multiplies the router's lr and must lie in (0, 1], not {factor}")
        if not 0.0 <= epsilon < 1.0:
            raise RouterCooldownError(f"epsilon is the jitter's half-width and must lie in [0, 1), not {epsilon}")
        if steps is not None and (isinstance(steps, bool) or int(steps) != steps or steps < 1):
            raise RouterCooldownError(f"steps counts optimizer steps and must be at least 1 (or None), not {steps!r}")
        with self._lock:
            if self.closed:
                raise RouterCooldownError("this RouterCooldown is closed; attach a new one")
            if layer in self._cooling:
                since = self._cooling[layer].started_step
                raise RouterCooldownError(f"layer {layer} is already cooling (since optimizer step {since}); "
                                          "end it first")
            now = self.optimizer_steps
            scheduled = self.scheduled_lr(layer)
            self._cooling[layer] = Cooling(factor=factor, epsilon=epsilon, started_step=now,
                                           ends_at_step=None if steps is None else now + int(steps), source=source,
                                           reason=reason)
            change = CooldownChange(at=dt.datetime.now(dt.timezone.utc), layer=layer, action="start",
                                    optimizer_step=now, lr_factor=factor, epsilon=epsilon, lr_before=scheduled,
                                    lr_after=scheduled * factor, reason=reason, source=source,
                                    steps=None if steps is None else int(steps))
            self.changes.append(change)
        self._notify(change)
        return change

    def end(self, layer: int, reason: str = "", *, source: str | None = None) -> CooldownChange | None:
        """End `layer`'s cooldown: lr and routing back to normal. Returns the change (also passed to
        each listener), or None when the layer was not cooling. Raises RouterCooldownError for an
        unknown layer."""
        layer = self._check_layer(layer)
        with self._lock:
            cooling = self._cooling.pop(layer, None)
            if cooling is None:
                return None
            now = self.optimizer_steps
            self._last_end[layer] = now
            scheduled = self.scheduled_lr(layer)
            change = CooldownChange(at=dt.datetime.now(dt.timezone.utc), layer=layer, action="end",
                                    optimizer_step=now, lr_factor=cooling.factor, epsilon=cooling.epsilon,
                                    lr_before=scheduled * cooling.factor, lr_after=scheduled, reason=reason,
                                    source=source or cooling.source, steps=now - cooling.started_step)
            self.changes.append(change)
        self._notify(change)
        return change

    def close(self, reason: str = "cooldown closed") -> list[CooldownChange]:
        """End every cooldown (`reason`), remove the hooks; safe twice. The param groups stay split,
        at the scheduled (parent's) lr. Returns the ends it made."""
        if self.closed:
            return []
        ended = [c for c in (self.end(layer, reason) for layer in sorted(self.cooling())) if c is not None]
        with self._lock:
            self.closed = True
            self._restore()
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
        return ended

    def _check_layer(self, layer: int) -> int:
        if int(layer) not in self.layers:
            raise RouterCooldownError(f"no MoE layer {layer}; the cooldown covers layers {sorted(self.layers)}")
        return int(layer)

    def _notify(self, change: CooldownChange) -> None:
        for listener in list(self.listeners):
            try:
                listener(change)
            except Exception:
                log.exception("routing cooldown listener failed")

    # -- hooks ---------------------------------------------------------------------------------

    def _failed(self) -> None:
        self.hook_errors += 1
        if self.on_error is not None:
            self.on_error()
        elif self.hook_errors == 1:
            log.exception("routing cooldown hook failed; training goes on as if the layer were not cooling")

    def _restore(self) -> None:
        """Put the scheduled lr back into every group the pre-hook scaled."""
        saved, self._saved = self._saved, {}
        for gi, lr in saved.items():
            self.optimizer.param_groups[gi]["lr"] = lr

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        try:
            with self._lock:
                self._restore()  # a step that raised after the last pre-hook left its groups scaled
                self.fit_scheduler()
                cooling = [(gi, c.factor) for layer, c in self._cooling.items() for gi in self._split.groups[layer]]
                saved = self._saved
                for gi, factor in cooling:
                    group = optimizer.param_groups[gi]
                    saved[gi] = group["lr"]
                    group["lr"] = group["lr"] * factor
        except Exception:
            self._failed()
            try:
                self._restore()
            except Exception:
                self._failed()

    def _post_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        try:
            with self._lock:
                self._restore()
                self.fit_scheduler()  # before the scheduler's step, which follows the optimizer's
                self.optimizer_steps += 1
                due = sorted(layer for layer, c in self._cooling.items()
                             if c.ends_at_step is not None and self.optimizer_steps >= c.ends_at_step)
            for layer in due:
                self.end(layer, "cooldown period over")
        except Exception:
            self._failed()

    def _generator(self, device: torch.device, layer: int) -> torch.Generator:
        key = (str(device), layer)
        generator = self._generators.get(key)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed * 1_000_003 + layer)
            self._generators[key] = generator
        return generator

    def _jitter_hook(self, layer: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            cooling = self._cooling.get(layer)
            if cooling is None or cooling.epsilon == 0 or not module.training:
                return None
            try:
                if args:
                    x = args[0]
                else:
                    name = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
                    x = kwargs[name]
                noise = torch.empty_like(x).uniform_(1.0 - cooling.epsilon, 1.0 + cooling.epsilon,
                                                     generator=self._generator(x.device, layer))
                jittered = x * noise  # a new tensor: whoever else reads x (the experts) sees it clean
                if args:
                    return (jittered, *args[1:]), kwargs
                return args, {**kwargs, name: jittered}
            except Exception:
                self._failed()
                return None
        return hook


# -- checkpoints in the layout the optimizer had before the split ---------------------------------

def _saved_unsplit(split: _Split) -> Callable:
    """A state_dict post-hook: the split's groups folded back into their parents, params in the order
    the optimizer had before the split; `state` (keyed by the same ids) is untouched."""
    def hook(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict | None:
        out = _unsplit(split, optimizer, state_dict) or state_dict["param_groups"]
        if split.owner is not None and out:  # the cooldown's state rides in the first group
            out = [{**out[0], COOLDOWN_STATE: split.owner.state()}, *out[1:]]
        return {**state_dict, "param_groups": out}
    return hook


def _unsplit(split: _Split, optimizer: torch.optim.Optimizer, state_dict: dict) -> list[dict] | None:
    """The saved param groups folded back into the layout before the split (None: nothing to fold)."""
    groups = optimizer.param_groups
    if len(state_dict["param_groups"]) != len(groups) or not split.parent:
        return None
    ids = dict(zip(map(id, chain.from_iterable(g["params"] for g in groups)),
                   chain.from_iterable(g["params"] for g in state_dict["param_groups"]), strict=True))
    names = {id(p): n for g in groups if "param_names" in g for p, n in zip(g["params"], g["param_names"],
                                                                              strict=True)}
    out = []
    for gi, saved in enumerate(state_dict["param_groups"]):
        if gi in split.parent:
            continue
        if gi < len(split.original) and any(p == gi for p in split.parent.values()):
            here = {id(p) for g in [gi, *(n for n, p in split.parent.items() if p == gi)]
                    for p in groups[g]["params"]}
            params = [p for p in split.original[gi] if id(p) in here]
            saved = {**saved, "params": [ids[id(p)] for p in params]}
            if "param_names" in saved:
                saved["param_names"] = [names[id(p)] for p in params]
        out.append(saved)
    return out


def _loaded_split(split: _Split) -> Callable:
    """A load_state_dict pre-hook: a state dict in the layout before the split is split the same way."""
    def hook(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict | None:
        groups = optimizer.param_groups
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(groups) - len(split.parent):
            return None  # already in the split layout, or not ours: torch checks it
        kept = [gi for gi in range(len(groups)) if gi not in split.parent]
        out: list[dict | None] = [None] * len(groups)
        for saved_index, gi in enumerate(kept):
            saved = saved_groups[saved_index]
            children = sorted(n for n, p in split.parent.items() if p == gi)
            if not children:
                out[gi] = saved
                continue
            before = split.original[gi]
            if len(saved["params"]) != len(before):
                return None  # not the layout this split came from: let torch say so
            by_param = dict(zip(map(id, before), saved["params"], strict=True))
            by_name = (dict(zip(map(id, before), saved["param_names"], strict=True))
                       if "param_names" in saved else None)
            for target in [gi, *children]:
                params = groups[target]["params"]
                piece = {k: v for k, v in saved.items() if _hyperparameter(k)}
                piece = {**piece, "params": [by_param[id(p)] for p in params]} if target != gi else {
                    **saved, "params": [by_param[id(p)] for p in params]}
                if by_name is not None:
                    piece["param_names"] = [by_name[id(p)] for p in params]
                out[target] = piece
        if any(g is None for g in out):
            return None
        return {**state_dict, "param_groups": out}
    return hook


def _loaded_state(split: _Split) -> Callable:
    """A load_state_dict post-hook: the checkpoint's cooldown state (which torch put into the first
    param group) becomes the open actuator's; without one open it waits there for the next attach."""
    def hook(optimizer: torch.optim.Optimizer) -> None:
        owner = split.owner
        if owner is None or owner.closed:
            return
        owner.load_state(take_saved(optimizer, COOLDOWN_STATE))
        owner.fit_scheduler()
    return hook
