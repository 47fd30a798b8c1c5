"""What the jitter and mismatch checks share: running a model's forwards to read its routing, and
comparing two routings of the same tokens.

Both checks feed a model padded batches the way a server does (`forward_routing`: an attention
mask, position ids from `generate_position_ids`, the pad id of `pad_id`, no cache) and read each
token's chosen experts and router logits (`moescope.probe.capture.RoutingCapture`). They compare
with the same rules: a token's top-1 is its chosen expert of highest router logit (`top1_expert`),
its margin is in router logits (`margins`), and margins are counted per bin of `MARGIN_EDGES`
(`margin_histogram`). Against an engine's trace, the reference router's own rule (`RouterRule`,
read from its module by `router_rule`) says whether the engine's slot 0 is its top-1
(`engine_top1`) and on what the router decides (`decision_margin`). A listed token keeps
`CONTEXT_BEFORE` and `CONTEXT_AFTER` neighbours, and its expert sets read as `expert_change` writes them.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from moescope.probe.capture import LayerRouting, RoutingCapture

__all__ = [
    "BIASED_SCORE_KIND", "CONTEXT_AFTER", "CONTEXT_BEFORE", "MARGIN_EDGES", "MARGIN_KIND", "RouterRule", "RoutingError",
    "decision_margin", "engine_top1", "expert_change", "forward_routing", "generate_position_ids", "margin_histogram",
    "margins", "pad_id", "router_rule", "top1_expert",
]

# Lower edges of the margin histogram's bins, in router logits (the last bin is open).
MARGIN_EDGES: tuple[float, ...] = (0.0, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)
MARGIN_KIND = "logit"
BIASED_SCORE_KIND = "biased score"  # DeepSeek-V3-style: sigmoid(logit) + correction bias
CONTEXT_BEFORE, CONTEXT_AFTER = 8, 4  # neighbours kept beside a listed token


class RoutingError(ValueError):
    """A model's routing cannot be read one router row per input token (an encoder-decoder's)."""


# -- running -----------------------------------------------------------------------------------

def _accepts(model: nn.Module, name: str) -> bool:
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def generate_position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a padded batch as transformers' `generate` builds them from its attention mask
    (`GenerationMixin._prepare_position_ids_for_generation`, transformers 5.24): each real token
    counts from its row's first real token, 0-based, and every pad slot gets position 0
    (`(mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)`). Pad tokens are routed too, so their
    positions change how a batch's tokens group per expert: the jitter check's batches and the
    mismatch check's reference batches are both fed by this one rule. Returns a long tensor of
    `mask`'s shape."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def forward_routing(model: nn.Module, capture: RoutingCapture, batch: Sequence[Sequence[int]], side: str,
                    pad_id: int, device: torch.device) -> list[list[LayerRouting]]:
    """One forward of `batch` padded on `side` (attention mask, `generate_position_ids`, no cache);
    per input, per layer, the routing of its real tokens. Raises RoutingError where a router does not
    see one row per token (an encoder-decoder's)."""
    length = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    starts = []
    for row, ids in enumerate(batch):
        start = length - len(ids) if side == "left" else 0
        input_ids[row, start:start + len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
        mask[row, start:start + len(ids)] = 1
        starts.append(start)
    kwargs: dict[str, Any] = {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}
    if _accepts(model, "position_ids"):
        kwargs["position_ids"] = generate_position_ids(mask).to(device)
    if _accepts(model, "use_cache"):
        kwargs["use_cache"] = False
    model(**kwargs)
    layers = capture.take()
    out: list[list[LayerRouting]] = []
    for row, ids in enumerate(batch):
        rows = np.arange(len(ids)) + row * length + starts[row]
        per_layer = []
        for routing in layers:
            if routing.logits.shape[0] != len(batch) * length:
                raise RoutingError(f"a router saw {routing.logits.shape[0]} token rows in a forward of "
                                  f"{len(batch)} x {length} tokens: the check needs one router row per "
                                  "token (decoder-only models)")
            per_layer.append(LayerRouting(routing.logits[rows], routing.ids[rows], routing.weights[rows],
                                          routing.kept[rows]))
        out.append(per_layer)
    return out


def pad_id(model: nn.Module, tokenizer: Any = None) -> int:
    """The id a padded batch fills its pad slots with: the tokenizer's or config's pad token, else their
    end-of-sequence token, else 0 (a pad slot is masked out; its id only changes how it routes)."""
    config = getattr(model, "config", None)
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(config, "pad_token_id", None),
                  getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            return value
    return 0



# -- comparing ---------------------------------------------------------------------------------

def top1_expert(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Of each token's chosen experts, the one with the highest router logit (a tie, as bfloat16 rounds
    logits together, goes to the earlier slot: the router's own order)."""
    return ids[np.arange(len(ids)), np.take_along_axis(logits, ids, axis=1).argmax(axis=1)]


def margins(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(top-k margin, top-1 margin) per token, in logits: the k-th largest logit minus the (k+1)-th,
    and the largest minus the second (inf where the router has no (k+1)-th slot)."""
    ordered = -np.sort(-logits.astype(np.float64), axis=1)
    width = ordered.shape[1]
    topk = ordered[:, k - 1] - ordered[:, k] if width > k else np.full(len(ordered), np.inf)
    top1 = ordered[:, 0] - ordered[:, 1] if width > 1 else np.full(len(ordered), np.inf)
    return topk, top1


@dataclass(frozen=True)
class RouterRule:
    """What comparing an engine's trace needs of the reference layer's routing rule.

    Attributes:
        ranked: the engine's slot 0 is its top-1. True for a plain top-k (Mixtral, Qwen: vLLM's
            `fused_topk` and SGLang's `fused_topk` return the top-k in score order). False for a
            grouped or biased router (DeepSeek-V2/V3 style): vLLM's `grouped_topk` and its biased
            top-k call `torch.topk(..., sorted=VLLM_BATCH_INVARIANT)`, off by default, and SGLang's
            `grouped_topk` and `biased_grouped_topk` sort only with fused shared experts
            (`sorted=num_fused_shared_experts > 0`): their slot order is the kernel's, not the scores'.
        bias: the router's `e_score_correction_bias` (E,), or None: the choice is then on the logits
            (a softmax router: softmax keeps the logits' order within a token).
        groups: expert groups (`n_group`); the choice is made among the experts of the best `topk_group`.
        topk_group: groups kept per token.
        group_score: how a group is ranked: "top2", the sum of its two best scores (DeepSeek-V3 and
            the biased routers after it; Mistral 4's softmax router, on probabilities), or "max", its
            best score (DeepSeek-V2's `group_limited_greedy`).
    """

    ranked: bool = True
    bias: np.ndarray | None = None
    groups: int = 1
    topk_group: int = 1
    group_score: str = "top2"

    @property
    def margin_kind(self) -> str:
        """The unit of `decision_margin`: "logit", or "biased score" for a biased router."""
        return MARGIN_KIND if self.bias is None else BIASED_SCORE_KIND


def router_rule(router: nn.Module) -> RouterRule:
    """The rule of a router module, read from what transformers' grouped and biased routers hold
    (DeepSeek-V2/V3, GLM-4-MoE, dots1, Mistral 4: `num_group`, `topk_group`, `e_score_correction_bias`,
    DeepSeek-V2's `topk_method`: "greedy" ignores the groups, "group_limited_greedy" ranks them by
    their best score)."""
    bias = getattr(router, "e_score_correction_bias", None)
    groups = getattr(router, "num_group", getattr(router, "n_group", None))
    if bias is None and groups is None:
        return RouterRule()
    values = None if bias is None else bias.detach().float().cpu().numpy().astype(np.float64)
    method = getattr(router, "topk_method", None)
    if method == "greedy":  # DeepSeek-V2's plain top-k over the softmax: n_group is not read
        groups = 1
    return RouterRule(ranked=False, bias=values, groups=int(groups or 1),
                      topk_group=int(getattr(router, "topk_group", None) or 1),
                      group_score="max" if method == "group_limited_greedy" else "top2")


def engine_top1(engine_ids: np.ndarray, logits: np.ndarray, rule: RouterRule) -> np.ndarray:
    """The engine's top-1 per token: its slot 0 where the rule promises a sorted top-k, else, of the
    engine's chosen experts, the one with the highest reference logit (`top1_expert`): an engine
    whose slots are a permutation of the reference's set then has the reference's top-1."""
    return engine_ids[:, 0] if rule.ranked else top1_expert(logits, engine_ids)


def decision_margin(logits: np.ndarray, k: int, rule: RouterRule) -> np.ndarray:
    """The router's top-k decision margin per token, on what it chooses by: its logits (a softmax
    router: softmax keeps their order), or sigmoid(logit) + bias for a biased router
    (DeepSeek-V3's `DeepseekV3TopkRouter`). An ungrouped router's margin is the k-th score minus the
    (k+1)-th (`margins`' top-k margin for logits). A grouped router (`RouterRule.groups` > 1) ranks
    its groups (`RouterRule.group_score`; a softmax router's sum of two probabilities in logits is
    the log of the sum of their exponentials: the softmax's denominator cancels between groups),
    keeps the best `topk_group` and takes its top-k among their experts, so two decisions can flip
    its choice, and the margin is the smaller of their gaps:

    - within the kept groups: the k-th score minus the best unchosen one (inf where they hold only
      k experts);
    - between groups: a kept group's score minus a dropped group's, for each pair whose exchange
      (the dropped group kept instead) changes the chosen experts. A flip to an expert of a group
      that is far from being kept is no near-tie, however close its score to a chosen one's.
    """
    scores = logits.astype(np.float64)
    if rule.bias is not None:
        scores = 1.0 / (1.0 + np.exp(-scores)) + rule.bias
    tokens, experts = scores.shape
    if rule.groups <= 1 or rule.topk_group >= rule.groups:
        ordered = -np.sort(-scores, axis=1)
        return ordered[:, k - 1] - ordered[:, k] if experts > k else np.full(tokens, np.inf)
    size = experts // rule.groups
    per_group = -np.sort(-scores.reshape(tokens, rule.groups, size), axis=2)
    if rule.group_score == "max":
        group = per_group[:, :, 0]
    elif rule.bias is None:  # softmax probabilities, in logits
        group = np.logaddexp(per_group[:, :, 0], per_group[:, :, 1]) if size > 1 else per_group[:, :, 0]
    else:
        group = per_group[:, :, :2].sum(axis=2)
    ranked = np.argsort(-group, axis=1, kind="stable")
    kept = ranked[:, :rule.topk_group]
    chosen, within = _top_within(scores, kept, rule.groups, k)
    margin = within
    rows = np.arange(tokens)
    for i in range(rule.topk_group):
        for j in range(rule.topk_group, rule.groups):
            exchanged = kept.copy()
            exchanged[:, i] = ranked[:, j]
            changes = (_top_within(scores, exchanged, rule.groups, k)[0] != chosen).any(axis=1)
            gap = group[rows, kept[:, i]] - group[rows, ranked[:, j]]
            margin = np.where(changes, np.minimum(margin, gap), margin)
    return margin


def _top_within(scores: np.ndarray, kept: np.ndarray, groups: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(the k chosen experts, sorted; the k-th score minus the (k+1)-th) among the experts of the
    `kept` groups of each token (inf where they hold only k experts)."""
    tokens, experts = scores.shape
    mask = np.zeros((tokens, groups), dtype=bool)
    np.put_along_axis(mask, kept, True, axis=1)
    candidates = np.where(np.repeat(mask, experts // groups, axis=1), scores, -np.inf)
    order = np.argsort(-candidates, axis=1, kind="stable")
    chosen = np.sort(order[:, :k], axis=1)
    ordered = np.take_along_axis(candidates, order, axis=1)
    if experts <= k:
        return chosen, np.full(tokens, np.inf)
    return chosen, ordered[:, k - 1] - ordered[:, k]  # -inf - x: inf where the kept groups hold only k experts


def margin_histogram(values: np.ndarray) -> np.ndarray:
    """Counts per bin of MARGIN_EDGES (bin i holds edges[i] <= margin < edges[i+1])."""
    bins = np.searchsorted(np.asarray(MARGIN_EDGES), values, side="right") - 1
    return np.bincount(np.clip(bins, 0, None), minlength=len(MARGIN_EDGES))[:len(MARGIN_EDGES)].astype(np.int64)


def expert_change(before: Sequence[int], after: Sequence[int], arrow: str = "->") -> str:
    """A listed token's expert sets as `[2, 4] -> [4, 6]`, each sorted, as plain integers (the
    stored lists come back as numpy integers, whose repr is `np.int32(2)`)."""
    def ids(values: Sequence[int]) -> str:
        return "[" + ", ".join(str(int(v)) for v in sorted(values)) + "]"

    return f"{ids(before)} {arrow} {ids(after)}"
