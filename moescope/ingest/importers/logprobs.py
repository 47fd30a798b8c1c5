"""The sampled tokens' log-probs, as vLLM and SGLang return them in the responses the importers and
the proxy already parse (the engine's "behaviour" log-probs an RL trainer compares its own with).

- vLLM, `/v1/completions` with `logprobs=N` (`CompletionLogProbs`,
  vllm/entrypoints/openai/completion/protocol.py): `choices[i].logprobs.token_logprobs`, one float
  (or null) per token of `choices[i].token_ids`; with `echo` the prompt's tokens come first (the
  first one null), so a list longer than the generated tokens by the prompt's length keeps its tail.
- vLLM, `/v1/chat/completions` with `logprobs=true`: `choices[i].logprobs.content[j].logprob`, one
  entry per generated token. vLLM's chat and completion servers clamp a log-prob to −9999.0
  (`max(logprob, -9999.0)`); SGLang writes −inf as −999999999.0. A value at or below
  `CLAMPED_LOGPROB` is a clamp, not a measurement: it is kept as null (not measured).
- A stream spreads either list over its chunks; they are joined in order (`join_vllm_logprobs`).
- SGLang `/generate` with `return_logprob=true`: `meta_info.output_token_logprobs`, a list of
  `[logprob, token_id, text or null]` per generated token (its tokenizer manager's
  `detokenize_logprob_tokens`); a stream repeats the whole list, the last chunk wins.

The log-prob of generated token j (0-based) belongs to position `prompt_tokens + j` of its sequence:
the position the sampled token takes once fed back (`moescope.store.schema.SCHEMAS["engine_logprobs"]`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from moescope.ingest.importers.source import SourceFormatError

CLAMPED_LOGPROB = -9999.0  # vLLM's floor; anything at or below it is a clamp, read as not measured


def _value(value: Any, field: str, where: str) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SourceFormatError(f"{where}: {field} must hold numbers (log-probs) or null, got {value!r:.40}")
    value = float(value)
    if value > 0 or math.isnan(value) or value == math.inf:
        raise SourceFormatError(f"{where}: {field} holds {value}, not a log-probability (a number <= 0)")
    return math.nan if value <= CLAMPED_LOGPROB else value


def vllm_logprob_list(logprobs: Any, where: str) -> list[float] | None:
    """A vLLM choice's `logprobs` object as one float per token (NaN: not measured), or None when
    the choice carries none. Raises SourceFormatError for any other shape."""
    if logprobs is None:
        return None
    if not isinstance(logprobs, dict):
        raise SourceFormatError(f"{where}: choices[].logprobs must be an object, not {type(logprobs).__name__}")
    if "content" in logprobs:  # chat completions
        content = logprobs["content"]
        if content is None:
            return None
        if not isinstance(content, list) or not all(isinstance(c, dict) for c in content):
            raise SourceFormatError(f"{where}: choices[].logprobs.content must be a list of objects")
        return [_value(c.get("logprob"), "choices[].logprobs.content[].logprob", where) for c in content]
    values = logprobs.get("token_logprobs")
    if values is None:
        return None
    if not isinstance(values, list):
        raise SourceFormatError(f"{where}: choices[].logprobs.token_logprobs must be a list")
    return [_value(v, "choices[].logprobs.token_logprobs", where) for v in values]


def join_vllm_logprobs(parts: list[list[float]]) -> dict[str, list[float]] | None:
    """A stream's per-chunk lists as one `logprobs` object (completion style), None without any."""
    if not parts:
        return None
    return {"token_logprobs": [v for part in parts for v in part]}


def vllm_choice_logprobs(choice: dict, generated: int | None, prompt_tokens: int | None,
                         where: str) -> np.ndarray | None:
    """The log-probs of a vLLM choice's generated tokens, float64 (NaN: not measured), or None.
    `generated` is the choice's token count where known; with `echo` the prompt's come first and
    are dropped. Raises SourceFormatError for a count that fits neither."""
    values = vllm_logprob_list(choice.get("logprobs"), where)
    if values is None:
        return None
    if generated is not None and len(values) != generated:
        if prompt_tokens is not None and len(values) == prompt_tokens + generated:
            values = values[prompt_tokens:]  # echo: the prompt's log-probs first
        else:
            raise SourceFormatError(f"{where}: choices[].logprobs holds {len(values)} log-probs for {generated} "
                                    "generated tokens")
    return np.asarray(values, dtype=np.float64)


def sglang_logprobs(meta: dict, where: str) -> tuple[np.ndarray, np.ndarray] | None:
    """SGLang's `meta_info.output_token_logprobs` as (log-probs float64, sampled token ids int64),
    or None when absent. Raises SourceFormatError for any other shape."""
    entries = meta.get("output_token_logprobs")
    if entries is None:
        return None
    if not isinstance(entries, list):
        raise SourceFormatError(f"{where}: meta_info.output_token_logprobs must be a list")
    values, ids = [], []
    for entry in entries:
        if not isinstance(entry, (list, tuple)) or len(entry) < 2 or isinstance(entry[1], bool) \
                or not isinstance(entry[1], int) or entry[1] < 0:
            raise SourceFormatError(f"{where}: meta_info.output_token_logprobs entries must be [logprob, token_id, "
                                    f"text], got {entry!r:.60}")
        values.append(_value(entry[0], "meta_info.output_token_logprobs", where))
        ids.append(entry[1])
    return np.asarray(values, dtype=np.float64), np.asarray(ids, dtype=np.int64)
