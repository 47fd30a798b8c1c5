"""The engine over a store: read new layer steps as they land, write transitions to `alerts`.

`StoreAlertRunner.poll_once()` refreshes the store's views, reads the `layer_steps` (and, when
a rule needs them, `routes`) of every run past the last step it has seen, feeds them to the
`AlertEngine` step by step, writes the resulting transitions to the `alerts` table and hands
them to the sinks (the outbox). `run()` repeats that every few seconds.

On start the runner replays each run from its first step: the windows and the alert states are
rebuilt exactly (event time), transitions already in the `alerts` table are not written twice,
and notifications already in the outbox are not enqueued twice (same idempotency keys).

The `alerts` table follows the store layout, the table `<root>/alerts` partitioned by run, written
by each run's writer (`store.writer.run_writer`) through its pipeline. Sharp edges: a step is read
once, when its `layer_steps` file has landed; rows that another rank writes later for a step
already read are not counted, and routes that land after their step's `layer_steps` are missed
by the route signals of that step.

A run whose every rank closed its session (a `run_ends` row after the last forward read) has
its open alerts resolved with the reason "run ended", as the live engine does when its session
closes: an event-time cooldown never passes in a run that records nothing more.

A full disk stops neither evaluation nor notification: transitions the table cannot take wait
in `AlertTableWriter.unwritten` and are written at the next poll that finds room. `close()`
releases the runs' writers, which write their final `probe_stats`.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
from collections.abc import Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

from moescope.alerts.engine import AlertEngine, AlertTransition, FlushableSink, TransitionSink
from moescope.alerts.observations import LayerObservation
from moescope.alerts.rules import RulePack
from moescope.metrics.placement import Placement
from moescope.store.location import StoreLocation, open_location
from moescope.store.schema import SCHEMAS
from moescope.store.store import Store
from moescope.store.writer import RunWriter, run_writer

log = logging.getLogger(__name__)

ALERTS_TABLE = "alerts"
ALERTS_SCHEMA = SCHEMAS[ALERTS_TABLE]  # the table's schema lives with every other in store/schema.py
_ROUTE_SIGNALS = {"routing_drift_rate", "switch_entropy", "whatif_drop_rate_cf1", "whatif_drop_rate_cf1_25",
                  "whatif_drop_rate_cf1_5", "whatif_drop_rate_cf2"}


def transitions_table(transitions: Sequence[AlertTransition]) -> pa.Table:
    now = dt.datetime.now(dt.timezone.utc)
    rows = [
        {
            "run_id": t.run_id, "fingerprint": t.fingerprint, "alertname": t.alertname, "state": t.state,
            "previous_state": t.previous_state, "ts": t.at, "step": t.step, "layer": t.layer, "severity": t.severity,
            "expr": t.expr, "labels": list(t.labels.items()), "annotations": list(t.annotations.items()),
            "signal_values": [(k, v) for k, v in t.values.items()], "starts_at": t.starts_at, "ends_at": t.ends_at,
            "written_at": now, "source": t.source, "expert": t.expert, "reason": t.reason,
            "window_steps": t.window_steps, "baseline_steps": t.baseline_steps,
        }
        for t in transitions
    ]
    return pa.Table.from_pylist(rows, schema=ALERTS_SCHEMA)


class AlertTableWriter(FlushableSink):
    """A TransitionSink that hands transitions to the `alerts` table of their run, through the run's
    writer (`store.writer.run_writer`: the one the run's other producers in this process share).

    `handle` never waits for the disk: the rows are written on the writer's thread. A write the
    disk refuses (a full disk) loses nothing: the writer hands the rows back, this sink keeps them
    (`unwritten`, at most `max_unwritten`; beyond that the oldest are counted in `lost` and in the
    run's `probe_stats` as write_failed) and emits them again at every `flush()` until there is
    room. `flush()` writes what was handed so far; `last_error` says why the last write failed,
    None once everything is written. `close()` makes a last try and gives the writers back; safe
    to call twice. Raises InvalidNameError (from `handle`) for a run id that cannot be in a path.
    """

    def __init__(self, root: str | os.PathLike | StoreLocation, rank: int = 0, max_unwritten: int = 10_000):
        self.location = open_location(root)
        self.root = self.location.redacted  # how messages name the store
        self.rank = rank
        self.max_unwritten = max_unwritten
        self.lost = 0
        self._writers: dict[str, RunWriter] = {}
        self._unwritten: list[tuple[str, pa.Table]] = []  # (run_id, rows) the disk refused, oldest first
        self._lock = threading.Lock()

    def _writer(self, run_id: str) -> RunWriter:
        with self._lock:
            writer = self._writers.get(run_id)
            if writer is None:
                writer = self._writers[run_id] = run_writer(self.location, run_id, self.rank)
            return writer

    def handle(self, transitions: Sequence[AlertTransition]) -> None:
        """Hand transitions to their runs' writers; transitions a full disk refused before are tried
        first (and waited for: only while the disk refuses them), so calling `handle([])` retries."""
        with self._lock:
            waiting = bool(self._unwritten)
        if waiting:
            self.flush()
        by_run: dict[str, list[AlertTransition]] = {}
        for t in transitions:
            by_run.setdefault(t.run_id, []).append(t)
        for run_id, items in by_run.items():
            self._emit(run_id, transitions_table(items))

    def _emit(self, run_id: str, rows: pa.Table) -> None:
        self._writer(run_id).emit(ALERTS_TABLE, rows, on_refused=lambda refused: self._refused(run_id, refused))

    def _refused(self, run_id: str, rows: pa.Table) -> None:
        """The writer's thread hands back rows the disk refused: keep them for the next flush."""
        with self._lock:
            if not self._unwritten:
                log.warning("could not write %d alert transitions to the alerts table under %s (%s); they are kept "
                            "in memory and written when there is room", rows.num_rows, self.root,
                            self._writers[run_id].last_error)
            self._unwritten.append((run_id, rows))
            while sum(r.num_rows for _, r in self._unwritten) > self.max_unwritten:
                old_run, old = self._unwritten.pop(0)
                self.lost += old.num_rows
                self._writers[old_run].count_dropped(ALERTS_TABLE, "write_failed", old.num_rows)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Write every transition handed so far, and again those waiting for room; False on timeout."""
        with self._lock:
            waiting, self._unwritten = self._unwritten, []
            writers = list(self._writers.values())
        for run_id, rows in waiting:
            self._emit(run_id, rows)
        done = all([writer.flush(timeout_s) for writer in writers])
        if waiting and not self.unwritten:
            log.warning("wrote %d alert transitions to the alerts table that had waited for room",
                        sum(r.num_rows for _, r in waiting))
        return done

    @property
    def unwritten(self) -> list[dict]:
        """Transitions (as `alerts` rows) waiting for room on the disk."""
        with self._lock:
            waiting = list(self._unwritten)
        return [row for _, rows in waiting for row in rows.to_pylist()]

    @property
    def last_error(self) -> str | None:
        """Why the last write failed; None once everything is written."""
        with self._lock:
            if not self._unwritten:
                return None
            writers = list(self._writers.values())
        return next((writer.last_error for writer in writers if writer.last_error), None)

    def close(self) -> None:
        """Try the waiting transitions once more, count what is still refused as lost, give back the
        writers; safe to call twice."""
        self.flush()
        with self._lock:
            waiting, self._unwritten = self._unwritten, []
            writers, self._writers = dict(self._writers), {}
        for run_id, rows in waiting:
            self.lost += rows.num_rows
            writers[run_id].count_dropped(ALERTS_TABLE, "write_failed", rows.num_rows)
        for writer in writers.values():
            writer.release()


def read_alerts(store: Store, run_id: str | None = None):
    """Return the `alerts` table (a DataFrame ordered by time), empty when nothing was written.

    Refreshes the store's views first, so transitions written a moment ago are included.
    """
    store.refresh()
    return store.alert_transitions(run_id)


class StoreAlertRunner:
    """Evaluates a rule pack over a store as new data lands."""

    def __init__(self, root: str | os.PathLike | StoreLocation, pack: RulePack, sinks: Sequence[TransitionSink] = (),
                 run_ids: Sequence[str] | None = None, write_alerts: bool = True,
                 placement: Placement | None = None):
        """`root`: the store, a folder or a URL (a `StoreLocation` carries its storage options);
        `placement`: experts on ranks for the rank signals (`AlertEngine`).
        Raises StoreError (EmptyStoreError: no store there yet) as `Store` does."""
        self.location = open_location(root)
        self.store = Store(self.location)
        self.pack = pack
        self.run_ids = list(run_ids) if run_ids else None
        self.engine = AlertEngine(pack, baseline_loader=self._load_baseline, placement=placement)
        self.sinks = list(sinks)
        self.writer = AlertTableWriter(self.location) if write_alerts else None
        self._needs_routes = any(set(r.signals) & _ROUTE_SIGNALS for r in pack.rules)
        self._last_step: dict[str, int] = {}
        self._last_forward: dict[str, int] = {}  # the last forward read per run (a row's step_end)
        self._finished: dict[str, int] = {}  # run -> last forward at which its end resolved its alerts
        self._total_params: dict[str, int] = {}
        existing = read_alerts(self.store)
        self._recorded = {
            (fp, state, pd_ts.to_pydatetime())
            for fp, state, pd_ts in zip(existing.fingerprint, existing.state, existing.ts)
        }

    def _load_baseline(self, run_id: str, layer: int, steps: int) -> np.ndarray | None:
        # the first rows that cover `steps` forwards (a windowed row covers several)
        rows = self.store.first_layer_rows(run_id, layer, steps)
        if rows.empty:
            return None
        covered = np.cumsum(rows.forwards.to_numpy())
        rows = rows.iloc[: int(np.searchsorted(covered, steps)) + 1]
        return np.sum([np.asarray(v, dtype=np.int64) for v in rows.expert_load], axis=0)

    def _runs(self) -> list[str]:
        found = self.store.runs_with_layer_steps()
        return [r for r in found if self.run_ids is None or r in self.run_ids]

    def _observations(self, run_id: str) -> list[LayerObservation]:
        last = self._last_step.get(run_id, -1)
        rows = self.store.layer_steps_after(run_id, last)
        if rows.empty:
            return []
        if run_id not in self._total_params:
            info = self.store.run_info(run_id)
            total = info["total_params"] if info is not None else None
            self._total_params[run_id] = int(total) if total is not None and pd.notna(total) else 0
            layers = self.store.layers(run_id)
            self.engine.routed_experts.update({int(r.layer): int(r.num_experts) for r in layers.itertuples()
                                               if pd.notna(r.num_experts)})
        total_params = self._total_params[run_id]
        routes: dict[tuple[int, int], list] = {}
        if self._needs_routes:
            r = self.store.routes_between(run_id, int(rows.step.min()), int(rows.step_end.max()))
            # a route row belongs to the layer_steps row (a forward, or a window) whose steps cover it
            starts = {int(layer): np.unique(g.step.to_numpy(np.int64)) for layer, g in rows.groupby("layer")}
            if not r.empty:
                r["window"] = r.step.to_numpy(np.int64)
                for layer, index in r.groupby("layer").groups.items():
                    first = starts.get(int(layer), np.zeros(1, np.int64))
                    steps_ = r.loc[index, "step"].to_numpy(np.int64)
                    r.loc[index, "window"] = first[np.maximum(np.searchsorted(first, steps_, "right") - 1, 0)]
            for (window, layer), group in (r.groupby(["window", "layer"], sort=False) if not r.empty else ()):
                routes[(int(window), int(layer))] = [
                    np.stack([np.asarray(v, dtype=np.int64) for v in group.expert_ids]),
                    group["rank"].to_numpy(np.int64) * 65536 + group.sequence.to_numpy(np.int64),
                    group.position.to_numpy(np.int64),
                    group.step.to_numpy(np.int64),
                    group.token.to_numpy(np.int64),
                    group["rank"].to_numpy(np.int64),
                ]
        out = []
        for (step, layer), group in rows.groupby(["step", "layer"], sort=True):
            # ranks of one step are summed: the load of the whole data-parallel batch
            load = np.sum([np.asarray(v, dtype=np.int64) for v in group.expert_load], axis=0)
            capacity = group.capacity_use.dropna()
            route = routes.get((int(step), int(layer)))
            tokens = group.tokens.to_numpy(np.float64)
            weight = tokens / tokens.sum() if tokens.sum() > 0 else np.full(len(tokens), 1.0 / len(tokens))
            out.append(LayerObservation(
                run_id=run_id, layer=int(layer), step=int(step), ts=group.ts.iloc[0].to_pydatetime(),
                tokens=int(group.tokens.sum()), expert_load=load,
                router_entropy_mean=float(np.sum(group.router_entropy_mean.to_numpy(np.float64) * weight)),
                dropped_tokens=int(group.dropped_tokens.sum()),
                capacity_use=float(capacity.max()) if len(capacity) else None,
                active_param_fraction=(float(np.sum(group.active_params_per_token.to_numpy(np.float64) * weight))
                                       / total_params if total_params else None),
                expert_ids=None if route is None else route[0],
                sequence=None if route is None else route[1],
                position=None if route is None else route[2],
                forwards=int(group.forwards.max()),
                route_step=None if route is None else route[3],
                token=None if route is None else route[4],
                rank=None if route is None else route[5],
            ))
        self._last_step[run_id] = int(rows.step.max())
        self._last_forward[run_id] = int(rows.step_end.max())
        return out

    def poll_once(self) -> list[AlertTransition]:
        """Evaluate whatever landed since the last poll; return the new transitions."""
        self.store.refresh()
        found: list[AlertTransition] = []
        ended = self.store.ended_runs()
        ended = {r: int(s) for r, s in zip(ended.run_id, ended.last_step) if pd.notna(s)}
        for run_id in self._runs():
            found.extend(self.engine.ingest(self._observations(run_id)))
            last = self._last_forward.get(run_id)
            # Every rank closed its session after the last forward read: what is still open resolves
            # now ("run ended"), once; a run resumed later (a new writer) goes on, and ends again.
            if last is not None and ended.get(run_id, -1) >= last and self._finished.get(run_id) != last:
                found.extend(self.engine.finish(run_id))
                self._finished[run_id] = last
        new = [t for t in found if (t.fingerprint, t.state, t.at) not in self._recorded]
        if self.writer is not None:
            self.writer.handle(new)
            self.writer.flush()  # on disk when the poll returns; also retries what an earlier poll could not write
            self._recorded.update((t.fingerprint, t.state, t.at) for t in new)
        for sink in self.sinks:
            sink.handle(found)  # the outbox drops what it already holds
        return new

    def close(self) -> None:
        """Give back the runs' writers (they write their final counts) and close the store; safe twice."""
        if self.writer is not None:
            self.writer.close()
        self.store.close()

    def run(self, interval_s: float = 5.0, stop: threading.Event | None = None, max_polls: int | None = None) -> None:
        """Poll every `interval_s` until `stop` is set (or `max_polls` polls are done)."""
        stop = stop or threading.Event()
        polls = 0
        while not stop.is_set():
            self.poll_once()
            polls += 1
            if max_polls is not None and polls >= max_polls:
                return
            stop.wait(interval_s)
