"""The trust gate: a per (layer, expert) weight in [0, 1] applied where the model routes.

A weight w_e < 1 multiplies expert e's routing score before the family's own selection and
normalisation run again: for softmax routers it is a logit offset of log(w_e) (so w_e scales the
expert's probability and the remaining weights renormalise exactly as the model's rule does:
over the top-k where the family renormalises the top-k, over all experts where it normalises
over all); for sigmoid routers (DeepSeek-V3) it scales the sigmoid score before bias correction,
group limiting and top-k. At w_e = 0 the expert is masked: it is never chosen, and each of its
tokens goes to the next-best expert by the router's own scores.

How it reaches the model: a forward hook on the router rewrites the router's output (the rule of
each family lives in `RULES`, one entry per family, checked against the router's own output in
the tests). Llama4 also needs a hook on its experts: every expert there processes every token
(scaled by a score that is zero when not chosen), so non-finite weights would leak through a zero
score; the hook removes the masked experts' rows from the experts' output. DBRX routes inside its
block, from the router's logits, so the gated logits are all it needs.

Sharp edges:
- The router output the rest of the model (and the probe's records) sees is the gated one:
  logits + log(w) (masked: -1e4, finite so entropies stay finite), and the gated choice.
- A layer whose weights are all 1 is left alone: the hook returns without touching anything, so
  an untouched gate changes no bit of the output.
- A family without a rule (a custom `MoESpec`, or a family added to the probe after this table)
  is not re-routed: the gate scales the weights its experts module receives (no
  renormalisation) and removes a masked expert's slots (pointed, with weight 0, at an expert the
  token already uses, so the masked expert is never computed).
- Changes happen only through `set`/`reset`, from any thread; each forward reads one consistent
  snapshot of a layer's weights. Every change is an `GateChange`, kept in `changes` and passed
  to each listener.
"""

from __future__ import annotations

import datetime as dt
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from moescope.probe.adapters import FamilyModule, MoELayer, experts_arguments, topk_experts_choice

log = logging.getLogger(__name__)

MASKED_LOGIT = -1.0e4  # logit offset of a masked expert: exp() is 0 in every float dtype, never -inf


class TrustGateError(ValueError):
    """A gate change was asked for that cannot be made; the message says why."""


@dataclass(frozen=True)
class GateChange:
    """One change of one expert's trust weight."""

    at: dt.datetime
    layer: int
    expert: int
    old_weight: float
    new_weight: float
    reason: str
    score: float | None = None
    source: str = "manual"  # "manual" (API), "auto" (policy), "override" (operator pin)
    step: int | None = None


class GatePolicy(Protocol):
    """What drives a session's gate from outside the probe and takes an operator's pins
    (`alerts.trust_policy.TrustPolicy`, bound by `moescope.attach` as `session.trust`)."""

    def override(self, layer: int, expert: int, weight: float, reason: str) -> GateChange | None: ...
    def release(self, layer: int, expert: int, reason: str = ...) -> GateChange | None: ...


@dataclass(frozen=True)
class _LayerState:
    weight: torch.Tensor  # (E,) float32 on the router's device
    offset: torch.Tensor  # (E,) float32: log(weight), MASKED_LOGIT at 0
    masked: torch.Tensor  # (E,) bool
    host: np.ndarray  # (E,) float64 mirror; the hot path never reads the device copy back
    active: bool  # any weight < 1


def _module_function(module: nn.Module, name: str) -> Callable:
    return getattr(sys.modules[type(module).__module__], name)


def _gated_logits(logits: torch.Tensor, state: _LayerState | None) -> torch.Tensor:
    return logits if state is None else logits + state.offset.to(logits.dtype)


@dataclass(frozen=True)
class Forced:
    """The experts a layer must choose (routing replay, probe/replay.py), as a rule receives them.

    Attributes:
        ids: (tokens, k) int64 expert ids on the router's device, rows batch-major as the router
            sees its tokens; 0 in a row the model routes itself.
        own: (tokens, 1) bool, true where the model's own choice stands (the replayed routing has
            nothing for that token); None when every row is forced.
    """

    ids: torch.Tensor
    own: torch.Tensor | None = None


def _pick(forced: Forced, own: Callable[[], torch.Tensor], shape: torch.Size | None = None) -> torch.Tensor:
    """The forced ids, the rule's own choice (`own()`, only computed when needed) where a row is not forced."""
    ids = forced.ids if shape is None else forced.ids.view(shape)
    if forced.own is None:
        return ids
    own_mask = forced.own if shape is None else forced.own.view(*shape[:-1], 1)
    return torch.where(own_mask, own(), ids)


# -- the family rules: router output in, gated (or replayed) router output out -----------------
# Each rule gets (router, router args, router output, state, forced) and returns the new output,
# built exactly as the family's router builds it; with every weight at 1 it reproduces the
# router's own output bit for bit (tests/unit/probe/test_trust_gate.py checks each family). State
# None: no gate. `forced` (routing replay): the family's selection step is replaced by the given
# experts, and their weights come from the same scores by the same rule, so with the router's
# own choice forced the output is again its own bit for bit (tests/unit/probe/test_replay.py).

def _softmax_topk(norm: bool | str, cast: str | None, scale: str | None = None, sort: bool = True) -> Callable:
    """softmax over all experts, top-k, optional renormalisation of the top-k, optional scale."""
    def rule(router: FamilyModule, args: tuple, output: Any, state: _LayerState | None,
             forced: Forced | None = None) -> Any:
        logits = output[0]
        probs = F.softmax(_gated_logits(logits.float(), state), dim=-1)
        if forced is None:
            top_value, top_index = torch.topk(probs, router.top_k, dim=-1, sorted=sort)
        else:
            top_index = _pick(forced, lambda: torch.topk(probs, router.top_k, dim=-1, sorted=sort)[1])
            top_value = probs.gather(-1, top_index)
        renorm = getattr(router, norm) if isinstance(norm, str) else norm
        if renorm:
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        if scale is not None:
            top_value = top_value * getattr(router, scale)
        if cast == "logits":
            top_value = top_value.to(logits.dtype)
        elif cast == "input":
            top_value = top_value.to(args[0].dtype)
        return (_gated_logits(logits, state), top_value, top_index)
    return rule


def _deepseek_v2(router: FamilyModule, args: tuple, output: Any, state: _LayerState | None,
                 forced: Forced | None = None) -> Any:
    """Softmax scores; group-limited greedy masks the groups outside the top groups before the top-k.
    Replayed: a forced expert's weight is its score, whichever group it is in (the group limit is
    part of the selection the engine made)."""
    logits = output[0]
    scores = _gated_logits(logits, state).softmax(dim=-1, dtype=torch.float32)

    def own() -> torch.Tensor:
        limited = scores
        if router.topk_method == "group_limited_greedy":
            per_group = router.num_experts // router.num_group
            group_scores = scores.view(-1, router.num_group, per_group).max(dim=-1).values
            group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(-1, router.num_group, per_group).reshape(
                -1, router.num_experts)
            limited = scores.masked_fill(~score_mask.bool(), 0.0)
        return torch.topk(limited, k=router.top_k, dim=-1, sorted=False)[1]

    top_index = own() if forced is None else _pick(forced, own)
    top_value = scores.gather(-1, top_index)
    return (_gated_logits(logits, state), top_value * router.routed_scaling_factor, top_index)


def _deepseek_v3(router: FamilyModule, args: tuple, output: Any, state: _LayerState | None,
                 forced: Forced | None = None) -> Any:
    """Sigmoid scores scaled by w; bias correction, group limiting and top-k as the router does.
    Replayed: the forced experts' weights are their sigmoid scores (no bias), renormalised and
    scaled as the router does."""
    logits = output[0]
    scores = logits.sigmoid() if state is None else logits.sigmoid() * state.weight

    def own() -> torch.Tensor:
        for_choice = scores + router.e_score_correction_bias
        per_group = router.num_experts // router.num_group
        if state is None:
            group_scores = for_choice.view(-1, router.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        else:
            # A group's score is the sum of its best two *unmasked* experts; a group left with one counts
            # it twice, so masking an expert does not starve the rest of its group.
            group_top = for_choice.masked_fill(state.masked, float("-inf")).view(
                -1, router.num_group, per_group).topk(2, dim=-1)[0]
            group_scores = torch.where(torch.isinf(group_top), group_top[..., :1], group_top).sum(dim=-1)
            for_choice = for_choice.masked_fill(state.masked, MASKED_LOGIT)
        group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, router.num_group, per_group).reshape(-1, router.num_experts)
        for_choice = for_choice.masked_fill(~score_mask.bool(), float("-inf"))
        return torch.topk(for_choice, k=router.top_k, dim=-1, sorted=False)[1]

    top_index = own() if forced is None else _pick(forced, own)
    top_weight = scores.gather(1, top_index)
    if router.norm_topk_prob:
        top_weight = top_weight / (top_weight.sum(dim=-1, keepdim=True) + 1e-20)
    return (_gated_logits(logits, state), top_weight * router.routed_scaling_factor, top_index)


def _topk_softmax(cast_input: bool) -> Callable:
    """top-k over the logits, softmax over the k chosen (GPT-OSS, GraniteMoE)."""
    def rule(router: FamilyModule, args: tuple, output: Any, state: _LayerState | None,
             forced: Forced | None = None) -> Any:
        logits = _gated_logits(output[0], state)
        if forced is None:
            top_value, top_index = torch.topk(logits, router.top_k, dim=-1)
        else:
            top_index = _pick(forced, lambda: torch.topk(logits, router.top_k, dim=-1)[1])
            top_value = logits.gather(-1, top_index)
        weights = torch.softmax(top_value, dim=-1, dtype=top_value.dtype)
        if cast_input:
            weights = weights.type_as(args[0])
        return (logits, weights, top_index)
    return rule


def _sparsemixer_weight(scores: torch.Tensor, candidates: torch.Tensor, chosen: torch.Tensor,
                        jitter_eps: float) -> torch.Tensor:
    """PhiMoE's multiplier of one chosen expert (transformers' `sparsemixer`, eval branch): a softmax
    over the candidates whose score lies within 2*eps (relative) of the chosen one's, at the chosen."""
    with torch.no_grad():
        threshold = candidates.gather(-1, chosen)
        factor = scores.abs().clamp(min=threshold)
        far = ((threshold - scores) / factor) > (2 * jitter_eps)
    return torch.softmax(candidates.masked_fill(far, float("-inf")), dim=-1).gather(dim=-1, index=chosen)


def _phimoe(router: FamilyModule, args: tuple, output: Any, state: _LayerState | None,
            forced: Forced | None = None) -> Any:
    """Sparsemixer on the (gated) logits. Replayed: each forced expert's multiplier is sparsemixer's
    eval-mode one with the forced expert in place of the best (the second one's among the experts
    without the first), also in training mode (no Heun estimator: the weights' gradient is the softmax's)."""
    logits = _gated_logits(output[0], state)
    sparsemixer = _module_function(router, "sparsemixer")
    if forced is None:
        weights, index = sparsemixer(logits, jitter_eps=router.router_jitter_noise, training=router.training,
                                     top_k=router.top_k)
        return (logits, weights, index)
    index = _pick(forced, lambda: sparsemixer(logits, jitter_eps=router.router_jitter_noise,
                                              training=router.training, top_k=router.top_k)[1])
    first, second = index[:, :1], index[:, 1:2]
    weights = torch.concat((
        _sparsemixer_weight(logits, logits, first, router.router_jitter_noise),
        _sparsemixer_weight(logits, torch.scatter(logits, -1, first, float("-inf")), second,
                            router.router_jitter_noise)), dim=-1)
    return (logits, weights, index)


def _llama4(router: FamilyModule, args: tuple, output: Any, state: _LayerState | None,
            forced: Forced | None = None) -> Any:
    """Dense scores: sigmoid of the chosen logits, zero elsewhere; w scales the score."""
    _, raw = output
    logits = _gated_logits(raw, state)
    if forced is None:
        top_index = torch.topk(logits, router.top_k, dim=1).indices
    else:
        top_index = _pick(forced, lambda: torch.topk(logits, router.top_k, dim=1).indices)
    scores = torch.full_like(raw, float("-inf")).scatter_(1, top_index, raw.gather(1, top_index))
    scores = torch.sigmoid(scores.float())
    if state is not None:
        scores = scores * state.weight
    return (scores.to(raw.dtype), logits)


def _switch(router: FamilyModule, args: tuple, output: Any, state: _LayerState | None,
            forced: Forced | None = None) -> Any:
    """Top-1 of the softmax, then the capacity mask, recomputed from the gated logits. Replayed: the
    forced expert, its probability, and the same capacity mask (first come, first served per row)."""
    logits = _gated_logits(output[2], state)
    input_dtype = args[0].dtype
    probs = F.softmax(logits, dim=-1, dtype=router.dtype).to(input_dtype)
    if forced is None:
        chosen = torch.argmax(probs, dim=-1)
        weight = probs.max(dim=-1).values.unsqueeze(-1)
    else:
        top = _pick(forced, lambda: torch.argmax(probs, dim=-1, keepdim=True), probs.shape[:-1] + (1,))
        chosen, weight = top.squeeze(-1), probs.gather(-1, top)
    index = F.one_hot(chosen, num_classes=router.num_experts)
    index = index * (torch.cumsum(index, dim=-2) <= router.expert_capacity)
    return (index, weight, logits)


def _dbrx(router: FamilyModule, args: tuple, output: Any, state: _LayerState | None,
          forced: Forced | None = None) -> Any:
    return _gated_logits(output, state)  # the block's own softmax/top-k/normalisation follow


def _dbrx_choice(block: FamilyModule, logits: torch.Tensor, forced: Forced) -> tuple[torch.Tensor, torch.Tensor]:
    """DBRX routes in its block (`route_tokens_to_experts`): softmax over all experts, top-k, p-norm.
    Replayed: (ids, weights) for its experts module, the forced experts' probabilities normalised so."""
    probs = F.softmax(logits, dim=1, dtype=logits.dtype)
    ids = _pick(forced, lambda: torch.topk(probs, block.top_k, dim=-1)[1])
    weights = probs.gather(-1, ids)
    if block.moe_normalize_expert_weights is not None:
        weights = weights / torch.norm(weights, p=block.moe_normalize_expert_weights, dim=-1, keepdim=True)
    return ids, weights


RULES: dict[str, Callable] = {
    "mixtral": _softmax_topk(norm=True, cast=None),
    "qwen2_moe": _softmax_topk(norm="norm_topk_prob", cast="logits"),
    "qwen3_moe": _softmax_topk(norm="norm_topk_prob", cast="logits"),
    "olmoe": _softmax_topk(norm="norm_topk_prob", cast="logits"),
    "jamba": _softmax_topk(norm=False, cast="input"),
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _topk_softmax(cast_input=False),
    "granitemoe": _topk_softmax(cast_input=True),
    "phimoe": _phimoe,
    "llama4": _llama4,
    "llama4_text": _llama4,
    "dbrx": _dbrx,
    "switch_transformers": _switch,
}

# Families whose experts process every token whatever the routing says (dense dispatch): the
# masked experts' output rows are removed after the experts ran.
DENSE_EXPERTS = {"llama4", "llama4_text"}

# Families that choose in their block, between the router and the experts: routing replay hands
# their experts module the (ids, weights) these build from the router's logits.
BLOCK_CHOICE: dict[str, Callable[[FamilyModule, torch.Tensor, Forced], tuple[torch.Tensor, torch.Tensor]]] = {
    "dbrx": _dbrx_choice,
}


class TrustGate:
    """Per (layer, expert) trust weights in [0, 1], applied at routing time.

    Build it from the probe's `MoELayer`s; `install()` adds the hooks and returns their handles
    (the probe session keeps and removes them). Every weight starts at 1.
    """

    def __init__(self, layers: list[MoELayer], on_error: Callable[[], None] | None = None):
        self.layers = {layer.index: layer for layer in layers}
        self._states: dict[int, _LayerState] = {}
        self._lock = threading.Lock()
        self.changes: list[GateChange] = []
        self.listeners: list[Callable[[GateChange], None]] = []
        self.on_error = on_error
        for layer in layers:
            self._states[layer.index] = self._state(layer, np.ones(layer.num_experts))

    @staticmethod
    def _device(layer: MoELayer) -> torch.device:
        for tensor in list(layer.router.parameters()) + list(layer.router.buffers()):
            return tensor.device
        return torch.device("cpu")

    def _state(self, layer: MoELayer, host: np.ndarray) -> _LayerState:
        device = self._device(layer)
        weight = torch.tensor(host, dtype=torch.float32)
        offset = torch.where(weight > 0, torch.log(weight.clamp_min(1e-30)), torch.tensor(MASKED_LOGIT))
        offset = offset.clamp_min(MASKED_LOGIT)
        return _LayerState(weight=weight.to(device), offset=offset.to(device), masked=(weight == 0).to(device),
                           host=host.copy(), active=bool((host < 1).any()))

    # -- reading -------------------------------------------------------------------------------

    def weights(self, layer: int) -> np.ndarray:
        """The trust weights of a layer's experts, as a new host array."""
        return self._states[self._check_layer(layer)].host.copy()

    def weight(self, layer: int, expert: int) -> float:
        return float(self.weights(layer)[self._check_expert(layer, expert)])

    def mechanism(self, layer: int) -> str | None:
        """How the gate acts on a layer: "reroute" (a family rule), "remove" (masked slots taken
        out before the experts run, no re-routing), or None (the gate cannot reach it)."""
        moe = self.layers[self._check_layer(layer)]
        if moe.family in RULES:
            return "reroute"
        if moe.experts is None or moe.read_choice is not topk_experts_choice:
            return None  # no experts module, or one that is not called with (states, ids, weights)
        return "remove"

    # -- changing ------------------------------------------------------------------------------

    def set(self, layer: int, expert: int, weight: float, reason: str, *, score: float | None = None,
            source: str = "manual", step: int | None = None) -> GateChange | None:
        """Set one expert's trust weight; returns the change, or None if the weight was already so.

        Raises TrustGateError for an unknown layer or expert or a weight outside [0, 1], and when
        masking would leave the layer fewer unmasked experts than its k.
        """
        layer = self._check_layer(layer)
        expert = self._check_expert(layer, expert)
        weight = float(weight)
        if not 0.0 <= weight <= 1.0 or weight != weight:
            raise TrustGateError(f"trust weight must lie in [0, 1], got {weight}")
        moe = self.layers[layer]
        if weight < 1 and self.mechanism(layer) is None:
            raise TrustGateError(f"layer {layer} ({moe.family}) cannot be gated: its experts are not a separate "
                                 "module the gate can reach; describe it with a probe.MoESpec")
        with self._lock:
            host = self._states[layer].host.copy()
            old = float(host[expert])
            if old == weight:
                return None
            host[expert] = weight
            if int((host > 0).sum()) < moe.top_k:
                raise TrustGateError(
                    f"masking expert {expert} would leave layer {layer} with {int((host > 0).sum())} experts, "
                    f"fewer than its k={moe.top_k}; lift another expert first")
            self._states[layer] = self._state(moe, host)
            change = GateChange(at=dt.datetime.now(dt.timezone.utc), layer=layer, expert=expert, old_weight=old,
                                new_weight=weight, reason=reason, score=score, source=source, step=step)
            self.changes.append(change)
        for listener in list(self.listeners):
            try:
                listener(change)
            except Exception:
                log.exception("trust-gate listener failed")
        return change

    def reset(self, reason: str = "reset", source: str = "manual") -> list[GateChange]:
        """Every weight back to 1; returns the changes made."""
        changes = []
        for layer, state in list(self._states.items()):
            for expert in np.flatnonzero(state.host < 1):
                change = self.set(layer, int(expert), 1.0, reason, source=source)
                if change is not None:
                    changes.append(change)
        return changes

    def _check_layer(self, layer: int) -> int:
        if layer not in self._states:
            raise TrustGateError(f"no MoE layer {layer}; the probe found layers {sorted(self._states)}")
        return int(layer)

    def _check_expert(self, layer: int, expert: int) -> int:
        count = self.layers[layer].num_experts
        if not 0 <= int(expert) < count:
            raise TrustGateError(f"layer {layer} has experts 0..{count - 1}, not {expert}")
        return int(expert)

    # -- hooks ---------------------------------------------------------------------------------

    def install(self) -> list[torch.utils.hooks.RemovableHandle]:
        """Hook every layer's router (and Llama4's experts); returns the handles to remove later.

        The router hook is prepended, so hooks added before it (the probe's recorder) already see
        the gated output.
        """
        handles = []
        for layer in self.layers.values():
            rule = RULES.get(layer.family)
            if rule is not None:
                handles.append(layer.router.register_forward_hook(self._router_hook(layer, rule), prepend=True))
                if layer.family in DENSE_EXPERTS and layer.experts is not None:
                    handles.append(layer.experts.register_forward_hook(self._dense_hook(layer)))
            elif layer.experts is not None and self.mechanism(layer.index) is not None:
                handles.append(layer.experts.register_forward_pre_hook(
                    self._weights_hook(layer), with_kwargs=True, prepend=True))
        return handles

    def _failed(self) -> None:
        if self.on_error is not None:
            self.on_error()
        else:
            log.exception("trust gate hook failed; the forward goes on ungated")

    def _router_hook(self, layer: MoELayer, rule: Callable) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            state = self._states[layer.index]
            if not state.active:
                return None
            try:
                return rule(module, args, output, state)
            except Exception:
                self._failed()
                return None
        return hook

    def _dense_hook(self, layer: MoELayer) -> Callable:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> Any:
            state = self._states[layer.index]
            if not state.active or not bool(state.host.min() == 0):
                return None
            try:
                rows = output.view(layer.num_experts, -1, output.shape[-1])
                rows = torch.where(state.masked.view(-1, 1, 1), torch.zeros((), dtype=rows.dtype,
                                                                             device=rows.device), rows)
                return rows.view_as(output)
            except Exception:
                self._failed()
                return None
        return hook

    def _weights_hook(self, layer: MoELayer) -> Callable:
        """No rule to re-route by: scale the weights the experts receive, and remove masked slots.

        A masked slot is pointed at an unmasked expert the token already uses (else the first
        unmasked expert) with weight 0: the masked expert is never computed, whatever the experts
        implementation (transformers' grouped kernels leave skipped rows uninitialised, so an
        out-of-range id is not safe), and the stand-in adds exactly 0.
        """
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            state = self._states[layer.index]
            if not state.active:
                return None
            try:
                ids, weights = experts_arguments(args, kwargs)
                real = ids < layer.num_experts  # ids past E are zero experts (LongCat): never masked
                in_range = ids.long().clamp(0, layer.num_experts - 1)
                masked = state.masked[in_range] & real
                scale = torch.where(real, state.weight.to(weights.dtype)[in_range],
                                    torch.ones((), dtype=weights.dtype, device=weights.device))
                scaled = torch.where(masked, torch.zeros((), dtype=weights.dtype, device=weights.device),
                                     weights * scale)
                usable = ~masked & real
                first = usable.to(torch.int8).argmax(dim=-1, keepdim=True)
                fallback = torch.full_like(ids[..., :1], int(np.flatnonzero(state.host > 0)[0]))
                stand_in = torch.where(usable.any(dim=-1, keepdim=True), ids.gather(-1, first), fallback)
                ids = torch.where(masked, stand_in.expand_as(ids), ids)
                new = dict(kwargs)
                rest = list(args[1:])
                for names, value in ((("top_k_index", "router_indices", "selected_experts", "expert_indices",
                                       "topk_indices"), ids),
                                     (("top_k_weights", "routing_weights", "router_scores", "topk_weights",
                                       "expert_weights"), scaled)):
                    name = next((n for n in names if n in kwargs), None)
                    if name is not None:
                        new[name] = value
                    else:
                        rest[0 if value is ids else (0 if len(rest) == 1 else 1)] = value
                return (args[0], *rest), new
            except Exception:
                self._failed()
                return None
        return hook
