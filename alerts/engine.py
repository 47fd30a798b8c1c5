"""The rules engine: windows of layer steps in, alert state transitions out.

`AlertEngine` is fed `LayerObservation`s (from the store by `alerts.storage.StoreAlertRunner`,
or from the live stream by `EngineExporter` inside the probe's pipeline) and, after each step,
evaluates every rule on every layer of that run. Each (rule, run, layer) is one alert with a
fingerprint over its labels, and moves through

    inactive -> pending -> firing -> resolved        (pending -> inactive if it clears early)

- `for`: the condition must hold that long (pending) before the alert fires.
- `cooldown`: a firing alert stays firing until its condition has been false that long, so a
  value hovering around the threshold neither flaps nor notifies twice.

Both are seconds of event time, or, where a rule writes `N steps`, that many steps (forwards).

Time is *event time*: the timestamps of the recorded steps, not the wall clock. Replaying a
recorded run therefore gives the same transitions as watching it live, and notifications keyed
on (fingerprint, episode start, status) are the same on every replay, which lets the outbox
drop the repeats of an engine that restarted.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import numpy as np

from moescope.alerts.observations import (
    TRAFFIC_SIGNALS,
    LayerHistory,
    LayerObservation,
    compute_signals,
    last_forwards,
    observations_from_record,
    summed_load,
)
from moescope.alerts.rules import Rule, RulePack
from moescope.core.exporters import AttachListener, Exporter
from moescope.core.records import RunInfo, StepRecord
from moescope.metrics.placement import LayerPlacements, Placement
from moescope.metrics.traffic import WireLayout

log = logging.getLogger(__name__)

MAX_HISTORY_STEPS = 4096  # bound on a time-based window's memory per layer

INACTIVE, PENDING, FIRING, RESOLVED = "inactive", "pending", "firing", "resolved"


def fingerprint(labels: dict[str, str]) -> str:
    """Return a stable 16-hex-digit id of an alert's label set."""
    text = json.dumps(sorted(labels.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class AlertTransition:
    """One change of one alert's state, as written to the `alerts` table and notified.

    Attributes:
        fingerprint: the alert's identity (a hash of its label set).
        alertname: the rule's name.
        state: the new state (inactive, pending, firing, resolved).
        previous_state: the state before.
        at: event time of the step that caused the change.
        step: that step.
        run_id: the run.
        layer: the MoE layer.
        severity: the rule's severity.
        expr: the rule's expression.
        labels: the full label set: alertname, severity, run_id, layer + the rule's.
        annotations: the rule's annotations.
        values: the signals of the rule's expression at `at` (None: undefined, NaN).
        starts_at: when this episode began (pending or firing since).
        ends_at: set on resolved, else None.
        source: what raised it: "rules", "health" (ExpertUnhealthy), "trust_gate" (TrustGateChanged).
        expert: the expert, for alerts about one expert; else None.
        reason: why the state changed when it was not the rule's verdict ("run ended"); else None.
        window_steps: the rule's window, in steps (None: a time window, or no rule).
        baseline_steps: the rule's baseline: its first steps.
    """

    fingerprint: str
    alertname: str
    state: str
    previous_state: str
    at: dt.datetime  # event time of the step that caused the change
    step: int
    run_id: str
    layer: int
    severity: str
    expr: str
    labels: dict[str, str]  # the full label set: alertname, severity, run_id, layer + the rule's
    annotations: dict[str, str]
    values: dict[str, float | None]  # the signals of the rule's expression at `at` (None: undefined, NaN)
    starts_at: dt.datetime  # when this episode began (pending or firing since)
    ends_at: dt.datetime | None  # set on resolved
    source: str = "rules"  # what raised it: "rules", "health" (ExpertUnhealthy), "trust_gate" (TrustGateChanged)
    expert: int | None = None  # for alerts about one expert
    reason: str | None = None  # why the state changed when it was not the rule's verdict ("run ended")
    window_steps: int | None = None  # the rule's window, in steps (None: a time window, or no rule)
    baseline_steps: int | None = None  # the rule's baseline: its first steps

    @property
    def notifies(self) -> bool:
        """Whether receivers hear of this change: only firing and resolved reach them."""
        return self.state in (FIRING, RESOLVED)

    def idempotency_key(self) -> str:
        """The key that makes a notification unique: fingerprint, episode, status.

        Returns:
            `"<fingerprint>:<starts_at, ISO>:<state>"`.
        """
        return f"{self.fingerprint}:{self.starts_at.isoformat()}:{self.state}"


def fire_once(pack: RulePack, values: dict[str, float], *, run_id: str, layer: int | None, source: str,
              step: int = 0, labels: dict[str, str] | None = None) -> list[AlertTransition]:
    """The firing transitions of the rules in `pack` that read only signals in `values` and hold for
    them: a figure judged once, with no window and no pending (`moescope mismatch`, `check`,
    `placement --rebalance`). A rule reading a signal `values` lacks is left out. `layer` None: a
    figure of the whole run (no layer label; the alerts table's layer column is nullable). `labels`
    go after run_id and layer, before the rule's own."""
    now = dt.datetime.now(dt.timezone.utc)
    out = []
    for rule in pack.rules:
        if not values or not set(rule.signals) <= set(values):
            continue
        if not rule.verdict(values):
            continue
        where = {} if layer is None else {"layer": str(layer)}
        names = {"alertname": rule.name, "severity": rule.severity, "run_id": run_id, **where, **(labels or {}),
                 **rule.labels}
        out.append(AlertTransition(
            fingerprint=fingerprint(names), alertname=rule.name, state=FIRING, previous_state=INACTIVE, at=now,
            step=step, run_id=run_id, layer=layer,  # type: ignore[arg-type]
            severity=rule.severity, expr=rule.expr, labels=names, annotations=dict(rule.annotations),
            values={signal: values[signal] for signal in rule.signals}, starts_at=now, ends_at=None,
            source=source))
    return out


@dataclass
class _AlertState:
    state: str = INACTIVE
    since: dt.datetime | None = None  # pending since, or firing since
    last_true: dt.datetime | None = None
    since_step: int = 0  # the same two as the last step of their observation, for step-counted rules
    last_true_step: int = 0


def _lasted(seconds: float, steps: int | None, start: dt.datetime, start_step: int, now: dt.datetime,
            now_step: int) -> bool:
    """Whether a `for` or `cooldown` of `seconds` (or of `steps` steps, where given) has passed."""
    if steps is not None:
        return now_step - start_step >= steps
    return (now - start).total_seconds() >= seconds


class TransitionSink(Protocol):
    """Where alert transitions go: the outbox (notifications), the `alerts` table's writer."""

    def handle(self, transitions: Sequence[AlertTransition]) -> None: ...


@runtime_checkable
class FlushableSink(TransitionSink, Protocol):
    """A sink that can be told to deliver or write what it holds (`alerts.outbox.Outbox`,
    `alerts.storage.AlertTableWriter`); False when that did not finish within `timeout_s`."""

    def flush(self, timeout_s: float = ...) -> bool: ...


BaselineLoader = Callable[[str, int, int], "np.ndarray | None"]  # (baseline run_id, layer, steps)


@dataclass
class _RunState:
    history: dict[int, LayerHistory] = field(default_factory=dict)
    baseline_parts: dict[int, list[LayerObservation]] = field(default_factory=lambda: defaultdict(list))
    baseline_forwards: dict[int, int] = field(default_factory=lambda: defaultdict(int))


class AlertEngine:
    """Evaluates a rule pack over per-layer windows and keeps every alert's state.

    Args:
        pack: the rules (`load_rules`, `default_rules`).
        baseline_loader: loads the baseline load of another run, when the pack's baseline names
            one: `(run_id, layer, first_steps) -> load or None`. None: such a baseline stays unknown.
        placement: experts on expert-parallel ranks for the rank and traffic signals (`RankImbalance`,
            ...; `moescope.metrics.placement.Placement`); None: those signals are no data.
    """

    def __init__(self, pack: RulePack, baseline_loader: BaselineLoader | None = None,
                 placement: Placement | None = None):
        self.pack = pack
        self.placement = placement
        self._layers = LayerPlacements(placement) if placement is not None else None
        self.baseline_loader = baseline_loader
        steps = max(pack.max_window_steps(), 1)
        if any(r.window.seconds for r in pack.rules):
            steps = MAX_HISTORY_STEPS
        self._history_steps = steps
        self._runs: dict[str, _RunState] = {}
        self._alerts: dict[str, _AlertState] = {}
        self._meta: dict[str, AlertTransition] = {}  # each alert's latest transition: what `finish` resolves
        self._external_baselines: dict[int, np.ndarray | None] = {}
        self.routed_experts: dict[int, int] = {}  # layer -> routed experts (zero experts left out of loads)

    # -- input ------------------------------------------------------------------------------

    def observe(self, obs: LayerObservation) -> None:
        """Add one layer step to its run's window; call `evaluate` once a step is complete.

        Args:
            obs: one layer's observation at one step (of one run).
        """
        run = self._runs.setdefault(obs.run_id, _RunState())
        history = run.history.get(obs.layer)
        if history is None:
            history = run.history[obs.layer] = LayerHistory(self._history_steps)
        history.append(obs)
        parts = run.baseline_parts[obs.layer]
        if self.pack.baseline.run_id is None and run.baseline_forwards[obs.layer] < self.pack.baseline.first_steps:
            parts.append(obs)  # the baseline is the first rows covering first_steps forwards
            run.baseline_forwards[obs.layer] += max(int(obs.forwards), 1)

    def baseline(self, run_id: str, layer: int) -> np.ndarray | None:
        """The baseline load for a layer.

        The pack's other run's (through `baseline_loader`), or the sum of this run's first rows covering
        the baseline's `first_steps` forwards.

        Args:
            run_id: the run.
            layer: the MoE layer.

        Returns:
            The load per expert, or None while it is not yet known.

        Raises:
            KeyError: for a run not observed (with a baseline from the run itself).
        """
        spec = self.pack.baseline
        if spec.run_id is not None:
            if layer not in self._external_baselines:
                loaded = self.baseline_loader(spec.run_id, layer, spec.first_steps) if self.baseline_loader else None
                self._external_baselines[layer] = loaded
            return self._external_baselines[layer]
        run = self._runs[run_id]
        if run.baseline_forwards.get(layer, 0) < spec.first_steps:
            return None
        return np.sum([o.expert_load for o in run.baseline_parts[layer]], axis=0)

    def baseline_rows(self, run_id: str, layer: int) -> list[LayerObservation] | None:
        """The run's own baseline rows for a layer (its first rows covering the baseline's `first_steps`
        forwards); None while they do not cover them yet, or when the pack's baseline is another run
        (whose load alone is loaded).

        Raises:
            KeyError: for a run not observed.
        """
        run = self._runs[run_id]
        spec = self.pack.baseline
        if spec.run_id is not None or run.baseline_forwards.get(layer, 0) < spec.first_steps:
            return None
        return run.baseline_parts[layer]

    # -- evaluation -------------------------------------------------------------------------

    def signals(self, rule: Rule, run_id: str, layer: int) -> dict[str, float]:
        """The values of the rule's signals over its window for one layer.

        Args:
            rule: a rule of the pack.
            run_id: an observed run.
            layer: an observed layer of that run.

        Returns:
            {signal: value}.

        Raises:
            KeyError: for a run or layer not observed.
        """
        window = self._runs[run_id].history[layer].window(rule.window)
        return compute_signals(window, rule.signals, self.baseline(run_id, layer), self.routed_experts.get(layer),
                               self.rank_shares(layer, window),
                               self.wire_layout(layer, window) if TRAFFIC_SIGNALS.keys() & set(rule.signals) else None,
                               self.baseline_rows(run_id, layer))

    @property
    def rank_node(self) -> np.ndarray | None:
        """(R,) the node of each expert-parallel rank, for the traffic signals; None without a placement.
        Nodes of `moescope.metrics.traffic.DEFAULT_RANKS_PER_NODE` ranks unless set."""
        return None if self._layers is None else self._layers.rank_node

    @rank_node.setter
    def rank_node(self, rank_node: np.ndarray | None) -> None:
        if self.placement is not None:
            self._layers = LayerPlacements(self.placement, rank_node)

    def _experts(self, layer: int, window: list[LayerObservation]) -> int:
        return self.routed_experts.get(layer) or int(np.size(window[-1].expert_load))

    def wire_layout(self, layer: int, window: list[LayerObservation]) -> WireLayout | None:
        """The placement of a layer with its ranks' nodes, for the traffic signals (None: no placement,
        or one that does not fit the layer: those signals are then no data)."""
        if self._layers is None or not window:
            return None
        return self._layers.wire(layer, self._experts(layer, window))

    def rank_shares(self, layer: int, window: list[LayerObservation]) -> np.ndarray | None:
        """The (routed experts, ranks) shares of `placement` for a layer (None: no placement, or one that
        does not fit the layer: the rank signals are then no data)."""
        if self._layers is None or not window:
            return None
        return self._layers.shares(layer, self._experts(layer, window))

    def evaluate(self, run_id: str) -> list[AlertTransition]:
        """Evaluate every rule on every layer of the run at its latest step.

        Args:
            run_id: the run; one not observed gives no changes.

        Returns:
            The state changes, in rule then layer order.
        """
        run = self._runs.get(run_id)
        if run is None:
            return []
        out: list[AlertTransition] = []
        for rule in self.pack.rules:
            for layer, history in sorted(run.history.items()):
                if not history.items:
                    continue
                latest = history.items[-1]
                values = self.signals(rule, run_id, layer)
                verdict = rule.verdict(values)
                if verdict is None:
                    continue  # no data: leave the alert where it is
                out.extend(self._step(rule, latest, verdict, values))
        return out

    def _labels(self, rule: Rule, run_id: str, layer: int) -> dict[str, str]:
        labels = dict(rule.labels)
        labels.update(alertname=rule.name, severity=rule.severity, run_id=run_id, layer=str(layer))
        return labels

    def _step(self, rule: Rule, obs: LayerObservation, active: bool, values: dict[str, float]) -> list[AlertTransition]:
        labels = self._labels(rule, obs.run_id, obs.layer)
        fp = fingerprint(labels)
        st = self._alerts.setdefault(fp, _AlertState())
        now = obs.ts
        now_step = obs.step + obs.forwards - 1
        changes: list[tuple[str, str]] = []

        def move(new: str) -> None:
            changes.append((st.state, new))
            st.state = new

        if active:
            st.last_true, st.last_true_step = now, now_step
            if st.state in (INACTIVE, RESOLVED):
                st.since, st.since_step = now, now_step
                move(PENDING)
            if st.state == PENDING and st.since is not None \
                    and _lasted(rule.for_s, rule.for_steps, st.since, st.since_step, now, now_step):
                st.since, st.since_step = now, now_step
                move(FIRING)
        else:
            if st.state == PENDING:
                move(INACTIVE)
            elif (st.state == FIRING and st.last_true is not None
                  and _lasted(rule.cooldown_s, rule.cooldown_steps, st.last_true, st.last_true_step, now, now_step)):
                move(RESOLVED)
        since = st.since
        if not changes or since is None:  # nothing changed (an alert never active has no episode)
            return []
        clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in values.items()}
        out = [
            AlertTransition(
                fingerprint=fp,
                alertname=rule.name,
                state=new,
                previous_state=old,
                at=now,
                step=obs.step,
                run_id=obs.run_id,
                layer=obs.layer,
                severity=rule.severity,
                expr=rule.expr,
                labels=labels,
                annotations=dict(rule.annotations),
                values=clean,
                starts_at=since,
                ends_at=now if new == RESOLVED else None,
                window_steps=rule.window.steps,
                baseline_steps=self.pack.baseline.first_steps,
            )
            for old, new in changes
        ]
        if out:
            self._meta[fp] = out[-1]
        return out

    def finish(self, run_id: str, at: dt.datetime | None = None, step: int | None = None,
               reason: str = "run ended") -> list[AlertTransition]:
        """End a run: resolve its firing alerts and drop its pending ones, with `reason`.

        A finished run produces no more data, so an event-time cooldown would keep its alerts firing
        for ever; this is the resolve Alertmanager gets as `endsAt`. The run's windows are kept: a run
        resumed later (a restarted writer) goes on from them.

        Args:
            run_id: the run.
            at: event time of the resolve; None: the run's latest observation's.
            step: step of the resolve; None: the run's latest observation's.
            reason: why, recorded on each transition.

        Returns:
            The transitions (none for an unknown run).
        """
        run = self._runs.get(run_id)
        latest = [h.items[-1] for h in (run.history.values() if run else ()) if h.items]
        if not latest:
            return []
        last = max(latest, key=lambda o: (o.step, o.ts))
        at = at or last.ts
        step = last.step if step is None else step
        out: list[AlertTransition] = []
        for fp, st in list(self._alerts.items()):
            meta = self._meta.get(fp)
            if meta is None or meta.run_id != run_id or st.state not in (PENDING, FIRING):
                continue
            new = RESOLVED if st.state == FIRING else INACTIVE
            assert st.since is not None  # pending or firing since then
            out.append(replace(meta, state=new, previous_state=st.state, at=at, step=step, starts_at=st.since,
                               ends_at=at if new == RESOLVED else None, reason=reason,
                               annotations={**meta.annotations, "resolved_reason": reason}))
            st.state = new
        return out

    def ingest(self, observations: Iterable[LayerObservation]) -> list[AlertTransition]:
        """Observe layer steps in (run, step) order, evaluating after each complete step.

        Args:
            observations: layer steps of one or more runs, in any order (they are sorted).

        Returns:
            Every state change, in order.
        """
        ordered = sorted(observations, key=lambda o: (o.run_id, o.step, o.layer))
        out: list[AlertTransition] = []
        for i, obs in enumerate(ordered):
            self.observe(obs)
            following = ordered[i + 1] if i + 1 < len(ordered) else None
            last_of_step = following is None or (following.run_id, following.step) != (obs.run_id, obs.step)
            if last_of_step:
                out.extend(self.evaluate(obs.run_id))
        return out

    def run_ids(self) -> list[str]:
        """The runs with observations.

        Returns:
            Their ids, in the order first seen.
        """
        return list(self._runs)

    def states(self) -> dict[str, str]:
        """The state of every alert seen so far.

        Returns:
            {fingerprint: state}.
        """
        return {fp: st.state for fp, st in self._alerts.items()}

    def window_load(self, run_id: str, layer: int, steps: int) -> np.ndarray:
        """A layer's expert load summed over its last forwards.

        Args:
            run_id: an observed run.
            layer: an observed layer of that run.
            steps: how many of the latest forwards to sum.

        Returns:
            The load per expert.

        Raises:
            KeyError: for a run or layer not observed.
        """
        return summed_load(last_forwards(list(self._runs[run_id].history[layer].items), steps))


def hand_to_sinks(transitions: Sequence[AlertTransition], sinks: Iterable[TransitionSink | None],
                  owner: str) -> int:
    """Give `transitions` to every sink (None ones skipped); returns how many sinks failed. A sink
    that raises is logged, never propagated: alerts are handed on the probe's writer thread, and a
    broken receiver must not stop the judging (the caller keeps the transitions)."""
    failed = 0
    for sink in sinks:
        if sink is None:
            continue
        try:
            sink.handle(transitions)
        except Exception:
            failed += 1
            log.exception("%s could not hand %d alert transition(s) to %s", owner, len(transitions),
                          type(sink).__name__)
    return failed


class EngineExporter(Exporter, AttachListener):
    """Runs the engine inside the probe's pipeline: an exporter fed the live StepRecords.

    Each exported batch is observed and evaluated; transitions go to every sink (the outbox
    dispatcher, the alerts-table writer). A sink that raises is counted (`sink_errors`), never
    propagated: the probe's worker thread must keep going. The last 1000 transitions are kept in
    `transitions`.

    Args:
        engine: the engine to run.
        sinks: where transitions go (`TransitionSink`s: `handle(transitions)`).
    """

    def __init__(self, engine: AlertEngine, sinks: Sequence[TransitionSink]):
        self.engine = engine
        self.sinks = list(sinks)
        self.transitions: list[AlertTransition] = []  # bounded: the most recent 1000
        self.sink_errors = 0
        self._closed = False

    def on_attach(self, run: RunInfo) -> None:
        """Take the layers' routed experts from the run; the probe calls this at attach.

        Zero experts are left out of load signals (see `moescope.metrics.signals`).

        Args:
            run: the run the probe attached as.
        """
        self.engine.routed_experts.update({info.layer: info.num_experts for info in run.layers})

    def export(self, records: Sequence[StepRecord]) -> bool:
        """Observe and evaluate a batch of records, and hand the transitions to the sinks.

        Args:
            records: a batch from the pipeline.

        Returns:
            False once shut down, or when a sink failed (counted); else True.
        """
        if self._closed:
            return False
        found: list[AlertTransition] = []
        for record in records:
            found.extend(self.engine.ingest(observations_from_record(record)))
        return self._hand(found)

    def _hand(self, transitions: list[AlertTransition]) -> bool:
        """Keep the last transitions and give them to every sink; False if a sink failed (counted).
        A bad sink never raises into the probe's writer thread or into closing."""
        if not transitions:
            return True
        self.transitions = (self.transitions + transitions)[-1000:]
        failed = hand_to_sinks(transitions, self.sinks, "the alerts engine")
        self.sink_errors += failed
        return not failed

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Flush the sinks that can be flushed (the outbox).

        Args:
            timeout_s: how long each sink may take, in seconds (default 30).

        Returns:
            True when every such sink flushed.
        """
        ok = True
        for sink in self.sinks:
            if isinstance(sink, FlushableSink):
                ok = bool(sink.flush(timeout_s)) and ok
        return ok

    def shutdown(self) -> None:
        """The probe's session closed: resolve its runs' open alerts ("run ended") and hand those on.

        Its runs have ended, so the sinks get the resolves before this exporter takes no more
        records; safe twice.
        """
        if self._closed:
            return
        self._closed = True
        self._hand([t for run_id in self.engine.run_ids() for t in self.engine.finish(run_id)])
