"""A STAND-IN for an inference engine (vLLM, SGLang cannot run here) and the oracle the mismatch tests use.

The stand-in runs the reference model itself under what an engine changes: a copy cast to
bfloat16 and another batch layout (left-padded batches of three), reads the router logits the
model returns (`output_router_logits=True`) and takes each token's top-k with `torch.topk`, as
Mixtral's router does (slot 0 the top-1). Its routing is then written in vLLM's and SGLang's
response formats, for the real importers to read. The oracle is the reference model in float32,
each sequence alone, read the same way; nothing here uses moescope's capture or comparison code.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import os

import numpy as np
import torch


def routed(model, sequences: list[list[int]], batch_size: int = 1, side: str = "right",
           dtype: torch.dtype | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per sequence: (ids (tokens, layers, k) int64 from torch.topk of the softmax, logits (tokens,
    layers, E) float64), from the model's own router logits; `dtype` runs a cast copy."""
    if dtype is not None:
        model = copy.deepcopy(model).to(dtype)
    k = model.config.num_experts_per_tok
    out = []
    with torch.no_grad():
        for first in range(0, len(sequences), batch_size):
            batch = sequences[first:first + batch_size]
            length = max(map(len, batch))
            ids = torch.zeros((len(batch), length), dtype=torch.long)
            mask = torch.zeros((len(batch), length), dtype=torch.long)
            starts = []
            for row, seq in enumerate(batch):
                start = length - len(seq) if side == "left" else 0
                ids[row, start:start + len(seq)] = torch.tensor(seq)
                mask[row, start:start + len(seq)] = 1
                starts.append(start)
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
            result = model(input_ids=ids, attention_mask=mask, position_ids=positions, output_router_logits=True,
                           use_cache=False)
            per_layer = [logits.reshape(len(batch), length, -1) for logits in result.router_logits]
            for row, seq in enumerate(batch):
                rows = slice(starts[row], starts[row] + len(seq))
                logits = torch.stack([layer[row, rows].float() for layer in per_layer], dim=1)  # (T, L, E)
                chosen = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1).indices
                out.append((chosen.numpy().astype(np.int64), logits.double().numpy()))
    return out


def engine_standin(model, sequences: list[list[int]]) -> list[np.ndarray]:
    """The stand-in engine's expert ids per sequence, (tokens, layers, k): bfloat16, left-padded
    batches of three."""
    return [ids for ids, _ in routed(model, sequences, batch_size=3, side="left", dtype=torch.bfloat16)]


def token_sequences(seed: int, prompts: int = 4, choices: int = 2) -> list[tuple[list[int], list[list[int]]]]:
    """Requests: (prompt ids, [generated ids of each choice]), of varied lengths, ids 1..127."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for number in range(prompts):
        prompt = torch.randint(1, 128, (5 + 3 * number,), generator=generator).tolist()
        generated = [torch.randint(1, 128, (4 + 2 * c + number,), generator=generator).tolist()
                     for c in range(choices)]
        out.append((prompt, generated))
    return out


def fed(prompt: list[int], generated: list[int]) -> list[int]:
    """The tokens an engine runs forwards on: the prompt and every generated token but the last."""
    return prompt + generated[:-1]


def _npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def vllm_responses(requests, routing: dict[tuple[int, int], np.ndarray]) -> str:
    """JSON Lines of vLLM OpenAI-style responses with routed experts (`--enable-return-routed-experts`):
    per request the prompt's rows once (`prompt_routed_experts`, choice 0's run) and each choice's
    generated rows (one fewer than its tokens); ids and routing as base64 `.npy` and nested lists.
    `routing[(request, choice)]` is the stand-in's (tokens, layers, k) for `fed(prompt, choice)`."""
    lines = []
    for number, (prompt, generated) in enumerate(requests):
        p = len(prompt)
        choices = []
        for c, gen in enumerate(generated):
            own = routing[(number, c)][p:].astype(np.int16)
            choices.append({"index": c, "text": "", "token_ids": gen, "finish_reason": "length",
                            "routed_experts": _npy_b64(own) if c % 2 else own.tolist()})
        lines.append(json.dumps({
            "id": f"cmpl-{number}", "object": "text_completion", "created": 1_700_000_000 + number, "model": "standin",
            "prompt_token_ids": prompt, "prompt_routed_experts": routing[(number, 0)][:p].tolist(),
            "choices": choices, "usage": {"prompt_tokens": p, "completion_tokens": len(generated[0])}}))
    return "\n".join(lines) + "\n"


def sglang_responses(requests, routing: dict[tuple[int, int], np.ndarray]) -> str:
    """JSON Lines of SGLang `/generate` outputs (`--enable-return-routed-experts`): one request per
    (prompt, choice), `meta_info.routed_experts` base64 of little-endian int32 (prompt + completion - 1,
    layers, k). SGLang's body carries no prompt ids: the test gives them beside the run."""
    lines = []
    for number, (prompt, generated) in enumerate(requests):
        for c, gen in enumerate(generated):
            ids = routing[(number, c)].astype("<i4")
            lines.append(json.dumps({"text": "", "output_ids": gen, "meta_info": {
                "id": f"req-{number}-{c}", "prompt_tokens": len(prompt), "completion_tokens": len(gen),
                "routed_experts": base64.b64encode(ids.tobytes()).decode()}}))
    return "\n".join(lines) + "\n"


# -- log-probs: engine STAND-INs whose only difference from the reference is known -------------

def _gate_hooks(model, choose=None):
    """Forward hooks on every Mixtral router (`mlp.gate`): record its chosen experts per forward and,
    where `choose[layer]` is given, replace its choice by `choose[layer](probs)` with the weights by
    Mixtral's own rule (softmax over every expert, the chosen ones' probabilities renormalised)."""
    records: dict[int, list] = {}
    handles = []
    for index, layer in enumerate(model.model.layers):
        def hook(module, args, output, index=index):
            logits = output[0]
            if choose and index in choose:
                probs = torch.softmax(logits.float(), dim=-1)
                ids = choose[index](probs)
                weights = probs.gather(-1, ids)
                output = (logits, weights / weights.sum(dim=-1, keepdim=True), ids)
            records.setdefault(index, []).append(output[2].detach().clone())
            return output
        handles.append(layer.mlp.gate.register_forward_hook(hook))
    return records, handles


def first_and_third(probs):
    """A perturbed router's choice: its first and third expert in place of its top-2 (what a bias on
    the selection does to near-ties), for every token."""
    order = torch.topk(probs, 3, dim=-1).indices
    return order[:, [0, 2]]


def standin_run(model, sequences: list[list[int]], generated_from: list[int], choose=None,
                dtype: torch.dtype | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """An engine STAND-IN run, each sequence alone: the reference model (cast to `dtype` where
    given) with the routers of `choose` replaced (`_gate_hooks`). Per sequence: (expert ids (tokens,
    layers, k), log-probs of tokens generated_from.. in float32 from its logits)."""
    if dtype is not None:
        model = copy.deepcopy(model).to(dtype)
    out = []
    with torch.no_grad():
        for seq, first in zip(sequences, generated_from):
            records, handles = _gate_hooks(model, choose)
            try:
                ids = torch.tensor([seq])
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                               position_ids=torch.arange(len(seq))[None], use_cache=False).logits[0].float()
            finally:
                for handle in handles:
                    handle.remove()
            routing = torch.stack([records[i][0] for i in sorted(records)], dim=1).numpy().astype(np.int64)
            logp = torch.log_softmax(logits, dim=-1)
            positions = range(first, len(seq))
            out.append((routing, np.array([float(logp[p - 1, seq[p]]) for p in positions])))
    return out


def vllm_logprob_responses(requests, routing: dict[tuple[int, int], np.ndarray],
                           logprobs: dict[tuple[int, int], list[float]]) -> str:
    """`vllm_responses` with each choice's `logprobs` as vLLM's completions server writes them
    (`CompletionLogProbs`: token_logprobs one per generated token, tokens, text_offset, top_logprobs)."""
    lines = []
    for line in vllm_responses(requests, routing).splitlines():
        body = json.loads(line)
        number = int(body["id"].split("-")[1])
        for choice in body["choices"]:
            values = logprobs[(number, choice["index"])]
            choice["logprobs"] = {"token_logprobs": values, "tokens": [""] * len(values),
                                  "text_offset": [0] * len(values), "top_logprobs": None}
        lines.append(json.dumps(body))
    return "\n".join(lines) + "\n"


def routing_sensitive_mixtral():
    """The zoo's tiny Mixtral with its experts' weights times 8: which experts a token takes then
    moves its log-probs by a few hundredths of a nat (k3 KL ~ 3e-3, the order R3 and AReaL report)."""
    from tests.support.zoo import tiny_model

    model = tiny_model("mixtral")
    with torch.no_grad():
        for layer in model.model.layers:
            for weight in layer.mlp.experts.parameters():
                weight.mul_(8)
    return model


def logprob_engine(model, tmp_path, choose=None, dtype=None):
    """A store in `tmp_path` holding run "engine": an engine STAND-IN (`standin_run`: `model` with the
    routers of `choose` replaced, or cast to `dtype`) over `token_sequences(seed=4, prompts=3)`, its
    routing and log-probs written as vLLM completions responses and imported. Returns (root,
    requests, full sequences, routing of the fed tokens, log-probs) keyed (request, choice)."""
    requests = token_sequences(seed=4, prompts=3)
    keys = [(r, c) for r, (_, gens) in enumerate(requests) for c in range(len(gens))]
    full = {key: requests[key[0]][0] + requests[key[0]][1][key[1]] for key in keys}
    runs = dict(zip(keys, standin_run(model, [full[k] for k in keys], [len(requests[k[0]][0]) for k in keys],
                                      choose=choose, dtype=dtype)))
    routing = {key: runs[key][0][:len(full[key]) - 1] for key in keys}  # the fed tokens': all but the last
    logprobs = {key: runs[key][1].tolist() for key in keys}
    path = os.path.join(tmp_path, "vllm.jsonl")
    with open(path, "w") as f:
        f.write(vllm_logprob_responses(requests, routing, logprobs))
    root = os.path.join(tmp_path, "store")
    from moescope.ingest.importers import import_files

    import_files("vllm", [path], root, run_id="engine")
    return root, requests, full, routing, logprobs
