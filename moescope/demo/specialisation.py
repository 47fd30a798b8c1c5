"""How much a MoE model's experts specialise: mutual information between domain and expert.

For every token of some domain-tagged texts we record, per MoE layer, the expert the router
ranks first (argmax of its logits), then measure the normalised mutual information (NMI)
between the token's domain and that expert (`moescope.metrics.signals.normalized_mutual_information`,
the measure the dashboard and the demo show too; here over top-1 choices, the model card's
figure). 0 means the expert choice says nothing about the domain; 1 means each domain has
experts of its own. A router that has learned nothing still scores above 0, because tokens
differ between domains and even random weights send different tokens to different experts,
so the figure is always read against the same config with random weights (:func:`random_twin`).

Routers are read with plain forward hooks on ``model.model.layers[i].mlp.gate`` (Mixtral and
families built the same way) or ``.mlp.router`` (LongCat-Flash), which in ``transformers`` 5.24
return ``(router_logits, ...)``. LongCat's logits cover its zero (identity) experts too, so a
token whose router ranks a zero expert first counts under that zero expert's id (E and above).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moescope.metrics.signals import normalized_mutual_information


def normalized_mutual_info(labels_a: Sequence[int] | np.ndarray, labels_b: Sequence[int] | np.ndarray) -> float:
    """Normalised mutual information between two labellings of the same items (see
    `moescope.metrics.signals.normalized_mutual_information`, the project's one specialisation measure).

    Raises:
        ValueError: the labellings differ in length or are empty.
    """
    a = np.asarray(labels_a).ravel()
    b = np.asarray(labels_b).ravel()
    if a.shape != b.shape:
        raise ValueError(f"labellings differ in length: {a.size} and {b.size}")
    if a.size == 0:
        raise ValueError("labellings are empty: there are no items to compare")
    _, a_codes = np.unique(a, return_inverse=True)
    _, b_codes = np.unique(b, return_inverse=True)
    contingency = np.zeros((a_codes.max() + 1, b_codes.max() + 1), dtype=np.int64)
    np.add.at(contingency, (a_codes, b_codes), 1)
    return normalized_mutual_information(contingency)


def router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router of every MoE layer, in layer order (``model.model.layers[i].mlp.gate``, or
    ``.mlp.router`` for LongCat-Flash).

    Raises:
        ValueError: the model is not laid out like Mixtral or LongCat-Flash (no
            ``model.layers[i].mlp.gate`` or ``.mlp.router``).
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers; expected a Mixtral-style causal LM")
    routers = [getattr(getattr(layer, "mlp", None), "gate", None) or getattr(getattr(layer, "mlp", None), "router",
                                                                             None) for layer in layers]
    found = [router for router in routers if router is not None]
    if len(found) != len(routers):
        raise ValueError(f"{type(model).__name__} has a layer without mlp.gate or mlp.router; expected a "
                         "Mixtral-style or LongCat-Flash MoE")
    return found


def router_width(model: torch.nn.Module) -> int:
    """Choices a router ranks: the routed experts plus any zero (identity) experts."""
    config: Any = model.config  # the model's transformers config, read by its field names
    return int(config.num_local_experts) + int(getattr(config, "zero_expert_num", 0) or 0)


@torch.no_grad()
def domain_expert_counts(model: torch.nn.Module, tokenizer, texts_by_domain: Mapping[str, Sequence[str]]
                         ) -> np.ndarray:
    """Token counts ``[layer, domain, expert]`` of each domain's tokens by top-1 expert (zero
    experts, where the model has them, after the routed ones).

    Domains are in the mapping's order. Each text is tokenised (no special tokens added) and run
    on its own: no padding, so nothing about the batch can change a token's routing (under an
    expert capacity, `moescope.demo.capacity`, a padded row would get the capacity of its padded length).

    Raises:
        ValueError: no texts, or the model is not Mixtral-style (see :func:`router_modules`).
    """
    routers = router_modules(model)
    num_experts = router_width(model)
    counts = np.zeros((len(routers), len(texts_by_domain), num_experts), dtype=np.int64)
    if not any(texts_by_domain.values()):
        raise ValueError("no texts to route; give at least one text for one domain")
    device = next(model.parameters()).device
    top1_per_layer: list[torch.Tensor | None] = [None] * len(routers)

    def recorder(layer: int):
        def hook(module: torch.nn.Module, inputs: tuple, output) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            top1_per_layer[layer] = logits.argmax(dim=-1)
        return hook

    handles = [router.register_forward_hook(recorder(i)) for i, router in enumerate(routers)]
    was_training = model.training
    model.eval()
    try:
        for domain_index, texts in enumerate(texts_by_domain.values()):
            for text in texts:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                if not ids:
                    continue
                model(input_ids=torch.tensor([ids], device=device))
                for layer, top1 in enumerate(top1_per_layer):
                    assert top1 is not None  # every router ran in the forward
                    counts[layer, domain_index] += np.bincount(top1.reshape(-1).cpu().numpy(), minlength=num_experts)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return counts


def random_twin(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A model of the same class and config as `model` with fresh random weights, in eval mode."""
    torch.manual_seed(seed)
    twin = type(model)(copy.deepcopy(model.config))
    return twin.to(next(model.parameters()).device).eval()


@dataclass
class SpecialisationReport:
    """Domain/expert NMI per MoE layer for a model and for its random-weight twin."""

    domains: tuple[str, ...]
    trained_nmi: list[float]
    random_nmi: list[float]
    tokens_per_domain: dict[str, int]
    # [layer, domain, expert] top-1 counts of the trained model, for figures and the model card.
    trained_counts: np.ndarray = field(repr=False)

    def favourite_experts(self) -> list[dict[str, tuple[int, float]]]:
        """Per layer, each domain's most chosen top-1 expert and the share of its tokens it gets."""
        favourites = []
        for layer_counts in self.trained_counts:
            per_domain = {}
            for domain, row in zip(self.domains, layer_counts):
                expert = int(row.argmax())
                per_domain[domain] = (expert, float(row[expert] / max(row.sum(), 1)))
            favourites.append(per_domain)
        return favourites


def measure_specialisation(model: torch.nn.Module, tokenizer, texts_by_domain: Mapping[str, Sequence[str]],
                           random_seed: int = 0) -> SpecialisationReport:
    """NMI between domain and top-1 expert per layer, for `model` and for its random twin.

    Raises:
        ValueError: as :func:`domain_expert_counts`.
    """
    trained_counts = domain_expert_counts(model, tokenizer, texts_by_domain)
    random_counts = domain_expert_counts(random_twin(model, random_seed), tokenizer, texts_by_domain)
    domains = tuple(texts_by_domain)
    return SpecialisationReport(
        domains=domains,
        trained_nmi=[normalized_mutual_information(layer) for layer in trained_counts],
        random_nmi=[normalized_mutual_information(layer) for layer in random_counts],
        tokens_per_domain={d: int(n) for d, n in zip(domains, trained_counts[0].sum(axis=1))},
        trained_counts=trained_counts,
    )
