"""Device-side expert-health sampling: what each expert outputs, and whether its weights moved.

Two measurements per MoE layer, both torch ops on the model's device, both joining the probe's
single packed transfer per forward:

- Output sample. At each recorded forward the router's input (the block's token states) is
  sampled: `tokens_per_expert` tokens (default 4), run through `experts_per_forward` experts
  (default 1, rotating, so each expert is visited every ceil(E / experts_per_forward)
  forwards; None: all of them) with gate weight 1, whatever the router chose. The cost is
  reading that expert's weights once more (memory-bound for a few tokens), so one expert per
  forward keeps it near 1/E of the layer's expert-weight traffic; the score carries each
  expert's last measurement between visits. So a
  masked expert keeps being measured and can be seen to recover. Per expert: samples taken, sum
  of the L2 norms of the finite outputs, and how many outputs held a NaN or an infinity. Cost:
  tokens_per_expert x experts_per_forward expert evaluations per layer and forward.
- Weight fingerprint. At attach, per expert: the sum of squares of all its weights, and a sketch:
  each weight tensor is split into `SKETCH_BLOCKS` contiguous blocks, each block projected onto
  one fixed random +-1 vector. Every `weight_every` recorded forwards both are taken again; the
  record carries the sketch's cosine similarity to the fingerprint and the norm ratio. Scaling an
  expert moves the norm ratio, re-initialising or swapping it moves the cosine, a NaN anywhere
  makes the norm non-finite. When parameters have gradients, per-expert gradient norms ride along.

Sharp edges: the experts are called through `forward` directly (no hooks run, so nothing else
records these calls); the calling convention comes from the layer's reader (ids, Switch's
one-hot mask, Llama4's dense per-expert rows). A corruption of a few weights inside the
remainder after the last sketch block changes the norm but not the sketch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from probe.adapters import MoELayer, switch_choice

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
        self.sumsq, self.sketch = self.measure()

    @torch.no_grad()
    def measure(self, grads: bool = False) -> tuple[torch.Tensor, ...]:
        """(sum of squares (E,), sketch (E, blocks)) and, with grads, gradient norms (E,) or None."""
        sumsq, sketches, grad_sq, have_grad = [], [], [], False
        for tensors in self.tensors:
            total = None
            parts = []
            gsq = None
            for (param, row), signs in zip(tensors, self.signs):
                flat = _part(param, row, self.layer.num_experts)
                square = torch.linalg.vector_norm(flat, dtype=torch.float32) ** 2
                total = square if total is None else total + square
                blocks = min(SKETCH_BLOCKS, flat.numel())
                length = signs.numel()
                parts.append((flat[: blocks * length].view(blocks, length) @ signs).to(torch.float32))
                if grads and param.grad is not None:
                    have_grad = True
                    grad = _part(param.grad, row, self.layer.num_experts)
                    g = torch.linalg.vector_norm(grad, dtype=torch.float32) ** 2
                    gsq = g if gsq is None else gsq + g
            sumsq.append(total)
            sketches.append(torch.cat(parts))
            grad_sq.append(gsq if gsq is not None else torch.zeros((), device=total.device))
        out = (torch.stack(sumsq), torch.stack(sketches))
        if grads:
            out = out + ((torch.stack(grad_sq).sqrt() if have_grad else None),)
        return out

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
    """Samples expert outputs and re-checks weight fingerprints at recorded forwards.

    `install(active)` hooks the routers; `active()` says whether the current forward is being
    recorded. `take(layer)` hands the forward's device tensors over for packing (and forgets
    them); `fields(got, num_experts)` turns their host copies into `LayerStep` keyword arguments.
    """

    def __init__(self, layers: list[MoELayer], tokens_per_expert: int = 4, experts_per_forward: int | None = 1,
                 weight_every: int = 32, seed: int = 0, on_error: Callable[[], None] | None = None):
        if tokens_per_expert < 1:
            raise ValueError("tokens_per_expert must be at least 1")
        if weight_every < 1:
            raise ValueError("weight_every must be at least 1 (recorded forwards between weight checks)")
        self.layers = [layer for layer in layers if layer.experts is not None]
        self.tokens_per_expert = tokens_per_expert
        self.experts_per_forward = experts_per_forward
        self.weight_every = weight_every
        self.on_error = on_error
        self.seed = seed
        self._device_generators: dict[str, torch.Generator] = {}
        self._forwards: dict[int, int] = {layer.index: 0 for layer in self.layers}
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        self.fingerprints = {layer.index: _Fingerprint(layer, seed + layer.index) for layer in self.layers}

    def refingerprint(self, layer: int | None = None) -> None:
        """Take the weight fingerprint again (after a deliberate weight update, e.g. in training)."""
        for moe in self.layers:
            if layer is None or moe.index == layer:
                self.fingerprints[moe.index] = _Fingerprint(moe, self.seed + moe.index)

    def install(self, active: Callable[[], bool]) -> list[torch.utils.hooks.RemovableHandle]:
        return [layer.router.register_forward_hook(self._hook(layer, active)) for layer in self.layers]

    def _hook(self, layer: MoELayer, active: Callable[[], bool]) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not active() or not args or not isinstance(args[0], torch.Tensor):
                return
            try:
                self._pending[layer.index] = self.sample(layer, args[0])
            except Exception:
                if self.on_error is not None:
                    self.on_error()
                else:
                    raise
        return hook

    def _experts_now(self, layer: MoELayer, visit: int) -> torch.Tensor:
        count = layer.num_experts
        per = count if dispatch_style(layer) == "dense" else min(self.experts_per_forward or count, count)
        start = (visit * per) % count
        return (torch.arange(per) + start) % count

    @torch.no_grad()
    def sample(self, layer: MoELayer, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """The device tensors of one layer for one forward (see the module docstring)."""
        visit = self._forwards[layer.index]
        self._forwards[layer.index] = visit + 1
        hidden = hidden.detach().reshape(-1, hidden.shape[-1])
        tokens = hidden.shape[0]
        count = layer.num_experts
        device = hidden.device
        out: dict[str, torch.Tensor] = {}
        if tokens:
            n = min(self.tokens_per_expert, tokens)
            # Tokens whose input is already non-finite (a fault upstream) say nothing about this
            # layer's experts: sample finite ones first, and count only those.
            finite_in = torch.isfinite(hidden).all(dim=-1)
            key = torch.rand(tokens, generator=self._device_generator(device), device=device) + (~finite_in) * 2.0
            rows = key.topk(n, largest=False).indices
            valid = finite_in.index_select(0, rows)  # (n,)
            experts = self._experts_now(layer, visit)
            index = experts.to(device)
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
        if visit % self.weight_every == 0:
            out.update(self.fingerprints[layer.index].compare())
        return out

    def _device_generator(self, device: torch.device) -> torch.Generator:
        # A generator of our own: sampling must not move the model's global random state.
        key = str(device)
        if key not in self._device_generators:
            self._device_generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._device_generators[key]

    def take(self, layer: int) -> dict[str, torch.Tensor]:
        return self._pending.pop(layer, {})

    def discard(self) -> None:
        self._pending.clear()

    @staticmethod
    def fields(got: dict[str, np.ndarray]) -> dict[str, np.ndarray | None]:
        """`LayerStep` keyword arguments from a layer's unpacked host arrays."""
        def get(name: str, dtype: type) -> np.ndarray | None:
            value = got.get(name)
            return None if value is None else value.astype(dtype)
        return dict(expert_output_samples=get("health_samples", np.int64),
                    expert_output_norm_sum=get("health_norm_sum", np.float64),
                    expert_output_nonfinite=get("health_nonfinite", np.int64),
                    expert_weight_cosine=get("weight_cosine", np.float64),
                    expert_weight_norm_ratio=get("weight_norm_ratio", np.float64),
                    expert_grad_norm=get("grad_norm", np.float64),
                    nonfinite_input_tokens=None if "health_input_nonfinite" not in got
                    else int(got["health_input_nonfinite"][0]))
