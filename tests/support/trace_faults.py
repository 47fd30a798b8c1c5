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


def redundant_map(experts: int, layers: int) -> list[list[int]]:
    """The map `physical` returns ids under, one row per MoE layer (vLLM's shape): slots 0..E-1 hold
    their own expert, slot E a copy of expert 0 and E + 1 one of expert 1."""
    return [[*range(experts), 0, 1] for _ in range(layers)]


def physical(requests, engine, experts):
    # an EPLB map with two redundant slots: physical E is a replica of expert 0, E + 1 of expert 1;
    # the engine returned the physical slot of every other token routed to experts 0 and 1
    for ids in engine.values():
        odd = (np.arange(len(ids)) % 2 == 1)[:, None, None]
        ids[:] = np.where(odd & (ids == 0), experts, np.where(odd & (ids == 1), experts + 1, ids))
    return "physical_ids", lambda arrays: sum(int((a >= experts).sum()) for a in arrays)


FAULTS = [zero_rows, sentinel, final_row, repeated, truncated, physical]


def load_sorted_map(arrays: list[np.ndarray], experts: int, redundant: int = 0) -> list[list[int]]:
    """A map as an EPLB rearrangement makes one from the load, a row per MoE layer: slot p holds the
    expert of p-th largest load in `arrays` (ties to the lower id), then `redundant` slots holding
    copies of the hottest experts. It moves experts whose loads differ, which is what makes physical
    ids tell in their counts."""
    load = np.array(slot_loads(arrays, experts))
    rows = []
    for layer_load in load:
        hottest = sorted(range(experts), key=lambda e: (-layer_load[e], e))
        rows.append(hottest + hottest[:redundant])
    return rows


def to_physical(ids: np.ndarray, mapping: list[list[int]]) -> np.ndarray:
    """A trace's logical ids as an engine returns physical ones under `mapping`: each routed (row,
    layer, slot) goes to a copy of its expert, the copies taken in turn by (row x k + slot) as vLLM
    picks them; all-zero and -1 rows stay as they are."""
    out = ids.copy()
    rows, layers, k = ids.shape
    for layer in range(layers):
        copies: dict[int, list[int]] = {}
        for slot, expert in enumerate(mapping[layer]):
            copies.setdefault(expert, []).append(slot)
        for row in range(rows):
            if ids[row, layer].any() and (ids[row, layer] >= 0).all():
                for slot in range(k):
                    mine = copies[int(ids[row, layer, slot])]
                    out[row, layer, slot] = mine[(row * k + slot) % len(mine)]
    return out


def slot_loads(arrays: list[np.ndarray], slots: int) -> list[list[int]]:
    """Per layer, how often each id is named over the routed rows of `arrays`: what an engine counts
    per physical slot (vLLM's expert_load_window, SGLang's global_physical_count) over its trace."""
    layers = arrays[0].shape[1]
    load = np.zeros((layers, slots), dtype=np.int64)
    for a in arrays:
        for row in a:
            for layer in range(layers):
                if row[layer].any() and (row[layer] >= 0).all():
                    for expert in row[layer]:
                        load[layer, int(expert)] += 1
    return load.tolist()


def misread_slots(arrays: list[np.ndarray], mapping: list[list[int]]) -> int:
    """Slots of routed rows whose id names a physical slot holding another logical expert."""
    count = 0
    for a in arrays:
        for row in a:
            for layer in range(a.shape[1]):
                if row[layer].any() and (row[layer] >= 0).all():
                    count += sum(1 for e in row[layer] if mapping[layer][int(e)] != int(e))
    return count
