"""Where each watched MoE layer's numbers live on the device, decided once at attach.

Layers with the same routing shape (experts, slots, k, device, encoder or decoder side,
co-selection, capacity) form one `LayerGroup`, reduced together at the end of every forward. Each
group gets a ring for per-token routes and one each for sampled router logits and inputs, when
those are recorded; the health sampler gets a row per layer it watches. Per device, one
`DeviceBuffer` holds them all (probe/accumulate.py draws that buffer), so closing a window is one
copy per device.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moescope.probe.accumulate import Columns, DeviceBuffer, HealthRows, LayerGroup, Ring
from moescope.probe.adapters import MoELayer, ProbeAttachError

COSELECTION_MAX_EXPERTS = 64  # E x E counts per layer and step; beyond this only on request


@dataclass
class Layout:
    """The device buffers of one session, and where each watched layer is."""

    buffers: list[DeviceBuffer]  # one per device
    devices: dict[int, torch.device]  # layer index -> the device its accumulators are on
    position: dict[int, int]  # layer index -> its place among the watched layers

    def health_rows(self) -> dict[int, tuple[torch.Tensor, Columns]]:
        """Each health-sampled layer's row of its device buffer, and that row's columns."""
        rows = {}
        for buffer in self.buffers:
            if buffer.health is None:
                continue
            for layer in buffer.health.positions:
                cols = HealthRows.columns(buffer.health.num_experts[layer])
                rows[layer] = (buffer.health.row(buffer.flat, layer), cols)
        return rows


def device_of(layer: MoELayer, fallback: torch.device) -> torch.device:
    """The device of the layer's first parameter or buffer (router first), else `fallback`."""
    for module in (layer.router, layer.experts, layer.block):
        if module is None:
            continue
        for param in module.parameters():
            return param.device
        for buffer in module.buffers():
            return buffer.device
    return fallback


def router_input_width(layer: MoELayer, config: Any) -> int:
    """The width of the hidden states the layer's router reads. Raises ProbeAttachError when
    neither the router's weight nor the model's config tells."""
    weight = getattr(layer.router, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[1])
    for name in ("hidden_size", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ProbeAttachError(f"cannot tell the router input width of {layer.name}; pass router_inputs=False")


def build_layout(model: nn.Module, layers: list[MoELayer], *, routes: bool, router_logits: int,
                 router_inputs: int, window: int, coselection: bool | None, ring_tokens: int,
                 health_layers: Collection[int] = ()) -> Layout:
    """Allocate the device buffers for `layers` (zeroed) and return their layout.

    routes: a routes ring per group, of `ring_tokens` tokens. router_logits / router_inputs: 0 for
    none, -1 for every token (a ring of `ring_tokens`), n for n sampled tokens per forward (a ring
    of n x `window`). coselection: None for on where k > 1 and the router has at most
    COSELECTION_MAX_EXPERTS slots. health_layers: indices of the layers the health sampler watches.
    Raises ProbeAttachError when router inputs are asked for and a router's input width is unknown.
    """
    fallback = next((p.device for p in model.parameters()), torch.device("cpu"))
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    by_key: dict[tuple, list[MoELayer]] = {}
    devices: dict[int, torch.device] = {}
    for layer in layers:
        device = device_of(layer, fallback)
        devices[layer.index] = device
        slots = layer.num_experts + layer.zero_experts
        cosel = coselection if coselection is not None else (layer.top_k > 1 and slots <= COSELECTION_MAX_EXPERTS)
        key = (layer.num_experts, slots, layer.top_k, str(device), "decoder" in layer.name, cosel,
               layer.expert_capacity is not None)
        by_key.setdefault(key, []).append(layer)
    groups_by_device: dict[str, list[LayerGroup]] = {}
    rings_by_device: dict[str, list[Ring]] = {}
    for key, members in by_key.items():
        device = devices[members[0].index]
        group = LayerGroup(members, device, coselection=key[5])
        groups_by_device.setdefault(str(device), []).append(group)
        rings = rings_by_device.setdefault(str(device), [])
        n = len(members)
        k = group.top_k
        if routes:
            cols = Columns()
            for name in ("forward", "token", "sequence", "position", "token_id"):
                cols.add(name, 1)
            cols.add("ids", n * k)
            cols.add("weights", n * k)
            cols.add("kept", n * k)
            rings.append(Ring("routes", group, cols, ring_tokens))
        for kind, size, width in (("logits", router_logits, group.router_width), ("inputs", router_inputs, None)):
            if not size:
                continue
            if width is None:
                width = router_input_width(members[0], config)
            cols = Columns()
            for name in ("forward", "token", "token_id"):
                cols.add(name, 1)
            cols.add("top1", n)
            cols.add("values", n * width)
            capacity = ring_tokens if size < 0 else size * window
            rings.append(Ring(kind, group, cols, max(capacity, 1), sample=size))
    buffers: list[DeviceBuffer] = []
    for name, groups in groups_by_device.items():
        members = [layer for group in groups for layer in group.layers if layer.index in health_layers]
        health_rows = None
        if members:
            width = max(HealthRows.columns(layer.num_experts).width for layer in members)
            health_rows = HealthRows({layer.index: layer.num_experts for layer in members},
                                     [layer.index for layer in members], width)
        buffers.append(DeviceBuffer(groups[0].device, groups, rings_by_device.get(name, []), health_rows))
    return Layout(buffers, devices, {layer.index: i for i, layer in enumerate(layers)})
