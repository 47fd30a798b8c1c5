"""The messages between a forked child and its delta helper process: JSON objects, each sent as its
length (4 bytes, big-endian) and its UTF-8 text; never pickle. Only metadata crosses (locations,
file actions, snapshots, results), never Arrow data.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
from typing import Any

from moescope.store.delta.errors import CommitConflictError, CommitError, LegacyStoreError, StoreAccessError
from moescope.store.delta.parts import PartFile, SkippedFile, Snapshot
from moescope.store.errors import StoreError
from moescope.store.location import StoreLocation

__all__ = ["ERRORS", "decode", "encode", "receive", "send"]

_HEADER = struct.Struct(">I")
ERRORS: dict[str, type[StoreError]] = {cls.__name__: cls for cls in (
    StoreError, CommitError, CommitConflictError, StoreAccessError, LegacyStoreError)}


def send(connection: socket.socket, message: dict[str, Any]) -> None:
    """Send one message; OSError when the other end is gone."""
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    connection.sendall(_HEADER.pack(len(body)) + body)


def receive(connection: socket.socket) -> dict[str, Any]:
    """One message; EOFError when the other end closed."""
    size, = _HEADER.unpack(_read_exactly(connection, _HEADER.size))
    return json.loads(_read_exactly(connection, size).decode("utf-8"))


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = connection.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the delta helper's connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def encode(value: Any) -> Any:
    """A call's argument or result as JSON: scalars and lists as they are; a StoreLocation, a
    PartFile, a SkippedFile, a Snapshot and a tuple as an object tagged with its kind ("$")."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, StoreLocation):
        return {"$": "location", "url": value.url, "storage_options": dict(value.storage_options)}
    if isinstance(value, PartFile):
        return {"$": "part", **dataclasses.asdict(value)}
    if isinstance(value, Snapshot):
        return {"$": "snapshot", "version": value.version, "files": [encode(f) for f in value.files],
                "skipped": [encode(f) for f in value.skipped], "app_version": value.app_version}
    if isinstance(value, SkippedFile):
        return {"$": "skipped", **dataclasses.asdict(value)}
    if isinstance(value, tuple):
        return {"$": "tuple", "items": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    raise TypeError(f"the delta helper cannot send a {type(value).__name__}")


def decode(value: Any) -> Any:
    """The value `encode` made; ValueError for an object it does not know."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get("$")
    if kind == "location":
        return StoreLocation(value["url"], dict(value["storage_options"]))
    if kind == "part":
        return PartFile(**{f.name: value[f.name] for f in dataclasses.fields(PartFile)})
    if kind == "snapshot":
        return Snapshot(int(value["version"]), [decode(f) for f in value["files"]],
                        [decode(f) for f in value.get("skipped", [])], value.get("app_version"))
    if kind == "skipped":
        return SkippedFile(**{f.name: value[f.name] for f in dataclasses.fields(SkippedFile)})
    if kind == "tuple":
        return tuple(decode(v) for v in value["items"])
    raise ValueError(f"the delta helper got a message it cannot read: {str(value)[:200]}")
