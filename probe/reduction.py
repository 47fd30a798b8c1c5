"""The device side of one forward: what the hooks kept, reduced into the buffers, rings written.

During a forward the probe's hooks only keep references (`ForwardRefs`: each watched layer's
router logits, final choice and sampled router inputs, and the forward's token ids and shape).
When the model returns, `reduce_forward` adds every group of like layers to its accumulators in
one stacked pass (`LayerGroup.reduce`, probe/accumulate.py), writes the group's ring rows from the
same stacked tensors, and counts the forward on the device. Everything is torch ops on the model's
device, with no host sync and no data-dependent shape: it traces into a `torch.compile` graph and
replays under CUDA graphs.

In eager runs on a CPU (inference and training) the session defers this: `count_forward` counts
the forward as it ends, and the window's forwards (all of one `deferral_key`: the same token counts, capacities and
kept inputs) are reduced together, stacked by layer and then by forward, with the same figures and
ring rows as one `reduce_forward` each: `reduce_into_snapshot` on the writer's thread, into the
window's snapshot, or `reduce_deferred` into the live buffers when a forward that cannot wait
follows them in the window.

Sharp edge: a group some of whose layers did not run in a forward (or whose reader failed) is
reduced layer by layer and writes no ring rows, since a ring row holds every layer of its group.
"""

from __future__ import annotations

import math
from typing import cast

import torch

from moescope.probe.accumulate import TOTAL_FORWARDS, WINDOW_FORWARDS, DeviceBuffer, LayerGroup, Ring
from moescope.probe.adapters import Choice, MoELayer


class ForwardRefs:
    """References the hooks keep during one forward, by each layer's place among the watched
    layers; no copies and no math. `clear()` starts the next forward (fresh lists: a `snapshot()`
    taken before keeps this forward's references, for a deferred reduction)."""

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

    def snapshot(self) -> ForwardRefs:
        kept = ForwardRefs.__new__(ForwardRefs)
        kept.__dict__.update(self.__dict__)
        return kept


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
            _reduce_group(flat, group, buffer.rings, [refs], present, slice(0, len(present)))
    count_forward(buffers)


def count_forward(buffers: list[DeviceBuffer]) -> None:
    """Count a forward on the device: after its reduction, or ahead of it when that is deferred
    (`deferral_key`, `reduce_deferred`)."""
    for buffer in buffers:
        buffer.flat[: WINDOW_FORWARDS + 1].add_(1)


def deferral_key(buffers: list[DeviceBuffer], position: dict[int, int], refs: ForwardRefs) -> tuple | None:
    """What forwards reduced together must share (every group: its token count, capacity, and
    whether token ids and router inputs were kept), or None when this forward cannot be stacked
    with others: a layer did not run, or the layers of a group saw different token counts."""
    key: list = [refs.shape, refs.decoder_shape]
    for buffer in buffers:
        for group in buffer.groups:
            places = [position[index] for index in group.positions]
            choices = [refs.choice[at] for at in places]
            if any(c is None for c in choices) or any(refs.logits[at] is None for at in places):
                return None
            shapes = {c.ids.shape for c in choices}  # type: ignore[union-attr]
            if len(shapes) == 1:  # every layer read alike: the usual case, one shape to look at
                shape = shapes.pop()
                tokens = {math.prod(shape[:-1]) if shape else 0}
            else:
                tokens = {c.ids.numel() // max(c.ids.shape[-1], 1) for c in choices}  # type: ignore[union-attr]
            if len(tokens) != 1:
                return None
            count = tokens.pop()
            main = refs.decoder_ids if group.decoder else refs.main_ids
            if group.capacity or any(c.capacity is not None for c in choices):  # type: ignore[union-attr]
                caps = tuple({_capacity(layer, c, refs) for layer, c in zip(group.layers, choices)})  # type: ignore[arg-type]
            else:
                caps = (None,)
            key.append((count, caps, main is not None and main.numel() == count,
                        all(refs.inputs[at] is not None for at in places)))
    return tuple(key)


@torch.no_grad()
def reduce_deferred(buffers: list[DeviceBuffer], position: dict[int, int], forwards: list[ForwardRefs]) -> None:
    """Add forwards already counted on the device (`count_forward`, oldest first, all of one
    `deferral_key`) to the accumulators and rings in one stacked pass per group: the same sums as
    one `reduce_forward` each, with the ops of one."""
    for buffer in buffers:
        _reduce_counted(buffer.flat, buffer, position, forwards)


@torch.no_grad()
def reduce_into_snapshot(data: torch.Tensor, buffer: DeviceBuffer, layout: list[tuple[int, int]],
                         position: dict[int, int], forwards: list[ForwardRefs]) -> None:
    """`reduce_deferred` for one buffer, into a window's snapshot of it (`data`, `layout`: what
    `DeviceBuffer.snapshot` returned) instead of the live buffer, so that it can run on the
    writer's thread. The forwards must be the last the window counted (none reduced after them);
    the snapshot then holds their figures and ring rows as if they had been reduced before it was
    taken (a ring row past those the snapshot holds is left out, as the snapshot would have)."""
    _reduce_counted(data, buffer, position, forwards, layout)


def _reduce_counted(flat: torch.Tensor, buffer: DeviceBuffer, position: dict[int, int], forwards: list[ForwardRefs],
                    snapshot_layout: list[tuple[int, int]] | None = None) -> None:
    """Every group of `buffer`, for forwards already counted, into `flat`: the buffer's own, or a
    window's snapshot of it (`snapshot_layout`)."""
    if not forwards:
        return
    for group in buffer.groups:
        present = [position[layer.index] for layer in group.layers]
        _reduce_group(flat, group, buffer.rings, forwards, present, slice(0, len(present)), counted=True,
                      snapshot_layout=snapshot_layout)


def _reduce_partial(flat: torch.Tensor, group: LayerGroup, position: dict[int, int], refs: ForwardRefs) -> None:
    # Some layers did not run (or a reader failed): reduce the ones that did, one by one; no
    # ring rows, since a ring row holds every layer of the group.
    for row, layer in enumerate(group.layers):
        at = position[layer.index]
        if refs.logits[at] is not None and refs.choice[at] is not None:
            _reduce_group(flat, group, (), [refs], [at], slice(row, row + 1))


def _stack(per_forward: list[list[torch.Tensor]]) -> torch.Tensor:
    """(L, F x T, ...) from F forwards' lists of L (T, ...) tensors: one op."""
    if len(per_forward) == 1:
        return torch.stack(per_forward[0])
    layers, count = len(per_forward[0]), len(per_forward)
    stacked = torch.stack([per_forward[f][i] for i in range(layers) for f in range(count)])  # layer-major
    return stacked.view(layers, count * stacked.shape[1], *stacked.shape[2:])


def _reduce_group(flat: torch.Tensor, group: LayerGroup, rings: list[Ring] | tuple[()], forwards: list[ForwardRefs],
                  present: list[int], rows: slice, counted: bool = False,
                  snapshot_layout: list[tuple[int, int]] | None = None) -> None:
    """Reduce the layers at `present` (places in each forward's refs) into the group's `rows`, and
    write their rows into those of `rings` that belong to the group. More than one forward: all
    of one `deferral_key`, already counted (`counted`). `snapshot_layout`: `flat` is a window's snapshot,
    holding each ring's first rows (rows, offset), as `DeviceBuffer.snapshot` lays them out."""
    # `present`: the places where the hooks kept both the logits and a choice
    choices = [cast("list[Choice]", [refs.choice[p] for p in present]) for refs in forwards]
    tokens = {c.ids.numel() // max(c.ids.shape[-1], 1) for c in choices[0]}
    if len(tokens) != 1:  # layers of one group saw different token counts: reduce one by one
        if len(present) > 1:
            for i, p in enumerate(present):
                _reduce_group(flat, group, (), forwards, [p], slice(rows.start + i, rows.start + i + 1))
        return
    ids = [[_rows(c.ids, c.ids.shape[-1]) for c in forward] for forward in choices]
    weights = [[_rows(c.weights, i.shape[-1]) for c, i in zip(forward, fids)] for forward, fids in zip(choices, ids)]
    if all(c.kept is None for forward in choices for c in forward):
        kept_s = None
    else:
        kept_s = _stack([[torch.ones_like(i, dtype=torch.bool) if c.kept is None else _rows(c.kept, i.shape[-1])
                          for c, i in zip(forward, fids)] for forward, fids in zip(choices, ids)])
    caps = [_capacity(group.layers[rows.start + i], c, forwards[0]) for i, c in enumerate(choices[0])]
    stacked = (_stack(ids), _stack(weights), kept_s,
               _stack([cast("list[torch.Tensor]", [refs.logits[p] for p in present]) for refs in forwards]))
    ids_s, weights_s, kept_s, logits_s = stacked
    group.reduce(flat, logits_s, ids_s, weights_s, kept_s,
                 caps[0] if all(c is not None for c in caps) else None, rows, forwards=len(forwards))
    for i, ring in enumerate(rings):
        if ring.group is group:
            _write_ring(flat, ring, stacked, present, forwards, counted,
                        None if snapshot_layout is None else snapshot_layout[i])


def _capacity(layer: MoELayer, choice: Choice, refs: ForwardRefs) -> int | None:
    """Slots per expert in this forward, where the layer has a capacity."""
    if choice.capacity is not None:  # set per forward where the router sizes it to the batch (NLLB)
        return choice.capacity
    if layer.expert_capacity is not None:
        shape = refs.decoder_shape if "decoder" in layer.name else refs.shape
        return layer.expert_capacity * (shape[0] if shape else 1)  # Switch: a capacity per sequence
    return None


def _write_ring(flat: torch.Tensor, ring: Ring, stacked: tuple, present: list[int], forwards: list[ForwardRefs],
                counted: bool, snapshot_rows: tuple[int, int] | None = None) -> None:
    """Write these forwards' rows of `ring` (every token, or the sampled ones) at the ring's
    position, which the device keeps in its own counter. No row of router inputs where a layer's
    were not kept (its router was called without its input as a positional tensor, or its hook
    failed): a ring row holds every layer of the group. `counted`: the device's forward counter
    already counts these forwards (a deferred reduction); otherwise it is the first one's number.
    `snapshot_rows`: `flat` is a window's snapshot holding the ring's first `rows` rows at `offset`."""
    count = len(forwards)
    if ring.kind == "inputs":
        inputs = [[hidden for hidden in (refs.inputs[p] for p in present) if hidden is not None] for refs in forwards]
        if any(len(held) != len(present) for held in inputs):
            return
    ids_s, weights_s, kept_s, logits_s = stacked
    n_layers = ids_s.shape[0]
    tokens = ids_s.shape[1] // count  # per forward
    acc = flat.dtype
    device = flat.device
    first = forwards[0]
    main = first.decoder_ids if ring.group.decoder else first.main_ids
    seq_len = main.shape[-1] if main is not None and main.dim() >= 2 and main.numel() == tokens else tokens
    rows = min(ring.rows(tokens), ring.capacity)  # per forward
    if ring.sample < 0:
        token = torch.arange(rows, device=device).expand(count, rows)
    else:
        token = torch.stack([refs.sample_base[:rows] for refs in forwards]) % tokens
    if main is not None and main.numel() == tokens:
        mains = [refs.decoder_ids if ring.group.decoder else refs.main_ids for refs in forwards]
        token_id = torch.stack([m.reshape(-1) for m in mains]).gather(1, token).to(acc)  # type: ignore[union-attr]
    else:
        token_id = torch.full((count, rows), -1.0, dtype=acc, device=device)
    number = flat[TOTAL_FORWARDS] - count if counted else flat[TOTAL_FORWARDS]  # the first forward's
    forward = number.expand(rows) if count == 1 else (number + torch.arange(count, device=device, dtype=acc)
                                                       ).repeat_interleave(rows)
    total = count * rows
    if ring.kind == "routes":
        def slots(tensor: torch.Tensor) -> torch.Tensor:  # (L, F x T, k) -> (F x rows, L x k), each forward's first
            return tensor.view(n_layers, count, tokens, -1)[:, :, :rows].permute(1, 2, 0, 3).reshape(total, -1)
        payload = [forward, token.to(acc), (token // seq_len).to(acc), (token % seq_len).to(acc), token_id,
                   slots(ids_s).to(acc), slots(weights_s).to(acc),
                   torch.ones((total, n_layers * ids_s.shape[2]), dtype=acc, device=device)
                   if kept_s is None else slots(kept_s).to(acc)]
    else:
        at = token.unsqueeze(0).expand(n_layers, count, rows)
        top1 = ids_s[:, :, 0].view(n_layers, count, tokens).gather(2, at).permute(1, 2, 0).to(acc)
        if ring.kind == "logits":
            width = logits_s.shape[-1]
            values = logits_s.view(n_layers, count, tokens, width).gather(
                2, at.unsqueeze(-1).expand(n_layers, count, rows, width)).permute(1, 2, 0, 3)
        else:
            values = torch.stack([torch.stack([hidden[:rows] for hidden in held]) for held in inputs])  # (F, L, r, H)
            values = values.transpose(1, 2)
        values = values.reshape(total, -1).to(acc)
        payload = [forward, token.to(acc), token_id, top1, values]
    data = torch.cat([p.reshape(total, -1) for p in payload], dim=1)
    start = flat[ring.pos_col].to(torch.int64)
    where = (start + torch.arange(total, device=device)) % ring.capacity
    if snapshot_rows is None:
        ring.view(flat).index_copy_(0, where, data)
    else:  # host code on a snapshot: a data-dependent selection is fine here
        rows_held, offset = snapshot_rows
        keep = where < rows_held
        flat[offset: offset + rows_held * ring.columns.width].view(rows_held, ring.columns.width).index_copy_(
            0, where[keep], data[keep])
    flat[ring.pos_col].add_(total)


def _rows(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """(tokens, width) without a view op when the reader already gave that shape."""
    return tensor if tensor.dim() == 2 else tensor.reshape(-1, width)
