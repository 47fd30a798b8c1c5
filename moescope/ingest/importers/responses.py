"""Routed experts as serving engines return them per request: vLLM and SGLang response bodies.

vLLM (`--enable-return-routed-experts`) puts `prompt_routed_experts` once per response and
`routed_experts` on each choice, as nested lists or as base64 of a `.npy` file; a stream spreads
them over its chunks, which are joined in order. SGLang (`--enable-return-routed-experts`) puts
`meta_info.routed_experts`: base64 of raw int32 bytes flattened from `[tokens, layers, top_k]`,
which needs the model's layer count and top-k to unflatten; a stream repeats it, the last one wins.
SGLang's own reader (`extract_routed_experts_from_meta_info`) decodes it with
`np.frombuffer(..., dtype=np.int32)`; its capturer fills an int32 buffer of shape
`(seq_len - 1, num_hidden_layers, num_experts_per_tok)` (seq_len = prompt + completion tokens; the
last token never runs a forward), so it is read here as little-endian int32 of that shape. Its
layer axis counts every hidden layer, dense ones included.

Alignment (both engines): row i of a sequence's routing is the token at position i, as the input of
the forward that routed it. A prompt routes every token. The last generated token is returned but
never fed back, so generated rows number the generated tokens or one fewer; with one fewer, that
last token simply has no route. Any other count is imported with a `row_count` finding
(`moescope.ingest.trace_checks`), which every sequence goes through as it is read. -1 rows (vLLM: prefix-cache hits,
not computed in this request) are left out of loads and routes.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from moescope.ingest.importers.fields import (
    DEFAULT_LIMIT,
    INT64_MAX,
    INT64_MIN,
    ExpertLimit,
    json_int,
    json_object,
    json_token_ids,
)
from moescope.ingest.importers.logprobs import (
    join_vllm_logprobs,
    sglang_logprobs,
    vllm_choice_logprobs,
    vllm_logprob_list,
)
from moescope.ingest.importers.source import SequenceLogprobs
from moescope.ingest.importers.tables import LayerRoutes, SourceFormatError, SourceStep, split_routed_rows
from moescope.ingest.trace_checks import TraceChecks

NPY_MAGIC = b"\x93NUMPY"
NPY_MAGIC_B64 = base64.b64encode(NPY_MAGIC)  # b"k05VTVBZ": how base64 text of a .npy file starts
# Token rows per piece of a step: a long sequence is checked and written in pieces of this many
# rows (each piece's decoded ids: rows x layers x top-k), so memory follows a piece, not the file.
CHUNK_ROWS = 1 << 16


@dataclass
class RoutedSequence:
    """One sequence's routing as a response carries it: rows aligned to positions from `first_position`."""

    ids: Any  # (rows, layers, top_k) integer ids, -1 where not computed: an array, or vllm.NpyRows (read by slices)
    sequence: int
    first_position: int = 0
    token_ids: np.ndarray | None = None  # (rows,) the input token of each row, where the response has it
    first_row: int = 0  # the row of `ids[0]` in the whole sequence (a chunk of a longer one), for messages
    # the row counts its engine returns for the sequence's tokens (None: the response does not say)
    allowed_rows: tuple[int, ...] | None = None
    ends: bool = True  # its last row is the sequence's last (False: a prompt whose choices follow)
    logprobs: SequenceLogprobs | None = None  # the generated tokens' log-probs, where the response has them


def decode_npy(raw: bytes, where: str) -> np.ndarray:
    """An integer array from the bytes of a `.npy` file; never unpickles. Raises SourceFormatError."""
    if not raw.startswith(NPY_MAGIC):
        raise SourceFormatError(f"{where}: not a .npy payload (it must start with the \\x93NUMPY magic)")
    try:
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        raise SourceFormatError(f"{where}: the .npy payload cannot be read ({e}); is it truncated?") from e
    return check_routed_array(array, where)


def check_routed_array(array: np.ndarray, where: str) -> np.ndarray:
    """The array as it is, once it is an integer (tokens, layers, top_k) array; its ids are
    range-checked in their own dtype where they are split (`tables.split_routed_rows`)."""
    if array.dtype.kind not in "iu":
        raise SourceFormatError(f"{where}: routed experts must be integer expert ids, got dtype {array.dtype}")
    if array.ndim != 3:
        raise SourceFormatError(f"{where}: routed experts must be (tokens, layers, top_k), got shape {array.shape}")
    return array


def _nested_ints(array: np.ndarray, where: str) -> np.ndarray:
    """Nested JSON lists numpy could not make integers of: name the first value that is not an int64."""
    flat = array.reshape(-1)
    for i, value in enumerate(flat):
        if isinstance(value, bool) or not isinstance(value, int) or not INT64_MIN <= value <= INT64_MAX:
            position = ", ".join(f"{axis} {int(n)}" for axis, n in zip(("token row", "layer", "slot"),
                                                                         np.unravel_index(i, array.shape)))
            raise SourceFormatError(f"{where}: expert id {value!r} at {position} is not an integer expert id")
    return array.astype(np.int64)


def vllm_array(value, where: str) -> np.ndarray:
    """vLLM's routed experts in any of its three forms (array, nested lists, base64 .npy) as an array."""
    if isinstance(value, np.ndarray):
        return check_routed_array(value, where)
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as e:
            raise SourceFormatError(f"{where}: a string of routed experts must be base64 of a .npy file") from e
        return decode_npy(raw, where)
    if isinstance(value, list):
        if not value:
            return np.zeros((0, 0, 0), dtype=np.int32)
        try:
            array = np.asarray(value)
        except (ValueError, RecursionError) as e:  # ragged or absurdly deep nesting
            raise SourceFormatError(f"{where}: routed experts are ragged nested lists; expected "
                                    "[tokens][layers][top_k]") from e
        if array.dtype.kind == "b":
            raise SourceFormatError(f"{where}: routed experts must be nested lists of integers")
        if array.dtype == object and array.ndim == 3:  # integers beyond int64, or mixed values
            return _nested_ints(array, where)
        if array.dtype == object:
            raise SourceFormatError(f"{where}: routed experts must be nested lists of integers")
        return check_routed_array(array, where)
    raise SourceFormatError(f"{where}: routed experts must be nested lists or base64 .npy text, "
                            f"not {type(value).__name__}")


def sglang_array(value, num_layers: int | None, top_k: int | None, where: str) -> np.ndarray:
    """SGLang's `meta_info.routed_experts` (base64 raw int32) as (tokens, layers, top_k)."""
    if not isinstance(value, str):
        raise SourceFormatError(f"{where}: meta_info.routed_experts must be base64 text, not {type(value).__name__}")
    if not num_layers or not top_k:
        raise ValueError(f"{where}: SGLang sends routed experts as flat int32 values; pass --num-layers (the "
                         "model's num_hidden_layers) and --top-k (num_experts_per_tok) to unflatten them")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise SourceFormatError(f"{where}: meta_info.routed_experts is not base64") from e
    per_token = 4 * num_layers * top_k
    if len(raw) % per_token:
        raise SourceFormatError(f"{where}: meta_info.routed_experts holds {len(raw)} bytes, not a whole number of "
                                f"tokens of {num_layers} layers x top-{top_k} int32 ids ({per_token} bytes each)")
    return np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k)


def _allowed_rows(tokens: int | None, generated: bool) -> tuple[int, ...] | None:
    """The row counts an engine returns for `tokens` tokens: one per prompt token; a generated
    token's row, the last one's optional (it never runs a forward). Another count is a `row_count`
    finding, not an error: the rows are kept."""
    if tokens is None:
        return None
    return (tokens, tokens - 1) if generated else (tokens,)


def _ids_column(ids: np.ndarray | None, rows: int) -> np.ndarray | None:
    return ids[:rows] if ids is not None and len(ids) >= rows else None


def is_vllm(body) -> bool:
    return isinstance(body, dict) and ("prompt_routed_experts" in body or any(
        isinstance(c, dict) and "routed_experts" in c for c in body.get("choices") or []))


def is_sglang(body) -> bool:
    return isinstance(body, dict) and isinstance(body.get("meta_info"), dict) and \
        "routed_experts" in body["meta_info"]


def merge_vllm_stream(chunks: list[dict], where: str) -> dict:
    """The chunks of a vLLM stream as one response: routing and token ids joined per choice, in order."""
    merged: dict = {"choices": []}
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for key in ("created", "model", "usage", "prompt_token_ids"):
            if chunk.get(key) is not None:
                merged[key] = chunk[key]
        if chunk.get("prompt_routed_experts") is not None:
            merged["prompt_routed_experts"] = vllm_array(chunk["prompt_routed_experts"], where)
        for choice in _choices(chunk, where):
            index = _choice_index(choice, where)
            slot = choices.setdefault(index, {"index": index, "parts": [], "token_ids": [], "logprobs": []})
            if choice.get("routed_experts") is not None:
                part = vllm_array(choice["routed_experts"], where)
                if part.size:
                    slot["parts"].append(part)
            generated = json_token_ids(choice.get("token_ids"), f"choices[{index}].token_ids", where)
            slot["token_ids"] += [] if generated is None else generated.tolist()
            values = vllm_logprob_list(choice.get("logprobs"), where)
            if values is not None:
                slot["logprobs"].append(values)
    for index in sorted(choices):
        slot = choices[index]
        merged["choices"].append({"index": index, "token_ids": slot["token_ids"] or None,
                                  "routed_experts": np.concatenate(slot["parts"]) if slot["parts"] else None,
                                  "logprobs": join_vllm_logprobs(slot["logprobs"])})
    return merged


def _choices(body: dict, where: str) -> list[dict]:
    choices = body.get("choices")
    if choices is None:
        return []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise SourceFormatError(f"{where}: choices must be a list of objects")
    return choices


def _choice_index(choice: dict, where: str) -> int:
    return json_int(choice.get("index", 0), "choices[].index", where, high=2**31 - 1)


def vllm_sequences(body: dict, where: str) -> list[RoutedSequence]:
    """The routed sequences of one vLLM response (or a merged stream); [] when it carries no routing.

    The prompt's rows go with choice 0 (the prompt ran once, for every choice); choice i's generated
    rows follow at positions from the prompt's length, in sequence i.
    """
    usage = json_object(body.get("usage"), "usage", where)
    choices = _choices(body, where)
    prompt_ids = json_token_ids(body.get("prompt_token_ids"), "prompt_token_ids", where)
    prompt_tokens = len(prompt_ids) if prompt_ids is not None else _count(usage, "prompt_tokens", where)
    out: list[RoutedSequence] = []
    first = 0
    if body.get("prompt_routed_experts") is not None:
        ids = vllm_array(body["prompt_routed_experts"], f"{where} prompt_routed_experts")
        first = len(ids) if prompt_tokens is None else int(prompt_tokens)
        if len(ids) or prompt_tokens:
            ends = not any(isinstance(c, dict) and c.get("routed_experts") is not None for c in choices)
            out.append(RoutedSequence(ids, sequence=0, first_position=0,
                                      token_ids=_ids_column(prompt_ids, len(ids)),
                                      allowed_rows=_allowed_rows(prompt_tokens, False), ends=ends))
    elif prompt_tokens is not None:
        first = int(prompt_tokens)
    for choice in choices:
        if choice.get("routed_experts") is None:
            continue
        index = _choice_index(choice, where)
        ids = vllm_array(choice["routed_experts"], f"{where} choices[{index}].routed_experts")
        generated = choice.get("token_ids")
        if not isinstance(generated, np.ndarray):  # a merged stream's are checked already
            generated = json_token_ids(generated, f"choices[{index}].token_ids", where)
        tokens = len(generated) if generated is not None else (
            _count(usage, "completion_tokens", where) if len(choices) == 1 else None)
        values = vllm_choice_logprobs(choice, tokens, prompt_tokens, f"{where} choices[{index}]")
        logprobs = None if values is None else SequenceLogprobs(index, first, values, generated)
        if len(ids) or tokens:
            out.append(RoutedSequence(ids, sequence=index, first_position=first,
                                      token_ids=_ids_column(generated, len(ids)),
                                      allowed_rows=_allowed_rows(tokens, True), logprobs=logprobs))
    return out


def _count(usage: dict, field: str, where: str) -> int | None:
    value = usage.get(field)
    return None if value is None else json_int(value, f"usage.{field}", where)


def sglang_sequences(bodies: list[dict], num_layers: int | None, top_k: int | None, where: str,
                     stream: bool = False) -> list[RoutedSequence]:
    """The routed sequences of SGLang `/generate` output: one body, a batch (a list, one sequence
    each), or the chunks of a stream (`stream=True`: chunks repeat their `index`, the last chunk
    carrying routed experts wins)."""
    latest: dict[int, dict] = {}
    for position, body in enumerate(bodies):
        if is_sglang(body):
            latest[json_int(body.get("index", 0), "index", where, high=2**31 - 1) if stream else position] = body
    out = []
    for index in sorted(latest):
        meta = latest[index]["meta_info"]
        ids = sglang_array(meta["routed_experts"], num_layers, top_k, f"{where} meta_info.routed_experts")
        prompt, completion = (_count(meta, f, where) for f in ("prompt_tokens", "completion_tokens"))
        total = prompt + completion if prompt is not None and completion is not None else None
        found = sglang_logprobs(meta, where)
        logprobs = None
        if found is not None:
            if completion is not None and len(found[0]) != completion:
                raise SourceFormatError(f"{where}: meta_info.output_token_logprobs holds {len(found[0])} entries for "
                                        f"{completion} completion tokens")
            first = prompt if prompt is not None else len(ids) + 1 - len(found[0])
            logprobs = SequenceLogprobs(index, first, found[0], found[1])
        if len(ids) or total:
            out.append(RoutedSequence(ids, sequence=index, first_position=0, allowed_rows=_allowed_rows(total, True),
                                      logprobs=logprobs))
    return out


def sequences_step(sequences: list[RoutedSequence], step: int, ts: dt.datetime, where: str, rank: int = 0,
                   tags: dict[str, str] | None = None, limit: ExpertLimit = DEFAULT_LIMIT,
                   first_token: int = 0) -> tuple[SourceStep, int]:
    """One step holding these sequences' routes (its rows numbered from `first_token`); returns it
    and the rows left out as not computed."""
    per_layer: dict[int, list[tuple]] = {}
    skipped = 0
    offset = first_token
    logprobs = [seq.logprobs for seq in sequences if seq.logprobs is not None]
    for seq in sequences:
        layers, not_computed = split_routed_rows(seq.ids, where, limit, first_row=seq.first_row)
        skipped += not_computed
        n = len(seq.ids)
        columns = (np.arange(offset, offset + n, dtype=np.int32), np.full(n, seq.sequence, dtype=np.int32),
                   np.arange(seq.first_position, seq.first_position + n, dtype=np.int32), seq.token_ids)
        for layer, (rows, ids) in layers.items():
            every = len(rows) == n  # most layers compute every row: share the columns, index nothing
            per_layer.setdefault(layer, []).append((ids, *(c if every or c is None else c[rows] for c in columns)))
        offset += n
    routes = {}
    for layer, parts in per_layer.items():
        widths = {p[0].shape[1] for p in parts}
        if len(widths) > 1:
            raise SourceFormatError(f"{where}: layer {layer} routes {sorted(widths)} experts per token in "
                                    "different sequences of one response")
        if len(parts) == 1:
            ids, token, sequence, position, token_ids = parts[0]
        else:
            ids, token, sequence, position = (np.concatenate([p[i] for p in parts]) for i in range(4))
            token_ids = None if any(p[4] is None for p in parts) else np.concatenate([p[4] for p in parts])
        routes[layer] = LayerRoutes(expert_ids=ids, token=token, sequence=sequence, position=position,
                                    token_ids=token_ids)
    return SourceStep(step=step, ts=ts, rank=rank, tags=dict(tags or {}), routes=routes, where=where,
                      logprobs=logprobs), skipped


def check_sequence(checks: TraceChecks | None, seq: RoutedSequence, where: str, ids: np.ndarray | None = None,
                   start: int = 0) -> None:
    """Feed `checks` one sequence, or its chunk `ids` of rows from `start` (the row count is checked
    with the first chunk); nothing when `checks` is None."""
    if checks is None:
        return
    label = f"{where} sequence {seq.sequence}"
    if start == 0 and seq.allowed_rows is not None:
        checks.expect_rows(label, len(seq.ids), seq.allowed_rows)
    chunk = np.asarray(seq.ids if ids is None else ids)
    checks.add(chunk, label, first_row=seq.first_row + start, ends=seq.ends and start + len(chunk) >= len(seq.ids))


def sequence_pieces(sequences: list[RoutedSequence], step: int, ts: dt.datetime, where: str,
                    limit: ExpertLimit = DEFAULT_LIMIT, chunk_rows: int | None = None,
                    checks: TraceChecks | None = None) -> Iterator[tuple[SourceStep, int]]:
    """The step of these sequences in pieces of at most `chunk_rows` (default CHUNK_ROWS) token
    rows, in order (pieces of one step share its number); yields each piece and its rows left out
    as not computed. Each chunk goes through `checks` (the trace checks) first."""
    chunk_rows = chunk_rows or CHUNK_ROWS
    offset = 0
    for seq in sequences:
        if not len(seq.ids):
            check_sequence(checks, seq, where)
        for start in range(0, len(seq.ids), chunk_rows):
            end = min(start + chunk_rows, len(seq.ids))
            ids = np.asarray(seq.ids[start:end])
            check_sequence(checks, seq, where, ids, start)
            chunk = RoutedSequence(ids, seq.sequence, seq.first_position + start,
                                   None if seq.token_ids is None else seq.token_ids[start:end], first_row=start,
                                   logprobs=seq.logprobs if start == 0 else None)
            yield sequences_step([chunk], step, ts, where, limit=limit, first_token=offset + start)
        offset += len(seq.ids)
