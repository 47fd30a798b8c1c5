"""Records as bytes with a declared layout, for a pipe to another process; never pickle.

A message is a tree of plain values (None, bools, numbers, strings, lists, tuples, dicts with string
keys, UTC datetimes), numpy arrays of numbers or bools, and the record types of
`moescope.core.records` (`StepRecord` and what it holds, `RunInfo`, `LayerInfo`). It travels as one
frame: its length (8 bytes, big-endian), the length of a JSON header (4 bytes), the header, then every
array's bytes back to back. The header names each array's dtype, shape and offset, and each record by
its type's name; decoding builds only those types and arrays of those dtypes (a header that names
anything else is refused with a `WireError`), so a frame cannot make the reader run code.

`send` and `receive` move frames over a socket (the store's writer process,
`moescope.store.writer_process`); `encode` and `decode` are the frame's body.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import socket
import struct
from typing import Any

import numpy as np

from moescope.core.records import KVCacheLayer, LayerInfo, LayerStep, Routes, RunInfo, StepRecord, TokenSample

__all__ = ["MAX_FRAME_BYTES", "WireError", "decode", "encode", "receive", "send"]

# A frame larger than this is refused before its bytes are read: the queue a frame comes from is
# bounded in bytes far below it (`moescope.core.pipeline.DEFAULT_MAX_QUEUE_BYTES`).
MAX_FRAME_BYTES = 4 * 1024 ** 3
_FRAME = struct.Struct(">Q")
_HEADER = struct.Struct(">I")
_TYPES: dict[str, type] = {cls.__name__: cls for cls in (
    StepRecord, LayerStep, Routes, TokenSample, KVCacheLayer, RunInfo, LayerInfo)}
_FIELDS = {name: tuple(f.name for f in dataclasses.fields(cls)) for name, cls in _TYPES.items()}
_KINDS = "biuf"  # bools, signed and unsigned integers, floats: what a record's arrays hold


class WireError(ValueError):
    """A frame that is not one `encode` made: a type, dtype or field it does not know, or bytes that
    do not add up. The sender is not this package's, or the stream is damaged."""


def encode(value: Any) -> bytes:
    """The frame body of `value` (see the module doc).

    Raises:
        TypeError: for a value of a type a frame cannot hold (an object array, a class not listed).
    """
    arrays: list[np.ndarray] = []
    size = 0

    def tree(v: Any) -> Any:
        nonlocal size
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, (int, float)):
            return v.item() if isinstance(v, np.generic) else v
        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, np.ndarray):
            if v.dtype.kind not in _KINDS:
                raise TypeError(f"a frame holds arrays of numbers or bools, not of {v.dtype}")
            array = np.ascontiguousarray(v)
            arrays.append(array)
            size += array.nbytes
            return {"$a": [array.dtype.str, list(array.shape), size - array.nbytes]}
        if isinstance(v, dt.datetime):
            return {"$d": v.isoformat()}
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            name = type(v).__name__
            if _TYPES.get(name) is not type(v):
                raise TypeError(f"a frame cannot hold a {name}")
            return {"$r": name, "f": [tree(getattr(v, f)) for f in _FIELDS[name]]}
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                raise TypeError("a frame's dicts have string keys")
            return {"$m": {k: tree(x) for k, x in v.items()}}
        if isinstance(v, tuple):
            return {"$t": [tree(x) for x in v]}
        if isinstance(v, list):
            return [tree(x) for x in v]
        raise TypeError(f"a frame cannot hold a {type(v).__name__}")

    header = json.dumps(tree(value), separators=(",", ":")).encode("utf-8")
    return b"".join([_HEADER.pack(len(header)), header, *(a.data.cast("B") for a in arrays)])


def decode(body: bytes | bytearray | memoryview) -> Any:
    """The value `encode` made of `body`; its arrays are read-only views of `body`.

    Raises:
        WireError: for a body that is not one `encode` made.
    """
    view = memoryview(body)
    if len(view) < _HEADER.size:
        raise WireError("a frame shorter than its header")
    length, = _HEADER.unpack(view[:_HEADER.size])
    start = _HEADER.size + length
    if start > len(view):
        raise WireError("a frame's header runs past its end")
    try:
        header = json.loads(bytes(view[_HEADER.size:start]).decode("utf-8"))
    except ValueError as e:
        raise WireError(f"a frame's header is not JSON: {e}") from None
    data = view[start:]

    def value(v: Any) -> Any:
        if isinstance(v, list):
            return [value(x) for x in v]
        if not isinstance(v, dict):
            return v
        if "$a" in v:
            return _array(v["$a"], data)
        if "$d" in v:
            return dt.datetime.fromisoformat(str(v["$d"]))
        if "$r" in v:
            name = v["$r"]
            if name not in _TYPES or not isinstance(v.get("f"), list) or len(v["f"]) != len(_FIELDS[name]):
                raise WireError(f"a frame names a record it cannot hold: {str(name)[:80]}")
            fields = {f: value(x) for f, x in zip(_FIELDS[name], v["f"])}
            if name == "RunInfo":
                fields["layers"] = tuple(fields["layers"])
            return _TYPES[name](**fields)
        if "$m" in v and isinstance(v["$m"], dict):
            return {k: value(x) for k, x in v["$m"].items()}
        if "$t" in v and isinstance(v["$t"], list):
            return tuple(value(x) for x in v["$t"])
        raise WireError(f"a frame holds an object it does not know: {str(v)[:80]}")

    return value(header)


def _array(spec: Any, data: memoryview) -> np.ndarray:
    try:
        dtype_str, shape, offset = spec
        dtype = np.dtype(str(dtype_str))
        shape = tuple(int(n) for n in shape)
        offset = int(offset)
    except (TypeError, ValueError) as e:
        raise WireError(f"a frame's array is not described as encode describes one: {e}") from None
    if dtype.kind not in _KINDS or dtype.hasobject or any(n < 0 for n in shape) or offset < 0:
        raise WireError(f"a frame holds an array it cannot: {dtype_str!r} {shape}")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if offset + count * dtype.itemsize > len(data):
        raise WireError("a frame's array runs past its end")
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)


def send(connection: socket.socket, body: bytes) -> None:
    """Send one frame; OSError when the other end is gone."""
    connection.sendall(_FRAME.pack(len(body)))
    connection.sendall(body)


def receive(connection: socket.socket) -> bytearray:
    """One frame's body; EOFError when the other end closed, WireError for a frame too large."""
    size, = _FRAME.unpack(_read_exactly(connection, _FRAME.size))
    if size > MAX_FRAME_BYTES:
        raise WireError(f"a frame of {size} bytes, more than the {MAX_FRAME_BYTES} a frame may hold")
    return _read_exactly(connection, size)


def _read_exactly(connection: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = connection.recv_into(view[got:], min(size - got, 1 << 22))
        if not n:
            raise EOFError("the connection closed")
        got += n
    return buffer
