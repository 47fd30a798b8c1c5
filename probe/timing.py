"""Compute time per MoE layer (`Recording(compute_time=True)`): how long each MoE block ran.

A pre-hook and a forward hook on each MoE block, and on its experts module, mark when it started
and ended. On CUDA a mark is a `torch.cuda.Event(enable_timing=True)` recorded on the current
stream, taken from a reusable pool; the model's thread only records them, and the writer's thread
reads `elapsed_time` once the window's copy event (recorded after them on the same stream) has
completed, so nothing waits on the device. On CPU a mark is `time.perf_counter()`: wall time.

Per expert: where the experts are separate modules run one after another (Switch's and NLLB's
`expert_0 ... expert_{E-1}`), each is hooked and *measured*. Where one module runs them all
(fused weights, `grouped_mm`), the experts module's time is *attributed* to the experts by their
token load in the window (kept slots; identity experts get none) and labelled so
(`LayerStep.expert_compute_time_measured` is False).

Sharp edges: these hooks are host code, wrapped in `torch.compiler.disable`, so under
`torch.compile` each timed block is a graph break; under CUDA-graph replay no host code runs and
nothing is timed. That is why compute time is opt-in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from moescope.probe.adapters import MoELayer

perf_counter = time.perf_counter  # module attribute: the exact-arithmetic test swaps in a clock of its own

BLOCK, EXPERTS = -1, -2  # what a mark pair timed, besides an expert's index


class EventPool:
    """Reusable CUDA timing events, handed out on the model's thread and returned by the writer."""

    def __init__(self) -> None:
        self._free: list[torch.cuda.Event] = []
        self._lock = threading.Lock()

    def take(self) -> torch.cuda.Event:
        with self._lock:
            if self._free:
                return self._free.pop()
        return torch.cuda.Event(enable_timing=True)

    def give(self, events: list[torch.cuda.Event]) -> None:
        with self._lock:
            self._free.extend(events)


@dataclass
class LayerTime:
    """One layer's compute time over a window, in seconds summed over its forwards."""

    block_s: float
    experts_s: float | None  # the experts module's time, where there is one
    per_expert_s: np.ndarray | None  # (num_experts,) measured per expert module, or None (attribute)


class WindowTimes:
    """A closed window's timing marks; `read()` runs on the writer's thread after the copy event."""

    def __init__(self, positions: list[int], sums: dict[tuple[int, int], float] | None = None,
                 pairs: list[tuple[int, int, Any, Any]] | None = None, pool: EventPool | None = None,
                 num_experts: dict[int, int] | None = None, measured: set[int] | None = None):
        self.positions = positions  # layer index per position
        self.sums = sums or {}  # (position, what) -> seconds (CPU)
        self.pairs = pairs or []  # (position, what, start event, end event) (CUDA)
        self.pool = pool
        self.num_experts = num_experts or {}
        self.measured = measured or set()

    def read(self) -> dict[int, LayerTime]:
        """Seconds per layer index. The CUDA events must have completed (the window's copy event)."""
        sums = dict(self.sums)
        if self.pairs:
            for position, what, start, end in self.pairs:
                end.synchronize()  # writer thread; already complete when on the copy event's stream
                sums[(position, what)] = sums.get((position, what), 0.0) + start.elapsed_time(end) / 1e3
            if self.pool is not None:
                self.pool.give([e for pair in self.pairs for e in pair[2:]])
            self.pairs = []
        out: dict[int, LayerTime] = {}
        for position, layer in enumerate(self.positions):
            if (position, BLOCK) not in sums:
                continue
            per_expert = None
            if position in self.measured:
                per_expert = np.array([sums.get((position, e), 0.0) for e in range(self.num_experts[position])])
            out[layer] = LayerTime(sums[(position, BLOCK)], sums.get((position, EXPERTS)), per_expert)
        return out


def expert_modules(layer: MoELayer) -> list[nn.Module] | None:
    """The experts as separate modules, one per routed expert in id order, or None when fused."""
    experts = layer.experts
    if experts is None:
        return None
    children = list(experts.children()) if isinstance(experts, (nn.ModuleList, nn.ModuleDict)) else []
    if len(children) != layer.num_experts or not all(any(True for _ in c.parameters()) for c in children):
        return None
    return children


class ComputeTimer:
    """Marks around each MoE block, its experts module and its expert modules; sums per window.

    A forward's marks are kept apart until the session commits the forward (it was recorded),
    and dropped otherwise (it raised, or it was not the recorded forward).
    """

    def __init__(self, layers: list[MoELayer], devices: list[torch.device], active: Callable[[], bool],
                 on_error: Callable[[], None]):
        self.layers = layers
        self.devices = devices
        self.active = active
        self.on_error = on_error
        self.cuda = any(device.type == "cuda" for device in devices)
        self.pool = EventPool() if self.cuda else None
        self.experts = {position: expert_modules(layer) for position, layer in enumerate(layers)}
        self.num_experts = {position: layer.num_experts for position, layer in enumerate(layers)}
        self.measured = {p for p, modules in self.experts.items() if modules is not None}
        self._open: dict[tuple[int, int], Any] = {}
        self._forward: list[tuple[int, int, Any, Any]] = []
        self._sums: dict[tuple[int, int], float] = {}
        self._pairs: list[tuple[int, int, Any, Any]] = []

    def install(self, capturing: Callable[[], bool]) -> list[torch.utils.hooks.RemovableHandle]:
        """Hook every timed module; returns the handles (the session removes them)."""
        handles = []
        eager = torch.compiler.disable
        for position, layer in enumerate(self.layers):
            timed = [(layer.block, BLOCK)]
            if layer.experts is not None:
                timed.append((layer.experts, EXPERTS))
            timed.extend((module, e) for e, module in enumerate(self.experts[position] or ()))
            for module, what in timed:
                start, end = self._hooks(position, what, capturing)
                handles.append(module.register_forward_pre_hook(eager(start)))
                handles.append(module.register_forward_hook(eager(end)))
        return handles

    def _hooks(self, position: int, what: int, capturing: Callable[[], bool]) -> tuple[Callable, Callable]:
        key = (position, what)
        device = self.devices[position]

        def start(module: nn.Module, args: tuple) -> None:
            if not self.active():
                return
            try:
                if self.pool is not None:  # CUDA: devices are all CUDA or all host (a layer on the CPU
                    # beside GPUs: not timed)
                    if device.type != "cuda" or capturing():
                        return
                    event = self.pool.take()
                    event.record(torch.cuda.current_stream(device))
                    self._open[key] = event
                else:
                    self._open[key] = perf_counter()
            except Exception:
                self.on_error()

        def end(module: nn.Module, args: tuple, output: Any) -> None:
            began = self._open.pop(key, None)
            if began is None:
                return
            try:
                if self.pool is not None:  # CUDA
                    event = self.pool.take()
                    event.record(torch.cuda.current_stream(device))
                    self._forward.append((position, what, began, event))
                else:
                    self._forward.append((position, what, began, perf_counter()))
            except Exception:
                self.on_error()

        return start, end

    def commit(self) -> None:
        """The forward was recorded: add its marks to the window."""
        if self.cuda:
            self._pairs.extend(self._forward)
        else:
            sums = self._sums
            for position, what, began, ended in self._forward:
                sums[(position, what)] = sums.get((position, what), 0.0) + (ended - began)
        self._forward = []

    def discard(self) -> None:
        """The forward was not recorded: forget its marks."""
        if self.pool is not None:
            self.pool.give([e for pair in self._forward for e in pair[2:]] + list(self._open.values()))
        self._forward = []
        self._open = {}

    def take(self) -> WindowTimes:
        """The window's marks (model thread: no device work); the next window starts empty."""
        times = WindowTimes([layer.index for layer in self.layers], self._sums, self._pairs, self.pool,
                            self.num_experts, self.measured)
        self._sums, self._pairs = {}, []
        return times


def expert_times(time: LayerTime, load: np.ndarray, num_experts: int) -> tuple[np.ndarray | None, bool | None]:
    """(per-expert seconds over the expert-load slots, measured?) of one layer in one window.

    Measured where the experts are separate modules; otherwise the experts module's time split by
    the routed experts' kept load (identity experts' slots get 0). None when the layer has no
    experts module to time, or no routed expert got a token.
    """
    out = np.zeros(len(load), dtype=np.float64)
    if time.per_expert_s is not None:
        out[:num_experts] = time.per_expert_s
        return out, True
    routed = load[:num_experts].astype(np.float64)
    if time.experts_s is None or routed.sum() <= 0:
        return None, None
    out[:num_experts] = time.experts_s * routed / routed.sum()
    return out, False
