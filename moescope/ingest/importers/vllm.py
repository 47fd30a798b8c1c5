"""vLLM's routed-experts replay (`--enable-return-routed-experts`) read from files.

Every file is recognised by its content, not its name:

- a `.npy` file holding one sequence's `CompletionOutput.routed_experts` (`[seq_len, layers,
  top_k]`, int16/int32/uint8, -1 where a position was not computed); it is read from disk in pieces
  of `responses.CHUNK_ROWS` rows (not memory-mapped: a map's pages would count against memory);
- base64 text of such a file (it starts with `k05VTVBZ`, the base64 of the `\\x93NUMPY` magic);
- JSON: one OpenAI-compatible response, a list of them, or JSON Lines with one per line (a file
  whose first line is a whole JSON value is JSON Lines, read line by line). Consecutive items
  sharing an `id` are the chunks of one streamed response and are joined (see `responses`); the
  same `id` again after another response is the response read twice, and refused.

Each response or array is one step, in the order the paths and their contents give. Rows align
to tokens as `responses` says; a response's `created` time is the step's time (else the file's).

Expert ids: signed arrays use -1 for "not computed"; any other id outside 0..E-1 (E from
--num-experts, else the --max-experts limit) is an error naming the file, the row, layer and slot,
and the value; unsigned arrays are compared as they are (a uint32 4294967295 is not -1).

Memory: a `.npy` file and JSON Lines are read a piece at a time; one JSON document (not JSON
Lines), a base64 file and a single response are decoded whole, so save large captures as JSON
Lines or `.npy`.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import os
from collections.abc import Iterator

import numpy as np

from moescope.ingest.importers.fields import DEFAULT_LIMIT, ExpertLimit, json_time
from moescope.ingest.importers.responses import (
    NPY_MAGIC,
    NPY_MAGIC_B64,
    RoutedSequence,
    check_routed_array,
    decode_npy,
    is_vllm,
    merge_vllm_stream,
    sequence_pieces,
    vllm_sequences,
)
from moescope.ingest.importers.tables import SourceData, SourceFormatError, SourceStep, StepStream, file_time

NOT_COMPUTED = "token rows with every slot -1 (not computed: prefix-cache hits) left out"
NO_ROUTING = "response without routed experts skipped (was the request sent with routed experts on?)"


def files(paths: list[str]) -> list[str]:
    """The files an import of `paths` reads (vLLM takes files, not folders)."""
    return list(paths)


def _loads(text: str, where: str):
    try:
        return json.loads(text)
    except RecursionError as e:
        raise SourceFormatError(f"{where}: JSON nested too deeply to be a response; is the file damaged?") from e


def json_values(path: str) -> Iterator[tuple[int, object]]:
    """(line number, value) for each JSON value of a file: JSON Lines, one value a line, read line by
    line (a file whose first line is a whole value and is followed by more lines); one document that
    is a list, its items decoded one at a time as the file is read (memory follows an item, not the
    file); or one other document, read whole (one response). Raises SourceFormatError naming the file
    (and line)."""
    with open(path, encoding="utf-8") as f:
        try:
            lines = ((number, line) for number, line in enumerate(f, 1) if line.strip())
            first, second = next(lines, None), next(lines, None)
            if first is None:
                raise SourceFormatError(f"{path}: the file is empty")
            if second is not None and _whole_value(first[1]):
                for number, line in itertools.chain([first, second], lines):
                    try:
                        yield number, _loads(line, f"{path} line {number}")
                    except json.JSONDecodeError as e:
                        raise SourceFormatError(f"{path}: line {number} is not valid JSON ({e}); is the file "
                                                "truncated?") from e
                return
            text = first[1] + ("" if second is None else second[1])
            if text.lstrip().startswith("["):
                for value in _list_items(f, text, path):
                    yield 1, value
                return
            text += f.read()
        except UnicodeDecodeError as e:
            raise SourceFormatError(f"{path}: neither a .npy file, base64 of one, nor JSON responses") from e
    try:
        document = _loads(text, path)
    except json.JSONDecodeError as e:
        raise SourceFormatError(f"{path}: not valid JSON ({e}); is the file truncated?") from e
    yield 1, document


READ_CHARS = 1 << 20  # characters read at a time while decoding a list's items


def _list_items(f, text: str, path: str) -> Iterator[object]:
    """The items of the JSON list that `text` (the file's first characters) starts and `f` goes on
    with, each decoded once it is whole: the buffer holds one item and what follows it, never the
    list. An item cut at the buffer's end is decoded again once more is read (reads double in size
    while one item is incomplete, so a large item costs a few decodes, not one per read)."""
    decoder = json.JSONDecoder()
    buffer, pos, ended, index = text, text.index("[") + 1, False, 0
    want = "item or ]"

    def more(least: int = READ_CHARS) -> None:
        nonlocal buffer, pos, ended
        chunk = f.read(max(least, READ_CHARS))
        ended = not chunk
        buffer, pos = buffer[pos:] + chunk, 0

    while True:
        while True:  # the next character that is not white space
            while pos < len(buffer) and buffer[pos] in " \t\r\n":
                pos += 1
            if pos < len(buffer) or ended:
                break
            more()
        if pos >= len(buffer):
            raise SourceFormatError(f"{path}: the JSON list ends after {index} items without its ']'; is the file "
                                    "truncated?")
        char = buffer[pos]
        if char == "]" and want != "item":
            if buffer[pos + 1:].strip() or f.read(1).strip():
                raise SourceFormatError(f"{path}: text after the JSON list's closing ']'")
            return
        if char == "," and want == ", or ]":
            pos, want = pos + 1, "item"
            continue
        if want == ", or ]":
            raise SourceFormatError(f"{path}: item {index} of the JSON list is followed by {char!r}, not ',' or "
                                    "']'; is the file damaged?")
        while True:
            try:
                value, end = decoder.raw_decode(buffer, pos)
                break
            except RecursionError as e:
                raise SourceFormatError(f"{path}: item {index} of the JSON list is nested too deeply to be a "
                                        "response; is the file damaged?") from e
            except json.JSONDecodeError as e:
                if ended or (e.pos == pos and buffer[pos] not in '{["-0123456789tfn'):  # not a value at all
                    raise SourceFormatError(f"{path}: item {index} of the JSON list is not valid JSON ({e}); is "
                                            "the file truncated?") from e
                more(len(buffer) - pos)  # the item may go on past the buffer: read as much again
        yield value
        pos, want, index = end, ", or ]", index + 1
        if pos > READ_CHARS:  # drop what was decoded
            buffer, pos = buffer[pos:], 0


def _whole_value(line: str) -> bool:
    try:
        json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


def response_groups(path: str, key_of) -> Iterator[tuple[str, list, bool]]:
    """(where, bodies, is_list) per response: consecutive values with the same `key_of(value)` (a
    stream's chunks) form one; a list value is one of its own (a stream saved as a list, or an
    SGLang batch), `is_list` then True. Raises SourceFormatError when a key comes back after
    another response."""
    seen: set = set()
    current: str | tuple | None = None
    bodies: list = []
    number = 0
    for line, value in json_values(path):
        key: str | tuple
        if isinstance(value, list):
            key = ("list", line, number)
        else:
            found = key_of(value)
            key = found if isinstance(found, str) else ("item", line, number)
        if key != current:
            if bodies:
                yield f"{path} response {number}", bodies, isinstance(current, tuple) and current[0] == "list"
                number += 1
            if key in seen:
                raise SourceFormatError(f"{path} line {line}: response {key!r} appears again after other responses: "
                                        "the same response twice, or a stream whose chunks are not together")
            seen.add(key)
            current, bodies = key, []
        bodies += [v for v in value if isinstance(v, dict)] if isinstance(value, list) else [value]
    if bodies:
        yield f"{path} response {number}", bodies, isinstance(current, tuple) and current[0] == "list"


def read(paths: list[str], limit: ExpertLimit = DEFAULT_LIMIT) -> SourceData:
    """The steps of the files, read lazily (each pass reads them again); a bad file raises
    SourceFormatError naming the file, the place in it and what was expected."""
    data = SourceData(steps=[])
    data.steps = StepStream(lambda: _steps(paths, limit, data))
    return data


def _steps(paths: list[str], limit: ExpertLimit, data: SourceData) -> Iterator[SourceStep]:
    data.notes.clear()
    data.checks.reset()
    number = 0
    for path in paths:
        with open(path, "rb") as f:
            head = f.read(64)
        if head.startswith(NPY_MAGIC) or head.lstrip().startswith(NPY_MAGIC_B64):
            sequence = RoutedSequence(_npy_file(path, head), sequence=0)
            yield from _pieces(data, [sequence], number, file_time(path), path, limit)
            number += 1
            continue
        for where, bodies, _ in response_groups(path, lambda v: v.get("id") if isinstance(v, dict) else None):
            if not any(is_vllm(b) for b in bodies):
                if any(isinstance(b, dict) and "meta_info" in b for b in bodies):
                    raise SourceFormatError(f"{where}: this is an SGLang response; import it with `moescope "
                                            "import sglang`")
                data.notes[NO_ROUTING] += 1
                continue
            body = bodies[0] if len(bodies) == 1 else merge_vllm_stream(bodies, where)
            data.model = data.model or (body.get("model") if isinstance(body.get("model"), str) else None)
            created = body.get("created")
            ts = file_time(path) if created is None else json_time(created, "created", where)
            yield from _pieces(data, vllm_sequences(body, where), number, ts, where, limit)
            number += 1


class NpyRows:
    """The rows of a C-ordered `.npy` file, read from disk a slice at a time (`rows[a:b]`), so a
    file's pages are not held as a memory map would hold them."""

    def __init__(self, path: str, shape: tuple[int, ...], dtype: np.dtype, offset: int):
        self.path, self.shape, self.dtype, self.offset = path, shape, dtype, offset
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, _ = rows.indices(self.shape[0])
        with open(self.path, "rb") as f:
            f.seek(self.offset + start * self.row_bytes)
            raw = f.read(max(stop - start, 0) * self.row_bytes)
        if len(raw) != max(stop - start, 0) * self.row_bytes:
            raise SourceFormatError(f"{self.path}: the .npy file ends before its row {stop - 1}; is it truncated?")
        return np.frombuffer(raw, dtype=self.dtype).reshape(-1, *self.shape[1:])


def _npy_file(path: str, head: bytes) -> np.ndarray | NpyRows:
    if not head.startswith(NPY_MAGIC):
        with open(path, "rb") as f:
            return decode_npy(_b64(f.read(), path), path)
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)  # the header is text, parsed without unpickling
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(f)
            offset = f.tell()
    except (ValueError, EOFError, OSError) as e:
        raise SourceFormatError(f"{path}: the .npy file cannot be read ({e}); is it truncated?") from e
    if fortran or dtype.hasobject:
        raise SourceFormatError(f"{path}: expected a C-ordered integer array (np.save of CompletionOutput."
                                f"routed_experts), got {'Fortran order' if fortran else dtype}")
    if len(shape) != 3:
        raise SourceFormatError(f"{path}: routed experts must be (tokens, layers, top_k), got shape {shape}")
    check_routed_array(np.empty((0, *shape[1:]), dtype=dtype), path)  # integer ids
    rows = NpyRows(path, shape, dtype, offset)
    if os.path.getsize(path) < offset + shape[0] * rows.row_bytes:
        raise SourceFormatError(f"{path}: the .npy file is shorter than its {shape} header says; is it truncated?")
    return rows


def _b64(raw: bytes, path: str) -> bytes:
    try:
        return base64.b64decode(b"".join(raw.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise SourceFormatError(f"{path}: starts like base64 of a .npy file but is not valid base64") from e


def _pieces(data: SourceData, sequences: list[RoutedSequence], number: int, ts, where: str,
            limit: ExpertLimit) -> Iterator[SourceStep]:
    produced = False
    for step, skipped in sequence_pieces(sequences, number, ts, where, limit, checks=data.checks):
        if skipped:
            data.notes[NOT_COMPUTED] += skipped
        produced = True
        yield step
    if not produced:  # a response whose routing is empty is still a step
        yield SourceStep(step=number, ts=ts, where=where)
