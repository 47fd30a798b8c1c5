"""Device accumulators: one vectorised reduction over all MoE layers at once, per forward (or per
window of forwards, in eager CPU runs: probe/reduction.py).

This module draws the buffers and reduces one group of layers; probe/device_layout.py decides at attach
which layers form a group and which rings exist, and probe/reduction.py runs each forward's
reduction and ring writes over them.

Per device the probe owns one flat buffer, preallocated at attach:

    [ counters | group 0 accumulators (L0 x W0) | group 1 ... | health rows | ring 0 | ring 1 ... ]

A *group* is a set of MoE layers with the same routing shape (router width, slots, k, device,
encoder or decoder side); at the end of each forward their router logits and choices are stacked
and reduced together into the group's rows with a handful of ops, whatever the number of layers.
*Rings* hold per-token payloads (routes, sampled router logits or inputs) written at positions the
device computes from its own counters. Everything is in-place torch arithmetic on the model's
device: no host tensor, no `.item()`, no data-dependent shape, so the reduction traces into a
`torch.compile` graph and replays under CUDA graphs. Closing a window copies the counters and the
used part of the rings out in one transfer and zeroes the counters (`DeviceBuffer.snapshot`).

Counts are stored as float64 (exact below 2^53); float32 on devices without float64 (MPS).
Router entropy's 95th percentile comes from a fixed-bin histogram over [0, ln E]; read with
`entropy_quantile`, it is within half a bin width (ln E / (2 * ENTROPY_BINS)) of `torch.quantile`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from moescope.probe.adapters import MoELayer

ENTROPY_BINS = 128
# Sampled tokens are (offset + j * SAMPLE_STRIDE) mod T: distinct for j < T because the stride is
# a prime larger than any batch, and the offset moves with the device's forward counter.
SAMPLE_STRIDE = 1_000_003
SAMPLE_MIX = 2_654_435_761  # Knuth's multiplicative hash: spreads consecutive forwards' offsets

# Counters at the head of each device buffer.
TOTAL_FORWARDS = 0  # never zeroed: the device's own step counter
WINDOW_FORWARDS = 1  # forwards in the window, zeroed at each snapshot
HEAD = 2


def accumulator_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


@dataclass
class Columns:
    """Named column ranges of a (rows, width) block."""

    names: dict[str, tuple[int, int]] = field(default_factory=dict)
    width: int = 0

    def add(self, name: str, size: int) -> None:
        self.names[name] = (self.width, self.width + size)
        self.width += size

    def __getitem__(self, name: str) -> slice:
        start, stop = self.names[name]
        return slice(start, stop)

    def at(self, name: str) -> int:
        """The column of a one-wide field."""
        return self.names[name][0]

    def __contains__(self, name: str) -> bool:
        return name in self.names


# The table each kind of ring's rows land in.
RING_TABLES = {"routes": "routes", "logits": "router_logits", "inputs": "router_inputs"}


@dataclass
class Ring:
    """A ring of per-token rows in a device buffer; `pos_col` counts rows written this window."""

    kind: str  # "routes", "logits" or "inputs"
    group: LayerGroup
    columns: Columns
    capacity: int
    sample: int = -1  # tokens a forward writes: -1 every token, n a sample of n
    pos_col: int = -1  # index of its counter in the buffer's head region
    offset: int = -1  # start of its data in the buffer
    host_rows: int = 0  # rows the host knows were written this window (eager and compiled runs)

    @property
    def size(self) -> int:
        return self.capacity * self.columns.width

    def rows(self, tokens: int) -> int:
        """Rows a forward of `tokens` tokens writes, before the ring's capacity caps them."""
        return tokens if self.sample < 0 else min(self.sample, tokens)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset: self.offset + self.size].view(self.capacity, self.columns.width)


class LayerGroup:
    """MoE layers reduced together: same router width, slots, k, device and side of the model."""

    def __init__(self, layers: list[MoELayer], device: torch.device, coselection: bool):
        first = layers[0]
        self.layers = layers
        self.positions = [layer.index for layer in layers]
        self.device = device
        self.router_width = first.num_experts + first.zero_experts  # the router scores every slot
        self.slots = first.num_experts + first.zero_experts
        self.num_experts = first.num_experts
        self.top_k = first.top_k
        self.coselection = coselection
        self.capacity = any(layer.expert_capacity is not None for layer in layers)
        self.decoder = "decoder" in first.name
        cols = Columns()
        cols.add("tokens", 1)
        cols.add("expert_load", self.slots)
        cols.add("router_topk_load", self.router_width)  # tokens whose top-k router probabilities hold e
        cols.add("gate_weight_sum", self.slots)
        cols.add("router_prob_sum", self.router_width)
        cols.add("entropy_sum", 1)
        cols.add("entropy_hist", ENTROPY_BINS)
        cols.add("margin_sum", 1)
        cols.add("router_z_sum", 1)  # sum over tokens of logsumexp(logits)^2 (router z-loss)
        cols.add("dropped_tokens", 1)
        cols.add("dropped_assignments", 1)
        cols.add("real_slots_kept", 1)
        cols.add("capacity_use", 1)  # a running maximum, not a sum
        cols.add("capacity", 1)  # a running maximum
        if coselection:
            cols.add("coselection", self.slots * self.slots)
        self.columns = cols
        self.offset = -1  # start of the (L, W) block in the buffer
        self.entropy_scale = ENTROPY_BINS / max(math.log(self.router_width), 1e-12)

    @property
    def size(self) -> int:
        return len(self.layers) * self.columns.width

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset: self.offset + self.size].view(len(self.layers), self.columns.width)

    def reduce(self, flat: torch.Tensor, logits_s: torch.Tensor, ids_s: torch.Tensor, weights_s: torch.Tensor,
               kept_s: torch.Tensor | None, capacity: int | None, rows: slice, forwards: int = 1) -> None:
        """Add `forwards` forwards of the layers in `rows` to the accumulators, stacked by layer:
        logits (L, N, slots), ids and weights (L, N, k), kept (L, N, k) bool or None (every slot
        kept), N = forwards x the tokens of each (every forward the same count). `capacity`: slots
        per expert in each forward, where the layers have one (the running maximum of use is taken
        per forward)."""
        acc = flat.dtype
        cols = self.columns
        n_layers = logits_s.shape[0]
        ids_s = ids_s.long()
        tokens = ids_s.shape[1]
        kept_f = torch.ones_like(ids_s, dtype=acc) if kept_s is None else kept_s.to(acc)
        flat_ids = ids_s.reshape(n_layers, -1).clamp(0, self.slots - 1)

        logits_f = logits_s.float()
        log_probs = torch.log_softmax(logits_f, dim=-1)
        probs = log_probs.exp()
        entropy = -(probs * log_probs).sum(dim=-1)  # (L, T)
        # the k most probable experts: the top-1/top-2 margin, and the load-balancing loss's
        # selection (transformers' load_balancing_loss_func: top-k of softmax(logits), before any
        # bias correction or capacity drop)
        top = probs.topk(min(max(self.top_k, 2), probs.shape[-1]), dim=-1)
        margin = top.values[..., 0] - top.values[..., 1] if probs.shape[-1] > 1 else torch.ones_like(entropy)
        topk_ids = top.indices[..., : self.top_k].reshape(n_layers, -1)
        bins = (entropy * self.entropy_scale).long().clamp(0, ENTROPY_BINS - 1)

        zeros = torch.zeros(n_layers, cols.width, dtype=acc, device=flat.device)
        block = zeros
        block[:, cols["tokens"]] = tokens
        block[:, cols["expert_load"]].scatter_add_(1, flat_ids, kept_f.reshape(n_layers, -1))
        block[:, cols["gate_weight_sum"]].scatter_add_(1, flat_ids, (weights_s.to(acc) * kept_f).reshape(n_layers, -1))
        def token_sum(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:  # (L, N, ...) -> (L, ...) in acc
            if forwards == 1:
                return x.sum(dim=1, keepdim=keepdim).to(acc)
            # each forward's sum in the float32 of one forward, then the forwards' in acc: the same
            # figures as reducing the forwards one by one
            return x.reshape(n_layers, forwards, -1, *x.shape[2:]).sum(dim=2).to(acc).sum(dim=1, keepdim=keepdim)

        block[:, cols["router_prob_sum"]] = token_sum(probs)
        block[:, cols["router_topk_load"]].scatter_add_(1, topk_ids, torch.ones_like(topk_ids, dtype=acc))
        block[:, cols["entropy_sum"]] = token_sum(entropy, keepdim=True)
        block[:, cols["entropy_hist"]].scatter_add_(1, bins, torch.ones_like(bins, dtype=acc))
        block[:, cols["margin_sum"]] = token_sum(margin, keepdim=True)
        # logsumexp(logits) = logit - log_softmax at any slot; at the most probable one it is finite
        # even where a gate masked other slots to -inf (a separate logsumexp costs as much as the
        # log-softmax itself on CPU)
        first = top.indices[..., :1]
        log_z = logits_f.gather(-1, first) - log_probs.gather(-1, first)  # (L, T, 1)
        block[:, cols["router_z_sum"]] = token_sum(log_z.square())
        if kept_s is not None:
            dropped = ~kept_s
            block[:, cols["dropped_tokens"]] = dropped.all(dim=-1).sum(dim=1, keepdim=True).to(acc)
            block[:, cols["dropped_assignments"]] = dropped.sum(dim=(1, 2)).unsqueeze(1).to(acc)
            real = kept_s & (ids_s < self.num_experts)
        else:
            real = ids_s < self.num_experts
        block[:, cols["real_slots_kept"]] = real.sum(dim=(1, 2)).unsqueeze(1).to(acc)
        if self.coselection:
            onehot = torch.zeros(n_layers, tokens, self.slots, dtype=torch.float32, device=flat.device)
            onehot.scatter_add_(2, ids_s.clamp(0, self.slots - 1), kept_f.float())
            block[:, cols["coselection"]] = torch.bmm(onehot.transpose(1, 2), onehot).reshape(n_layers, -1).to(acc)
        view = self.view(flat)[rows]
        if self.capacity and capacity is not None:
            load = block[:, cols["expert_load"]][:, : self.num_experts]
            if forwards > 1:  # each forward's own load: its slots are per forward
                load = torch.zeros(n_layers, forwards, self.slots, dtype=acc, device=flat.device).scatter_add_(
                    2, flat_ids.view(n_layers, forwards, -1), kept_f.reshape(n_layers, forwards, -1))
                load = load[..., : self.num_experts].amax(dim=1)
            use = load.amax(dim=1, keepdim=True) / capacity
            running = view[:, cols["capacity_use"]]
            running.copy_(torch.maximum(running, use))
            view[:, cols["capacity"]].clamp_(min=float(capacity))
        view.add_(block)


def entropy_quantile(hist: np.ndarray, q: float, router_width: int) -> float:
    """The q-quantile of router entropy from a fixed-bin histogram over [0, ln E].

    Uses torch.quantile's rule (linear interpolation at rank q * (n - 1)) with each order
    statistic replaced by its bin's centre, so the result is within half a bin width
    (ln E / (2 * ENTROPY_BINS)) of the exact quantile of the same tokens. NaN for no tokens.
    """
    n = float(hist.sum())
    if n <= 0:
        return float("nan")
    width = max(math.log(router_width), 1e-12) / len(hist)
    cumulative = np.cumsum(hist)
    rank = q * (n - 1)
    low = math.floor(rank)
    high = min(low + 1, int(n) - 1)

    def centre(order: int) -> float:  # the bin holding the order-th smallest value (0-based)
        return (int(np.searchsorted(cumulative, order + 1 - 1e-9)) + 0.5) * width

    a, b = centre(low), centre(high)
    return a + (rank - low) * (b - a)


@dataclass
class HealthRows:
    """Per-layer health accumulators (see probe/health_sampling.py): sums, and the last weight check."""

    num_experts: dict[int, int]
    positions: list[int]
    width: int
    offset: int = -1

    @staticmethod
    def columns(num_experts: int) -> Columns:
        cols = Columns()
        for name in ("samples", "norm_sum", "nonfinite"):
            cols.add(name, num_experts)
        cols.add("input_nonfinite", 1)
        for name in ("weight_cosine", "weight_norm_ratio", "grad_norm"):
            cols.add(name, num_experts)
        cols.add("weight_checked", 1)
        cols.add("grad_present", 1)
        return cols

    @property
    def size(self) -> int:
        return len(self.positions) * self.width

    def row(self, flat: torch.Tensor, layer: int) -> torch.Tensor:
        start = self.offset + self.positions.index(layer) * self.width
        return flat[start: start + self.width]


class DeviceBuffer:
    """The one preallocated accumulator buffer of a device, and its layout."""

    def __init__(self, device: torch.device, groups: list[LayerGroup], rings: list[Ring],
                 health: HealthRows | None):
        self.device = device
        self.groups = groups
        self.rings = rings
        self.health = health
        head = HEAD
        for ring in rings:
            ring.pos_col = head
            head += 1
        offset = head
        for group in groups:
            group.offset = offset
            offset += group.size
        if health is not None:
            health.offset = offset
            offset += health.size
        self.counters_end = offset  # counters and accumulators: what a snapshot always copies
        for ring in rings:
            ring.offset = offset
            offset += ring.size
        self.flat = torch.zeros(offset, dtype=accumulator_dtype(device), device=device)

    def snapshot(self, whole_rings: bool) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Counters, accumulators and each ring's used rows, gathered into one fresh tensor on the
        device; then the window's counters are zeroed. Returns the tensor and, per ring, the
        (rows, offset) of its rows in it. `whole_rings`: copy every ring whole (the host did not see
        every forward, e.g. CUDA-graph replays, so it does not know how far each ring was written).
        """
        pieces = [self.flat[: self.counters_end]]
        layout = []
        at = self.counters_end
        for ring in self.rings:
            rows = ring.capacity if whole_rings else min(ring.host_rows, ring.capacity)
            layout.append((rows, at))
            if rows:
                pieces.append(self.flat[ring.offset: ring.offset + rows * ring.columns.width])
            at += rows * ring.columns.width
            ring.host_rows = 0
        out = torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()
        self.flat[WINDOW_FORWARDS: self.counters_end].zero_()
        return out, layout
