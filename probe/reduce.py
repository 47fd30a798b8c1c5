"""Per-layer reductions on the model's device, and the one-transfer packing of their results.

Everything here is torch ops on whatever device the router ran on; nothing calls `.item()` or
`.cpu()`, so a layer adds no host sync. `pack` concatenates every tensor of a forward into one
byte buffer, so the host sees exactly one transfer per forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from probe.adapters import Choice


def _acc_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def reduce_layer(logits: torch.Tensor, choice: Choice, num_slots: int, num_experts: int,
                 coselection: bool) -> dict[str, torch.Tensor]:
    """Exact per-layer statistics of one forward.

    logits: (tokens, E_router) raw router logits; choice: what the experts really got;
    num_slots: experts the router can choose (routed + zero experts); num_experts: routed experts
    with parameters. Returns named device tensors, see `LayerStep` for their meaning.
    """
    acc = _acc_dtype(logits.device)
    ids = choice.ids.long()
    tokens = ids.shape[0]
    kept = choice.kept if choice.kept is not None else torch.ones_like(ids, dtype=torch.bool)
    kept_f = kept.to(acc)
    flat_ids = ids.reshape(-1).clamp_(0, num_slots - 1)

    load = torch.zeros(num_slots, dtype=torch.int64, device=ids.device)
    load.scatter_add_(0, flat_ids, kept.reshape(-1).to(torch.int64))
    gate_sum = torch.zeros(num_slots, dtype=acc, device=ids.device)
    gate_sum.scatter_add_(0, flat_ids, (choice.weights.to(acc) * kept_f).reshape(-1))

    log_probs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs).sum(dim=-1)
    if probs.shape[-1] > 1:
        top2 = probs.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
    else:
        margin = torch.ones(tokens, device=probs.device)
    prob_sum = probs.to(acc).sum(dim=0)

    slots_kept = kept.sum(dim=-1)
    real_kept = (kept & (ids < num_experts)).sum().to(acc)
    out = {
        "expert_load": load,
        "gate_weight_sum": gate_sum,
        "router_prob_sum": prob_sum,
        "entropy_mean": entropy.mean().to(acc).reshape(1),
        "entropy_p95": torch.quantile(entropy, 0.95).to(acc).reshape(1) if tokens else entropy.new_zeros(1),
        "margin_mean": margin.mean().to(acc).reshape(1),
        "dropped_tokens": (slots_kept == 0).sum().reshape(1),
        "dropped_assignments": (~kept).sum().reshape(1),
        "real_slots_kept": real_kept.reshape(1),
    }
    if coselection:
        onehot = torch.zeros(tokens, num_slots, dtype=torch.float32, device=ids.device)
        onehot.scatter_add_(1, ids.clamp(0, num_slots - 1), kept.to(torch.float32))
        out["coselection"] = (onehot.T @ onehot).round().to(torch.int64)
    return out


@dataclass(frozen=True)
class Slot:
    key: tuple
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64,
          torch.int32: np.int32, torch.bool: np.bool_, torch.float16: np.float16, torch.uint8: np.uint8}


def pack(tensors: dict[tuple, torch.Tensor]) -> tuple[torch.Tensor | None, list[Slot]]:
    """One uint8 buffer holding every tensor (still on the device), and where each one lies."""
    parts, slots, offset = [], [], 0
    device = next((t.device for t in tensors.values() if t.device.type != "cpu"), torch.device("cpu"))
    for key, tensor in tensors.items():
        if tensor.dtype not in _NUMPY:
            tensor = tensor.to(torch.float32)
        # A few small tensors start on the host (sampled token indices): they join the device
        # buffer so that the forward still makes one transfer.
        flat = tensor.detach().to(device, non_blocking=True).contiguous().reshape(-1)
        raw = flat.view(torch.uint8)
        slots.append(Slot(key, tensor.dtype, tuple(tensor.shape), offset, raw.numel()))
        offset += raw.numel()
        parts.append(raw)
    if not parts:
        return None, []
    return torch.cat(parts), slots


def unpack(buffer: torch.Tensor | None, slots: list[Slot]) -> dict[tuple, np.ndarray]:
    """Host arrays from a packed buffer: the forward's single device-to-host transfer."""
    if buffer is None:
        return {}
    host = buffer.to("cpu").numpy()
    out = {}
    for slot in slots:
        raw = host[slot.offset: slot.offset + slot.nbytes]
        out[slot.key] = np.frombuffer(raw.tobytes(), dtype=_NUMPY[slot.dtype]).reshape(slot.shape)
    return out
