"""Device-side expert-health sampling: what each expert outputs, and whether its weights moved.

Two measurements per MoE layer, both torch ops on the model's device, added into the layer's row
of the probe's device buffer (a window's record carries their sums):

- Output sample. At every `sample_every`-th forward (default 4) the router's input (the block's
  token states) is sampled: `tokens_per_expert` tokens (default 4), run through
  `experts_per_forward` experts (default 1, rotating, so each expert is visited every
  sample_every x ceil(E / experts_per_forward) forwards; None: all of them) with gate weight 1,
  whatever the router chose. Tokens and experts are chosen on the device from a per-layer visit
  counter (a hash of it orders the tokens, finite inputs first): no host sync, no random state of
  the model's moved, and CUDA-graph replays keep rotating. The cost is reading the sampled
  expert's weights once more (memory-bound for a few tokens), so one expert per sampled forward
  keeps it near 1/(4E) of the layer's expert-weight traffic; the score carries each expert's last
  measurement between visits, so a masked expert keeps being measured and can be seen to
  recover. Per expert: samples taken, sum of the L2 norms of the finite outputs, and how many
  outputs held a NaN or an infinity.
- Weight fingerprint. At attach, per expert: the sum of squares of all its weights, and a sketch:
  each weight tensor is split into `SKETCH_BLOCKS` contiguous blocks, each block projected onto
  one fixed random +-1 vector. Every `weight_every` sampled forwards both are taken again; the
  record carries the sketch's cosine similarity to the fingerprint and the norm ratio (the
  window's latest check). Scaling an expert moves the norm ratio, re-initialising or swapping it
  moves the cosine, a NaN anywhere makes the norm non-finite. When parameters have gradients,
  per-expert gradient norms ride along.

Sharp edges: the experts are called through `forward` directly (no hooks run, so nothing else
records these calls); the calling convention comes from the layer's reader (ids, Switch's
one-hot mask, Llama4's dense per-expert rows). A corruption of a few weights inside the
remainder after the last sketch block changes the norm but not the sketch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moescope.probe.adapters import MoELayer, switch_choice

SKETCH_BLOCKS = 16  # sketch entries per weight tensor and expert


def dispatch_style(layer: MoELayer) -> str:
    """How the experts module is called: "ids", "onehot" (Switch) or "dense" (Llama4)."""
    if layer.read_choice is switch_choice:
        return "onehot"
    if layer.read_choice is None and layer.read_router_choice is not None:
        return "dense"
    return "ids"


def expert_outputs(layer: MoELayer, hidden: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Each of `experts` (m,) applied with weight 1 to each row of `hidden` (S, H): (m, S, H).

    For the dense style every expert is evaluated (m must be all E, in order).
    """
    module = layer.experts
    assert module is not None, "health sampling watches only layers with an experts module"
    tokens = hidden.shape[0]
    count = experts.numel()
    batch = hidden.repeat(count, 1)
    style = dispatch_style(layer)
    if style == "dense":
        out = module.forward(batch)
    else:
        ids = experts.repeat_interleave(tokens).reshape(-1, 1)
        ones = torch.ones(ids.shape, dtype=hidden.dtype, device=hidden.device)
        if style == "onehot":
            mask = torch.nn.functional.one_hot(ids.reshape(-1), layer.num_experts).reshape(-1, 1, layer.num_experts)
            out = module.forward(batch, mask, ones)
        else:
            out = module.forward(batch, ids, ones)
    return out.reshape(count, tokens, -1)


def _expert_tensors(layer: MoELayer) -> list[list[tuple[nn.Parameter, int | None]]]:
    """Per expert, its weights: (parameter, row in the parameter's (E, -1) view, or None: all of it)."""
    module, count = layer.experts, layer.num_experts
    assert module is not None, "health sampling and gradient norms watch only layers with an experts module"
    children = list(module.children())
    if len(children) == count and all(any(True for _ in c.parameters()) for c in children):
        return [[(p, None) for p in child.parameters()] for child in children]  # a submodule per expert (Switch)
    per_expert: list[list[tuple[nn.Parameter, int | None]]] = [[] for _ in range(count)]
    for param in module.parameters():
        if param.dim() >= 1 and param.shape[0] % count == 0:  # fused (E, ...), and DBRX's (E * ffn, hidden)
            for e in range(count):
                per_expert[e].append((param, e))
    return per_expert


def _part(tensor: torch.Tensor, row: int | None, count: int) -> torch.Tensor:
    return tensor.detach().reshape(-1) if row is None else tensor.detach().view(count, -1)[row]


@torch.no_grad()
def expert_grad_norms(tensors: list[list[tuple[nn.Parameter, int | None]]], count: int) -> torch.Tensor | None:
    """(E,) float32 L2 norm of each expert's weight gradients (`_expert_tensors`' partition), or
    None when no expert weight has a gradient. One reduction per parameter: a fused (E, ...)
    parameter's gradient is reduced row-wise at once. The health score's gradient component and
    the training monitor's per-expert gradient norms are this number."""
    fused: dict[int, torch.Tensor] = {}  # id of a fused parameter -> its gradient
    own: list[torch.Tensor | None] = [None] * count
    for expert, parts in enumerate(tensors):
        for param, row in parts:
            grad = param.grad
            if grad is None:
                continue
            if row is None:
                square = torch.linalg.vector_norm(grad.detach(), dtype=torch.float32) ** 2
                sofar = own[expert]
                own[expert] = square if sofar is None else sofar + square
            else:
                fused[id(param)] = grad
    total: torch.Tensor | None = None
    for grad in fused.values():
        rows = torch.linalg.vector_norm(grad.detach().reshape(count, -1), dim=1, dtype=torch.float32) ** 2
        total = rows if total is None else total + rows
    present = [t for t in own if t is not None]
    if present:
        zero = torch.zeros((), dtype=torch.float32, device=present[0].device)
        stacked = torch.stack([zero if t is None else t for t in own])
        total = stacked if total is None else total + stacked
    return None if total is None else total.sqrt()


class ExpertGradients:
    """Per-expert gradient norms of one MoE layer, its parameters partitioned once."""

    def __init__(self, layer: MoELayer):
        self.layer = layer
        self.tensors = _expert_tensors(layer)

    def norms(self) -> torch.Tensor | None:
        return expert_grad_norms(self.tensors, self.layer.num_experts)


class _Fingerprint:
    """One layer's per-expert weight fingerprint, and the means to take it again."""

    def __init__(self, layer: MoELayer, seed: int):
        self.layer = layer
        self.tensors = _expert_tensors(layer)
        generator = torch.Generator().manual_seed(seed)
        self.signs: list[torch.Tensor] = []
        for param, row in self.tensors[0]:
            tensor = _part(param, row, layer.num_experts)
            length = max(tensor.numel() // SKETCH_BLOCKS, 1)
            signs = torch.randint(0, 2, (length,), generator=generator).to(torch.float32) * 2 - 1
            self.signs.append(signs.to(device=tensor.device, dtype=tensor.dtype))
        self.sumsq, self.sketch, _ = self.measure()

    @torch.no_grad()
    def measure(self, grads: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(sum of squares (E,), sketch (E, blocks), gradient norms (E,)): the norms only with
        `grads`, and None when no expert weight has a gradient. A fused (E, ...) parameter is
        measured for every expert at once (two ops), a submodule per expert one by one."""
        count = self.layer.num_experts
        sumsq: torch.Tensor | None = None
        parts = []
        if all(row is not None for _, row in self.tensors[0]):  # fused: every expert a row of each parameter
            for (param, _), signs in zip(self.tensors[0], self.signs):
                rows = param.detach().view(count, -1)
                square = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32) ** 2
                sumsq = square if sumsq is None else sumsq + square
                blocks = min(SKETCH_BLOCKS, rows.shape[1])
                length = signs.numel()
                parts.append((rows[:, : blocks * length].reshape(count, blocks, length) @ signs).to(torch.float32))
            if sumsq is None:
                raise ValueError("an expert without weights has no fingerprint")
            sketch = torch.cat(parts, dim=1)
        else:
            totals, sketches = [], []
            for tensors in self.tensors:
                total: torch.Tensor | None = None
                pieces = []
                for (param, row), signs in zip(tensors, self.signs):
                    flat = _part(param, row, count)
                    square = torch.linalg.vector_norm(flat, dtype=torch.float32) ** 2
                    total = square if total is None else total + square
                    blocks = min(SKETCH_BLOCKS, flat.numel())
                    length = signs.numel()
                    pieces.append((flat[: blocks * length].view(blocks, length) @ signs).to(torch.float32))
                sketches.append(torch.cat(pieces))  # raises for an expert without weights
                assert total is not None
                totals.append(total)
            sumsq, sketch = torch.stack(totals), torch.stack(sketches)
        norms = expert_grad_norms(self.tensors, count) if grads else None
        return sumsq, sketch, norms

    def compare(self) -> dict[str, torch.Tensor]:
        """Cosine of the sketch to the fingerprint, norm ratio, and gradient norms when present."""
        sumsq, sketch, grad = self.measure(grads=True)
        dot = (sketch * self.sketch).sum(dim=1)
        norms = sketch.norm(dim=1) * self.sketch.norm(dim=1)
        both_zero = (sketch.abs().sum(dim=1) == 0) & (self.sketch.abs().sum(dim=1) == 0)
        cosine = torch.where(norms > 0, dot / norms.clamp_min(1e-30), both_zero.to(dot.dtype))
        ratio = torch.where(self.sumsq > 0, (sumsq / self.sumsq.clamp_min(1e-30)).sqrt(),
                            torch.where(sumsq == 0, torch.ones_like(sumsq), torch.full_like(sumsq, float("inf"))))
        out = {"weight_cosine": cosine.to(torch.float32), "weight_norm_ratio": ratio.to(torch.float32)}
        if grad is not None:
            out["grad_norm"] = grad
        return out


class HealthSampler:
    """Samples expert outputs and re-checks weight fingerprints, at every `sample_every`-th forward.

    The probe's router hooks call each layer's `visitor` at the forwards they record. At a sampling
    forward the visited layers add their measurements into their rows of the probe's device buffer
    (`bind`); a window's record carries their sums. `sample(layer, hidden)` returns one layer's
    measurements as named device tensors.

    The budget of a sampled forward is `experts_per_forward` experts per watched layer (None: every
    expert of every layer), spent in as few calls of the experts modules as it takes: the layers
    are visited in turn, each running min(budget, its experts) experts in one call, until the
    budget is spent. So each expert is visited as often as if every layer ran its share, with one
    call instead of one per layer when a layer has at least as many experts as there are layers.
    Weight fingerprints rotate too: each layer is checked every `weight_every` sampled forwards,
    the layers spread over them. The token and expert choices within a layer are made on the
    device from its visit counter (no host sync). Under CUDA-graph capture and torch.compile every
    layer runs its own `experts_per_forward` at each sampled forward instead (the host's rotation
    would be frozen into the graph), and all fingerprints are checked every `weight_every`.
    """

    def __init__(self, layers: list[MoELayer], tokens_per_expert: int = 4, experts_per_forward: int | None = 1,
                 weight_every: int = 32, sample_every: int = 4, seed: int = 0,
                 on_error: Callable[[], None] | None = None):
        if tokens_per_expert < 1:
            raise ValueError("tokens_per_expert must be at least 1")
        if experts_per_forward is not None and experts_per_forward < 1:
            raise ValueError("experts_per_forward must be at least 1 (or None: every expert)")
        if weight_every < 1:
            raise ValueError("weight_every must be at least 1 (sampled forwards between weight checks)")
        if sample_every < 1:
            raise ValueError("sample_every must be at least 1 (forwards between health samples)")
        self.layers = [layer for layer in layers if layer.experts is not None]
        self.tokens_per_expert = tokens_per_expert
        self.experts_per_forward = experts_per_forward
        self.weight_every = weight_every
        self.sample_every = sample_every
        self.on_error = on_error
        self.seed = seed
        # experts run per sampled forward: the layers' shares, pooled
        self.budget = (sum(layer.num_experts for layer in self.layers) if experts_per_forward is None
                       else experts_per_forward * max(len(self.layers), 1))
        self.now = False  # this forward samples (decided on the host before the forward)
        self.weights_now = False  # every layer's weights are due (the rule under capture and compile)
        self.visiting: dict[int, int] = {}  # layer index -> experts it runs at this forward
        self.weights_due: set[int] = set()  # layers whose fingerprints are checked at this forward
        self._forwards = 0
        self._samples = 0
        self._next_layer = 0  # the rotation's place among self.layers
        self._visits: dict[int, torch.Tensor] = {}
        self._rows: dict[int, tuple[torch.Tensor, Any]] = {}
        self.fingerprints = {layer.index: _Fingerprint(layer, seed + layer.index) for layer in self.layers}

    def own_share(self, layer: MoELayer) -> int:
        """Experts `layer` runs when every layer samples at once (under capture and compile)."""
        share = self.experts_per_forward
        return layer.num_experts if share is None or dispatch_style(layer) == "dense" else min(share, layer.num_experts)

    def experts_per_visit(self, layer: MoELayer) -> int:
        """Experts a visit of `layer` runs while the layers take turns: all of a dense-style layer's."""
        count = layer.num_experts
        return count if dispatch_style(layer) == "dense" else min(self.budget, count)

    def refingerprint(self, layer: int | None = None) -> None:
        """Take the weight fingerprint again (after a deliberate weight update, e.g. in training)."""
        for moe in self.layers:
            if layer is None or moe.index == layer:
                self.fingerprints[moe.index] = _Fingerprint(moe, self.seed + moe.index)

    def bind(self, rows: dict[int, tuple[torch.Tensor, Any]]) -> None:
        """Where each layer accumulates: layer -> (its row of the device buffer, its Columns)."""
        self._rows = rows

    def begin_forward(self, capturing: bool = False) -> None:
        """Host side, before a forward: whether it samples, which layers it visits, whose weights
        are checked. `capturing`: the forward is captured into a CUDA graph (every layer visits)."""
        self.now = self._forwards % self.sample_every == 0
        self._forwards += 1
        self.visiting, self.weights_due = {}, set()
        self.weights_now = False
        if not self.now or not self.layers:
            return
        count = len(self.layers)
        self.weights_now = self._samples % self.weight_every == 0
        if capturing:
            self.visiting = {layer.index: self.own_share(layer) for layer in self.layers}
            self.weights_due = {layer.index for layer in self.layers} if self.weights_now else set()
        else:
            spent = 0
            while spent < self.budget and len(self.visiting) < count:
                layer = self.layers[self._next_layer]
                self._next_layer = (self._next_layer + 1) % count
                self.visiting[layer.index] = self.experts_per_visit(layer)
                spent += self.visiting[layer.index]
            # layer i is checked at the sampled forwards s with s = i * weight_every // count (mod weight_every)
            self.weights_due = {layer.index for i, layer in enumerate(self.layers)
                                if (self._samples - i * self.weight_every // count) % self.weight_every == 0}
        self._samples += 1

    def visitor(self, layer: MoELayer) -> Callable[[tuple], None] | None:
        """What the probe's router hook of `layer` calls, with the router's arguments, at a forward
        it records and this sampler samples (`now`); None for a layer it does not watch. One hook per
        router does both: a second Python hook costs its dispatch at every forward, sampled or not."""
        if all(moe is not layer for moe in self.layers):
            return None
        every_layer = self.own_share(layer)

        def visit(args: tuple) -> None:
            if not args or not isinstance(args[0], torch.Tensor):
                return
            if torch.compiler.is_compiling():  # no host rotation inside a graph: every layer, its share
                experts, weights = every_layer, self.weights_now
            else:
                experts, weights = self.visiting.get(layer.index, 0), layer.index in self.weights_due
                if not experts and not weights:
                    return
            try:
                self.accumulate(layer, self.sample(layer, args[0], weights=weights, experts=experts))
            except Exception:
                if self.on_error is not None:
                    self.on_error()
                else:
                    raise
        return visit

    @torch.no_grad()
    def accumulate(self, layer: MoELayer, measured: dict[str, torch.Tensor]) -> None:
        if layer.index not in self._rows:
            return
        row, cols = self._rows[layer.index]
        if "health_samples" in measured:
            row[cols["samples"]].add_(measured["health_samples"].to(row.dtype))
            row[cols["norm_sum"]].add_(measured["health_norm_sum"].to(row.dtype))
            row[cols["nonfinite"]].add_(measured["health_nonfinite"].to(row.dtype))
            row[cols["input_nonfinite"]].add_(measured["health_input_nonfinite"].to(row.dtype))
        if "weight_cosine" in measured:  # the latest check of the window counts
            row[cols["weight_cosine"]].copy_(measured["weight_cosine"])
            row[cols["weight_norm_ratio"]].copy_(measured["weight_norm_ratio"])
            row[cols["weight_checked"]].fill_(1.0)
            if "grad_norm" in measured:
                row[cols["grad_norm"]].copy_(measured["grad_norm"])
                row[cols["grad_present"]].fill_(1.0)

    def _visit(self, layer: MoELayer, device: torch.device) -> torch.Tensor:
        if layer.index not in self._visits:
            self._visits[layer.index] = torch.zeros((), dtype=torch.int64, device=device)
        return self._visits[layer.index]

    @torch.no_grad()
    def sample(self, layer: MoELayer, hidden: torch.Tensor, weights: bool | None = None,
               experts: int | None = None) -> dict[str, torch.Tensor]:
        """The device tensors of one layer for one sampling forward (see the module docstring).

        weights: also re-check the weight fingerprint (default: every `weight_every`-th call).
        experts: how many experts run, rotating from where the layer's last visit stopped (default
        `experts_per_visit`; 0: none, only the weights).
        """
        hidden = hidden.detach().reshape(-1, hidden.shape[-1])
        tokens = hidden.shape[0]
        count = layer.num_experts
        device = hidden.device
        out: dict[str, torch.Tensor] = {}
        if weights is None:
            weights = self._samples % self.weight_every == 0
            self._samples += 1
        per = self.experts_per_visit(layer) if experts is None else experts
        if dispatch_style(layer) == "dense" and per:
            per = count  # the dense call evaluates every expert
        if tokens and per:
            visit = self._visit(layer, device)
            n = min(self.tokens_per_expert, tokens)
            # Tokens whose input is already non-finite (a fault upstream) say nothing about this
            # layer's experts: sample finite ones first, and count only those. The order among
            # finite tokens is a hash of the visit: spread, reproducible, no random state moved.
            finite_in = torch.isfinite(hidden).all(dim=-1)
            rank = (torch.arange(tokens, device=device) * 1_000_003 + visit * 2_654_435_761 + self.seed) % tokens
            key = rank.to(torch.float32) + (~finite_in) * float(2 * tokens)
            rows = key.topk(n, largest=False).indices
            valid = finite_in.index_select(0, rows)  # (n,)
            index = (torch.arange(per, device=device) + visit * per) % count
            result = expert_outputs(layer, hidden.index_select(0, rows), index).to(torch.float32)
            finite = torch.isfinite(result).all(dim=-1)  # (m, n)
            norms = torch.where(finite & valid, torch.linalg.vector_norm(torch.nan_to_num(result), dim=-1),
                                torch.zeros((), device=device))
            out["health_samples"] = torch.zeros(count, dtype=torch.int64, device=device).index_copy(
                0, index, valid.sum().expand(index.numel()))
            out["health_norm_sum"] = torch.zeros(count, dtype=torch.float32, device=device).index_copy(
                0, index, norms.sum(dim=1))
            out["health_nonfinite"] = torch.zeros(count, dtype=torch.int64, device=device).index_copy(
                0, index, (~finite & valid).sum(dim=1))
            out["health_input_nonfinite"] = (~finite_in).sum().reshape(1)
            visit.add_(1)
        if weights:
            out.update(self.fingerprints[layer.index].compare())
        return out
