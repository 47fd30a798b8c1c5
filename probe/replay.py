"""Routing replay: every MoE layer routes each token to given experts, with the family's own weights.

R3 ("rollout routing replay", arXiv 2510.11370) trains a policy on the routing its inference
engine sampled with: the engine's choice of experts, the training router's weights. Here the
choice replaces the family's selection step inside the trust gate's rule for the family
(`trust_gate.RULES`, re-run from the router's own output with a `trust_gate.Forced`), so the
forced experts' gate weights come from the model's own router scores by the family's own rule
(softmax, sigmoid, renormalisation, scaling) and gradients flow through them. DBRX, which chooses
in its block, gets its experts' (ids, weights) from `trust_gate.BLOCK_CHOICE`. A family without a
rule is refused by name.

`RoutingReplay(layers, routes)` checks the routing against the layers (count, top-k, ids in range,
no repeated id within a token's top-k) when it is built, and every forward's input shape against
the routing before the forward runs; `install(model)` adds the hooks and returns their handles.
`moescope.replay` and `moescope.attach(replay=...)` are the user's entry points; they read the
routing from arrays, an export folder or a store.

Sharp edges:
- The same routing applies to every forward while installed: each forward must feed the
  (batch, tokens) the routing describes (a training forward and its backward, a scoring pass).
  One-token decode steps over a KV cache need a routing of one token per step.
- A token whose every expert id in a layer is -1 (the engine routed nothing there) is routed by
  the model's own router in that layer; a row with some ids -1 and some not is refused.
- The hook is prepended to the router's: a probe session on the same model (and its routes table)
  sees the forced experts and their weights.
- Switch's capacity still applies to the forced experts (first come, first served per row); a
  forced token dropped at capacity is recorded under the router's own first choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from moescope.probe.adapters import MoELayer
from moescope.probe.forwards import main_input
from moescope.probe.trust_gate import BLOCK_CHOICE, RULES, Forced


class ReplayError(ValueError):
    """A routing that cannot be replayed in this model (or this forward); the message says why."""


def replayable(layer: MoELayer) -> bool:
    """Whether routing replay covers this layer's family (a rule in `trust_gate.RULES`)."""
    return layer.family in RULES


def check_routes(routes: Any, layers: list[MoELayer]) -> np.ndarray:
    """The routing as an int64 array (batch, tokens, layers, top_k), checked against `layers`.

    Args:
        routes: expert ids (tokens, layers, top_k) for one sequence or (batch, tokens, layers,
            top_k), a numpy array or torch tensor of integers; layers in the order of `layers`;
            -1 for a whole row: the model's own choice.
        layers: every MoE layer of the model (`find_moe_layers`).

    Returns:
        The checked ids, int64, 4-dimensional.

    Raises:
        ReplayError: for a family replay does not cover, a shape of the wrong rank, a layer count or
            top-k that differs from the model's, an id out of range, a repeated id within one
            token's top-k, or a row only partly -1.
    """
    uncovered = sorted({layer.family for layer in layers if not replayable(layer)})
    if uncovered:
        raise ReplayError(f"routing replay has no rule for the {', '.join(uncovered)} family: it covers "
                          f"{', '.join(sorted(RULES))}")
    if isinstance(routes, torch.Tensor):
        routes = routes.detach().cpu().numpy()
    ids = np.asarray(routes)
    if ids.dtype.kind not in "iu":
        raise ReplayError(f"routes must hold integer expert ids, not {ids.dtype}")
    if ids.ndim == 3:
        ids = ids[None]
    if ids.ndim != 4:
        raise ReplayError(f"routes must be shaped [tokens, layers, top_k] or [batch, tokens, layers, top_k], "
                          f"got {list(np.shape(routes))}")
    ids = ids.astype(np.int64)
    if ids.shape[2] != len(layers):
        raise ReplayError(f"routes hold {ids.shape[2]} layers, the model has {len(layers)} MoE layers "
                          f"({', '.join(layer.name for layer in layers)})")
    for index, layer in enumerate(layers):
        if ids.shape[3] != layer.top_k:
            raise ReplayError(f"routes choose {ids.shape[3]} experts per token, MoE layer {index} ({layer.name}) "
                              f"chooses top_k={layer.top_k}")
        layer_ids = ids[:, :, index, :]
        own = (layer_ids == -1).all(axis=-1)
        routed = layer_ids[~own]
        if (routed == -1).any():
            batch, token = np.argwhere((layer_ids == -1).any(axis=-1) & ~own)[0]
            raise ReplayError(f"routes: token {token} of sequence {batch} in layer {index} is only partly routed "
                              f"({layer_ids[batch, token].tolist()}): -1 must fill a whole row (the model's own "
                              "choice) or none")
        bad = (routed < 0) | (routed >= layer.num_experts)
        if bad.any():
            raise ReplayError(f"routes: expert id {int(routed[bad][0])} in layer {index} is out of range: the layer "
                              f"has experts 0..{layer.num_experts - 1} (-1: the model's own choice)")
        ordered = np.sort(layer_ids, axis=-1)
        repeated = (ordered[..., 1:] == ordered[..., :-1]).any(axis=-1) & ~own
        if repeated.any():
            batch, token = np.argwhere(repeated)[0]
            raise ReplayError(f"routes: token {token} of sequence {batch} repeats an expert within its top-k in "
                              f"layer {index} ({layer_ids[batch, token].tolist()}): each token's experts must differ")
    return ids


def _device(module: nn.Module) -> torch.device:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return torch.device("cpu")


class RoutingReplay:
    """Forced routing for every MoE layer of a model (see the module docstring).

    Args:
        layers: every MoE layer of the model, in order (`find_moe_layers`).
        routes: the expert ids (`check_routes`).
        label: what the routing is (the session's `replay` tag): an export folder, a run, "array".

    Raises:
        ReplayError: from `check_routes`.
    """

    def __init__(self, layers: list[MoELayer], routes: Any, label: str = "array"):
        self.layers = list(layers)
        self.routes = check_routes(routes, self.layers)
        self.label = label
        self._forced: dict[int, Forced] = {}

    @property
    def shape(self) -> tuple[int, int]:
        """(batch, tokens) every forward must feed."""
        return int(self.routes.shape[0]), int(self.routes.shape[1])

    def forced(self, index: int, device: torch.device | str = "cpu") -> Forced:
        """Layer `index`'s forced choice on `device`: (batch * tokens, k) ids, batch-major."""
        forced = self._forced.get(index)
        if forced is None or forced.ids.device != torch.device(device):
            ids = self.routes[:, :, index, :].reshape(-1, self.routes.shape[3])
            own = (ids == -1).all(axis=-1, keepdims=True)
            forced = Forced(ids=torch.from_numpy(np.where(own, 0, ids)).to(device),
                            own=torch.from_numpy(own).to(device) if own.any() else None)
            self._forced[index] = forced
        return forced

    def check_forward(self, inputs: dict[str, Any]) -> None:
        """Raise ReplayError, before the forward, when its (batch, tokens) are not the routing's."""
        for decoder in (False, True):
            _, shape = main_input(inputs, decoder=decoder)
            if shape and tuple(shape) != self.shape:
                name = "decoder input" if decoder else "input"
                raise ReplayError(
                    f"the forward's {name} is (batch, tokens) = {tuple(shape)}, the replayed routing is {self.shape}: "
                    "feed the sequence the routing was taken from (an engine's export routes every token it fed; "
                    "drop the last generated token from the inputs, or pad the routing with a row of -1, the "
                    "model's own choice)")

    # -- hooks ---------------------------------------------------------------------------------

    def install(self, model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        """Hook the model (the shape check) and every layer's router (prepended: hooks added before
        see the forced routing); returns the handles to remove."""
        handles = [model.register_forward_pre_hook(torch.compiler.disable(self._check_hook), with_kwargs=True,
                                                   prepend=True)]
        try:
            for layer in self.layers:
                forced = self.forced(layer.index, _device(layer.router))
                choose = BLOCK_CHOICE.get(layer.family)
                if choose is None:
                    handles.append(layer.router.register_forward_hook(
                        self._router_hook(layer, RULES[layer.family], forced), prepend=True))
                    continue
                if layer.experts is None:
                    raise ReplayError(f"MoE layer {layer.index} ({layer.name}, {layer.family}) has no experts module "
                                      "to hand the forced experts to")
                logits: list[torch.Tensor] = []
                handles.append(layer.router.register_forward_hook(self._keep_logits(layer, logits), prepend=True))
                handles.append(layer.experts.register_forward_pre_hook(
                    self._experts_hook(layer, choose, forced, logits), with_kwargs=True, prepend=True))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles

    def _check_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = dict(kwargs)
        if args and "input_ids" not in inputs and isinstance(args[0], torch.Tensor):
            inputs["input_ids"] = args[0]
        self.check_forward(inputs)

    @staticmethod
    def _check_rows(layer: MoELayer, rows: int, forced: Forced) -> None:
        if rows != forced.ids.shape[0]:
            raise ReplayError(f"MoE layer {layer.index} ({layer.name}) routes {rows} tokens in this forward, the "
                              f"replayed routing has {forced.ids.shape[0]} (batch x tokens)")

    def _router_hook(self, layer: MoELayer, rule: Callable, forced: Forced) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            logits = layer.read_logits(output)
            self._check_rows(layer, logits.shape[0], forced)
            return rule(module, args, output, None, forced)
        return hook

    def _keep_logits(self, layer: MoELayer, kept: list[torch.Tensor]) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            logits = layer.read_logits(output)
            self._check_rows(layer, logits.shape[0], forced=self.forced(layer.index, logits.device))
            kept[:] = [logits]
        return hook

    def _experts_hook(self, layer: MoELayer, choose: Callable, forced: Forced, kept: list[torch.Tensor]) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            ids, weights = choose(layer.block, kept.pop(), forced)
            if kwargs or len(args) < 3:
                raise ReplayError(f"MoE layer {layer.index} ({layer.family}): its experts module was not called "
                                  "with (hidden_states, ids, weights); this transformers release is not covered")
            return (args[0], ids, weights, *args[3:]), kwargs
        return hook
