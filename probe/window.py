"""Windows: the host side of the probe, run on the writer's thread.

A window is a run of forwards whose device accumulators were snapshotted together (see
probe/accumulate.py). Closing one on the model thread only launches device work: one gather, one
asynchronous copy into a pinned buffer from a reusable pool, a CUDA event. The `PendingWindow` it
leaves is handed to the writer's queue; there, `materialize()` waits for the copy (the writer
thread blocks, never the model), reduces the forwards the model thread left unreduced (CPU
runs: probe/reduction.py) into the snapshot, and builds the `StepRecord`: unpacking,
per-layer figures, routes and samples.

A window's figures weight every token equally: loads, drops and co-selection are sums; router
entropy, margin and the active-parameter figures are token-weighted means (sums over the window
divided by its tokens); capacity use is the largest over its forwards; the entropy p95 is read from
the window's histogram.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moescope.core.records import KVCacheLayer, LayerStep, Routes, StepRecord, TokenSample
from moescope.probe.accumulate import (
    RING_TABLES,
    TOTAL_FORWARDS,
    WINDOW_FORWARDS,
    DeviceBuffer,
    LayerGroup,
    Ring,
    entropy_quantile,
)
from moescope.probe.reduction import ForwardRefs, reduce_into_snapshot
from moescope.probe.timing import LayerTime, WindowTimes, expert_times


class PinnedPool:
    """Reusable page-locked host buffers for the windows' device-to-host copies."""

    def __init__(self, limit: int = 8):
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.limit = limit

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= numel and buf.dtype == dtype:
                    return self._free.pop(i)[:numel]
        return torch.empty(max(numel, 1), dtype=dtype, pin_memory=True)[:numel]

    def give(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        with self._lock:
            if len(self._free) < self.limit:
                self._free.append(base)


@dataclass
class HostContext:
    """What the host knows of a window when it closes; nothing here waited on the device."""

    run_id: str
    ts: dt.datetime
    tags: dict[str, str]
    host_forwards: int  # forwards the host saw (0 under CUDA-graph replays)
    duration_s: float  # host wall time of those forwards, hooks included
    batch_size: int
    seq_len: int
    shape_known: bool
    active_base: float  # parameters every token uses, plus the estimate for unwatched layers
    total_params: int
    kv_cache: list[KVCacheLayer] | None
    trust_weights: dict[int, np.ndarray] = field(default_factory=dict)
    compute_time: WindowTimes | None = None  # timing marks (Recording.compute_time), read after the copy


@dataclass
class Snapshot:
    """One device's part of a window: a host buffer (once `event` completes) and its layout.

    deferred: the window's last forwards, counted but not yet reduced (eager CPU runs,
    probe/reduction.py), by the places of `position`; `materialize` reduces them into `host`.
    """

    buffer: DeviceBuffer
    host: torch.Tensor
    layout: list[tuple[int, int]]
    event: Any = None
    pool: PinnedPool | None = None
    deferred: list[ForwardRefs] = field(default_factory=list)
    position: dict[int, int] = field(default_factory=dict)
    deferred_bytes: int = 0


class PendingWindow:
    """A closed window waiting for its copies; `materialize()` runs on the writer thread."""

    def __init__(self, context: HostContext, snapshots: list[Snapshot],
                 on_dropped: Callable[[str, int], None] | None = None):
        self.context = context
        self.snapshots = snapshots
        self.on_dropped = on_dropped  # (table, rows) a full ring overwrote

    @property
    def nbytes(self) -> int:
        return sum(s.host.numel() * s.host.element_size() + s.deferred_bytes for s in self.snapshots)

    def rows(self) -> dict[str, int]:
        """An upper bound of the rows this window adds to each table (for drop accounting)."""
        rows = {"steps": 1, "layer_steps": sum(len(g.layers) for s in self.snapshots for g in s.buffer.groups)}
        for snap in self.snapshots:
            for ring, (count, _) in zip(snap.buffer.rings, snap.layout):
                table = RING_TABLES[ring.kind]
                rows[table] = rows.get(table, 0) + count * (len(ring.group.layers))
        if self.context.kv_cache:
            rows["kv_cache"] = len(self.context.kv_cache)
        return rows

    def materialize(self) -> StepRecord:
        for snap in self.snapshots:
            if snap.event is not None:
                snap.event.synchronize()
            if snap.deferred:  # the reduction the model thread left: here, off its interpreter
                forwards, snap.deferred = snap.deferred, []
                reduce_into_snapshot(snap.host, snap.buffer, snap.layout, snap.position, forwards)
        try:
            return self._build()
        finally:
            for snap in self.snapshots:
                if snap.pool is not None:
                    snap.pool.give(snap.host)

    def _build(self) -> StepRecord:
        ctx = self.context
        head = self.snapshots[0].host.numpy() if self.snapshots else np.zeros(2)
        forwards = int(round(head[WINDOW_FORWARDS])) if self.snapshots else ctx.host_forwards
        total = int(round(head[TOTAL_FORWARDS])) if self.snapshots else ctx.host_forwards
        layer_steps: list[LayerStep] = []
        active = ctx.active_base
        times = ctx.compute_time.read() if ctx.compute_time is not None else {}
        for snap in self.snapshots:
            host = snap.host.numpy()
            rings = {}
            for ring, (count, offset) in zip(snap.buffer.rings, snap.layout):
                written = int(round(host[ring.pos_col]))
                data = host[offset: offset + count * ring.columns.width].reshape(count, ring.columns.width)
                if written > ring.capacity and self.on_dropped is not None:
                    table = RING_TABLES[ring.kind]
                    self.on_dropped(table, (written - ring.capacity) * len(ring.group.layers))
                data = data[: min(written, count)]
                order = np.lexsort((data[:, 1], data[:, 0])) if len(data) else np.arange(0)
                rings[(id(ring.group), ring.kind)] = (ring, data[order])
            for group in snap.buffer.groups:
                block = host[group.offset: group.offset + group.size].reshape(len(group.layers), -1)
                for row, layer in enumerate(group.layers):
                    step = self._layer_step(group, layer, block[row], snap, host, rings, times.get(layer.index))
                    if step is None:
                        continue
                    active += step.active_params_per_token
                    layer_steps.append(step)
        layer_steps.sort(key=lambda ls: ls.layer)
        tokens = layer_steps[0].tokens if layer_steps else ctx.batch_size * ctx.seq_len * max(forwards, 1)
        batch_size, seq_len = (ctx.batch_size, ctx.seq_len) if ctx.shape_known else (1, tokens)
        return StepRecord(
            run_id=ctx.run_id, step=total - forwards, ts=ctx.ts, duration_s=ctx.duration_s, tokens=tokens,
            batch_size=batch_size, seq_len=seq_len, active_params=active, total_params=ctx.total_params,
            tags=ctx.tags, layers=layer_steps, kv_cache=ctx.kv_cache, forwards=forwards,
            step_end=total - 1)

    def _layer_step(self, group: LayerGroup, layer: Any, row: np.ndarray, snap: Snapshot, host: np.ndarray,
                    rings: dict, time: LayerTime | None) -> LayerStep | None:
        cols = group.columns
        tokens = int(round(row[cols["tokens"]][0]))
        if tokens == 0:
            return None
        load = np.rint(row[cols["expert_load"]]).astype(np.int64)
        capacity = int(round(row[cols["capacity"]][0])) if group.capacity and row[cols["capacity"]][0] > 0 else None
        fields: dict[str, Any] = {}
        if snap.buffer.health is not None and layer.index in snap.buffer.health.positions:
            fields = health_fields(snap.buffer.health, host, layer.index, layer.num_experts)
        trust = self.context.trust_weights.get(layer.index)
        if trust is not None:
            fields["trust_weight"] = trust
        if time is not None:
            per_expert, measured = expert_times(time, load, layer.num_experts)
            fields.update(compute_time_s=time.block_s, expert_compute_time_s=per_expert,
                          expert_compute_time_measured=measured)
        position = group.layers.index(layer)
        return LayerStep(
            layer=layer.index, tokens=tokens, expert_load=load,
            gate_weight_sum=row[cols["gate_weight_sum"]].astype(np.float64),
            router_entropy_mean=float(row[cols["entropy_sum"]][0]) / tokens,
            router_entropy_p95=entropy_quantile(row[cols["entropy_hist"]], 0.95, group.router_width),
            top1_margin_mean=float(row[cols["margin_sum"]][0]) / tokens,
            dropped_tokens=int(round(row[cols["dropped_tokens"]][0])),
            dropped_assignments=int(round(row[cols["dropped_assignments"]][0])),
            capacity=capacity, capacity_use=float(row[cols["capacity_use"]][0]) if capacity else None,
            active_params_per_token=float(row[cols["real_slots_kept"]][0]) / tokens * layer.params_per_expert,
            router_prob_sum=row[cols["router_prob_sum"]].astype(np.float64),
            router_topk_load=np.rint(row[cols["router_topk_load"]]).astype(np.int64),
            router_z_sum=float(row[cols["router_z_sum"]][0]),
            coselection=(np.rint(row[cols["coselection"]]).astype(np.int64).reshape(group.slots, group.slots)
                         if group.coselection else None),
            routes=_routes(rings.get((id(group), "routes")), position, group),
            router_logits=_sample(rings.get((id(group), "logits")), position, group),
            router_inputs=_sample(rings.get((id(group), "inputs")), position, group),
            forwards=int(round(host[WINDOW_FORWARDS])), **fields)


def health_fields(health: Any, host: np.ndarray, layer: int, num_experts: int) -> dict[str, Any]:
    """`LayerStep` health keyword arguments from a layer's host row (see probe/health_sampling.py)."""
    cols = health.columns(num_experts)
    start = health.offset + health.positions.index(layer) * health.width
    row = host[start: start + health.width]
    checked = row[cols["weight_checked"]][0] > 0
    grads = row[cols["grad_present"]][0] > 0
    return dict(
        expert_output_samples=np.rint(row[cols["samples"]]).astype(np.int64),
        expert_output_norm_sum=row[cols["norm_sum"]].astype(np.float64),
        expert_output_nonfinite=np.rint(row[cols["nonfinite"]]).astype(np.int64),
        nonfinite_input_tokens=int(round(row[cols["input_nonfinite"]][0])),
        expert_weight_cosine=row[cols["weight_cosine"]].astype(np.float64) if checked else None,
        expert_weight_norm_ratio=row[cols["weight_norm_ratio"]].astype(np.float64) if checked else None,
        expert_grad_norm=row[cols["grad_norm"]].astype(np.float64) if checked and grads else None)


def _routes(ring_data: tuple[Ring, np.ndarray] | None, position: int, group: LayerGroup) -> Routes | None:
    if ring_data is None:
        return None
    ring, data = ring_data
    cols = ring.columns
    # (rows, layers, k): a window can hold no row (no forward of it wrote the ring: a layer of the
    # group did not run, or its reader failed), so no dimension is left to numpy to infer
    shape = (len(data), len(group.layers), group.top_k)
    ids = data[:, cols["ids"]].reshape(shape)[:, position]
    weights = data[:, cols["weights"]].reshape(shape)[:, position]
    kept = data[:, cols["kept"]].reshape(shape)[:, position] > 0
    token_id = data[:, cols.at("token_id")]
    return Routes(expert_ids=np.rint(ids).astype(np.int32), gate_weights=weights.astype(np.float32), kept=kept,
                  token_ids=None if (token_id < 0).any() else np.rint(token_id).astype(np.int64),
                  sequence=np.rint(data[:, cols.at("sequence")]).astype(np.int32),
                  position=np.rint(data[:, cols.at("position")]).astype(np.int32),
                  step=np.rint(data[:, cols.at("forward")]).astype(np.int64),
                  token=np.rint(data[:, cols.at("token")]).astype(np.int32))


def _sample(ring_data: tuple[Ring, np.ndarray] | None, position: int, group: LayerGroup) -> TokenSample | None:
    if ring_data is None:
        return None
    ring, data = ring_data
    cols = ring.columns
    values = data[:, cols["values"]]
    values = values.reshape(len(data), len(group.layers), values.shape[1] // len(group.layers))[:, position]
    token_id = data[:, cols.at("token_id")]
    return TokenSample(token=np.rint(data[:, cols.at("token")]).astype(np.int32),
                       token_ids=None if (token_id < 0).any() else np.rint(token_id).astype(np.int64),
                       values=values.astype(np.float32),
                       top1_expert=np.rint(data[:, cols["top1"]][:, position]).astype(np.int32),
                       step=np.rint(data[:, cols.at("forward")]).astype(np.int64))
