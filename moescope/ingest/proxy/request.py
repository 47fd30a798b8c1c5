"""A client's request as the engine gets it: its body (read whole, or streamed in pieces) and the
headers that go with it.

A request the client cut short (its headers or its body) never reaches the engine whole: its body's
pieces raise `ClientGone` where the client stopped, and the sender closes the engine's connection
under the unfinished request. Framing that cannot be forwarded as sent raises `BadRequest`.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from email.message import Message
from typing import TypeAlias

from moescope.ingest.proxy.limits import BUFFERED_BODY_BYTES, READ_CHUNK, Upstream

__all__ = ["HOP_BY_HOP", "BadRequest", "ClientGone", "RequestBody", "request_body", "upstream_headers"]

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "trailers", "transfer-encoding", "upgrade", "proxy-connection"}
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")

# The body to send: bytes when read whole, an iterator of pieces when streamed, None when there is none.
RequestBody: TypeAlias = "bytes | Iterator[bytes] | None"


class ClientGone(Exception):
    """The client hung up or went quiet before its request was whole: nothing may reach the engine."""


class BadRequest(Exception):
    """The request cannot be forwarded as sent (its framing is broken); the message says why."""


def request_body(rfile: io.BufferedIOBase, headers: Message) -> RequestBody:
    """The body of the request whose headers were just read from `rfile`.

    Args:
        rfile: the client connection's reader, at the start of the body.
        headers: the request's headers (Transfer-Encoding, Content-Length say how the body is framed).

    Returns:
        bytes for a body up to `BUFFERED_BODY_BYTES` (read whole now), an iterator of pieces for a
        larger or chunked one (read as the engine takes them), None when there is no body.

    Raises:
        BadRequest: a Content-Length that is not one whole number (a streamed body raises it too, mid-way).
        ClientGone: the client hung up or passed --read-timeout inside the body (likewise).
    """
    if "chunked" in headers.get("Transfer-Encoding", "").lower():
        return _chunked_pieces(rfile)
    lengths = {v.strip() for v in headers.get_all("Content-Length") or []}
    if not lengths:
        return None
    length = lengths.pop()
    if lengths or not length.isdigit():
        raise BadRequest("Content-Length must be one non-negative whole number of bytes")
    size = int(length)
    if size > BUFFERED_BODY_BYTES:
        return _sized_pieces(rfile, size)
    return b"".join(_sized_pieces(rfile, size))


def upstream_headers(headers: Message, command: str, upstream: Upstream, body: RequestBody) -> dict[str, str]:
    """The headers to send the engine with `body`.

    Args:
        headers: the client's request headers.
        command: the request's method.
        upstream: the engine; its credentials, if any, replace the client's Authorization.
        body: what `request_body` returned.

    Returns:
        The client's end-to-end headers (hop-by-hop ones and those its Connection header names left
        out), with the engine's Host, and the body's framing (Content-Length or chunked).
    """
    named = {h.strip().lower() for h in headers.get("Connection", "").split(",")}
    dropped = HOP_BY_HOP | named | {"host", "content-length", "expect"}
    if upstream.authorization:
        dropped.add("authorization")  # the upstream's own credentials replace the client's
    sent = {k: v for k, v in headers.items() if k.lower() not in dropped}
    sent["Host"] = upstream.host_header
    if upstream.authorization:
        sent["Authorization"] = upstream.authorization
    if isinstance(body, bytes):
        sent["Content-Length"] = str(len(body))
    elif body is not None and "chunked" in headers.get("Transfer-Encoding", "").lower():
        sent["Transfer-Encoding"] = "chunked"
    elif body is not None:
        sent["Content-Length"] = headers["Content-Length"].strip()
    elif command in ("POST", "PUT", "PATCH"):
        sent["Content-Length"] = "0"
    return sent


def _read_piece(rfile: io.BufferedIOBase, size: int) -> bytes:
    try:
        piece = rfile.read1(size)
    except OSError as e:  # --read-timeout, or a reset
        raise ClientGone(f"reading the request body failed: {e}") from e
    if not piece:
        raise ClientGone("the client ended its connection inside the request body")
    return piece


def _read_line(rfile: io.BufferedIOBase, what: str) -> bytes:
    try:
        line = rfile.readline(1025)
    except OSError as e:
        raise ClientGone(f"reading the request body failed: {e}") from e
    if not line.endswith(b"\n"):
        if len(line) > 1024:
            raise BadRequest(f"a chunked request body's {what} line is longer than 1024 bytes")
        raise ClientGone("the client ended its connection inside the request body")
    return line


def _sized_pieces(rfile: io.BufferedIOBase, size: int) -> Iterator[bytes]:
    left = size
    while left:
        piece = _read_piece(rfile, min(left, READ_CHUNK))
        left -= len(piece)
        yield piece


def _chunked_pieces(rfile: io.BufferedIOBase) -> Iterator[bytes]:
    while True:
        token = _read_line(rfile, "chunk size").split(b";")[0].strip()
        if not _HEX.fullmatch(token):
            raise BadRequest(f"a chunked request body has a bad chunk size {token[:20]!r}")
        left = int(token, 16)
        if not left:
            while _read_line(rfile, "trailer") not in (b"\r\n", b"\n"):
                pass
            return
        while left:
            piece = _read_piece(rfile, min(left, READ_CHUNK))
            left -= len(piece)
            yield piece
        if _read_line(rfile, "chunk end") not in (b"\r\n", b"\n"):
            raise BadRequest("a chunk of the request body is longer than its size says")
