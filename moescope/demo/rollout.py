"""The demo's rollout, as an inference engine would serve it, measured against the trainer's model.

An RL loop samples with an engine and trains with another stack. The demo plays both on its own
model: the "engine" is a STAND-IN (vLLM cannot run here): the demo model cast to bfloat16, run on
left-padded batches of `ENGINE_BATCH` sequences (another batch shape than the trainer's). It
samples (`generate`, every prompt in one batch) a few continuations of held-out prompts and
returns what vLLM returns with `--enable-return-routed-experts` and `logprobs`: the prompt's and
each completion's routed experts and the sampled tokens' log-probs, written as vLLM completions
responses (JSON Lines) and imported with the real importer (`moescope import vllm`). The trainer
is the float32 demo model: `moescope.mismatch` compares its routing with the engine's and
measures the log-prob gap with its own routing and with the engine's replayed
(`moescope.analyses.logprob_gap`), every layer left out in turn. The results are the store's
engine run and mismatch run, which the Engine vs reference page shows.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from moescope.probe.adapters import find_moe_layers
from moescope.probe.capture import RoutingCapture

# the rollout's runs: `<new run id>-rollout-engine` and `-rollout-mismatch`, made before the story's run
# starts, so they sort and start before it (the dashboard opens the story)
ROLLOUT_SUFFIXES = ("-rollout-engine", "-rollout-mismatch")
ENGINE_BATCH = 3  # sequences per engine forward, left-padded (the trainer runs its own batches, right-padded)
PROMPT_TOKENS, NEW_TOKENS = 24, 16


@dataclass
class Rollout:
    """What the demo's rollout measured: the mismatch line, the log-prob gap line, and the figures."""

    engine_run: str
    mismatch_run: str
    mismatch_line: str
    gap_line: str
    k3_reference: float
    k3_replay: float
    removed_share: float
    tokens: int


def _engine_forward(engine: nn.Module, capture: RoutingCapture, batch: list[list[int]], pad: int
                    ) -> tuple[torch.Tensor, list[list[np.ndarray]], list[int]]:
    """One left-padded forward of the engine stand-in: (logits, per sequence per layer expert ids, starts)."""
    length = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), length), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    starts = []
    for row, ids in enumerate(batch):
        start = length - len(ids)
        input_ids[row, start:] = torch.tensor(ids)
        mask[row, start:] = 1
        starts.append(start)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    logits = engine(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    layers = capture.take()
    routing = [[layer.ids[row * length + starts[row] + np.arange(len(ids))] for layer in layers]
               for row, ids in enumerate(batch)]
    return logits, routing, starts


def engine_responses(model: nn.Module, prompts: list[list[int]], seed: int, pad: int) -> str:
    """The engine stand-in's responses (vLLM completions JSON Lines, one per prompt): in bfloat16,
    left-padded batches of ENGINE_BATCH, it samples NEW_TOKENS tokens per prompt (`generate`, seeded,
    the caller's random state left as it was), then scores each sequence in one forward, as a
    prefill, and returns the routed experts of every token it fed and the log-prob of every token it
    sampled, both from that forward (the demo model's capacity is per sequence: a decode step, which
    sees only the tokens so far, routes and scores differently)."""
    engine: Any = copy.deepcopy(model).to(torch.bfloat16).eval()
    layers = find_moe_layers(engine)
    lines = []
    with torch.no_grad():
        with torch.random.fork_rng():  # one batch of every prompt: decode steps are what a CPU pays for
            torch.manual_seed(seed)
            length = max(map(len, prompts))
            ids = torch.tensor([[pad] * (length - len(p)) + list(p) for p in prompts])
            mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
            out = engine.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS, top_k=0, top_p=1.0, pad_token_id=pad)
            sampled = [list(p) + out[row, length:].tolist() for row, p in enumerate(prompts)]
    with torch.no_grad(), RoutingCapture(layers) as capture:
        for first in range(0, len(prompts), ENGINE_BATCH):
            sequences = sampled[first:first + ENGINE_BATCH]
            logits, routing, starts = _engine_forward(engine, capture, [s[:-1] for s in sequences], pad)
            for row, seq in enumerate(sequences):
                number = first + row
                experts = np.stack(routing[row], axis=1).astype(np.int16)  # (fed tokens, layers, k)
                prompt = prompts[number]
                scores = torch.log_softmax(logits[row, starts[row]:].float(), dim=-1)
                fed = torch.arange(len(prompt) - 1, len(seq) - 1)
                chosen = torch.tensor(seq[len(prompt):])
                logprobs = scores[fed, chosen].tolist()
                lines.append(json.dumps({
                    "id": f"cmpl-demo-{number}", "object": "text_completion", "created": 1_700_000_000 + number,
                    "model": "moescope-demo (bfloat16 engine stand-in)", "prompt_token_ids": prompt,
                    "prompt_routed_experts": experts[:len(prompt)].tolist(),
                    "choices": [{"index": 0, "text": "", "token_ids": seq[len(prompt):], "finish_reason": "length",
                                 "routed_experts": experts[len(prompt):].tolist(),
                                 "logprobs": {"token_logprobs": logprobs, "tokens": [""] * NEW_TOKENS,
                                              "text_offset": [0] * NEW_TOKENS, "top_logprobs": None}}],
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": NEW_TOKENS}}))
    return "\n".join(lines) + "\n"


def play_rollout(model: nn.Module, prompts: list[list[int]], store_root: str, seed: int, pad: int) -> Rollout:
    """Sample the rollout with the engine stand-in, import it, and measure it against `model`
    (float32) with `moescope.mismatch`, per layer. Returns the figures the story prints."""
    from moescope.analyses.mismatch import mismatch
    from moescope.core.runs import new_run_id
    from moescope.ingest.importers import import_files

    stamp = new_run_id()
    engine_run, mismatch_run = (stamp + suffix for suffix in ROLLOUT_SUFFIXES)

    path = os.path.join(store_root, "engine_rollout.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write(engine_responses(model, prompts, seed, pad))
    import_files("vllm", [path], store_root, run_id=engine_run, tags={"phase": "rollout"})
    report = mismatch(model, store=store_root, run=engine_run, run_id=mismatch_run, per_layer=True)
    gap = report.gap
    if gap is None:
        raise RuntimeError("the demo's engine stand-in returned no log-probs")
    own, replay = gap.figures("reference"), gap.figures("replay")
    assert own is not None and replay is not None  # a gap report holds both
    return Rollout(engine_run, mismatch_run, report.line(), gap.line(), float(own.k3_mean), float(replay.k3_mean),
                   gap.removed_share, int(own.tokens))
