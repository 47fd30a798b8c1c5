"""vLLM's routed-experts replay (`--enable-return-routed-experts`) read from files.

Every file is recognised by its content, not its name:

- a `.npy` file holding one sequence's `CompletionOutput.routed_experts` (`[seq_len, layers,
  top_k]`, int16/int32/uint8, -1 where a position was not computed);
- base64 text of such a file (it starts with `k05VTVBZ`, the base64 of the `\\x93NUMPY` magic);
- JSON: one OpenAI-compatible response, a list of them, or JSON Lines with one per line. Items
  sharing an `id` are the chunks of one streamed response and are joined (see `responses`).

Each response or array is one step, in the order the paths and their contents give. Rows align
to tokens as `responses` says; a response's `created` time is the step's time (else the file's).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json

from moescope.store.importers.responses import (
    NPY_MAGIC,
    NPY_MAGIC_B64,
    RoutedSequence,
    decode_npy,
    is_vllm,
    merge_vllm_stream,
    sequences_step,
    vllm_sequences,
)
from moescope.store.importers.tables import SourceData, SourceFormatError, file_time

NOT_COMPUTED = "token rows with every slot -1 (not computed: prefix-cache hits) left out"
NO_ROUTING = "response without routed experts skipped (was the request sent with routed experts on?)"


def read_json_values(path: str, text: str) -> list:
    """The JSON values of a file: one document, or one per line (JSON Lines). Raises SourceFormatError."""
    try:
        value = json.loads(text)
        return value if isinstance(value, list) else [value]
    except json.JSONDecodeError as whole:
        lines = [line for line in text.splitlines() if line.strip()]
        if len(lines) < 2:
            raise SourceFormatError(f"{path}: not valid JSON ({whole}); is the file truncated?") from whole
    values = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            values.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise SourceFormatError(f"{path}: line {number} is not valid JSON ({e}); is the file truncated?") from e
    return values


def group_streams(values: list) -> list[list[dict]]:
    """Responses as lists of bodies: items sharing an `id` (a stream's chunks) form one group."""
    groups: dict[object, list[dict]] = {}
    for position, value in enumerate(values):
        if isinstance(value, list):  # a line holding the chunk list of one stream
            groups[("list", position)] = [v for v in value if isinstance(v, dict)]
        elif isinstance(value, dict):
            key = value.get("id") if isinstance(value.get("id"), str) else ("item", position)
            groups.setdefault(key, []).append(value)
    return list(groups.values())


def read(paths: list[str]) -> SourceData:
    """Every step in the files, checked; raises SourceFormatError naming the file and what was expected."""
    data = SourceData(steps=[])
    for path in paths:
        with open(path, "rb") as f:
            raw = f.read()
        if raw.startswith(NPY_MAGIC) or raw.lstrip().startswith(NPY_MAGIC_B64):
            npy = raw if raw.startswith(NPY_MAGIC) else _b64(raw, path)
            sequences = [RoutedSequence(decode_npy(npy, path), sequence=0)]
            _add(data, sequences, file_time(path), path)
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SourceFormatError(f"{path}: neither a .npy file, base64 of one, nor JSON responses") from e
        if not text.strip():
            raise SourceFormatError(f"{path}: the file is empty")
        for number, bodies in enumerate(group_streams(read_json_values(path, text))):
            where = f"{path} response {number}"
            if not any(is_vllm(b) for b in bodies):
                if any(isinstance(b, dict) and "meta_info" in b for b in bodies):
                    raise SourceFormatError(f"{where}: this is an SGLang response; import it with `moescope "
                                            "import sglang`")
                data.notes[NO_ROUTING] += 1
                continue
            body = bodies[0] if len(bodies) == 1 else merge_vllm_stream(bodies, where)
            data.model = data.model or body.get("model")
            created = body.get("created")
            ts = (dt.datetime.fromtimestamp(float(created), dt.timezone.utc)
                  if isinstance(created, (int, float)) else file_time(path))
            _add(data, vllm_sequences(body, where), ts, where)
    return data


def _b64(raw: bytes, path: str) -> bytes:
    try:
        return base64.b64decode(b"".join(raw.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise SourceFormatError(f"{path}: starts like base64 of a .npy file but is not valid base64") from e


def _add(data: SourceData, sequences: list[RoutedSequence], ts: dt.datetime, where: str) -> None:
    step, skipped = sequences_step(sequences, len(data.steps), ts, where)
    if skipped:
        data.notes[NOT_COMPUTED] += skipped
    data.steps.append(step)
