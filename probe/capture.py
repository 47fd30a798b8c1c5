"""Capture what every router decided in one forward, token by token, on the host.

The session (probe/session.py) reduces routing on the device and never syncs; this is the other
tool, for checks that compare whole forwards offline (`moescope.analyses.jitter`, tests): it keeps,
per MoE layer, every token's router logits and the final choice (ids, weights, kept slots) that
the layer's readers take from the model (probe/adapters.py), copied to the host as float32 and
int64 arrays. The readers are the probe's own, so every family the probe reads is captured the
same way, bias correction, grouped top-k and capacity drops included.

Sharp edges: it copies to the host after every router and experts call (a device sync each:
never on a serving path); a layer whose router runs more than once in the forward (a re-entrant
call) keeps its last call; hooks are global state on the modules, removed in `close()` exactly
as added, also when installing them fails half-way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from moescope.probe.adapters import MoELayer


@dataclass(frozen=True)
class LayerRouting:
    """One layer's routing in one forward. Rows are the forward's tokens, batch-major (the rows the
    router saw: padding included).

    logits: (tokens, slots) float32, the router's output logits (slots: experts + zero experts).
    ids: (tokens, k) int64, the experts each token went to, in the model's slot order.
    weights: (tokens, k) float32, the gate weights the experts module received (a slot dropped at
    capacity has the weight the family gives it: 0 for sequence capacity, the router's for Switch).
    kept: (tokens, k) bool, slots an expert processed (all True for a dropless router).
    """

    logits: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    kept: np.ndarray


def _floats(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32).numpy()


class RoutingCapture:
    """Hooks on `layers` that keep each layer's `LayerRouting` of the latest forward.

    Use as a context manager around forwards of the model; read `take()` after each forward.
    """

    def __init__(self, layers: Iterable[MoELayer]):
        self.layers = list(layers)
        self._handles: list[Any] = []
        self._logits: dict[int, torch.Tensor] = {}
        self._choice: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        try:
            for layer in self.layers:
                self._handles.append(layer.router.register_forward_hook(self._router_hook(layer)))
                if layer.read_choice is not None and layer.experts is not None:
                    self._handles.append(layer.experts.register_forward_pre_hook(self._experts_hook(layer),
                                                                                 with_kwargs=True))
        except BaseException:
            self.close()
            raise

    def _keep(self, layer: MoELayer, choice: Any) -> None:
        ids = choice.ids.detach().to("cpu", torch.int64).numpy()
        kept = (np.ones(ids.shape, dtype=bool) if choice.kept is None
                else choice.kept.detach().cpu().numpy().astype(bool).reshape(ids.shape))
        self._choice[layer.index] = (ids, _floats(choice.weights).reshape(ids.shape), kept)

    def _router_hook(self, layer: MoELayer):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            logits = layer.read_logits(output)
            self._logits[layer.index] = logits
            if layer.read_router_choice is not None:
                self._keep(layer, layer.read_router_choice(output, logits))
        return hook

    def _experts_hook(self, layer: MoELayer):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            assert layer.read_choice is not None  # hooked only where the experts call holds the choice
            self._keep(layer, layer.read_choice(args, kwargs, self._logits.get(layer.index)))
        return hook

    def take(self) -> list[LayerRouting]:
        """Every layer's routing of the forward(s) since the last `take`, in layer order, and forget
        it. Raises RuntimeError when a layer was not routed (its router or experts never ran)."""
        missing = [layer.name for layer in self.layers
                   if layer.index not in self._logits or layer.index not in self._choice]
        if missing:
            raise RuntimeError(f"no routing captured for {', '.join(missing)}: run one forward of the whole "
                               "model between take() calls")
        out = []
        for layer in self.layers:
            ids, weights, kept = self._choice[layer.index]
            out.append(LayerRouting(_floats(self._logits[layer.index]), ids, weights, kept))
        self._logits.clear()
        self._choice.clear()
        return out

    def discard(self) -> None:
        """Forget what was captured since the last `take` (after a forward that failed half-way)."""
        self._logits.clear()
        self._choice.clear()

    def close(self) -> None:
        """Remove exactly the hooks this capture added (safe to call twice)."""
        while self._handles:
            self._handles.pop().remove()

    def __enter__(self) -> RoutingCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
