"""One engine response on its way to the client, and the copy of its body kept for the recorder.

The response goes on as it arrives: status and end-to-end headers first, then the body piece by
piece, flushed (a body without a length is re-chunked, so server-sent events stream through). A
successful POST whose body is JSON or an event stream is also kept, within the bytes every
connection's captures share (`CaptureBudget`), and handed to the recorder once the engine has sent
all of it. When the engine fails mid-response (closes early, or stalls past the upstream timeout)
the client's connection is closed at once, short of the declared length or the last chunk, so the
client sees the failure as it would directly; the response is counted as `upstream_incomplete` or
`upstream_timeout`.
"""

from __future__ import annotations

import http.client
import logging
from typing import TYPE_CHECKING

from moescope.ingest.proxy.limits import MAX_CAPTURE_BYTES, READ_CHUNK
from moescope.ingest.proxy.recorder import Captured
from moescope.ingest.proxy.request import HOP_BY_HOP

if TYPE_CHECKING:
    from moescope.ingest.proxy.handler import Handler

__all__ = ["ResponseRelay"]

log = logging.getLogger(__name__)


class ResponseRelay:
    """Relay `response` to the client `handler` serves; `run()` once.

    Every response is counted once by the recorder when it is not recorded: its status (a POST
    answered 3xx-5xx), too large, the capture budget full, the engine failing mid-body, or the
    client gone before the body was whole.
    """

    def __init__(self, handler: Handler, response: http.client.HTTPResponse, tags: dict[str, str]):
        self.handler, self.response, self.tags = handler, response, tags
        self.recorder = handler.server.recorder
        self.budget = handler.server.capture_budget
        self.content_type = response.getheader("Content-Type", "")
        self.capture = (handler.command == "POST" and 200 <= response.status < 300
                        and ("json" in self.content_type or "event-stream" in self.content_type))
        self.kept: list[bytes] = []
        self.size = 0  # bytes of the body read so far
        self.reserved = 0  # of those, bytes taken from the capture budget
        self.handed = False
        self.failure: str | None = None  # why the engine's body ended before it was whole

    def run(self) -> None:
        """Send the response on as it arrives; hand a captured body to the recorder once whole."""
        handler, response = self.handler, self.response
        if handler.command == "POST" and response.status >= 300:
            self.recorder.count(f"upstream_status_{response.status // 100}xx")
        try:
            has_body, chunked = self._send_head()
            if has_body:
                self._send_body(chunked)
            if self.failure:
                self._end_early(self.failure)
                return
            if not self.handed:
                self._hand_over()
            if chunked:
                handler.wfile.write(b"0\r\n\r\n")
        except OSError as e:  # writing to the client failed: it went away, or stalled past --read-timeout
            log.debug("moescope proxy: client connection ended mid-response: %s", e)
            handler.close_connection = True
            if self.capture and not self.handed:
                self.recorder.count("client_disconnected")
        finally:
            self.budget.give(self.reserved)
            if self.failure or not self.handed or response.will_close:
                response.close()
                handler.close_upstream()

    def _send_head(self) -> tuple[bool, bool]:
        """Send the status and end-to-end headers; returns whether a body follows and whether it is
        re-chunked (the engine gave no length)."""
        handler, response = self.handler, self.response
        handler.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in HOP_BY_HOP:
                handler.send_header(name, value)
        has_body = handler.command != "HEAD" and response.status not in (204, 304) and response.status >= 200
        chunked = has_body and response.getheader("Content-Length") is None
        if chunked:
            handler.send_header("Transfer-Encoding", "chunked")
        if response.will_close:
            handler.send_header("Connection", "close")
            handler.close_connection = True
        handler.end_headers()
        return has_body, chunked

    def _send_body(self, chunked: bool) -> None:
        """Pass the body on piece by piece until it ends or the engine fails (then `failure` says how)."""
        response = self.response
        while True:
            piece = self._read_piece(chunked)
            if not piece:
                return
            if self.capture:
                self._keep(piece)
            if not chunked and not response.length:  # the last piece of a sized body
                self._hand_over()
            self.handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)

    def _read_piece(self, chunked: bool) -> bytes:
        """The engine's next piece of body; b"" at its end, or when it failed (`failure` set)."""
        response = self.response
        try:
            piece = response.read1(READ_CHUNK) if chunked else response.read(READ_CHUNK)
        except TimeoutError:
            self.failure = "upstream_timeout"
            return b""
        except (OSError, http.client.HTTPException, ValueError):  # closed inside a chunk, reset
            self.failure = "upstream_incomplete"
            return b""
        if not piece and not chunked and response.length:  # closed before the length it declared
            self.failure = "upstream_incomplete"
        return piece

    def _keep(self, piece: bytes) -> None:
        """Keep a copy of `piece` for the recorder, within the size and the shared budget."""
        self.size += len(piece)
        if self.size > MAX_CAPTURE_BYTES:  # forwarded, not recorded: keep nothing more
            self.kept.clear()
        elif self.budget.take(len(piece)):
            self.kept.append(piece)
            self.reserved += len(piece)
        else:  # every connection's captures together are at their bound
            self.capture = False
            self.recorder.count("capture_bytes_full")
            self.kept.clear()

    def _hand_over(self) -> None:
        # Once the engine's whole body is read, before the client's last bytes go out: a client
        # that has its response and flushes the recorder finds the request recorded.
        self.handed = True
        if not self.capture:
            return
        if self.size > MAX_CAPTURE_BYTES:
            self.recorder.count("too_large")
        elif self.kept or not self.size:
            self.recorder.submit(Captured(b"".join(self.kept), self.content_type, self.tags))

    def _end_early(self, failure: str) -> None:
        # The client sees the engine's failure as it would directly: its connection ends now, short
        # of the declared length or the last chunk.
        handler = self.handler
        log.warning("moescope proxy: the upstream's response to %s %s ended early (%s)", handler.command,
                    handler.path[:200], failure)
        self.recorder.count(failure)
        handler.close_connection = True
