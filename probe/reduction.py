"""The device side of one forward: what the hooks kept, reduced into the buffers, rings written.

During a forward the probe's hooks only keep references (`ForwardRefs`: each watched layer's
router logits, final choice and sampled router inputs, and the forward's token ids and shape).
When the model returns, `reduce_forward` adds every group of like layers to its accumulators in
one stacked pass (`LayerGroup.reduce`, probe/accumulate.py), writes the group's ring rows from the
same stacked tensors, and counts the forward on the device. Everything is torch ops on the model's
device, with no host sync and no data-dependent shape: it traces into a `torch.compile` graph and
replays under CUDA graphs.

Sharp edge: a group some of whose layers did not run in a forward (or whose reader failed) is
reduced layer by layer and writes no ring rows, since a ring row holds every layer of its group.
"""

from __future__ import annotations

from typing import cast

import torch

from moescope.probe.accumulate import TOTAL_FORWARDS, WINDOW_FORWARDS, DeviceBuffer, LayerGroup, Ring
from moescope.probe.adapters import Choice, MoELayer


class ForwardRefs:
    """References the hooks keep during one forward, by each layer's place among the watched
    layers; no copies and no math. `clear()` starts the next forward."""

    def __init__(self, layers: int):
        self._layers = layers
        # offsets of this forward's sampled tokens, set at its start when the session samples router
        # logits or inputs (empty otherwise: no ring or hook reads it then)
        self.sample_base = torch.empty(0, dtype=torch.int64)
        self.clear()

    def clear(self) -> None:
        n = self._layers
        self.logits: list[torch.Tensor | None] = [None] * n
        self.choice: list[Choice | None] = [None] * n
        self.inputs: list[torch.Tensor | None] = [None] * n
        self.main_ids: torch.Tensor | None = None  # the forward's token ids, where given as ids
        self.decoder_ids: torch.Tensor | None = None
        self.shape: tuple = ()  # (batch, sequence) of the forward's input; () when unknown
        self.decoder_shape: tuple = ()


@torch.no_grad()
def reduce_forward(buffers: list[DeviceBuffer], position: dict[int, int], refs: ForwardRefs) -> None:
    """Add one forward to the device buffers: every group's stacked reduction and ring rows, and
    the forward counters. `position` maps a layer's index to its place in `refs`."""
    for buffer in buffers:
        flat = buffer.flat
        for group in buffer.groups:
            present = [position[layer.index] for layer in group.layers
                       if refs.logits[position[layer.index]] is not None
                       and refs.choice[position[layer.index]] is not None]
            if len(present) != len(group.layers):
                _reduce_partial(flat, group, position, refs)
                continue
            _reduce_group(flat, group, buffer.rings, refs, present, slice(0, len(present)))
        flat[: WINDOW_FORWARDS + 1].add_(1)


def _reduce_partial(flat: torch.Tensor, group: LayerGroup, position: dict[int, int], refs: ForwardRefs) -> None:
    # Some layers did not run (or a reader failed): reduce the ones that did, one by one; no
    # ring rows, since a ring row holds every layer of the group.
    for row, layer in enumerate(group.layers):
        at = position[layer.index]
        if refs.logits[at] is not None and refs.choice[at] is not None:
            _reduce_group(flat, group, (), refs, [at], slice(row, row + 1))


def _reduce_group(flat: torch.Tensor, group: LayerGroup, rings: list[Ring] | tuple[()], refs: ForwardRefs,
                  present: list[int], rows: slice) -> None:
    """Reduce the layers at `present` (places in `refs`) into the group's `rows`, and write their
    rows into those of `rings` that belong to the group."""
    # `present`: the places where the hooks kept both the logits and a choice
    choices = cast("list[Choice]", [refs.choice[p] for p in present])
    tokens = {c.ids.numel() // max(c.ids.shape[-1], 1) for c in choices}
    if len(tokens) != 1:  # layers of one group saw different token counts: reduce one by one
        if len(present) > 1:
            for i, p in enumerate(present):
                _reduce_group(flat, group, (), refs, [p], slice(rows.start + i, rows.start + i + 1))
        return
    ids = [_rows(c.ids, c.ids.shape[-1]) for c in choices]
    weights = [_rows(c.weights, i.shape[-1]) for c, i in zip(choices, ids)]
    stacked = group.reduce(
        flat, cast("list[torch.Tensor]", [refs.logits[p] for p in present]), ids, weights,
        [None if c.kept is None else _rows(c.kept, i.shape[-1]) for c, i in zip(choices, ids)],
        [_capacity(group.layers[rows.start + i], c, refs) for i, c in enumerate(choices)], rows)
    for ring in rings:
        if ring.group is group:
            _write_ring(flat, ring, stacked, present, refs)


def _capacity(layer: MoELayer, choice: Choice, refs: ForwardRefs) -> int | None:
    """Slots per expert in this forward, where the layer has a capacity."""
    if choice.capacity is not None:  # set per forward where the router sizes it to the batch (NLLB)
        return choice.capacity
    if layer.expert_capacity is not None:
        shape = refs.decoder_shape if "decoder" in layer.name else refs.shape
        return layer.expert_capacity * (shape[0] if shape else 1)  # Switch: a capacity per sequence
    return None


def _write_ring(flat: torch.Tensor, ring: Ring, stacked: tuple, present: list[int], refs: ForwardRefs) -> None:
    """Write this forward's rows of `ring` (every token, or the sampled ones) at the ring's
    position, which the device keeps in its own counter. No row of router inputs where a layer's
    were not kept (its router was called without its input as a positional tensor, or its hook
    failed): a ring row holds every layer of the group."""
    if ring.kind == "inputs":
        inputs = [hidden for hidden in (refs.inputs[p] for p in present) if hidden is not None]
        if len(inputs) != len(present):
            return
    ids_s, weights_s, kept_s, logits_s = stacked
    tokens = ids_s.shape[1]
    acc = flat.dtype
    device = flat.device
    main = refs.decoder_ids if ring.group.decoder else refs.main_ids
    seq_len = main.shape[-1] if main is not None and main.dim() >= 2 and main.numel() == tokens else tokens
    rows = min(ring.rows(tokens), ring.capacity)
    token = torch.arange(rows, device=device) if ring.sample < 0 else refs.sample_base[:rows] % tokens
    if main is not None and main.numel() == tokens:
        token_id = main.reshape(-1).index_select(0, token).to(acc)
    else:
        token_id = torch.full((rows,), -1.0, dtype=acc, device=device)
    forward = flat[TOTAL_FORWARDS].expand(rows)
    if ring.kind == "routes":
        payload = [forward, token.to(acc), (token // seq_len).to(acc), (token % seq_len).to(acc), token_id,
                   ids_s[:, :rows].transpose(0, 1).reshape(rows, -1).to(acc),
                   weights_s[:, :rows].transpose(0, 1).reshape(rows, -1).to(acc),
                   (torch.ones_like(ids_s[:, :rows], dtype=acc) if kept_s is None
                    else kept_s[:, :rows].to(acc)).transpose(0, 1).reshape(rows, -1)]
    else:
        top1 = ids_s[:, :, 0].index_select(1, token).transpose(0, 1).to(acc)
        if ring.kind == "logits":
            values = logits_s.index_select(1, token).transpose(0, 1).reshape(rows, -1).to(acc)
        else:
            values = torch.stack([hidden[:rows] for hidden in inputs]).transpose(0, 1).reshape(rows, -1)
            values = values.to(acc)
        payload = [forward, token.to(acc), token_id, top1, values]
    data = torch.cat([p.reshape(rows, -1) for p in payload], dim=1)
    start = flat[ring.pos_col].to(torch.int64)
    where = (start + torch.arange(rows, device=device)) % ring.capacity
    ring.view(flat).index_copy_(0, where, data)
    flat[ring.pos_col].add_(rows)


def _rows(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """(tokens, width) without a view op when the reader already gave that shape."""
    return tensor if tensor.dim() == 2 else tensor.reshape(-1, width)
