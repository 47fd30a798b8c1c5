"""Faults injected into a stand-in engine's routed experts, one at a time, and the count each
should give, counted by plain loops over the arrays exactly as each format sends them (the trace
checks' tests, through the importers and through the proxy)."""

from __future__ import annotations

import numpy as np

FORMATS = ("vllm", "sglang")


def standin_trace():
    """(requests, {(request, choice): (tokens, layers, k) ids}, layers, k, experts) of the STAND-IN
    engine (tests/support/engine_standin.py: a tiny Mixtral in bfloat16, left-padded batches)."""
    from tests.support.engine_standin import engine_standin, fed, token_sequences
    from tests.support.zoo import tiny_model

    model = tiny_model("mixtral")
    requests = token_sequences(seed=3)
    keys = [(r, c) for r, (_, gens) in enumerate(requests) for c in range(len(gens))]
    engine = dict(zip(keys, engine_standin(model, [fed(requests[r][0], requests[r][1][c]) for r, c in keys])))
    config = model.config
    return requests, engine, config.num_hidden_layers, config.num_experts_per_tok, config.num_local_experts


def sent(fmt: str, requests, engine) -> list[np.ndarray]:
    """The arrays a format sends, sequence by sequence: vLLM the prompt's rows once (choice 0's run)
    and each choice's generated rows; SGLang every (prompt, choice) whole."""
    if fmt == "sglang":
        return list(engine.values())
    out = []
    for r, (prompt, generated) in enumerate(requests):
        out.append(engine[(r, 0)][:len(prompt)])
        out += [engine[(r, c)][len(prompt):] for c in range(len(generated))]
    return out


def zero_rows(requests, engine, experts):
    engine[(0, 0)][1:4] = 0  # three prompt rows whose capture never wrote the buffer
    return "zero_rows", lambda arrays: sum(int((~a[:-1].reshape(len(a) - 1, -1).any(axis=1)).sum()) for a in arrays)


def sentinel(requests, engine, experts):
    engine[(0, 0)][1:3] = -1  # two prompt rows vLLM did not compute (prefix-cache hits)
    return "sentinel_rows", lambda arrays: sum(int((a.reshape(len(a), -1) == -1).all(axis=1).sum()) for a in arrays)


def final_row(requests, engine, experts):
    for key in engine:  # verl's zero-filled last token
        engine[key][-1] = 0
    # the last row of each sequence: vLLM's prompt rows are followed by a choice's, so it ends none
    return "final_row_zero", lambda arrays: sum(1 for a in arrays if not a[-1].any() and a is not None)


def repeated(requests, engine, experts):
    engine[(1, 0)][2, 0, 1] = engine[(1, 0)][2, 0, 0]  # a prompt row of layer 0 names one expert twice
    return "repeated_ids", lambda arrays: sum(int((np.sort(a, axis=2)[:, :, 1:] == np.sort(a, axis=2)[:, :, :-1])
                                                  .any(axis=2).sum()) for a in arrays)


def truncated(requests, engine, experts):
    engine[(0, 0)] = engine[(0, 0)][:-2]  # two rows short: choice 0 of request 0
    return "row_count", lambda arrays: 2


def physical(requests, engine, experts):
    # an EPLB map with two redundant slots: physical E is a replica of expert 0, E + 1 of expert 1;
    # the engine returned the physical slot of every other token routed to experts 0 and 1
    for ids in engine.values():
        odd = (np.arange(len(ids)) % 2 == 1)[:, None, None]
        ids[:] = np.where(odd & (ids == 0), experts, np.where(odd & (ids == 1), experts + 1, ids))
    return "physical_ids", lambda arrays: sum(int((a >= experts).sum()) for a in arrays)


FAULTS = [zero_rows, sentinel, final_row, repeated, truncated, physical]
