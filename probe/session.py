"""`attach`: hook a model's MoE layers and turn each forward pass into a `StepRecord`.

The session owns the hooks, the windows and the lifecycle. Where the numbers live on the device
is probe/device_layout.py's (made once at attach, drawn by probe/accumulate.py); what a forward adds to
them is probe/reduction.py's; what a closed window becomes is probe/window.py's.

Hooks are global state on the modules they sit on: this session keeps every handle it adds and
removes exactly those in `close()` (also when attaching fails half-way), leaving other hooks alone.
Only forwards of the module passed to `attach` are recorded; calling a submodule directly, or the
recomputation of gradient checkpointing, records nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime as dt
import logging
import multiprocessing.util
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from moescope.core import forking
from moescope.core.exporters import AttachListener, BindsProcessor, Exporter, ProbeStats, ProbeStatsReader, WritesRows
from moescope.core.pipeline import BatchProcessor
from moescope.core.records import LayerInfo, RunInfo, StepRecord
from moescope.core.runs import new_run_id
from moescope.probe.accumulate import RING_TABLES, SAMPLE_MIX, SAMPLE_STRIDE, TOTAL_FORWARDS
from moescope.probe.adapters import MoELayer, MoESpec, NoMoELayersError, ProbeAttachError, find_moe_layers
from moescope.probe.device_layout import build_layout
from moescope.probe.forwards import forward_kind, kv_cache_layers, main_input
from moescope.probe.health_sampling import HealthSampler
from moescope.probe.options import HealthSampling, Pipeline, Recording
from moescope.probe.reduction import ForwardRefs, count_forward, deferral_key, reduce_deferred, reduce_forward
from moescope.probe.replay import RoutingReplay
from moescope.probe.timing import ComputeTimer
from moescope.probe.trust_gate import GatePolicy, TrustGate
from moescope.probe.window import HostContext, PendingWindow, PinnedPool, Snapshot

log = logging.getLogger(__name__)

# Tokens (per group of like layers) of the forwards whose reduction may wait for one stacked pass:
# decode steps of batches up to this size, times the window. Their router logits and choices are
# held until then (4096 tokens x 48 layers x 128 experts: 100 MB of float32 logits at most).
DEFERRED_TOKENS = 4096


def shared_run_id() -> str:
    """A new run id; under torch.distributed, rank 0's, so that every rank writes one run.

    This is a collective call when a process group is initialised: every rank must attach.
    """
    run_id = new_run_id()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [run_id]
        torch.distributed.broadcast_object_list(box, src=0)
        run_id = box[0]
    return run_id


def _distributed() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _sample_size(option: bool | int) -> int:
    """router_logits / router_inputs: False or 0 is off, True is every token, n a sample of n."""
    if option is True:
        return -1
    return max(int(option or 0), 0)


class TrustPolicyExporter(GatePolicy, Exporter[StepRecord], Protocol):
    """A trust policy a session runs (`alerts.trust_policy.TrustPolicy`).

    It drives the session's gate and takes an operator's pins (`GatePolicy`), and judges the
    session's records as one of its exporters. Bound with `ProbeSession.bind_trust_policy`.
    """


class ProbeSession:
    """A probe attached to one model. Use as a context manager, or call `close()`.

    Made by `probe.attach` (or `moescope.attach`), which finds the layers and checks the options.
    Per forward the hooks keep references to each MoE layer's router logits and final choice; at
    the end of the forward one stacked reduction per group of like layers adds them to device
    accumulators (probe/reduction.py). Every `window` forwards, or `window_s` seconds, or when a
    tag changes, or when the forwards change kind (prefill and decode, `forward_kind`), the window
    closes: one asynchronous copy out, and the record is built on the writer's thread
    (probe/window.py). `window=1` gives one record per forward.

    The session produces records and hands them to its exporters; it knows nothing of where they
    go. `moescope.attach` wires the store, the trust policy and alerts to it (`session.trust` is
    the policy it bound, or None); `add_exporter` adds a consumer to a running session.

    In a forked child the session resets itself through the at-fork registry
    (`moescope.core.forking`); see `_start_in_child` for what the child records.

    Args:
        model: the model whose forwards are recorded.
        layers: the MoE layers to hook (`find_moe_layers`).
        exporters: consumers of the records; each is shut down when the session closes.
        recording: what is recorded and how forwards become records.
        pipeline: the bounded queue between the model and the exporters.
        health: expert-health sampling, or None (default) for none.
        gate: install the `TrustGate` (`session.gate`). Default False.
        tags: key=value tags on every record (values are kept as strings).
        replay: a `RoutingReplay` to install (`session.replay`): every forward routes as it says,
            and every record is tagged `replay=<its label>`. Default None.
        run_id: the run's id; by default `$MOESCOPE_RUN_ID`, else a new one (rank 0's under
            torch.distributed, a collective call: every rank must attach).
        all_layers: every MoE layer of the model when `layers` is a selection of them: the
            active-parameter figures count the unwatched ones' experts as k experts per token.

    Raises:
        ValueError: for a pipeline policy other than "block" or "drop", bad sampling options, or a
            trust gate together with a routing replay.
    """

    def __init__(self, model: nn.Module, layers: list[MoELayer], exporters: Sequence[Exporter[StepRecord]] = (),
                 recording: Recording = Recording(), pipeline: Pipeline = Pipeline(),
                 health: HealthSampling | None = None, gate: bool = False, tags: dict | None = None,
                 run_id: str | None = None, all_layers: list[MoELayer] | None = None,
                 replay: RoutingReplay | None = None):
        if gate and replay is not None:
            raise ValueError("a trust gate re-routes by the router's scores, a replay forces given experts: "
                             "use one or the other")
        if replay is not None:
            tags = {**(tags or {}), "replay": replay.label}
        self.replay = replay
        self.model = model
        self.layers = layers
        self.recording = recording
        self.routes = recording.routes
        self.router_logits = _sample_size(recording.router_logits)
        self.router_inputs = _sample_size(recording.router_inputs)
        self.kv_cache = recording.kv_cache
        self.window = recording.window
        self.window_s = recording.window_s
        self.sample_seed = recording.sample_seed
        self._tags: list[dict[str, str]] = [{str(k): str(v) for k, v in (tags or {}).items()}]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._lock = threading.Lock()
        self.step = 0
        self.hook_errors = 0
        self.closed = False
        self._forked = False  # set in a forked child until its first forward (see _start_in_child)
        forking.join(self)
        self.graphed = False  # a forward was captured into a CUDA graph: replays run no host code
        self._trust: TrustPolicyExporter | None = None  # bind_trust_policy's
        self.timer: ComputeTimer | None = None

        rank, world_size = _distributed()
        total = sum(p.numel() for p in model.parameters())
        every = all_layers if all_layers is not None else layers
        # Rows no token can use (LongCat's zero-expert slots in fused weights) are never active.
        routed = sum(layer.params_per_expert * layer.num_experts + layer.unused_params for layer in every)
        watched = {id(layer) for layer in layers}
        self.total_params = total
        self.shared_params = total - routed  # counted for every token, by the model-card convention
        # Layers not watched: their experts' share is estimated as k experts per token (no drops).
        self.unwatched_params = float(sum(layer.top_k * layer.params_per_expert for layer in every
                                          if id(layer) not in watched))
        self.run = RunInfo(
            run_id=run_id or os.environ.get("MOESCOPE_RUN_ID") or shared_run_id(),
            started_at=dt.datetime.now(dt.timezone.utc), model_class=type(model).__name__,
            total_params=total, routed_expert_params=routed, tags=dict(self._tags[0]), rank=rank,
            world_size=world_size, layers=tuple(LayerInfo(
                layer=layer.index, module=layer.name, family=layer.family, num_experts=layer.num_experts,
                top_k=layer.top_k, params_per_expert=layer.params_per_expert, zero_experts=layer.zero_experts,
                expert_capacity=layer.expert_capacity) for layer in layers))
        self.processor: BatchProcessor[StepRecord] = BatchProcessor(
            list(exporters), max_queue=pipeline.max_queue, policy=pipeline.policy,
            flush_interval_s=pipeline.flush_interval_s, max_queue_bytes=pipeline.max_queue_bytes)
        try:
            for exporter in exporters:
                self._introduce(exporter)
            self.health = HealthSampler(layers, on_error=self._hook_failed, **vars(health)) if health else None
            self.gate = TrustGate(layers, on_error=self._hook_failed) if gate else None
            layout = build_layout(
                model, layers, routes=self.routes, router_logits=self.router_logits,
                router_inputs=self.router_inputs, window=self.window, coselection=recording.coselection,
                ring_tokens=recording.ring_tokens,
                health_layers={layer.index for layer in self.health.layers} if self.health is not None else set())
            self.buffers = layout.buffers
            self._position = layout.position
            if self.health is not None:
                self.health.bind(layout.health_rows())
            self._refs = ForwardRefs(len(layers))
            self._deferred: list[ForwardRefs] = []  # forwards counted but not yet reduced (eager CPU runs)
            self._deferred_key: tuple | None = None
            self._deferred_tokens = 0
            # CPU only: on a CUDA device a deferred reduction could land inside a CUDA-graph capture
            # (replayed with every replay), and its kernels are cheap to launch anyway
            self._may_defer = all(buffer.device.type == "cpu" for buffer in self.buffers)
            self._window_kind: str | None = None  # prefill or decode: the kind of the open window's forwards
            self._pool = PinnedPool()
            self.timer = ComputeTimer(layers, [layout.devices[layer.index] for layer in layers],
                                      lambda: self._recording, self._hook_failed) if recording.compute_time else None
            self._reset_forward()
            self._window_open(time.monotonic())
            self._install()
        except BaseException:
            self._remove_hooks()
            self.processor.shutdown()  # the writer thread started above must not outlive a failed attach
            raise

    def _introduce(self, exporter: Exporter[StepRecord]) -> None:
        """Give an exporter what it asks for (moescope/core/exporters.py), before its first record."""
        if isinstance(exporter, BindsProcessor):
            exporter.bind_processor(self.processor)
        if isinstance(exporter, AttachListener):
            exporter.on_attach(self.run)
        if isinstance(exporter, ProbeStatsReader):
            exporter.bind_probe_stats(self.probe_stats)

    # -- hooks ---------------------------------------------------------------------------------

    def _install(self) -> None:
        # The root's pre-hook and its host post-hook are bookkeeping: they stay out of any
        # compiled graph (under torch.compile the root's hooks run as frames of their own, so a
        # disabled one is simply run eagerly, with no graph break). The layers' hooks and the
        # reduction are device work that traces into the graph.
        eager = torch.compiler.disable
        self._handles.append(self.model.register_forward_pre_hook(eager(self._on_forward_start),
                                                                  with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._reduce_forward))
        self._handles.append(self.model.register_forward_hook(eager(self._on_forward_end), with_kwargs=True,
                                                              always_call=True))
        for layer in self.layers:
            self._handles.append(layer.router.register_forward_hook(self._router_hook(layer)))
            if layer.read_choice is not None and layer.experts is not None:
                self._handles.append(layer.experts.register_forward_pre_hook(
                    self._experts_hook(layer), with_kwargs=True))
        if self.gate is not None:  # prepended to the routers: the recorder above sees the gated routing
            self._handles.extend(self.gate.install())
        if self.replay is not None:  # prepended too: the recorder sees the forced routing
            self._handles.extend(self.replay.install(self.model))
        if self.timer is not None:
            self._handles.extend(self.timer.install(_capturing))

    def _remove_hooks(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def _reset_forward(self) -> None:
        self._recording = False
        self._reduced = False
        self._refs.clear()
        if self.timer is not None:
            self.timer.discard()

    def _on_forward_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        try:
            if self._recording:  # re-entrant call of the root: record the outer one only
                return
            if self._forked:
                self._start_in_child()
            self._reset_forward()
            refs = self._refs
            inputs = dict(kwargs)
            if args and "input_ids" not in inputs and isinstance(args[0], torch.Tensor):
                inputs["input_ids"] = args[0]
            refs.main_ids, refs.shape = main_input(inputs, decoder=False)
            refs.decoder_ids, refs.decoder_shape = main_input(inputs, decoder=True)
            self._started = time.perf_counter()
            expected = max(_tokens(refs.shape), _tokens(refs.decoder_shape))
            kind = forward_kind(refs.shape, refs.decoder_shape)
            if not _capturing() and self._forwards_in_window and kind is not None and self._window_kind is not None \
                    and kind != self._window_kind:
                self._close_window()  # a prefill after decode steps (or the reverse): a row holds one kind
            if not _capturing() and any(ring.host_rows and ring.host_rows + ring.rows(expected)
                                        > ring.capacity for buffer in self.buffers for ring in buffer.rings):
                self._close_window()  # this forward would not fit: start a new window first
            self._window_kind = kind or self._window_kind
            if self.router_inputs > 0 or self.router_logits > 0:
                size = max(self.router_inputs, self.router_logits)
                base = self.buffers[0].flat[TOTAL_FORWARDS].to(torch.int64) * SAMPLE_MIX + self.sample_seed
                refs.sample_base = (base + torch.arange(size, device=base.device) * SAMPLE_STRIDE)
            if self.health is not None:
                self.health.begin_forward(capturing=_capturing())
            self._recording = True
        except Exception:
            self._hook_failed()

    def _router_hook(self, layer: MoELayer) -> Callable:
        position = self._position[layer.index]
        refs = self._refs
        health = self.health
        visit = health.visitor(layer) if health is not None else None  # the same hook samples health

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self._recording:
                return
            try:
                logits = layer.read_logits(output)
                refs.logits[position] = logits
                if self.router_inputs and args and isinstance(args[0], torch.Tensor):
                    hidden = args[0].reshape(-1, args[0].shape[-1])
                    if self.router_inputs > 0:
                        hidden = hidden.index_select(0, refs.sample_base[: min(self.router_inputs, hidden.shape[0])]
                                                     % hidden.shape[0])
                    refs.inputs[position] = hidden
                if layer.read_router_choice is not None:
                    refs.choice[position] = layer.read_router_choice(output, logits)
            except Exception:
                self._hook_failed()
            if visit is not None and health.now:  # type: ignore[union-attr]
                visit(args)  # counts its own failures
        return hook

    def _experts_hook(self, layer: MoELayer) -> Callable:
        position = self._position[layer.index]
        refs = self._refs

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._recording:
                return
            try:
                read_choice = layer.read_choice
                assert read_choice is not None  # hooked only where the experts call holds the choice
                refs.choice[position] = read_choice(args, kwargs, refs.logits[position])
            except Exception:
                self._hook_failed()
        return hook

    def _reduce_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Device side of a forward (probe/reduction.py), once per forward of the root. Traceable:
        under torch.compile it is a graph of its own, with no break.

        In eager runs on a CPU (inference and training; not under compile) the forward is only
        counted and its references kept: forwards of one shape are reduced together, in one
        stacked pass, when the window closes (on the writer's thread, into the window's snapshot)
        or when DEFERRED_TOKENS tokens are waiting. Decode steps are small, and the ops of a
        reduction cost the same for one step as for thirty. The references are the tensors the
        model passed (no copies): a model that changes its router logits or choices in place after
        the router and experts have run would be recorded with the changed values."""
        if not self._recording or self._reduced:
            return
        self._reduced = True
        refs = self._refs
        if self._may_defer and not torch.compiler.is_compiling():
            key = deferral_key(self.buffers, self._position, refs)
            tokens = max((entry[0] for entry in key[2:]), default=0) if key is not None else DEFERRED_TOKENS + 1
            if self._deferred and (key != self._deferred_key or self._deferred_tokens + tokens > DEFERRED_TOKENS):
                self._reduce_deferred()
            if tokens <= DEFERRED_TOKENS:
                count_forward(self.buffers)
                self._deferred.append(refs.snapshot())
                self._deferred_key = key
                self._deferred_tokens += tokens
                return
        self._reduce_deferred()
        reduce_forward(self.buffers, self._position, refs)

    def _reduce_deferred(self) -> None:
        if self._deferred:
            forwards, self._deferred, self._deferred_key, self._deferred_tokens = self._deferred, [], None, 0
            reduce_deferred(self.buffers, self._position, forwards)

    def _on_forward_end(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._recording:
            return
        reduced = self._reduced
        try:
            if _capturing():
                # Captured into a CUDA graph: the device work above replays with the graph; the
                # host will not see those forwards, so from now on windows read the device counters.
                self.graphed = True
                return
            if not reduced:
                return  # the forward raised: nothing of it was added
            self.step += 1
            self._forwards_in_window += 1
            if self.timer is not None:
                self.timer.commit()
            self._duration_s += time.perf_counter() - self._started
            refs = self._refs
            expected = max(_tokens(refs.shape), _tokens(refs.decoder_shape))
            for buffer in self.buffers:
                for ring in buffer.rings:
                    ring.host_rows += ring.rows(expected)
                    # a forward with more rows than its ring holds writes the first `capacity`: count the rest
                    over = ring.rows(_tokens(refs.decoder_shape if ring.group.decoder else refs.shape)) - ring.capacity
                    if over > 0:
                        self._count_ring_drop(RING_TABLES[ring.kind], over * len(ring.group.layers))
            self._last_shape = refs.shape
            if self.kv_cache:
                self._last_kv = kv_cache_layers(output)
            if (self._forwards_in_window >= self.window
                    or (self.window_s is not None and time.monotonic() - self._window_started >= self.window_s)):
                self._close_window()
        except Exception:
            self._hook_failed()
        finally:
            self._reset_forward()

    def count_hook_error(self) -> None:
        """Count a failure of a hook that works for this session but is not its own.

        For an actuator's hooks, e.g. the routing cooldown's: one `hook_errors` count, one log line for
        the first.
        """
        self._hook_failed()

    def _hook_failed(self) -> None:
        # The model thread must never see the probe fail: count, log once, carry on.
        self.hook_errors += 1
        if self.hook_errors == 1:
            log.exception("moescope probe hook failed; the forward goes on unrecorded for that layer")

    # -- a forked child ------------------------------------------------------------------------

    def reset_in_child(self) -> None:
        """Mark an open session as forked; the at-fork registry calls this in a forked child.

        Nothing else should call it: its first forward in the child starts afresh (`_start_in_child`).
        """
        if not self.closed:
            self._lock = threading.Lock()  # a thread of the parent's may have held it at the fork
            self._forked = True

    def _start_in_child(self) -> None:
        """The first forward of a forked child (torch.multiprocessing with fork, os.fork) on the model
        this session watches: the window open at the fork is the parent's to record, so it is dropped
        here; the child's forwards are recorded under the same run and rank, numbered on from the
        fork, and its last window is written when the child exits (atexit, and multiprocessing's exit
        finalizers, which run where atexit does not). A child that never runs the model (a DataLoader
        worker) does none of this and writes nothing."""
        self._forked = False
        with self._lock:
            self._deferred, self._deferred_key, self._deferred_tokens = [], None, 0  # the parent's
            if self._forwards_in_window:
                for buffer in self.buffers:
                    buffer.snapshot(whole_rings=self.graphed)
            self._window_open(time.monotonic())
        atexit.register(self._exit_in_child)
        multiprocessing.util.Finalize(self, self._exit_in_child, exitpriority=10)

    def _exit_in_child(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._close_window(force=True)
        except Exception:
            self._hook_failed()
        self.processor.shutdown()

    # -- windows -------------------------------------------------------------------------------

    def _window_open(self, now: float) -> None:
        self._window_started = now
        self._forwards_in_window = 0
        self._duration_s = 0.0
        self._last_kv = None
        self._last_shape = getattr(self, "_last_shape", ())
        self._window_kind = None

    def _close_window(self, force: bool = False) -> None:
        """Snapshot the device accumulators and hand the window to the writer. Model thread:
        launches only (a gather, one non-blocking copy per device, an event)."""
        with self._lock:
            # the last forwards, not yet reduced, are reduced into the snapshot on the writer's thread
            deferred, self._deferred, self._deferred_key, self._deferred_tokens = self._deferred, [], None, 0
            if not self._forwards_in_window and not (force and self.graphed):
                reduce_deferred(self.buffers, self._position, deferred)  # none, unless the host lost count
                self._window_open(time.monotonic())
                return
            deferred_bytes = _refs_bytes(deferred[0]) * len(deferred) if deferred else 0
            snapshots = []
            for buffer in self.buffers:
                data, layout = buffer.snapshot(whole_rings=self.graphed)
                if data.is_cuda:
                    host = self._pool.take(data.numel(), data.dtype)
                    host.copy_(data, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                    snapshots.append(Snapshot(buffer, host, layout, event, self._pool))
                else:  # CPU: a fresh tensor, the writer may reduce into it (only CPU buffers defer)
                    snapshots.append(Snapshot(buffer, data, layout, deferred=deferred, position=self._position,
                                              deferred_bytes=deferred_bytes))
            tags: dict[str, str] = {}
            for layer_tags in self._tags:
                tags.update(layer_tags)
            shape = self._last_shape
            context = HostContext(
                run_id=self.run.run_id, ts=dt.datetime.now(dt.timezone.utc), tags=tags,
                host_forwards=self._forwards_in_window, duration_s=self._duration_s,
                batch_size=shape[0] if shape else 1, seq_len=shape[1] if shape else 0, shape_known=bool(shape),
                active_base=self.shared_params + self.unwatched_params, total_params=self.total_params,
                kv_cache=self._last_kv, compute_time=None if self.timer is None else self.timer.take(),
                trust_weights={} if self.gate is None else {layer.index: self.gate.weights(layer.index)
                                                            for layer in self.layers})
            self._window_open(time.monotonic())
        self.processor.emit(PendingWindow(context, snapshots, on_dropped=self._count_ring_drop))

    def _count_ring_drop(self, table: str, rows: int) -> None:
        self.processor.count_dropped_rows(table, "ring_full", rows)

    # -- public API ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def tag(self, **tags: Any) -> Iterator[None]:
        """Tag every record made inside the block (key=value); blocks nest.

        Entering and leaving a block closes the current window, so a window never mixes tags.

        Args:
            **tags: the tags; values are kept as strings. An inner block's tags are added to the outer's.

        Yields:
            Nothing; the tags hold until the block ends.
        """
        self._close_window()
        self._tags.append({str(k): str(v) for k, v in tags.items()})
        try:
            yield
        finally:
            self._close_window()
            self._tags.pop()

    @property
    def forwards_in_window(self) -> int:
        """Forwards recorded since the current window opened (a host count)."""
        return self._forwards_in_window

    def end_window(self) -> bool:
        """Close the current window now, without waiting for the writer.

        The training monitor ends one per optimizer step.

        Returns:
            Whether the window held a forward (an empty one is not recorded).
        """
        held = self._forwards_in_window > 0
        self._close_window()
        return held

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Close the current window and write everything recorded so far.

        After CUDA-graph replays this reads the device counters out (without a sync on the model's
        stream: the copy is queued behind the replays).

        Args:
            timeout_s: how long to wait for the writer, in seconds (default 30).

        Returns:
            False if the writer did not finish in time, else True.
        """
        self._close_window(force=True)
        return self.processor.force_flush(timeout_s)

    def close(self) -> None:
        """Remove exactly the hooks this session added, close the window, flush the writer; safe twice.

        The exporters (and a bound trust policy) are shut down; a failure while closing the window is
        counted in `hook_errors`, not raised.
        """
        if self.closed:
            return
        self.closed = True
        self._remove_hooks()
        try:
            self._close_window(force=True)
        except Exception:
            self._hook_failed()
        self.processor.shutdown()

    def add_exporter(self, exporter: Exporter[StepRecord], *, first: bool = False) -> None:
        """Send this session's records to one more exporter, from the next batch on; safe while the
        model runs and the writer exports.

        The exporter is given what it asks for first, as the exporters given at attach are: the
        session's processor (`BindsProcessor`), the run (`AttachListener`), the probe's counts
        (`ProbeStatsReader`). It is shut down when the session closes.

        Args:
            exporter: the consumer to add (e.g. the training monitor's, a cooldown policy).
            first: put it before the other exporters, so that it sees each batch first (one that
                fills in what later exporters read).

        Raises:
            ValueError: when the session is closed. What the exporter's `on_attach` raises (the
                store's: a store that cannot be used); the exporter is not added then.
        """
        if self.closed:
            raise ValueError("the probe session is closed; add exporters to an open session")
        self._introduce(exporter)
        self.processor.add_exporter(exporter, first=first)

    @property
    def trust(self) -> TrustPolicyExporter | None:
        """The trust policy bound to this session (`bind_trust_policy`), or None."""
        return self._trust

    def bind_trust_policy(self, policy: TrustPolicyExporter) -> None:
        """Run `policy` on this session: it becomes `session.trust` and judges every record from now
        on, as the last of the exporters (after one that fills in what it reads, e.g. the training
        monitor's gradient norms). `moescope.attach` calls this; the policy binds itself to the
        session's gate and run first (`alerts.trust_policy.TrustPolicy.bind`).

        Args:
            policy: the trust policy; it is shut down when the session closes.

        Raises:
            ValueError: when the session is closed, or already runs a trust policy (one policy
                drives a gate).
        """
        if self._trust is not None:
            raise ValueError("this session already runs a trust policy; a gate is driven by one policy")
        self.add_exporter(policy)
        self._trust = policy

    def probe_stats(self) -> ProbeStats:
        """What the probe wrote and dropped, so far.

        Returns:
            (rows written per table, by the exporters that write rows, e.g. the store's; rows dropped
                per (table, reason)).
        """
        written: dict[str, int] = {}
        for exporter in self.processor.exporters:  # exporters that write rows say how many (the store's)
            if not isinstance(exporter, WritesRows):
                continue
            for table, rows in dict(exporter.written_rows or {}).items():
                written[table] = written.get(table, 0) + rows
        return written, dict(self.processor.dropped_rows)

    @property
    def dropped_records(self) -> int:
        """Records the pipeline dropped so far, over every reason."""
        return sum(self.processor.dropped_records.values())

    def __enter__(self) -> ProbeSession:
        """Return the session itself; leaving the block calls `close()`."""
        return self

    def __exit__(self, *exc: Any) -> None:
        """Close the session (`close()`), whatever ended the block; exceptions pass through."""
        self.close()


def _capturing() -> bool:
    # nothing captures before CUDA is initialised; is_initialized() is a flag read, is_available() is not
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _refs_bytes(refs: ForwardRefs) -> int:
    """Bytes of the tensors a deferred forward holds (router logits, choices, router inputs)."""
    held = [t for t in refs.logits if t is not None] + [t for t in refs.inputs if t is not None]
    held += [t for c in refs.choice if c is not None for t in (c.ids, c.weights, c.kept) if t is not None]
    return sum(t.numel() * t.element_size() for t in held)


def _tokens(shape: tuple) -> int:
    return shape[0] * shape[1] if shape else 0


def _is_compiled(model: nn.Module) -> bool:
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    wrapper = getattr(optimized, "OptimizedModule", None)
    return (wrapper is not None and isinstance(model, wrapper)) or getattr(
        model, "_compiled_call_impl", None) is not None


def attach(model: nn.Module, exporters: Sequence[Exporter[StepRecord]] = (), *, specs: Iterable[MoESpec] = (),
           layers: str | Sequence[str] | Callable[[str], bool] | None = None, tags: dict | None = None,
           run_id: str | None = None, recording: Recording | None = None, pipeline: Pipeline | None = None,
           health: bool | HealthSampling = False, gate: bool = False, health_options: dict | None = None,
           replay: RoutingReplay | None = None, **options: Any) -> ProbeSession:
    """Hook every MoE layer of `model` and hand its records to `exporters`.

    The low-level API: the probe only produces records. `moescope.attach(model, store=...)` wires
    the store, the trust policy and alerts to a session made here.

    Attach first, then compile (`torch.compile(model)`): the probe's device work traces into the
    graphs without a break. Under CUDA-graph replay the device accumulators keep counting;
    `session.flush()` reads them out. Hooks are state on the model's modules: `session.close()`
    removes exactly the ones this session added.

    Args:
        model: the torch model to hook.
        exporters: consumers of the records (`export`, `force_flush`, `shutdown`; e.g. the store's
            `ParquetExporter`, the Prometheus exporter, `moescope.core.exporters.InMemoryExporter`).
        specs: `MoESpec`s describing custom MoE modules; they take precedence over what the model
            declares.
        layers: only hook the MoE blocks with these names (a name, a list of names, or a predicate on
            the name); each keeps its index among all the model's MoE layers, and the
            active-parameter figures count the unwatched layers' experts as k experts per token (an
            estimate: their routing is not seen). Default None: every MoE layer.
        tags: key=value tags on every record of the session (`session.tag` adds more for a block).
        run_id: the run's id; by default `$MOESCOPE_RUN_ID`, else a new one (rank 0's under
            torch.distributed, a collective call: every rank must attach).
        recording: a `Recording` (what is recorded, the window); default `Recording()`.
        pipeline: a `Pipeline` (the queue to the exporters); default `Pipeline()`.
        health: sample expert outputs and weight fingerprints (True, or a `HealthSampling`;
            docs/health.md). Default False.
        gate: install the `TrustGate` (`session.gate`); with every weight at 1 it changes no bit of
            the output. Default False.
        health_options: a `HealthSampling`'s fields as a dict; when given, it replaces `health`.
        replay: a `probe.replay.RoutingReplay` to install with the session (`moescope.attach(replay=...)`
            builds it from an array, an export folder or a store); the records are tagged `replay=`.
        **options: the fields of `Recording` and `Pipeline`, one by one (`routes=True, window=1,
            policy="drop"`); they win over `recording` and `pipeline`.

    Returns:
        The session (a context manager).

    Raises:
        NoMoELayersError: for a model with no MoE layer (or none matching `layers`).
        ProbeAttachError: for a model compiled (`torch.compile`) before attaching.
        TypeError: for an unknown option, or `layers` of another type.
        ValueError: for a `Recording`, `Pipeline` or `HealthSampling` value out of range.
    """
    if _is_compiled(model):
        raise ProbeAttachError(
            "this model was compiled with torch.compile before attaching: compiled graphs do not run "
            "hooks added afterwards, so nothing would be recorded. Attach first, then compile: "
            "`session = probe.attach(model, ...); model = torch.compile(model)`.")
    recording, pipeline = _configs(recording, pipeline, options)
    if health_options is not None:
        health = HealthSampling(**health_options)
    elif health is True:
        health = HealthSampling()
    every = find_moe_layers(model, specs=specs)
    select = _layer_selector(layers)
    moe_layers = every if select is None else [layer for layer in every if select(layer.name)]
    if not moe_layers:
        names = ", ".join(layer.name for layer in every)
        raise NoMoELayersError(f"layers={layers!r} matches none of the model's MoE blocks: {names}")
    return ProbeSession(model, moe_layers, exporters=list(exporters), recording=recording, pipeline=pipeline,
                        health=health or None, gate=gate, tags=tags, run_id=run_id, all_layers=every,
                        replay=replay)


def _configs(recording: Recording | None, pipeline: Pipeline | None,
             options: dict[str, Any]) -> tuple[Recording, Pipeline]:
    """`Recording` and `Pipeline` from the given objects and keyword options (options win)."""
    fields = {cls: {f.name for f in dataclasses.fields(cls)} for cls in (Recording, Pipeline)}
    unknown = set(options) - fields[Recording] - fields[Pipeline]
    if unknown:
        known = ", ".join(sorted(fields[Recording] | fields[Pipeline]))
        raise TypeError(f"unknown probe option(s) {', '.join(sorted(unknown))}; the options are: {known} "
                        "(the store, trust gate policy and alerts are moescope.attach's)")
    recording = dataclasses.replace(recording or Recording(),
                                    **{k: v for k, v in options.items() if k in fields[Recording]})
    pipeline = dataclasses.replace(pipeline or Pipeline(),
                                   **{k: v for k, v in options.items() if k in fields[Pipeline]})
    return recording, pipeline


def _layer_selector(layers: str | Sequence[str] | Callable[[str], bool] | None) -> Callable[[str], bool] | None:
    if layers is None:
        return None
    if isinstance(layers, str):
        return lambda name: name == layers
    if callable(layers):
        return layers
    if isinstance(layers, Iterable):
        wanted = set(layers)
        return lambda name: name in wanted
    raise TypeError(f"layers must be a module name, a list of names or a predicate, not {type(layers).__name__}")
