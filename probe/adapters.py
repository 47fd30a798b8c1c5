"""Finding the MoE layers of a model and reading what each router decided.

A `MoELayer` names three modules of one MoE block: the router (whose output holds the logits),
the experts module (whose inputs hold the final choice: ids and weights after bias correction,
grouping and normalisation) and the block itself. Families in `transformers` declare their router
class in `_can_record_outputs["router_logits"]`; most experts modules take
`(hidden_states, top_k_index, top_k_weights)`, so one generic reading covers them. The few that
route differently get a small reader, chosen in one table, `ROUTINGS`: capacity masks (Switch
top-1, NLLB top-2, and a capacity per sequence as GShard and Megatron drop tokens: a block that
implements `CapacityPerSequence`, an interface declared here, such as
`moescope.demo.capacity.CapacityMoeBlock`), Llama4's dense scores, JetMoE's grouped gating,
identity ("zero") experts (LongCat-Flash) and a parameter-free skip expert (ZAYA). A user
describes a custom MoE module with `MoESpec`.

Sharp edge: readers see the tensors the model really passed, so a family whose experts module
changes signature in a new `transformers` release fails loudly at attach or in the exactness
tests, never silently.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


class NoMoELayersError(ValueError):
    """The model has no MoE layer that the probe recognises (a ValueError).

    Raised by `find_moe_layers` and `probe.attach`; the message names the routers the model declares
    and says to pass a `MoESpec` for a custom MoE module.
    """


class ProbeAttachError(RuntimeError):
    """The probe cannot attach to this model as it is (a RuntimeError); the message says what to do.

    E.g. a model compiled with `torch.compile` before attaching, or router inputs asked for where
    the router's input width cannot be told.
    """


@dataclass
class Choice:
    """The experts each token really went to: ids and weights (tokens, k), and which slots were kept.

    What a `MoESpec`'s `choice` or `router_choice` reader returns.

    Args:
        ids: (tokens, k) expert ids, in the model's order.
        weights: (tokens, k) gate weights.
        kept: (tokens, k) bool, false where a slot was dropped at capacity; None (default) means every
            slot was processed.
        capacity: slots per expert in this forward, where the router sizes it per batch; else None.
    """

    ids: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor | None = None  # (tokens, k) bool; None means every slot was processed
    capacity: int | None = None  # slots per expert in this forward, where the router sizes it per batch


@dataclass(frozen=True)
class CapacityDispatch:
    """What one forward of a `CapacityPerSequence` block dispatched.

    Args:
        kept: (tokens, k) bool, false where a slot was dropped; rows batch-major as the experts see them.
        capacity: slots per expert per sequence.
        groups: sequences (batch rows) in the forward.
    """

    kept: torch.Tensor  # (tokens, k) bool, rows batch-major as the experts see them
    capacity: int  # slots per expert per sequence
    groups: int  # sequences (batch rows) in the forward


@runtime_checkable
class CapacityPerSequence(Protocol):
    """An MoE block whose experts take at most `capacity(seq_len)` (token, slot) assignments per sequence.

    It drops the rest, earlier positions first within a choice rank (GShard; Megatron-Core's
    `moe_token_drop_policy="position"`). The probe reads such a block through these members only;
    `moescope.demo.capacity.CapacityMoeBlock` implements it.

    The block passes its router's top-k ids and weights to its experts module, with the weights of
    dropped slots zeroed, and keeps the forward's decision in `dispatch` (overwritten by every
    forward; None before the first).

    Attributes:
        token_drop_policy: "position".
        capacity_factor: the capacity factor the block sizes its capacity with.
        max_sequence_length: the longest sequence it is configured for (None: unknown).
        dispatch: the last forward's `CapacityDispatch`, or None before the first.
    """

    token_drop_policy: str  # "position"
    capacity_factor: float
    max_sequence_length: int | None  # the longest sequence it is configured for (None: unknown)
    dispatch: CapacityDispatch | None

    def capacity(self, seq_len: int) -> int:
        """Slots per expert for one sequence.

        Args:
            seq_len: the sequence's length, in tokens.

        Returns:
            The most (token, slot) assignments each expert takes from that sequence.
        """
        ...


# A family's router or experts module as its family's code reads it: by its own attribute names
# (top_k, expert_capacity, num_group...). torch types every attribute of an nn.Module it does not
# know as `Tensor | Module`; these are ints, floats, dtypes and flags, so they are read untyped.
FamilyModule = Any

# Readers: router output -> logits (tokens, E); experts call -> Choice; router output -> Choice.
LogitsReader = Callable[[Any], torch.Tensor]
ChoiceReader = Callable[[tuple, dict, "torch.Tensor | None"], Choice]


@dataclass
class MoESpec:
    """How to read a custom MoE module.

    Pass specs to `probe.attach(specs=...)` (or `moescope.attach`, `find_moe_layers`); they take
    precedence over what the model declares.

    Args:
        match: which modules are MoE blocks: a class, a predicate `(name, module) -> bool`, or a name
            (the qualified name, its last part, or the module's class name).
        num_experts: routed experts per block.
        top_k: experts chosen per token.
        router: attribute name (relative to the MoE block) of the router module.
        experts: attribute name of the experts module; None where the block has none.
        logits: turns the router's output into (tokens, num_experts) logits; None (default): the
            output is the logits (reshaped to two dimensions).
        choice: turns the experts module's (args, kwargs, logits) into a `Choice`; None (default):
            ids and weights are read from the experts call's arguments, unless `router_choice` is given.
        router_choice: turns the router's output and logits into a `Choice`, when the experts never
            see ids.
        expert_capacity: slots per expert, for a block with a fixed capacity; None: no capacity.
        zero_experts: identity ("zero") experts that the router may choose but that hold no parameters.
        family: the family name recorded for the layers (`layers.family`).
    """

    match: type | Callable[[str, nn.Module], bool] | str
    num_experts: int
    top_k: int
    router: str = "gate"
    experts: str | None = "experts"
    logits: LogitsReader | None = None
    choice: ChoiceReader | None = None
    router_choice: Callable[[Any, torch.Tensor], Choice] | None = None
    expert_capacity: int | None = None
    zero_experts: int = 0
    family: str = "custom"

    def matches(self, name: str, module: nn.Module) -> bool:
        """Whether the module at `name` is an MoE block this spec describes.

        Args:
            name: the module's qualified name in the model.
            module: the module.

        Returns:
            True when `match` (a class, a name or a predicate) accepts the module.
        """
        if isinstance(self.match, type):
            return isinstance(module, self.match)
        if isinstance(self.match, str):
            return name == self.match or name.endswith("." + self.match) or type(module).__name__ == self.match
        return bool(self.match(name, module))


@dataclass
class MoELayer:
    """An MoE layer as the probe reads it: its modules, its shape and how to read its routing.

    Made by `find_moe_layers`; the probe hooks `router` (and `experts`) through the readers.

    Attributes:
        index: 0-based index of the MoE layer in module order.
        name: the MoE block's qualified name in the model.
        family: the model family (the config's `model_type`, the model's class name, or a spec's).
        block: the MoE block.
        router: the router module.
        experts: the experts module, or None.
        num_experts: routed experts with parameters.
        top_k: experts chosen per token.
        read_logits: router output -> (tokens, E) logits.
        read_choice: experts call (args, kwargs, logits) -> `Choice`, or None.
        read_router_choice: router output and logits -> `Choice`, or None.
        expert_capacity: slots per expert where the router has a capacity, else None.
        zero_experts: identity ("zero") experts the router may choose, holding no parameters.
        params_per_expert: parameters of one routed expert.
        unused_params: parameters in the experts module that no token can use (rows of fused weights
            kept for zero experts).
        expert_modules: where the experts' parameters live, when not in `experts`.
        routing: how the router hands its choice to the experts.
        extra: family-specific settings.
    """
    index: int
    name: str
    family: str
    block: nn.Module
    router: nn.Module
    experts: nn.Module | None
    num_experts: int
    top_k: int
    read_logits: LogitsReader
    read_choice: ChoiceReader | None = None  # from the experts call
    read_router_choice: Callable[[Any, torch.Tensor], Choice] | None = None  # from the router output
    expert_capacity: int | None = None
    zero_experts: int = 0
    params_per_expert: int = 0
    unused_params: int = 0  # parameters in the experts module that no token can use (see _expert_params)
    expert_modules: tuple[nn.Module, ...] = ()  # where the experts' parameters live, when not in `experts`
    routing: str = "experts inputs"
    extra: dict = field(default_factory=dict)


# -- readers ---------------------------------------------------------------------------------------

def logits_at(index: int | None) -> LogitsReader:
    def read(output: Any) -> torch.Tensor:
        logits = output if index is None or isinstance(output, torch.Tensor) else output[index]
        return logits if logits.dim() == 2 else logits.reshape(-1, logits.shape[-1])  # a view op costs ~µs
    return read


_ID_NAMES = ("top_k_index", "router_indices", "selected_experts", "expert_indices", "topk_indices")
_WEIGHT_NAMES = ("top_k_weights", "routing_weights", "router_scores", "topk_weights", "expert_weights")


def experts_arguments(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The (ids, weights) an experts module was called with, by position or by keyword."""
    if not kwargs and len(args) >= 3:  # (hidden_states, ids, weights): most families, on every forward
        return args[1], args[2]
    ids = next((kwargs[n] for n in _ID_NAMES if n in kwargs), None)
    weights = next((kwargs[n] for n in _WEIGHT_NAMES if n in kwargs), None)
    rest = list(args[1:])
    if ids is None and rest:
        ids = rest.pop(0)
    if weights is None and rest:
        weights = rest.pop(0)
    if ids is None or weights is None:
        raise TypeError("experts module was not called with (hidden_states, ids, weights)")
    return ids, weights


def topk_experts_choice(args: tuple, kwargs: dict, logits: torch.Tensor | None) -> Choice:
    ids, weights = experts_arguments(args, kwargs)
    if ids.dim() != 2:  # (tokens, k) already, in most families: no view op on the hot path
        ids = ids.reshape(-1, ids.shape[-1])
    return Choice(ids=ids, weights=weights if weights.shape == ids.shape else weights.reshape(ids.shape))


def switch_choice(args: tuple, kwargs: dict, logits: torch.Tensor | None) -> Choice:
    """Switch/NLLB-style: the experts get a one-hot dispatch mask with over-capacity slots zeroed.

    A kept token's choice is its mask's expert (the router's argmax, or the expert a routing replay
    forced); a dropped token's, with an empty mask, the router's argmax.
    """
    mask, weights = experts_arguments(args, kwargs)
    mask = mask.reshape(-1, mask.shape[-1])
    assert logits is not None, "switch routing needs the router logits"
    kept = mask.sum(dim=-1, keepdim=True) > 0
    ids = torch.where(kept, mask.argmax(dim=-1, keepdim=True), logits.argmax(dim=-1, keepdim=True))
    return Choice(ids=ids, weights=weights.reshape(-1, 1).to(torch.float32), kept=kept)


def dense_scores_choice(top_k: int) -> Callable[[Any, torch.Tensor], Choice]:
    """Llama4-style: the router returns dense (tokens, E) scores that scale each expert's input, zero
    where an expert is not chosen; the chosen are the top-k of the logits among the non-zero scores
    (the router's own top-k, or the experts a routing replay forced)."""
    def read(output: Any, logits: torch.Tensor) -> Choice:
        scores = output[0].reshape(-1, logits.shape[-1])
        ids = torch.topk(logits.masked_fill(scores == 0, float("-inf")), top_k, dim=-1).indices
        return Choice(ids=ids, weights=scores.gather(1, ids))
    return read


def capacity_top2_choice(router: FamilyModule) -> ChoiceReader:
    """NLLB-style: top-2 under a capacity. The experts get the kept first choice as a one-hot mask
    and the combine weights (tokens, E), zero where a slot was dropped at capacity (or, under
    `second_expert_policy="random"`, not sampled).

    The first expert is the mask's where kept, else the logits' argmax; the second is the argmax of
    the logits without the first, the router's own rule (under "sampling" the router adds its
    Gumbel noise to the very logits it returns, so the noise is included). A slot is kept when its
    combine weight is non-zero. The capacity is the router's for this forward: in eval mode NLLB
    sizes it to the batch (`moe_eval_capacity_token_fraction` of all its tokens).
    Sharp edge: under "sampling", a dropped first choice is read from the noisy logits.
    """
    def read(args: tuple, kwargs: dict, logits: torch.Tensor | None) -> Choice:
        mask, combine = experts_arguments(args, kwargs)
        assert logits is not None, "top-2 capacity routing needs the router logits"
        mask = mask.reshape(-1, mask.shape[-1])
        combine = combine.reshape(mask.shape)
        first_kept = mask.sum(dim=-1) > 0
        first = torch.where(first_kept, mask.argmax(dim=-1), logits.argmax(dim=-1))
        second = logits.scatter(1, first[:, None], float("-inf")).argmax(dim=-1)
        ids = torch.stack([first, second], dim=1)
        weights = combine.gather(1, ids)
        kept = torch.stack([first_kept, weights[:, 1] > 0], dim=1)
        return Choice(ids=ids, weights=weights, kept=kept, capacity=int(router.expert_capacity))
    return read


def sequence_capacity_choice(block: CapacityPerSequence) -> ChoiceReader:
    """GShard/Megatron-style capacity per sequence (a `CapacityPerSequence` block): the experts get
    the router's top-k ids and weights with the dropped slots' weights zeroed, and the block keeps
    the forward's decision in `block.dispatch` (kept mask, capacity per sequence, sequences). Ids
    and weights are read from the experts call, as the model passed them; which slots were kept
    from the block, since a weight of 0 alone cannot tell a dropped slot from one whose weight
    underflowed. The capacity per expert in the forward is the capacity per sequence times the
    sequences, as for Switch.
    """
    def read(args: tuple, kwargs: dict, logits: torch.Tensor | None) -> Choice:
        ids, weights = experts_arguments(args, kwargs)
        ids = ids.reshape(-1, ids.shape[-1])
        dispatch = block.dispatch
        assert dispatch is not None, "the block keeps its dispatch before it calls its experts"
        return Choice(ids=ids, weights=weights.reshape(ids.shape), kept=dispatch.kept.reshape(ids.shape),
                      capacity=int(dispatch.capacity) * int(dispatch.groups))
    return read


def grouped_gating_choice(top_k: int) -> Callable[[Any, torch.Tensor], Choice]:
    """JetMoE-style: the router returns its choice already grouped by expert, as the experts
    consume it: (slot order, token index, gates, tokens per expert, logits), where slot order
    sorts the flattened (token, slot) pairs by expert. Undoing that sort gives per-token ids and
    the gates the experts applied.
    """
    def read(output: Any, logits: torch.Tensor) -> Choice:
        order, _, gates, per_expert, _ = output
        sorted_ids = torch.repeat_interleave(torch.arange(len(per_expert), device=order.device),
                                             torch.as_tensor(per_expert, device=order.device))
        ids = torch.empty_like(order).scatter_(0, order, sorted_ids).reshape(-1, top_k)
        weights = torch.empty_like(gates).scatter_(0, order, gates).reshape(-1, top_k)
        return Choice(ids=ids, weights=weights)
    return read


# -- discovery -------------------------------------------------------------------------------------

def _router_recorders(model: nn.Module) -> list[tuple[type, int | None]]:
    """(router class, output index) pairs declared by the model's classes for `router_logits`."""
    found: list[tuple[type, int | None]] = []
    seen = set()
    for module in model.modules():
        declared = getattr(type(module), "_can_record_outputs", None) or {}
        recorders = declared.get("router_logits")
        if recorders is None:
            continue
        for recorder in recorders if isinstance(recorders, (list, tuple)) else [recorders]:
            target = getattr(recorder, "target_class", recorder)
            index = getattr(recorder, "index", 0)
            if isinstance(target, type) and target not in seen:
                seen.add(target)
                found.append((target, index))
    return found


def _int_attr(objects: Iterable[Any], names: Iterable[str]) -> int | None:
    for obj in objects:
        if obj is None:
            continue
        for name in names:
            value = getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _config_of(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) if config is not None else None
    return text or config


def _experts_child(block: nn.Module, router: nn.Module) -> nn.Module | None:
    experts = getattr(block, "experts", None)
    if isinstance(experts, nn.Module) and experts is not router:
        return experts
    for name, child in block.named_children():
        if child is not router and "expert" in name and "shared" not in name:
            return child
    return None


def _parent_map(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    parents: dict[int, tuple[str, nn.Module]] = {}
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            parents[id(child)] = (f"{name}.{child_name}" if name else child_name, module)
    return parents


def find_moe_layers(model: nn.Module, specs: Iterable[MoESpec] = (),
                    select: Callable[[str], bool] | None = None) -> list[MoELayer]:
    """Every MoE layer of `model`, in module order.

    Modules are walked once (`named_modules()`); a module is an MoE block when a spec matches it or
    it is a router the model declares.

    Args:
        model: the torch model.
        specs: `MoESpec`s describing custom MoE modules; they take precedence over what the model
            declares.
        select: keep only the blocks whose qualified name it accepts; None (default): every block.

    Returns:
        The layers, indexed 0.. in module order (after `select`).

    Raises:
        NoMoELayersError: when none is found.
    """
    specs = list(specs)
    config = _config_of(model)
    family = getattr(config, "model_type", None) or type(model).__name__
    recorders = _router_recorders(model)
    names = {id(m): n for n, m in model.named_modules()}
    parents = _parent_map(model)
    layers: list[MoELayer] = []
    claimed: set[int] = set()

    for name, module in model.named_modules():
        spec = next((s for s in specs if s.matches(name, module)), None)
        if spec is not None:
            router = module.get_submodule(spec.router)
            experts = module.get_submodule(spec.experts) if spec.experts else None
            layers.append(MoELayer(
                index=-1, name=name, family=spec.family, block=module, router=router, experts=experts,
                num_experts=spec.num_experts, top_k=spec.top_k, read_logits=spec.logits or logits_at(None),
                read_choice=spec.choice or (topk_experts_choice if spec.router_choice is None else None),
                read_router_choice=spec.router_choice, expert_capacity=spec.expert_capacity,
                zero_experts=spec.zero_experts))
            claimed.add(id(router))
            continue
        match = next(((cls, idx) for cls, idx in recorders if isinstance(module, cls)), None)
        if match is None or id(module) in claimed:
            continue
        router_name, block = parents.get(id(module), (name, module))
        block_name = names.get(id(block), name)
        layers.append(_transformers_layer(block_name, block, module, match[1], family, config))

    if select is not None:
        layers = [layer for layer in layers if select(layer.name)]
    if not layers:
        hint = ("pass a probe.MoESpec describing your MoE module (router and experts attribute names, "
                "number of experts, k)")
        raise NoMoELayersError(
            f"{type(model).__name__} has no MoE layer that moescope recognises: no module is a router "
            f"declared by the model ({', '.join(c.__name__ for c, _ in recorders) or 'none declared'})"
            f" and no MoESpec matched. If this is a dense model there is nothing to probe; if it is a "
            f"custom MoE, {hint}.")
    for index, layer in enumerate(layers):
        layer.index = index
        modules = layer.expert_modules or ((layer.experts,) if layer.experts is not None else ())
        if modules and layer.num_experts:
            layer.params_per_expert, layer.unused_params = _expert_params(modules, layer.num_experts,
                                                                          layer.zero_experts)
    return layers


def _expert_params(modules: Iterable[nn.Module], num_experts: int, zero_experts: int) -> tuple[int, int]:
    """(parameters per routed expert, parameters no token can use) of the experts' modules.

    Fused weights stacked over the router's every slot, zero experts included (LongCat-Flash's
    `gate_up_proj` is (E + Z, ...) though identity experts never read it), hold rows that no token
    uses: those count as unused, never as active and never as shared.
    """
    total = unused = 0
    for module in modules:
        for param in module.parameters():
            total += param.numel()
            if zero_experts and param.dim() and param.shape[0] == num_experts + zero_experts:
                unused += param.numel() // (num_experts + zero_experts) * zero_experts
    return (total - unused) // num_experts, unused


# -- how each kind of router hands its choice to the experts ---------------------------------------

@dataclass(frozen=True)
class Routing:
    """One way of routing: which layers it describes, and how it sets their readers.

    `applies(router, block, experts)` looks at the modules; `configure(layer)` replaces the
    generic reading (ids and weights from the experts module's inputs) where that is not the
    final choice.
    """

    name: str
    applies: Callable[[nn.Module, nn.Module, nn.Module | None], bool]
    configure: Callable[[MoELayer], None]


def _router_named(*names: str) -> Callable[[nn.Module, nn.Module, nn.Module | None], bool]:
    return lambda router, block, experts: type(router).__name__ in names


def _capacity_top2(layer: MoELayer) -> None:
    router: FamilyModule = layer.router
    layer.top_k = 2
    layer.expert_capacity = router.expert_capacity
    layer.read_choice = capacity_top2_choice(router)


def _capacity_top1(layer: MoELayer) -> None:
    router: FamilyModule = layer.router
    layer.top_k = 1
    layer.expert_capacity = router.expert_capacity
    layer.read_choice = switch_choice


def _capacity_per_sequence(layer: MoELayer) -> None:
    block = layer.block
    assert isinstance(block, CapacityPerSequence), "this routing applies to nothing else"
    # The layers table holds one capacity per layer: that of a full-length sequence. Each forward
    # records the capacity it really had (per sequence, times its sequences) in layer_steps.
    layer.expert_capacity = int(block.capacity(block.max_sequence_length or 1))
    layer.extra["capacity_factor"] = float(block.capacity_factor)
    layer.read_choice = sequence_capacity_choice(block)


def _grouped_gating(layer: MoELayer) -> None:
    # JetMoE's experts are two stacked projections of the block (input_linear, output_linear),
    # in its MLP (MoE) and in its attention (MoA, one query/output projection pair per expert).
    layer.experts = None
    layer.expert_modules = tuple(getattr(layer.block, n) for n in ("input_linear", "output_linear"))
    layer.read_choice = None
    layer.read_router_choice = grouped_gating_choice(layer.top_k)


def _dense_scores(layer: MoELayer) -> None:
    layer.read_choice = None
    layer.read_router_choice = dense_scores_choice(layer.top_k)


def _zero_experts(layer: MoELayer) -> None:
    experts: FamilyModule = layer.experts  # one with zero_expert_num > 0: this routing applies to nothing else
    layer.zero_experts = experts.zero_expert_num


def _experts_take_only_hidden_states(experts: nn.Module | None) -> bool:
    if experts is None:
        return True
    parameters = inspect.signature(experts.forward).parameters
    return len(parameters) == 1 and "hidden_states" in parameters


# First match wins; the last entry is the generic reading.
ROUTINGS: tuple[Routing, ...] = (
    Routing("capacity top-2 (NLLB-MoE)", lambda r, b, e: hasattr(r, "second_expert_policy"), _capacity_top2),
    Routing("capacity top-1 (Switch)", lambda r, b, e: isinstance(getattr(r, "expert_capacity", None), int),
            _capacity_top1),
    Routing("capacity per sequence (GShard/Megatron token dropping)",
            lambda r, b, e: isinstance(b, CapacityPerSequence) and b.token_drop_policy == "position",
            _capacity_per_sequence),
    Routing("grouped gating (JetMoE)", _router_named("JetMoeTopKGating"), _grouped_gating),
    Routing("dense scores (Llama4)", lambda r, b, e: _experts_take_only_hidden_states(e), _dense_scores),
    Routing("zero experts (LongCat-Flash)", lambda r, b, e: (getattr(e, "zero_expert_num", 0) or 0) > 0,
            _zero_experts),
    Routing("experts inputs", lambda r, b, e: True, lambda layer: None),
)


def _transformers_layer(block_name: str, block: nn.Module, router: nn.Module, index: int | None,
                        family: str, config: Any) -> MoELayer:
    experts = _experts_child(block, router)
    num_experts = _int_attr([router, experts, block, config],
                            ["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                             "out_features"])
    top_k = _int_attr([router, block, config], ["top_k", "num_experts_per_tok", "moe_top_k", "moe_topk"])
    if isinstance(getattr(router, "expert_capacity", None), int) and top_k is None:
        top_k = 1  # Switch-style top-1 routers carry no k; NLLB's top-2 is set by its Routing
    ffn_config = getattr(config, "ffn_config", None)  # DBRX keeps its MoE fields here
    if num_experts is None or top_k is None:
        num_experts = num_experts or _int_attr([ffn_config], ["moe_num_experts"])
        top_k = top_k or _int_attr([ffn_config], ["moe_top_k"])
    if num_experts is None or top_k is None:
        raise NoMoELayersError(f"cannot tell the number of experts or k of {block_name}; describe it "
                               "with a probe.MoESpec")
    layer = MoELayer(index=-1, name=block_name, family=family, block=block, router=router,
                     experts=experts, num_experts=num_experts, top_k=top_k, read_logits=logits_at(index),
                     read_choice=topk_experts_choice)
    routing = next(r for r in ROUTINGS if r.applies(router, block, experts))
    layer.routing = routing.name
    routing.configure(layer)
    return layer
