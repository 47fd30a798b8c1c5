"""The proxy's recorder: captured responses become steps of one run, through the write pipeline.

The recorder is the write pipeline's three layers, as for the probe: the request thread only hands
a captured body over (`RoutingRecorder.submit` is `BatchProcessor.emit` under the `drop` policy:
never blocking, a full queue drops the response and counts it); the processor's worker runs the
recorder's exporter, which parses the routed experts out of each body (`ingest.importers.responses`),
buffers the steps and writes them through the run's writer (`moescope.store.writer.run_writer`);
`moescope.store.schema` and `ingest.importers.tables` build the rows. A response without a routing field, or
one whose body cannot be read (any error while parsing it), is counted and skipped: one odd body
never stops the recorder. Should its thread end all the same, `RoutingRecorder.failed` says why
(the server then answers 503 and stops). Prompt and generated token ids are left out of
`routes.token_id` (null) unless `record_token_ids` is set: with a tokenizer they give the user's
text back. Responses not recorded are counted in `probe_stats` (table_name "steps", one row per
reason), like the probe's own drops, and the run's writer writes its final counts when the recorder
shuts down. Every response's routing goes through the trace checks (`moescope.ingest.trace_checks`)
as it is parsed; each flush writes what they found since the last as `trace_findings` rows. With
the engine's map (`engine_map`, `--placement`) they check physical_ids too: a response naming ids
past `num_experts` but within the map's physical slots is checked, then refused (out_of_range) as
any such response is, so the finding names what was not stored.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from moescope.core.pipeline import BatchProcessor
from moescope.core.runs import current_host, new_run_id
from moescope.ingest.importers.responses import (
    RoutedSequence,
    check_sequence,
    is_sglang,
    is_vllm,
    merge_vllm_stream,
    sequences_step,
    sglang_sequences,
    vllm_sequences,
)
from moescope.ingest.importers.tables import (
    LayerShape,
    RunSpec,
    SourceFormatError,
    SourceStep,
    build_step_tables,
    check_new_run,
    check_tags,
    run_tables,
)
from moescope.ingest.proxy.limits import DEFAULT_MAX_QUEUE_BYTES
from moescope.ingest.trace_checks import EngineMap, TraceChecks
from moescope.store.location import StoreLocation, open_location
from moescope.store.naming import check_name
from moescope.store.schema import trace_findings_table
from moescope.store.writer import RunWriter, run_writer

__all__ = ["Captured", "RoutingRecorder", "sse_events"]

log = logging.getLogger(__name__)


@dataclass
class Captured:
    """One response as the request thread handed it over: a record of the write pipeline (one step
    if it holds routing; its body's bytes are what it costs in the queue)."""

    body: bytes
    content_type: str
    tags: dict[str, str]
    ts: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc))

    def rows(self) -> dict[str, int]:
        return {"steps": 1}

    @property
    def nbytes(self) -> int:
        return len(self.body)


def sse_events(body: bytes) -> list[Any]:
    """The JSON payloads of a server-sent event stream.

    Args:
        body: the whole stream as the engine sent it (bytes that are not UTF-8 are replaced).

    Returns:
        Each event's `data:` lines joined and parsed, in order; `[DONE]` left out.

    Raises:
        ValueError: an event's data is not JSON (json.JSONDecodeError).
    """
    events, data = [], []
    for line in body.decode("utf-8", errors="replace").splitlines() + [""]:
        if line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        elif not line.strip() and data:
            payload = "\n".join(data).strip()
            data = []
            if payload and payload != "[DONE]":
                events.append(json.loads(payload))
    return events


class RoutingRecorder:
    """A write pipeline (`BatchProcessor`, policy "drop") whose exporter turns captured responses
    into steps of one run.

    `submit` never blocks and never raises. Steps are buffered and written every
    `flush_interval_s` or `max_steps`, whichever comes first; `shutdown()` drains the queue, writes
    what is left and the run's final counts, and is safe to call twice. `counts` says how many
    responses were recorded and, per reason, how many were not. The queue holds at most
    `max_queue` responses and `max_queue_bytes` of their bodies. Token ids are stored only with
    `record_token_ids` (see the module doc).
    """

    def __init__(self, root: str | os.PathLike | StoreLocation, num_experts: int, run_id: str | None = None,
                 tags: dict[str, str] | None = None, num_layers: int | None = None, top_k: int | None = None,
                 max_queue: int = 1024, flush_interval_s: float = 2.0, max_steps: int = 256,
                 model: str = "served model", max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
                 record_token_ids: bool = False, engine_map: EngineMap | None = None):
        """Open the run in the store and start the recorder's worker.

        Args:
            root: the store, a folder or a URL (a `StoreLocation` carries its storage options).
            num_experts: experts per layer; a response routing outside them is counted `bad_routing`.
            run_id: the new run's id (made up when None); the store must not hold it yet.
            tags: the run's tags; each step also carries its request's (`request_tags`).
            num_layers: SGLang's routing shape, its layers (its responses do not say it).
            top_k: SGLang's routing shape, experts per token.
            max_queue: the queue's bound in responses.
            flush_interval_s: steps are written every this many seconds, or every `max_steps` steps.
            max_steps: steps are written every this many, or every `flush_interval_s`.
            model: the run's model name.
            max_queue_bytes: the queue's bound in the responses' bodies' bytes.
            record_token_ids: keep prompt and generated token ids in `routes.token_id`.
            engine_map: the engine's map (`moescope.cli.check.read_engine_map`), for the physical_ids
                check; its logical experts must be `num_experts`.

        Raises:
            ValueError: a bad option, a map of another expert count, a store URL that cannot be used or a
                run id the store already has.
            OSError: the store does not take the run's first row.
        """
        if num_experts < 1:
            raise ValueError(f"--num-experts must be positive, not {num_experts}")
        if max_queue < 1:
            raise ValueError(f"--max-queue must be positive, not {max_queue}")
        if max_queue_bytes < 1:
            raise ValueError(f"--max-queue-mb must be positive, not {max_queue_bytes / 2**20:g}")
        if engine_map is not None and engine_map.logical_experts != num_experts:
            raise ValueError(f"--placement {engine_map.source}: the map holds {engine_map.logical_experts} logical "
                             f"experts, but --num-experts is {num_experts}: give the map of the model this server "
                             "serves")
        self.location = open_location(root)
        self.root = self.location.redacted  # how messages name the store
        self.num_experts = num_experts
        self.num_layers, self.top_k = num_layers, top_k
        self.record_token_ids = record_token_ids
        run_id = check_name("run_id", run_id) if run_id else new_run_id("proxy")
        check_new_run(self.location, run_id)
        self.spec = RunSpec(run_id=run_id, source="proxy", model=model, tags=check_tags(dict(tags or {})),
                            host=current_host(),
                            started_at=dt.datetime.now(dt.timezone.utc))
        self.flush_interval_s, self.max_steps = flush_interval_s, max_steps
        self._counts: Counter[str] = Counter()  # recorded, and each reason a response was not (but the queue's)
        self._lock = threading.Lock()
        self._shapes: dict[int, LayerShape] = {}
        self._pending: list[SourceStep] = []
        self._first_pending_at: float | None = None
        self._next_step = 0
        self._failure: str | None = None
        self.checks = TraceChecks(engine_map)  # the trace checks since the last flush (the worker's)
        # ids the trace checks read: physical slots of the map past num_experts are checked, not stored
        self._checked_ids = max(num_experts, engine_map.physical_slots if engine_map is not None else 0)
        self.map_problem: str | None = None  # why physical_ids stopped being checked (a map that does not fit)
        self._refused_checked = 0  # responses checked, then refused: ids of the map's slots past num_experts
        self._findings: Counter[str] = Counter()  # every flush's findings, per check, for `report`
        self._checked_rows = 0
        self.writer: RunWriter = run_writer(self.location, run_id)
        if not self.writer.write("runs", run_tables(self.spec, {}, [0])["runs"], retried=True):
            self.writer.release()
            raise OSError(f"cannot write to the store {self.root!r}: {self.writer.last_error}")
        self.processor = BatchProcessor([_ResponseExporter(self)], max_queue=max_queue, policy="drop",
                                        flush_interval_s=flush_interval_s, max_batch=max_steps,
                                        max_queue_bytes=max_queue_bytes, name="moescope-proxy-recorder")
        self.writer.watch(self.processor)  # the queue's drops (queue_full, closed) go into probe_stats

    # -- the request thread's side -------------------------------------------------------------

    def submit(self, captured: Captured) -> None:
        """Hand a response over; never blocks, never raises (a full queue drops and counts it)."""
        self.processor.emit(captured)

    def count(self, reason: str) -> None:
        """Count a response that was not recorded (too large, upstream error, no routing, ...)."""
        with self._lock:
            self._counts[reason] += 1
        self.writer.count_dropped("steps", reason, rows=1, records=1)

    @property
    def counts(self) -> Counter[str]:
        """Responses recorded, and per reason the ones that were not (the queue's drops included)."""
        with self._lock:
            counts = Counter(self._counts)
        counts.update(self.processor.drop_counts()[1])
        return counts

    @property
    def failed(self) -> str | None:
        """Why the recorder can record nothing more (its worker thread ended before `shutdown`), or None."""
        if self._failure is None:
            if self.processor.worker_died:
                self._failure = "the recorder's thread ended unexpectedly, so no response can be recorded"
        return self._failure

    # -- the exporter (the processor's worker) ----------------------------------------------------

    def _record(self, captured: Captured) -> None:
        try:
            sequences = self._sequences(captured)
            if sequences is None:
                self.count("no_routing")
                return
            if not self.record_token_ids:  # the prompt's text, given a tokenizer: kept only when asked
                for sequence in sequences:
                    sequence.token_ids = None
                    if sequence.logprobs is not None:
                        sequence.logprobs.token_ids = None
            step, _ = sequences_step(sequences, self._next_step, captured.ts, "response", tags=captured.tags)
            largest = self._check(step)
            if largest < self.num_experts:
                self._trace_check(sequences, f"response {self._next_step}")
            else:  # a physical slot of the map past the experts: checked, then refused as out of range
                self._refused_checked += 1
                self._trace_check(sequences, f"refused response {self._refused_checked}")
            if self._first_pending_at is None:  # what the checks saw is written within the flush interval
                self._first_pending_at = time.monotonic()
            if largest >= self.num_experts:
                raise SourceFormatError(f"a layer routes to expert {largest}, outside --num-experts "
                                        f"{self.num_experts} (check out_of_range): a physical slot of the "
                                        "--placement map, counted by the physical_ids check but not stored")
        except (SourceFormatError, ValueError) as e:  # json errors are ValueErrors too
            log.warning("moescope proxy: a response's routing could not be read: %s", e)
            self.count("bad_routing")
            return
        except Exception as e:  # any body at all (a null where a number belongs, nesting past the recursion limit)
            log.warning("moescope proxy: a response's body could not be read (%s: %.200s); skipped",
                        type(e).__name__, e)
            self.count("bad_routing")
            return
        self._next_step += 1
        self._pending.append(step)
        if self._first_pending_at is None:
            self._first_pending_at = time.monotonic()
        with self._lock:
            self._counts["recorded"] += 1

    def _sequences(self, captured: Captured) -> list[RoutedSequence] | None:
        if "text/event-stream" in captured.content_type:
            bodies, stream = sse_events(captured.body), True
        else:
            value = json.loads(captured.body)
            bodies, stream = (value if isinstance(value, list) else [value]), False
        if any(is_vllm(b) for b in bodies):
            body = bodies[0] if len(bodies) == 1 and not stream else merge_vllm_stream(bodies, "response")
            return vllm_sequences(body, "response")
        if any(is_sglang(b) for b in bodies):
            return sglang_sequences(bodies, self.num_layers, self.top_k, "response", stream=stream)
        return None

    def _check(self, step: SourceStep) -> int:
        """The largest id the step names (-1: none); refuses a layer routing another k than before, or
        an id past both `num_experts` and the map's physical slots."""
        largest = -1
        for layer, routes in step.routes.items():
            k = routes.expert_ids.shape[1]
            known = self._shapes.get(layer)
            if known is not None and known.top_k != k:
                raise SourceFormatError(f"layer {layer} routes {k} experts per token, earlier responses {known.top_k}")
            if len(routes.expert_ids):
                largest = max(largest, int(routes.expert_ids.max()))
            if largest >= self._checked_ids:
                raise SourceFormatError(f"layer {layer} routes to expert {largest}, outside --num-experts "
                                        f"{self.num_experts} (check out_of_range)")
        return largest

    def _trace_check(self, sequences: list[RoutedSequence], label: str) -> None:
        for sequence in sequences:
            check_sequence(self.checks, sequence, label)

    def _trace_findings(self) -> dict:
        """The trace checks' findings since the last flush as rows (none: {}), the checks then reset."""
        try:
            findings = self.checks.findings(num_experts=self.num_experts)
        except ValueError as e:  # PlacementError: the map's rows do not fit the responses' MoE layers
            self.map_problem = f"physical_ids not checked: {e}"
            log.error("moescope proxy: %s; the other trace checks go on", self.map_problem)
            self.checks.forget_map()
            findings = self.checks.findings(num_experts=self.num_experts)
        self._checked_rows += self.checks.rows
        self.checks.reset()
        with self._lock:
            for finding in findings:
                self._findings[finding.check] += finding.count
        if not findings:
            return {}
        return {"trace_findings": trace_findings_table(self.spec.run_id, dt.datetime.now(dt.timezone.utc), "proxy",
                                                       findings)}

    def _due(self) -> bool:
        return len(self._pending) >= self.max_steps or (
            self._first_pending_at is not None and time.monotonic() - self._first_pending_at >= self.flush_interval_s)

    def _write_pending(self) -> None:
        steps, self._pending, self._first_pending_at = self._pending, [], None
        if not steps:  # responses checked, then refused (physical ids past the experts): their findings
            try:
                tables = self._trace_findings()
            except Exception:
                log.exception("moescope proxy: the trace checks' findings could not be made into rows")
                return
            for table, data in tables.items():
                self.writer.write(table, data)  # refused rows are counted
            return
        try:
            new = {layer: LayerShape(self.num_experts, s.routes[layer].expert_ids.shape[1])
                   for s in steps for layer in s.routes if layer not in self._shapes}
            tables = build_step_tables(steps, self.spec, {**self._shapes, **new})
            tables.update(self._trace_findings())
            if new:
                tables["layers"] = run_tables(self.spec, new, [0])["layers"]
        except Exception:
            log.exception("moescope proxy: %d steps could not be made into rows; they are counted as write_failed",
                          len(steps))
            ok = False
        else:
            self._shapes.update(new)
            written = [self.writer.write(table, data) for table, data in tables.items()]  # refused rows are counted
            ok = written[list(tables).index("steps")]
            if not ok:
                log.error("moescope proxy: writing %d steps to %s failed: %s", len(steps), self.root,
                          self.writer.last_error)
        if not ok:
            with self._lock:
                self._counts["recorded"] -= len(steps)
                self._counts["write_failed"] += len(steps)

    # -- stopping --------------------------------------------------------------------------------

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Record everything submitted so far and write it; False on timeout."""
        return self.processor.force_flush(timeout_s)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Drain the queue, write what is left and the run's final counts; safe to call twice."""
        _ = self.failed  # noticed before the shutdown ends the thread as it should
        self.processor.shutdown(timeout_s)

    def report(self) -> str:
        """One line for the command's output: responses recorded, the others per reason, and why the
        recorder failed if it did."""
        counts = self.counts
        others = ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items()) if reason != "recorded" and n)
        with self._lock:
            found = ", ".join(f"{check} {n}" for check, n in sorted(self._findings.items()))
        return (f"moescope proxy: recorded {counts.get('recorded', 0)} responses into run {self.spec.run_id}"
                + (f"; not recorded: {others}" if others else "")
                + (f"; trace checks found: {found} (moescope check STORE --run RUN)" if found
                   else f"; trace checks: no finding in {self._checked_rows:,} token rows")
                + (f"; {self.map_problem}" if self.map_problem else "")
                + (f"; {why}" if (why := self.failed) else ""))


class _ResponseExporter:
    """The recorder's exporter, on its processor's worker: parse, buffer, write (see RoutingRecorder).
    It never raises: each response is counted once, as recorded or with its reason."""

    def __init__(self, recorder: RoutingRecorder):
        self.recorder = recorder
        self._closed = False

    def export(self, records: Sequence[Captured]) -> bool:
        for captured in records:
            self.recorder._record(captured)
        if self.recorder._due():
            self.recorder._write_pending()
        return True

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        self.recorder._write_pending()
        self.recorder.writer.write_changed_stats()
        return True

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.recorder._write_pending()
        self.recorder.writer.release()  # the last holder: the run's final probe_stats
