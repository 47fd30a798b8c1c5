"""Expert capacity with token dropping on a transformers Mixtral, as GShard, Switch and Megatron do it.

A dropless top-k model uses exactly k experts for every token, so "the fraction of its parameters
a token uses" never moves. Models trained the GShard / Switch Transformer way, and Megatron-Core
run with `moe_expert_capacity_factor` and `moe_token_drop_policy="position"`, give each expert a
fixed number of slots per group of tokens and drop what does not fit:

- a group is one sequence (a batch row); each expert takes at most
  ``capacity = ceil(capacity_factor * seq_len * k / E)`` (token, slot) assignments of it
  (`moescope.metrics.signals.expert_capacity`, the one definition of that number);
- assignments are admitted in priority order: every token's first choice before any second choice
  (GShard), and within a choice rank earlier positions first (Megatron's "position" policy);
- a dropped slot contributes nothing: its combine weight is zero, so the token's output does not
  depend on that expert's parameters, and the token still passes through the residual. The
  remaining weight is not renormalised (GShard, Megatron). A token whose every slot is dropped
  is a "dropped token".

So the parameters a token uses vary with the token: a sequence whose tokens crowd onto a few
experts overflows them, and later positions lose their slots first. Decoding one token at a time
never drops: a one-token group has capacity >= 1 and the token's k experts are distinct.

Padding (GShard's `paddings`): where the model's forward gets a 2-D `attention_mask`, padded
positions are never dispatched and take no capacity; the probe counts them as dropped tokens,
since no expert processed them. Without a mask every position competes.

:func:`install_capacity` replaces each `MixtralSparseMoeBlock` with a :class:`CapacityMoeBlock`
holding the same router and experts modules (the same parameter names, so checkpoints load
either way) and records ``capacity_factor`` in the config, so a saved model says how it ran.
Plain ``MixtralForCausalLM.from_pretrained`` ignores that field and gives the dropless model; call
:func:`install_capacity` (the demo's loader and training script do) to get the trained behaviour.

Sharp edges:
- transformers' fused experts kernels have no way to skip a slot (an out-of-range id is only
  safe under expert parallelism), so a dropped slot keeps its expert id with weight 0: the
  output is exactly that of a skipped slot, but the kernel still spends the FLOPs on it.
- The block keeps the last forward's decision in `dispatch` (a `probe.adapters.CapacityDispatch`:
  kept mask, capacity, groups) for the probe to read; it is overwritten by every forward.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

from moescope.metrics.signals import expert_capacity
from moescope.probe.adapters import CapacityDispatch, CapacityPerSequence, FamilyModule

TOKEN_DROP_POLICY = "position"  # Megatron-Core's name for "earlier positions win within a choice rank"


class CapacityInstallError(ValueError):
    """The model cannot take (or already has) the capacity: the message says what to do."""


def capacity_keep(ids: torch.Tensor, capacity: int, num_experts: int,
                  nonpadding: torch.Tensor | None = None) -> torch.Tensor:
    """Which (token, slot) assignments fit: a (batch, seq, k) bool mask for `ids` (batch, seq, k).

    Each sequence is a group; per expert the first `capacity` assignments in priority order are
    kept (choice rank first, then position). `nonpadding` (batch, seq) bool marks real tokens;
    padded ones are never kept and take no capacity. Vectorised and shape-static: no host sync.
    """
    batch, seq, k = ids.shape
    order = ids.transpose(1, 2).reshape(batch, k * seq)  # every first choice, then every second, ...
    wants = nn.functional.one_hot(order.long(), num_experts).to(torch.int32)  # (batch, k * seq, E)
    if nonpadding is not None:
        wants = wants * nonpadding.to(torch.int32).repeat(1, k).unsqueeze(-1)
    queue = torch.cumsum(wants, dim=1)  # 1-based place of each assignment in its expert's queue
    fits = ((queue <= capacity) & (wants > 0)).any(dim=-1)
    return fits.view(batch, k, seq).transpose(1, 2)


class _Nonpadding:
    """The 2-D attention mask of the forward in flight, shared by a model's capacity blocks."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        self.mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.mask = None

    def rows(self, batch: int, seq: int) -> torch.Tensor | None:
        """(batch, seq) bool for the tokens being routed: the mask's last `seq` columns (with a KV
        cache the mask also covers the past). None when there is no usable mask."""
        mask = self.mask
        if mask is None or mask.shape[0] != batch or mask.shape[1] < seq:
            return None
        return mask[:, mask.shape[1] - seq:].bool()


class CapacityMoeBlock(nn.Module, CapacityPerSequence):
    """A Mixtral MoE block whose experts have a capacity per sequence (see the module docstring).

    Holds the original block's `gate` (router) and `experts`, so parameter names, the router's
    hooks (the probe's, the trust gate's) and the experts kernel are unchanged; between them it
    zeroes the weights of the slots that did not fit. The probe reads it through the interface it
    declares, `probe.adapters.CapacityPerSequence`.
    """

    def __init__(self, block: FamilyModule, capacity_factor: float, nonpadding: _Nonpadding | None = None,
                 max_sequence_length: int | None = None):
        super().__init__()
        self.gate = block.gate
        self.experts = block.experts
        self.top_k = int(block.top_k)
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.num_experts = int(block.experts.num_experts)
        self.capacity_factor = float(capacity_factor)
        self.token_drop_policy = TOKEN_DROP_POLICY
        self.max_sequence_length = max_sequence_length
        self._nonpadding = nonpadding or _Nonpadding()
        self.dispatch: CapacityDispatch | None = None

    def capacity(self, seq_len: int) -> int:
        """Slots per expert for one sequence of `seq_len` tokens."""
        return expert_capacity(seq_len, self.top_k, self.num_experts, self.capacity_factor)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        flat = hidden_states.reshape(-1, hidden)
        _, weights, ids = self.gate(flat)
        capacity = self.capacity(seq)
        kept = capacity_keep(ids.view(batch, seq, -1), capacity, self.num_experts,
                             self._nonpadding.rows(batch, seq)).reshape(ids.shape)
        self.dispatch = CapacityDispatch(kept=kept, capacity=capacity, groups=batch)
        weights = torch.where(kept, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
        return self.experts(flat, ids, weights).reshape(batch, seq, hidden)

    def extra_repr(self) -> str:
        return f"capacity_factor={self.capacity_factor}, token_drop_policy={self.token_drop_policy!r}"


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise CapacityInstallError(f"{type(model).__name__} has no model.layers; install_capacity takes a "
                                   "transformers Mixtral (MixtralForCausalLM or MixtralModel)")
    return list(layers)


def capacity_blocks(model: nn.Module) -> list[CapacityMoeBlock]:
    """The model's capacity blocks, in layer order (empty when none was installed)."""
    blocks = [getattr(layer, "mlp", None) for layer in _decoder_layers(model)]
    return [block for block in blocks if isinstance(block, CapacityMoeBlock)]


ModelT = TypeVar("ModelT", bound=nn.Module)


def install_capacity(model: ModelT, capacity_factor: float | None = None) -> ModelT:
    """Give every MoE block of a transformers Mixtral an expert capacity with token dropping.

    `capacity_factor` defaults to the config's ``capacity_factor`` (what a checkpoint trained
    with it records); the value used is written to ``model.config.capacity_factor`` so that
    ``save_pretrained`` keeps it. Returns `model`, changed in place.

    Raises:
        CapacityInstallError: no capacity factor given or recorded, a factor that is not
            positive, capacity already installed, or a model that is not a Mixtral-style
            decoder (``model.layers[i].mlp`` with ``gate``, ``experts`` and ``top_k``).
    """
    config = getattr(model, "config", None)
    if capacity_factor is None:
        capacity_factor = getattr(config, "capacity_factor", None)
        if capacity_factor is None:
            raise CapacityInstallError("no capacity factor: pass capacity_factor= (e.g. 1.0) or load a checkpoint "
                                       "whose config records capacity_factor")
    if not isinstance(capacity_factor, (int, float)) or isinstance(capacity_factor, bool) or capacity_factor <= 0:
        raise CapacityInstallError(f"capacity_factor must be a positive number, got {capacity_factor!r}")
    layers = _decoder_layers(model)
    if capacity_blocks(model):
        raise CapacityInstallError("this model already has expert capacity installed; install it once")
    for index, layer in enumerate(layers):
        block = getattr(layer, "mlp", None)
        # Exactly a router and the routed experts: a block with more (shared experts, a dense
        # branch) has its own forward, which the capacity block would silently drop.
        if not isinstance(block, nn.Module) or {name for name, _ in block.named_children()} != {"gate", "experts"} \
                or not hasattr(block, "top_k") or not hasattr(block.experts, "num_experts"):
            raise CapacityInstallError(f"layer {index} has no Mixtral-style MoE block (exactly mlp.gate and "
                                       "mlp.experts, and mlp.top_k); install_capacity takes a transformers Mixtral")
    nonpadding = _Nonpadding()
    base = getattr(model, "model", model)
    max_length = getattr(config, "max_position_embeddings", None)
    for layer in layers:
        layer.mlp = CapacityMoeBlock(layer.mlp, float(capacity_factor), nonpadding, max_length)
    # The hooks live as long as the model; they only note (and then forget) the forward's mask.
    base.register_forward_pre_hook(nonpadding.before, with_kwargs=True)
    base.register_forward_hook(nonpadding.after, with_kwargs=True, always_call=True)
    if config is not None:
        config.capacity_factor = float(capacity_factor)
    return model


@torch.no_grad()
def active_fraction_per_token(model: nn.Module, input_ids: torch.Tensor,
                              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(batch, seq) float64: the share of the model's parameters each token used in one forward.

    The probe's convention (and the model cards'): every parameter outside the experts counts for
    every token; an expert's parameters count for a token when it kept a slot there. Read from
    the capacity blocks' `dispatch` after one forward of `model` on `input_ids`.

    Raises:
        CapacityInstallError: the model has no capacity installed.
    """
    blocks = capacity_blocks(model)
    if not blocks:
        raise CapacityInstallError("the model has no expert capacity; call install_capacity(model, factor) first")
    total = sum(p.numel() for p in model.parameters())
    per_expert = [sum(p.numel() for p in block.experts.parameters()) // block.num_experts for block in blocks]
    used = torch.full(input_ids.shape, float(total - sum(n * b.num_experts for n, b in zip(per_expert, blocks))),
                      dtype=torch.float64)
    model(input_ids=input_ids, attention_mask=attention_mask)
    for block, params in zip(blocks, per_expert):
        assert block.dispatch is not None  # the forward above set it
        used += block.dispatch.kept.sum(dim=-1).view(input_ids.shape).to(torch.float64).cpu() * params
    return used / total
