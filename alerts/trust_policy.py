"""The trust policy: expert-health scores in, trust-gate weights, events and alerts out.

`TrustPolicy` is an exporter in the probe's pipeline (it runs on the writer thread, never on
the model's). For every record it feeds the `HealthScorer`; for every closed window it writes the
scores to the `expert_health` table and judges each (layer, expert):

- bad after `gate_after` consecutive windows scoring below `bad_below`: the `ExpertUnhealthy`
  alert fires and, when the gate is "auto", the expert's weight goes to `gated_weight` (0: masked);
- good after `lift_after` consecutive windows scoring at least `good_above`: the alert resolves
  and the weight goes back to 1. Between the two thresholds nothing changes (hysteresis).
- a dead expert (low load and nothing else wrong) is alerted but not gated: it gets no tokens, so
  gating it would change nothing.
- guard rails: the policy never gates more than `max_gated_share` of a layer's experts, and never
  leaves fewer than `min_active` (default: the layer's k) ungated; the worst score goes first.
  A judgement the rails stop is still alerted, annotated with the rail that stopped it.

Every change of the gate, whoever made it (this policy, `override`, or a direct
`TrustGate.set`), is written to the `trust_gate_events` table and sent as a `TrustGateChanged`
alert (firing when the weight drops below 1, resolved when it is back at 1) through `sink`, e.g.
an `alerts.outbox.Outbox`, which delivers to the configured notifiers. Every ExpertUnhealthy and
TrustGateChanged transition also lands in the store's `alerts` table, next to the rules engine's.
When the session closes, what is still firing resolves with the reason "run ended" (`finish`).
Every row goes to the run's one writer (`store.writer.run_writer`), through its pipeline: the
write happens on the writer's thread, and a failed one is counted in `probe_stats`.

`override(layer, expert, weight, reason)` pins an expert's weight: the policy leaves a pinned
expert alone until `release(layer, expert)` hands it back (at weight 1).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from moescope.alerts.engine import (
    FIRING,
    INACTIVE,
    RESOLVED,
    AlertTransition,
    TransitionSink,
    fingerprint,
    hand_to_sinks,
)
from moescope.alerts.health_score import ExpertHealth, HealthConfig, HealthScorer
from moescope.alerts.storage import AlertTableWriter
from moescope.core.exporters import Exporter
from moescope.core.records import StepRecord
from moescope.probe.options import TRUST_GATE_MODES
from moescope.probe.session import ProbeSession
from moescope.probe.trust_gate import GateChange, GatePolicy, TrustGate, TrustGateError
from moescope.store.errors import StoreError
from moescope.store.location import StoreLocation, open_location
from moescope.store.store import Store
from moescope.store.writer import RunWriter, run_writer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrustPolicyConfig:
    """How the trust policy judges and gates experts; every field is checked at construction.

    See `alerts.trust_policy`'s module docstring for the judgement (hysteresis between the two
    thresholds, guard rails).

    Args:
        bad_below: a window scoring below this (0 to 100) counts as bad.
        good_above: a window scoring at least this counts as good.
        gate_after: consecutive bad windows before the expert is judged unhealthy (the alert fires;
            in "auto" mode it is gated).
        lift_after: consecutive good windows before the alert resolves and the weight goes back to 1.
        gated_weight: the trust weight of a gated expert, in [0, 1) (0: masked).
        max_gated_share: the largest share of a layer's experts the policy gates.
        min_active: the fewest experts of a layer left ungated; None: the layer's k.
        gate_on: health components whose failure lets the policy gate, of load, confidence, output,
            weight, grad. Load and confidence describe what the router does with the expert (a
            traffic shift moves them too); output, weight and gradient describe the expert's own
            computation. An expert that is only unusual in routing is alerted, not gated.

    Raises:
        ValueError: unless 0 <= bad_below <= good_above <= 100, for gate_after or lift_after below 1,
            gated_weight outside [0, 1), or gate_on empty or naming an unknown component.
    """
    bad_below: float = 40.0
    good_above: float = 70.0
    gate_after: int = 2
    lift_after: int = 3
    gated_weight: float = 0.0
    max_gated_share: float = 0.25
    min_active: int | None = None  # None: the layer's k
    # Components whose failure lets the policy gate. Load and confidence describe what the router
    # does with the expert (a traffic shift moves them too); output, weight and gradient describe
    # the expert's own computation. An expert that is only unusual in routing is alerted, not gated.
    gate_on: tuple[str, ...] = ("output", "weight", "grad")

    def __post_init__(self) -> None:
        if not 0 <= self.bad_below <= self.good_above <= 100:
            raise ValueError("need 0 <= bad_below <= good_above <= 100")
        if self.gate_after < 1 or self.lift_after < 1:
            raise ValueError("gate_after and lift_after count windows and must be at least 1")
        if not 0 <= self.gated_weight < 1:
            raise ValueError("gated_weight must lie in [0, 1)")
        unknown = set(self.gate_on) - {"load", "confidence", "output", "weight", "grad"}
        if unknown or not self.gate_on:
            raise ValueError(f"gate_on names health components (load, confidence, output, weight, grad), "
                             f"not {sorted(unknown) or 'nothing'}")


@dataclass
class _Judgement:
    bad_run: int = 0
    good_run: int = 0
    unhealthy: bool = False
    since: dt.datetime | None = None


class TrustPolicy(Exporter[StepRecord], GatePolicy):
    """Scores, judges and (mode "auto") gates; see the module docstring.

    Build it with its configuration and a sink, pass it to `moescope.attach(..., trust_policy=)`
    (or let `attach` build a default one), and the session binds it to its gate and store.
    """

    def __init__(self, config: TrustPolicyConfig | None = None, health: HealthConfig | None = None,
                 sink: TransitionSink | None = None, max_buffer_rows: int = 4096, max_age_s: float = 5.0,
                 accept_requests: bool = False, request_poll_s: float = 2.0, keep_rows: int = 65536):
        """Make a policy; it does nothing until a session binds it (`bind`).

        Args:
            config: the judgement's thresholds and guard rails; None: `TrustPolicyConfig()`.
            health: the health score's configuration; None: the defaults.
            sink: where ExpertUnhealthy and TrustGateChanged transitions go (e.g. an
                `alerts.outbox.Outbox`); None: only the store's `alerts` table.
            max_buffer_rows: health rows buffered before they are handed to the writer (default 4096).
            max_age_s: seconds after the first buffered row at which they are handed over (default 5).
            accept_requests: apply the dashboard's trust-gate requests from the store
                (`apply_requests`). Default False.
            request_poll_s: seconds between two reads of the requests (default 2).
            keep_rows: the latest health rows kept in memory for in-process readers (`health_rows`);
                every row goes to the store's `expert_health` table, so a long run's memory stays bounded.
        """
        self.config = config or TrustPolicyConfig()
        self.scorer = HealthScorer(health)
        self.sink = sink
        self.mode: str | None = None
        self.gate: TrustGate | None = None
        self.session: ProbeSession | None = None
        self.root: StoreLocation | None = None  # the store (a folder or a URL, with its storage options)
        self.run_id = ""
        self.rank = 0
        self.top_k: dict[int, int] = {}
        self.num_experts: dict[int, int] = {}
        self.pinned: set[tuple[int, int]] = set()
        self.judgements: dict[tuple[int, int], _Judgement] = {}
        self.health_rows: deque[ExpertHealth] = deque(maxlen=keep_rows)  # the latest rows scored
        self.events: list[GateChange] = []
        self.alerts: list[AlertTransition] = []
        self._episodes: dict[tuple[int, int], dt.datetime] = {}
        self._buffer: list[dict] = []
        self._first_at: float | None = None
        self._lock = threading.RLock()
        self.max_buffer_rows = max_buffer_rows
        self.max_age_s = max_age_s
        self.last_step = 0
        self.last_ts: dt.datetime | None = None
        self.alert_table: AlertTableWriter | None = None  # every transition also lands in the `alerts` table
        # Gate requests written into the store by another process (the dashboard started with
        # --allow-writes). Off unless the model's owner opts in here too: a file in a folder
        # must not be able to change a running model by default.
        self.accept_requests = accept_requests
        self.request_poll_s = request_poll_s
        self.applied_requests: dict[str, str] = {}  # request_id -> what happened
        self._requests: Store | None = None  # the store read for requests, opened at the first poll
        self._polled_at = 0.0
        self.tables: RunWriter | None = None

    # -- binding -------------------------------------------------------------------------------

    def bind(self, session: ProbeSession, mode: str | None,
             store: str | os.PathLike | StoreLocation | None) -> TrustPolicy:
        """Attach to a probe session: its run, layers, gate (if any) and store folder.

        Args:
            session: the probe session.
            mode: the trust gate's mode (`probe.TRUST_GATE_MODES`: None, "manual", "auto").
            store: where the health rows, gate events and alerts go; None: nowhere.

        Returns:
            The policy itself.

        Raises:
            ValueError: for an unknown mode.
        """
        if mode not in TRUST_GATE_MODES:
            raise ValueError(f"trust_gate must be one of None, 'manual', 'auto', not {mode!r}")
        self.session = session
        self.mode = mode
        self.gate = session.gate
        self.root = None if store is None else open_location(store)
        self.run_id = session.run.run_id
        self.rank = session.run.rank
        # health rows, gate events and alerts go to the run's one writer; what it cannot write is
        # counted in the run's probe_stats
        self.tables = None if self.root is None else run_writer(self.root, self.run_id, self.rank)
        self.alert_table = None if self.root is None else AlertTableWriter(self.root, self.rank)
        for info in session.run.layers:
            self.top_k[info.layer] = info.top_k
            self.num_experts[info.layer] = info.num_experts
            self.scorer.set_experts(info.layer, info.num_experts)
        if self.gate is not None:
            self.gate.listeners.append(self._on_change)
        return self

    # -- the exporter interface ----------------------------------------------------------------

    def export(self, records: Sequence[StepRecord]) -> bool:
        """Score each record, judge the closed windows, poll requests when due, hand buffered rows on.

        Args:
            records: a batch from the pipeline.

        Returns:
            True.
        """
        for record in records:
            self.last_step, self.last_ts = record.step, record.ts
            rows = self.scorer.observe(record)
            if rows:
                self.judge(rows, record.step)
        if self.accept_requests and time.monotonic() - self._polled_at >= self.request_poll_s:
            self.apply_requests()
        self._write_due()
        return True

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Write the buffered health rows, and everything handed to the run's writer so far.

        Args:
            timeout_s: how long each writer may take, in seconds (default 30).

        Returns:
            False if a writer did not finish in time, else True (also without a store).
        """
        self._write_health()
        if self.tables is None or self.alert_table is None:  # no store: both None
            return True
        return self.alert_table.flush(timeout_s) and self.tables.flush(timeout_s)

    def shutdown(self) -> None:
        """The session closed: resolve what is still open ("run ended"), write what is buffered.

        Then give the run's writer back. Safe to call twice.
        """
        self.finish()
        self._write_health()
        if self.gate is not None and self._on_change in self.gate.listeners:
            self.gate.listeners.remove(self._on_change)
        if self._requests is not None:
            self._requests.close()
            self._requests = None
        if self.alert_table is not None:
            self.alert_table.close()
        if self.tables is not None:
            tables, self.tables = self.tables, None
            tables.release()

    # -- judging -------------------------------------------------------------------------------

    def judge(self, rows: list[ExpertHealth], step: int) -> None:
        """Record and judge the scored rows of closed windows (gating in "auto" mode).

        Args:
            rows: health scores of (layer, expert) for closed windows.
            step: the step they were scored at.
        """
        cfg = self.config
        with self._lock:
            self.health_rows.extend(rows)
            self._buffer.extend(row.as_row() | {"rank": self.rank} for row in rows)
            self._first_at = self._first_at or time.monotonic()
            to_gate: list[ExpertHealth] = []
            to_lift: list[ExpertHealth] = []
            for row in rows:
                key = (row.layer, row.expert)
                j = self.judgements.setdefault(key, _Judgement())
                if row.score < cfg.bad_below:
                    j.bad_run, j.good_run = j.bad_run + 1, 0
                elif row.score >= cfg.good_above:
                    j.good_run, j.bad_run = j.good_run + 1, 0
                else:
                    j.bad_run = j.good_run = 0
                if not j.unhealthy and j.bad_run >= cfg.gate_after:
                    to_gate.append(row)
                elif j.unhealthy and j.good_run >= cfg.lift_after:
                    to_lift.append(row)
            for row in to_lift:
                self._lift(row, step)
            for row in sorted(to_gate, key=lambda r: r.score):
                self._gate(row, step)

    def _gate(self, row: ExpertHealth, step: int) -> None:
        key = (row.layer, row.expert)
        j = self.judgements[key]
        j.unhealthy, j.since = True, row.ts
        action = "not gated: trust gate off" if self.mode != "auto" else ""
        failing = [name for name in self.config.gate_on
                   if getattr(row, name) is not None and getattr(row, name) < self.config.bad_below]
        dead = (row.load is not None and row.load < self.config.bad_below and row.load_share_ratio is not None
                and row.load_share_ratio < 1)
        if self.mode == "auto" and key not in self.pinned and not failing:
            action = ("not gated: a dead expert gets no tokens, gating it would change nothing" if dead else
                      "not gated: only its routing looks wrong (" + ", ".join(
                          n for n in ("load", "confidence")
                          if getattr(row, n) is not None and getattr(row, n) < self.config.bad_below)
                      + "); its own outputs and weights are fine")
        elif self.mode == "auto" and key not in self.pinned:
            blocked = self._guard_rail(row.layer)
            if blocked:
                action = f"not gated: {blocked}"
            else:
                reason = f"score {row.score:.1f} < {self.config.bad_below:g} for {j.bad_run} windows: {row.reasons}"
                try:
                    self._require_gate().set(row.layer, row.expert, self.config.gated_weight, reason,
                                             score=row.score, source="auto", step=step)
                    action = f"gated to {self.config.gated_weight:g}"
                except TrustGateError as e:
                    action = f"not gated: {e}"
        elif key in self.pinned:
            action = "not gated: pinned by an operator override"
        self._notify_health(row, FIRING, INACTIVE, step, action)

    def _lift(self, row: ExpertHealth, step: int) -> None:
        key = (row.layer, row.expert)
        j = self.judgements[key]
        j.unhealthy = False
        action = ""
        if self.mode == "auto" and key not in self.pinned and self._require_gate().weight(*key) < 1:
            reason = f"score {row.score:.1f} >= {self.config.good_above:g} for {j.good_run} windows"
            self._require_gate().set(row.layer, row.expert, 1.0, reason, score=row.score, source="auto", step=step)
            action = "gate lifted"
        self._notify_health(row, RESOLVED, FIRING, step, action)

    def _guard_rail(self, layer: int) -> str:
        """Why gating one more expert of `layer` is not allowed, or '' if it is."""
        experts = self.num_experts[layer]
        gated = int((self._require_gate().weights(layer) < 1).sum())
        limit = int(self.config.max_gated_share * experts)
        if gated + 1 > limit:
            return f"guard rail: at most {self.config.max_gated_share:.0%} of layer {layer} ({limit} experts) gated"
        min_active = self.config.min_active if self.config.min_active is not None else self.top_k[layer]
        if experts - gated - 1 < min_active:
            return f"guard rail: at least {min_active} experts of layer {layer} stay ungated"
        return ""

    # -- the operator's API --------------------------------------------------------------------

    def override(self, layer: int, expert: int, weight: float, reason: str) -> GateChange | None:
        """Pin an expert's trust weight; the policy leaves it alone until `release`.

        Args:
            layer: the MoE layer.
            expert: the expert.
            weight: its trust weight, in [0, 1].
            reason: why, recorded on the gate event.

        Returns:
            The change, or None when the weight was already so.

        Raises:
            TrustGateError: (from the gate) for a bad layer, expert or weight.
            RuntimeError: when no gate is installed (attach with trust_gate="manual" or "auto").
        """
        gate = self._require_gate()
        with self._lock:
            change = gate.set(layer, expert, weight, reason, source="override", step=self._step())
            self.pinned.add((int(layer), int(expert)))
        return change

    def release(self, layer: int, expert: int, reason: str = "override released") -> GateChange | None:
        """Un-pin an expert and put its weight back to 1; the policy judges it again from here.

        Args:
            layer: the MoE layer.
            expert: the expert.
            reason: why, recorded on the gate event.

        Returns:
            The change, or None when the weight was already 1.

        Raises:
            TrustGateError: (from the gate) for a bad layer or expert.
            RuntimeError: when no gate is installed.
        """
        gate = self._require_gate()
        with self._lock:
            self.pinned.discard((int(layer), int(expert)))
            self.judgements.pop((int(layer), int(expert)), None)
            return gate.set(layer, expert, 1.0, reason, source="override", step=self._step())

    def apply_requests(self) -> dict[str, str]:
        """Apply the store's new `trust_gate_requests` rows for this run, each request_id once.

        A request the gate refuses (bad expert, guard rail) is recorded with the error and not retried;
        when the store cannot be read, the poll is skipped with a warning and the next one reads again.
        The rows come from the store's query (`Store.gate_requests`), which leaves out damaged files.

        Returns:
            {request_id: outcome} of the requests handled in this call (empty without a store or gate).
        """
        self._polled_at = time.monotonic()
        if self.root is None or self.gate is None:
            return {}
        try:
            if self._requests is None:
                self._requests = Store(self.root, verify=False)  # footers only: this runs on the writer thread
            else:
                self._requests.refresh()
            requests = self._requests.gate_requests(self.run_id)
        except StoreError as e:  # a store that cannot be read now must not stop the policy
            log.warning("cannot read gate requests from %s: %s", self.root, e)
            return {}
        handled: dict[str, str] = {}
        for row in requests.itertuples(index=False):
            if row.request_id in self.applied_requests:
                continue
            reason = f"{row.reason} (requested by {row.requested_by}, request {row.request_id[:8]})"
            try:
                if row.action == "release":
                    self.release(int(row.layer), int(row.expert), reason)
                elif row.action == "override":
                    self.override(int(row.layer), int(row.expert), float(row.weight), reason)
                else:
                    raise ValueError(f"unknown action {row.action!r}")
                outcome = "applied"
            except (TrustGateError, ValueError) as e:
                outcome = f"refused: {e}"
                log.warning("gate request %s refused: %s", row.request_id, e)
            self.applied_requests[row.request_id] = handled[row.request_id] = outcome
        return handled

    def _require_gate(self) -> TrustGate:
        if self.gate is None:
            raise RuntimeError("no trust gate in this model: attach with trust_gate='manual' or 'auto'")
        return self.gate

    def _step(self) -> int:
        return self.last_step if self.session is None else int(self.session.step)

    # -- events and alerts ---------------------------------------------------------------------

    def _on_change(self, change: GateChange) -> None:
        step = change.step if change.step is not None else self._step()
        self.events.append(change)
        if self.root is not None:
            row = dict(run_id=self.run_id, ts=change.at, step=step, layer=change.layer, expert=change.expert,
                       old_weight=change.old_weight, new_weight=change.new_weight, score=change.score,
                       reason=change.reason, source=change.source, rank=self.rank)
            self._write("trust_gate_events", [row])
        key = (change.layer, change.expert)
        if change.new_weight < 1:
            self._episodes[key] = change.at  # each drop is its own notification
            state, previous, starts = FIRING, (FIRING if change.old_weight < 1 else INACTIVE), change.at
        else:
            state, previous, starts = RESOLVED, FIRING, self._episodes.pop(key, change.at)
        labels = self._labels("TrustGateChanged", change.layer, change.expert)
        values: dict[str, float | None] = {"old_weight": change.old_weight, "new_weight": change.new_weight}
        if change.score is not None:
            values["score"] = change.score
        self._send(AlertTransition(
            fingerprint=fingerprint(labels), alertname="TrustGateChanged", state=state, previous_state=previous,
            at=change.at, step=step, run_id=self.run_id, layer=change.layer, severity="critical",
            expr=f"trust_weight {change.old_weight:g} -> {change.new_weight:g}", labels=labels,
            annotations={"summary": f"layer {change.layer} expert {change.expert}: trust weight "
                                    f"{change.old_weight:g} -> {change.new_weight:g} ({change.source})",
                         "reason": change.reason, "source": change.source},
            values=values, starts_at=starts, ends_at=change.at if state == RESOLVED else None,
            source="trust_gate", expert=change.expert))

    def _notify_health(self, row: ExpertHealth, state: str, previous: str, step: int, action: str) -> None:
        key = (row.layer, row.expert)
        labels = self._labels("ExpertUnhealthy", row.layer, row.expert)
        starts = self.judgements[key].since or row.ts
        summary = (f"layer {row.layer} expert {row.expert} unhealthy: score {row.score:.1f}" if state == FIRING
                   else f"layer {row.layer} expert {row.expert} healthy again: score {row.score:.1f}")
        self._send(AlertTransition(
            fingerprint=fingerprint(labels), alertname="ExpertUnhealthy", state=state, previous_state=previous,
            at=row.ts, step=step, run_id=self.run_id, layer=row.layer, severity="critical",
            expr=f"expert_health_score < {self.config.bad_below:g}", labels=labels,
            annotations={"summary": summary + (f"; {action}" if action else ""), "reasons": row.reasons,
                         "action": action},
            values={k: v for k, v in (("score", row.score), ("load", row.load), ("confidence", row.confidence),
                                      ("output", row.output), ("weight", row.weight), ("grad", row.grad))
                    if v is not None},
            starts_at=starts, ends_at=row.ts if state == RESOLVED else None, source="health", expert=row.expert))

    def finish(self, reason: str = "run ended") -> list[AlertTransition]:
        """Resolve every ExpertUnhealthy and TrustGateChanged alert still firing, at the last recorded step.

        A run that ended judges and gates nothing any more.

        Args:
            reason: why, recorded on each transition.

        Returns:
            The transitions made.
        """
        ended: list[AlertTransition] = []
        at = self.last_ts or dt.datetime.now(dt.timezone.utc)
        with self._lock:
            for key, j in sorted(self.judgements.items()):
                if not j.unhealthy:
                    continue
                j.unhealthy = False
                labels = self._labels("ExpertUnhealthy", *key)
                ended.append(AlertTransition(
                    fingerprint=fingerprint(labels), alertname="ExpertUnhealthy", state=RESOLVED,
                    previous_state=FIRING, at=at, step=self.last_step, run_id=self.run_id, layer=key[0],
                    severity="critical", expr=f"expert_health_score < {self.config.bad_below:g}", labels=labels,
                    annotations={"summary": f"layer {key[0]} expert {key[1]}: {reason}", "resolved_reason": reason},
                    values={}, starts_at=j.since or at, ends_at=at, source="health", expert=key[1], reason=reason))
            for key, since in sorted(self._episodes.items()):
                labels = self._labels("TrustGateChanged", *key)
                ended.append(AlertTransition(
                    fingerprint=fingerprint(labels), alertname="TrustGateChanged", state=RESOLVED,
                    previous_state=FIRING, at=at, step=self.last_step, run_id=self.run_id, layer=key[0],
                    severity="critical", expr="trust_weight < 1", labels=labels,
                    annotations={"summary": f"layer {key[0]} expert {key[1]}: {reason}; the gate no longer "
                                            "acts on the model", "resolved_reason": reason},
                    values={}, starts_at=since, ends_at=at, source="trust_gate", expert=key[1], reason=reason))
            self._episodes.clear()
        for transition in ended:
            self._send(transition)
        return ended

    def _labels(self, name: str, layer: int, expert: int) -> dict[str, str]:
        return {"alertname": name, "severity": "critical", "run_id": self.run_id, "layer": str(layer),
                "expert": str(expert)}

    def _send(self, transition: AlertTransition) -> None:
        self.alerts.append(transition)
        hand_to_sinks([transition], (self.alert_table, self.sink), "the trust policy")

    # -- tables --------------------------------------------------------------------------------

    def _write_due(self) -> None:
        with self._lock:
            due = len(self._buffer) >= self.max_buffer_rows or (
                self._first_at is not None and time.monotonic() - self._first_at >= self.max_age_s)
        if due:
            self._write_health()

    def _write_health(self) -> None:
        with self._lock:
            rows, self._buffer, self._first_at = self._buffer, [], None
        if rows and self.root is not None:
            self._write("expert_health", rows)

    def _write(self, table: str, rows: list[dict]) -> None:
        if self.tables is None:
            return
        try:
            self.tables.emit(table, rows)  # written on the writer's thread; a refused write is counted there
        except Exception:  # a row that does not fit the schema must not stop the judging
            log.exception("could not write %d rows to %s", len(rows), table)


def bind_policy(session: ProbeSession, policy: TrustPolicy | None, mode: str | None,
                store: str | os.PathLike | StoreLocation | None) -> TrustPolicy:
    """The policy a probe session runs: the one given, or a default one, bound to the session's run,
    gate and store; the caller hands it to the session (`ProbeSession.bind_trust_policy`)."""
    return (policy or TrustPolicy()).bind(session, mode, store)
