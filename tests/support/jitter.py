"""A Mixtral with near-tied routers and the token lists the jitter suites run."""

from __future__ import annotations

import torch

from tests.support.zoo import tiny_model

LENGTHS = (5, 9, 12, 7, 3, 16, 11, 14)


def near_tied_mixtral() -> torch.nn.Module:
    """A tiny Mixtral whose routers hold three experts with almost the same weights, made the
    strongest where their shared direction points along the token: the top-2 is then decided among
    them by logit gaps of about 1e-3, under bfloat16's resolution at these magnitudes."""
    model = tiny_model("mixtral")
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            weight = layer.mlp.gate.weight
            weight[0] *= 3
            weight[1] = weight[0] + 1e-3 * torch.randn(weight.shape[1], generator=generator)
            weight[2] = weight[0] + 1e-3 * torch.randn(weight.shape[1], generator=generator)
    return model


def token_lists(seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=generator).tolist() for n in LENGTHS]
