"""The routing cooldown policy: the RoutingCooldown rule in, router cooldowns, events and alerts out.

`CooldownPolicy` is an exporter in the probe's pipeline (it runs on the writer thread, never on the
model's). It feeds every record to its own `AlertEngine` holding one rule, the default pack's
`RoutingCooldown` (router entropy collapsed while the fullest expert is near capacity; thresholds,
window and `for` can be overridden in `CooldownConfig`), and drives a `moescope.probe.router_cooldown.RouterCooldown`:

- while the rule fires for a layer that is not cooling, the layer's cooldown starts (router lr
  times `factor`, router input jitter `epsilon`) for `period_steps` optimizer steps, unless a
  guard rail stops it: at most `max_share` of the layers cool at once (at least one may), and a
  layer cools again only `min_gap_steps` optimizer steps after its last cooldown ended. Of several
  candidates the lowest router entropy goes first. A stopped start is a 'blocked' row naming the
  rail (once per layer and rail until the layer cools or the rule resolves).
- the actuator ends the cooldown after exactly `period_steps` optimizer steps (its step hook
  counts them), and a rule still firing after `min_gap_steps` more starts another.
- the policy's copy of the rule resolves as soon as its condition is false (cooldown 0): a rule's
  `cooldown` delays notifications, it must not keep a recovered router cooling.

Every start, end and block is a row of the `routing_cooldown_events` table (store/schema.py); every
start and end, whoever made it (this policy, or `RouterCooldown.start/end` by hand), is also a
`RoutingCooldownApplied` alert transition (firing at the start, resolved at the end) written to the
store's `alerts` table and handed to `sink` (e.g. an `alerts.outbox.Outbox`, which delivers the
webhooks). Rows and alerts go to the run's one writer (`store.writer.run_writer`), through its
pipeline. When the session closes (`shutdown`), the cooldowns still on end with the reason
"run ended" and their alerts resolve (`finish`), then the actuator's hooks are removed.

Threads: starts happen on the writer thread; an end at the period's close happens in the
optimizer's step hook on the training thread, where the policy only queues the change: its row and
alert are written on the writer thread (at the next record, or the writer's idle flush).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moescope.alerts.engine import (
    FIRING,
    INACTIVE,
    RESOLVED,
    AlertEngine,
    AlertTransition,
    TransitionSink,
    fingerprint,
    hand_to_sinks,
)
from moescope.alerts.observations import observations_from_record
from moescope.alerts.rules import Baseline, Condition, Rule, RulePack, default_rules, parse_duration
from moescope.alerts.storage import AlertTableWriter
from moescope.core.exporters import Exporter
from moescope.core.records import StepRecord
from moescope.probe.optim import OptimizerLike, SchedulerLike
from moescope.probe.router_cooldown import CooldownChange, RouterCooldown, RouterCooldownError
from moescope.probe.session import ProbeSession
from moescope.store.location import StoreLocation
from moescope.store.writer import RunWriter, run_writer

log = logging.getLogger(__name__)

RULE_NAME = "RoutingCooldown"
ALERT_NAME = "RoutingCooldownApplied"
EVENTS_TABLE = "routing_cooldown_events"
SEVERITY = "warning"  # the training's hyperparameters were changed by automation, for a while


@dataclass(frozen=True)
class CooldownConfig:
    """What the cooldown policy watches and does; every field is checked at construction.

    Args:
        rule: the rule to act on: None (default) for the default pack's RoutingCooldown, or a `Rule`
            from your own pack (`alerts.rules.load_rules(path)`).
        thresholds: new thresholds for the rule's signals, its operators kept, e.g.
            {"router_entropy": 0.3}; None: the rule's own.
        window: the rule's window in forwards (None: the rule's; default pack: 32).
        for_duration: how long the condition must hold before the layer cools, in event time ("0s",
            "30s", 90; None: the rule's; default pack: "2m"). A `for` of minutes suits training steps
            of seconds; a CPU run of sub-second steps wants "0s" or a few seconds.
        factor: the router lr's multiplier while cooling, in (0, 1] (0.1 cools it ten times).
        epsilon: the router input jitter's half-width, in [0, 1) (Switch Transformer's 1e-2; 0 turns
            the jitter off).
        period_steps: a cooldown's length, in optimizer steps (at least 1).
        max_share: the largest share of the MoE layers cooling at once, in (0, 1] (at least one layer
            may cool whatever the share).
        min_gap_steps: optimizer steps from the end of a layer's cooldown before it may cool again.

    Raises:
        ValueError: for a field out of its range, a duration that cannot be read, a `rule` that is
            not a `Rule`, or a threshold for a signal the rule does not have (or not a finite number).
    """

    rule: Rule | None = None
    thresholds: Mapping[str, float] | None = None
    window: int | None = None
    for_duration: str | float | None = None
    factor: float = 0.1
    epsilon: float = 0.01
    period_steps: int = 100
    max_share: float = 0.25
    min_gap_steps: int = 100

    def __post_init__(self) -> None:
        def whole(name: str, value: Any, least: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"CooldownConfig.{name} counts optimizer steps and must be a whole number "
                                 f">= {least}, not {value!r}")

        if not isinstance(self.factor, (int, float)) or not 0 < self.factor <= 1:
            raise ValueError(f"CooldownConfig.factor multiplies the router's lr and must lie in (0, 1], "
                             f"not {self.factor!r} (0.1 cools it ten times)")
        if not isinstance(self.epsilon, (int, float)) or not 0 <= self.epsilon < 1:
            raise ValueError(f"CooldownConfig.epsilon is the router jitter's half-width and must lie in [0, 1), "
                             f"not {self.epsilon!r} (0.01 is Switch Transformer's; 0 turns the jitter off)")
        whole("period_steps", self.period_steps, 1)
        whole("min_gap_steps", self.min_gap_steps, 0)
        if not isinstance(self.max_share, (int, float)) or not 0 < self.max_share <= 1:
            raise ValueError(f"CooldownConfig.max_share is a share of the MoE layers and must lie in (0, 1], "
                             f"not {self.max_share!r}")
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 1):
            raise ValueError(f"CooldownConfig.window counts forwards and must be a whole number >= 1, "
                             f"not {self.window!r}")
        if self.for_duration is not None:
            try:
                parse_duration(self.for_duration)
            except (TypeError, ValueError) as e:
                raise ValueError(f"CooldownConfig.for_duration: {e}") from None
        if self.rule is not None and not isinstance(self.rule, Rule):
            raise ValueError("CooldownConfig.rule must be an alerts.rules.Rule (from load_rules or default_rules), "
                             f"not {type(self.rule).__name__}")
        rule = self.rule or _default_rule()
        for signal, value in (self.thresholds or {}).items():
            if signal not in rule.signals:
                raise ValueError(f"CooldownConfig.thresholds: {signal!r} is not a signal of {rule.name} "
                                 f"({rule.expr}); set thresholds of {', '.join(rule.signals)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"CooldownConfig.thresholds[{signal!r}] must be a finite number, not {value!r}")

    def resolved_rule(self) -> Rule:
        """The rule the policy evaluates: the chosen rule with the overrides applied.

        It resolves as soon as its condition is false (cooldown 0).

        Returns:
            The resolved `Rule`.
        """
        rule = self.rule or _default_rule()
        thresholds = dict(self.thresholds or {})
        conditions = tuple(Condition(c.signal, c.op, float(thresholds.get(c.signal, c.threshold)))
                           for c in rule.conditions)
        window = rule.window if self.window is None else dataclasses.replace(rule.window, steps=self.window,
                                                                             seconds=None)
        for_s = rule.for_s if self.for_duration is None else parse_duration(self.for_duration)
        return dataclasses.replace(rule, conditions=conditions, expr=" and ".join(str(c) for c in conditions),
                                   window=window, for_s=for_s, cooldown_s=0.0)


def _default_rule() -> Rule:
    return next(r for r in default_rules().rules if r.name == RULE_NAME)


def _number(value: Any) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


class CooldownPolicy(Exporter[StepRecord]):
    """Watches the RoutingCooldown rule and cools routers down; see the module docstring.

    Build it with `bind_cooldown`, which also builds the actuator and puts the policy into the
    session's pipeline. `rows` keeps every event row written, `alerts` every transition made.

    Args:
        config: what it watches and does; None: `CooldownConfig()`.
        sink: where its alert transitions go (e.g. an `alerts.outbox.Outbox`); None: only the
            store's `alerts` table.
    """

    def __init__(self, config: CooldownConfig | None = None, sink: TransitionSink | None = None):
        self.config = config or CooldownConfig()
        self.rule = self.config.resolved_rule()
        self.sink = sink
        self.engine = AlertEngine(RulePack(rules=(self.rule,), baseline=Baseline(), source="cooldown policy"))
        self.actuator: RouterCooldown | None = None
        self.session: ProbeSession | None = None
        self.run_id = ""
        self.rank = 0
        self.tables: RunWriter | None = None
        self.alert_table: AlertTableWriter | None = None
        self.rows: list[dict] = []
        self.alerts: list[AlertTransition] = []
        self.rule_transitions: collections.deque[AlertTransition] = collections.deque(maxlen=1000)
        self.last_step = 0
        self.last_ts: dt.datetime | None = None
        self._firing: set[int] = set()
        self._blocked: dict[int, str] = {}  # layer -> the rail that last stopped it (one row per rail)
        self._start_signals: dict[int, dict[str, float]] = {}
        self._episodes: dict[int, dt.datetime] = {}  # layer -> when its RoutingCooldownApplied fired
        self._changes: collections.deque[tuple[CooldownChange, int]] = collections.deque()
        self._lock = threading.RLock()
        self._closed = False

    # -- binding -------------------------------------------------------------------------------

    def bind(self, session: ProbeSession, actuator: RouterCooldown,
             store: str | os.PathLike | StoreLocation | None = None) -> CooldownPolicy:
        """Attach to a probe session's run and store folder, and to the actuator's changes.

        Changes the actuator made before the policy bound (a cooldown resumed from a checkpoint) are
        taken in too.

        Args:
            session: the probe session.
            actuator: the `RouterCooldown` that changes the routers' learning rates and jitter.
            store: where the event rows and alerts go; None: nowhere.

        Returns:
            The policy itself.
        """
        self.session = session
        self.actuator = actuator
        self.run_id = session.run.run_id
        self.rank = session.run.rank
        self.engine.routed_experts.update({info.layer: info.num_experts for info in session.run.layers})
        if store is not None:
            self.tables = run_writer(store, self.run_id, self.rank)  # what it cannot write lands in probe_stats
            self.alert_table = AlertTableWriter(store, self.rank)
        actuator.listeners.append(self._on_change)
        for change in actuator.changes:  # made before the policy bound: a cooldown resumed from a checkpoint
            self._on_change(change)
        return self

    def _on_change(self, change: CooldownChange) -> None:
        # Any thread (the training thread at a period's end): queue only, the writer thread writes.
        self._changes.append((change, self._forward_step()))

    def _forward_step(self) -> int:
        return self.last_step if self.session is None else int(self.session.step)

    # -- the exporter interface ----------------------------------------------------------------

    def export(self, records: Sequence[StepRecord]) -> bool:
        """Evaluate the rule on each record, start the cooldowns it calls for, write the changes' rows.

        Args:
            records: a batch from the pipeline.

        Returns:
            True (records after `shutdown` are ignored).
        """
        with self._lock:
            if self._closed:
                return True
            for record in records:
                self.last_step, self.last_ts = record.step, record.ts
                for transition in self.engine.ingest(observations_from_record(record)):
                    self.rule_transitions.append(transition)
                    if transition.state == FIRING:
                        self._firing.add(transition.layer)
                    elif transition.state in (RESOLVED, INACTIVE):
                        self._firing.discard(transition.layer)
                        self._blocked.pop(transition.layer, None)
            self._drain()  # ends the training thread made since the last batch free their rails
            self._decide()
            self._drain()
        return True

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Write the queued changes' rows and alerts, and everything handed to the run's writer.

        Args:
            timeout_s: how long each writer may take, in seconds (default 30).

        Returns:
            False if a writer did not finish in time, else True (also without a store).
        """
        with self._lock:
            self._drain()
        if self.tables is None or self.alert_table is None:  # no store: both None
            return True
        return self.alert_table.flush(timeout_s) and self.tables.flush(timeout_s)

    def shutdown(self) -> None:
        """The session closed: end what still cools ("run ended"), remove the actuator's hooks; safe twice."""
        with self._lock:
            if self._closed:
                return
            try:
                self.finish()
            finally:
                self._closed = True
                if self.actuator is not None:
                    self.actuator.close()
                    if self._on_change in self.actuator.listeners:
                        self.actuator.listeners.remove(self._on_change)
                self._drain()
                if self.alert_table is not None:
                    self.alert_table.close()
                if self.tables is not None:
                    self.tables.release()

    def finish(self, reason: str = "run ended") -> list[AlertTransition]:
        """End every cooldown in force with `reason` and resolve its alert.

        Args:
            reason: why, recorded on the events and transitions.

        Returns:
            The transitions made.
        """
        with self._lock:
            if self.actuator is not None:
                for layer in sorted(self.actuator.cooling()):
                    self.actuator.end(layer, reason)
            before = len(self.alerts)
            self._drain()
            return self.alerts[before:]

    # -- deciding ------------------------------------------------------------------------------

    def signals(self, layer: int) -> dict[str, float]:
        """The rule's signals over its window at the latest record of `layer`.

        Args:
            layer: the MoE layer.

        Returns:
            {signal: value}; empty before any record of the layer.
        """
        try:
            return self.engine.signals(self.rule, self.run_id, layer)
        except KeyError:
            return {}

    def _decide(self) -> None:
        actuator = self.actuator
        if actuator is None or actuator.closed:
            return
        cooling = set(actuator.cooling())
        candidates = [layer for layer in self._firing if layer not in cooling and layer in actuator.layers]
        values = {layer: self.signals(layer) for layer in candidates}

        def collapse(layer: int) -> tuple[float, int]:
            entropy = _number(values[layer].get("router_entropy"))
            return (math.inf if entropy is None else entropy, layer)

        for layer in sorted(candidates, key=collapse):
            kind, rail = self._guard_rail(layer, len(cooling))
            if rail:
                if self._blocked.get(layer) != kind:
                    self._blocked[layer] = kind
                    log.info("routing cooldown of layer %d not started: %s", layer, rail)
                    lr = actuator.lr_in_force(layer)
                    self._row(layer=layer, action="blocked", optimizer_step=actuator.optimizer_steps,
                              forward_step=self._forward_step(), at=dt.datetime.now(dt.timezone.utc),
                              lr_factor=self.config.factor, epsilon=self.config.epsilon, lr_before=lr, lr_after=lr,
                              reason=rail, source="auto", steps=None, values=values[layer])
                continue
            self._blocked.pop(layer, None)
            self._start_signals[layer] = values[layer]
            try:
                actuator.start(layer, self.config.factor, self.config.epsilon, self._reason(values[layer]),
                               steps=self.config.period_steps, source="auto")
            except RouterCooldownError as e:  # closed meanwhile, or started by hand just now
                self._start_signals.pop(layer, None)
                log.warning("routing cooldown of layer %d not started: %s", layer, e)
                continue
            cooling.add(layer)

    def _guard_rail(self, layer: int, cooling: int) -> tuple[str, str]:
        """(rail, why) when a rail stops `layer` from cooling now, ('', '') when none does."""
        actuator = self.actuator
        assert actuator is not None  # asked only while one is bound
        layers = len(actuator.layers)
        limit = max(1, math.floor(self.config.max_share * layers + 1e-9))
        if cooling + 1 > limit:
            return "max_share", (f"guard rail: at most {limit} of {layers} MoE layers cool at once "
                                 f"(max_share {self.config.max_share:g}); {cooling} cooling now")
        last = actuator.last_end_step(layer)
        if last is not None and actuator.optimizer_steps - last < self.config.min_gap_steps:
            return "min_gap", (f"guard rail: layer {layer}'s last cooldown ended "
                               f"{actuator.optimizer_steps - last} optimizer steps ago; min_gap_steps is "
                               f"{self.config.min_gap_steps}")
        return "", ""

    def _reason(self, values: Mapping[str, float]) -> str:
        held = ", ".join(f"{c.signal} {values.get(c.signal, float('nan')):.3g} {c.op} {c.threshold:g}"
                         for c in self.rule.conditions)
        return f"{self.rule.name} fired: {held}"

    # -- events and alerts ---------------------------------------------------------------------

    def _drain(self) -> None:
        """Write the row and the alert of every change queued so far, in order."""
        while self._changes:
            change, forward_step = self._changes.popleft()
            if change.action == "start":
                values = self._start_signals.pop(change.layer, None)
                values = self.signals(change.layer) if values is None else values
            else:
                values = self.signals(change.layer)
            self._row(layer=change.layer, action=change.action, optimizer_step=change.optimizer_step,
                      forward_step=forward_step, at=change.at, lr_factor=change.lr_factor, epsilon=change.epsilon,
                      lr_before=change.lr_before, lr_after=change.lr_after, reason=change.reason,
                      source=change.source, steps=change.steps, values=values)
            self._alert(change, forward_step, values)

    def _row(self, *, layer: int, action: str, optimizer_step: int, forward_step: int, at: dt.datetime,
             lr_factor: float, epsilon: float, lr_before: float, lr_after: float, reason: str, source: str,
             steps: int | None, values: Mapping[str, float]) -> None:
        row = dict(run_id=self.run_id, step=optimizer_step, forward_step=forward_step, ts=at, layer=layer,
                   action=action, lr_factor=lr_factor, epsilon=epsilon, lr_before=lr_before, lr_after=lr_after,
                   reason=reason, router_entropy=_number(values.get("router_entropy")),
                   capacity_use=_number(values.get("capacity_use")), source=source, period_steps=steps,
                   rank=self.rank)
        self.rows.append(row)
        if self.tables is not None:
            try:
                self.tables.emit(EVENTS_TABLE, [row])  # written on the writer's thread; a refused write is counted
            except Exception:  # a row that does not fit must not stop the policy
                log.exception("could not write a %s row", EVENTS_TABLE)

    def _alert(self, change: CooldownChange, forward_step: int, values: Mapping[str, float]) -> None:
        labels = {"alertname": ALERT_NAME, "severity": SEVERITY, "run_id": self.run_id, "layer": str(change.layer)}
        if change.action == "start":
            self._episodes[change.layer] = change.at  # each cooldown is its own notification
            state, previous, starts = FIRING, INACTIVE, change.at
            summary = (f"layer {change.layer}: router lr x{change.lr_factor:g} ({change.lr_before:.3g} -> "
                       f"{change.lr_after:.3g}) and router jitter {change.epsilon:g}"
                       + (f" for {change.steps} optimizer steps" if change.steps else ""))
        else:
            state, previous, starts = RESOLVED, FIRING, self._episodes.pop(change.layer, change.at)
            summary = (f"layer {change.layer}: routing cooldown ended after {change.steps} optimizer steps "
                       f"({change.reason}); router lr back to {change.lr_after:.3g}")
        numbers: dict[str, float | None] = {
            "lr_factor": change.lr_factor, "epsilon": change.epsilon, "lr_before": change.lr_before,
            "lr_after": change.lr_after, "optimizer_step": float(change.optimizer_step),
            **{k: v for k, v in values.items() if _number(v) is not None}}
        transition = AlertTransition(
            fingerprint=fingerprint(labels), alertname=ALERT_NAME, state=state, previous_state=previous,
            at=change.at, step=forward_step, run_id=self.run_id, layer=change.layer, severity=SEVERITY,
            expr=self.rule.expr, labels=labels,
            annotations={"summary": summary, "reason": change.reason, "source": change.source,
                         "optimizer_step": str(change.optimizer_step)},
            values=numbers, starts_at=starts, ends_at=change.at if state == RESOLVED else None, source="cooldown",
            reason=None if state == FIRING else change.reason, window_steps=self.rule.window.steps)
        self.alerts.append(transition)
        hand_to_sinks([transition], (self.alert_table, self.sink), "the cooldown policy")


def bind_cooldown(session: ProbeSession, optimizer: OptimizerLike, scheduler: SchedulerLike | None = None,
                  config: CooldownConfig | None = None, store: str | os.PathLike | StoreLocation | None = None,
                  sink: TransitionSink | None = None) -> CooldownPolicy:
    """Cool `session`'s MoE routers down while they collapse: returns the running policy.

    Builds the actuator (`moescope.probe.router_cooldown.RouterCooldown` over the session's layers: the router param
    groups are split from `optimizer` now, and `scheduler`'s per-group lists extended), the policy
    (`config`, default `CooldownConfig()`), writes events and alerts under `store` (a folder, or
    None) and hands alerts to `sink` (e.g. an `alerts.outbox.Outbox`). The policy joins the session's
    pipeline; closing the session ends what cools ("run ended") and removes the actuator's hooks.

    Raises ValueError for a closed session, and RouterCooldownError (a ValueError) when the optimizer
    does not hold every router parameter or the scheduler does not match it.
    """
    if session.closed:
        raise ValueError("the probe session is closed; bind the cooldown to an open session")
    if config is not None and not isinstance(config, CooldownConfig):
        raise ValueError(f"config must be an alerts.cooldown_policy.CooldownConfig, not {type(config).__name__}")
    actuator = RouterCooldown(session.layers, optimizer, scheduler, on_error=session.count_hook_error)
    try:
        policy = CooldownPolicy(config, sink).bind(session, actuator, store)
    except BaseException:
        actuator.close()
        raise
    session.add_exporter(policy)
    return policy
