"""A Mixtral with near-tied routers, the token lists the jitter suites run, and the store the mismatch
suites read (the dashboard page's unit tests and its browser test)."""

from __future__ import annotations

import os

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


def mismatch_store(folder) -> tuple[str, dict[tuple[int, int], list[int]]]:
    """(root, the token ids fed per (request, choice)) of a store in `folder` where the mismatch check
    (run "mm") compared a STAND-IN engine (tests/support/engine_standin.py: the near-tied Mixtral in
    bfloat16 and another batch layout, written as vLLM responses and imported as run "engine") with
    the float32 model."""
    import moescope
    from moescope.ingest.importers import import_files
    from tests.support.engine_standin import engine_standin, fed, token_sequences, vllm_responses

    model = near_tied_mixtral()
    requests = token_sequences(seed=3)
    keys = [(r, c) for r, (_, gens) in enumerate(requests) for c in range(len(gens))]
    sequences = {key: fed(requests[key[0]][0], requests[key[0]][1][key[1]]) for key in keys}
    engine = dict(zip(keys, engine_standin(model, [sequences[key] for key in keys])))
    responses = os.path.join(str(folder), "vllm.jsonl")
    with open(responses, "w") as f:
        f.write(vllm_responses(requests, engine))
    root = os.path.join(str(folder), "store")
    import_files("vllm", [responses], root, run_id="engine")
    moescope.mismatch(model, store=root, run="engine", run_id="mm")
    return root, sequences
