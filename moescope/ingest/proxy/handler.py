"""One client connection of the proxy: read each request within the bounds, forward it to the engine,
relay the answer (`ResponseRelay`).

http.server's own request loop, with the proxy's bounds (`ProxyLimits`): a request is waited for at
most the idle timeout, its line and headers must be whole within the header timeout (a deadline
across reads, `Deadlines`), and a header block the client did not finish is never acted on. Each
connection keeps its own kept-alive connection to the engine; one the engine closed is retried once
on a new one when the request's body can be sent again.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import logging
import time
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any, cast

from moescope.ingest.proxy.relay import ResponseRelay
from moescope.ingest.proxy.request import BadRequest, ClientGone, RequestBody, request_body, upstream_headers
from moescope.ingest.proxy.tags import request_tags

if TYPE_CHECKING:
    from moescope.ingest.proxy.server import ProxyServer

__all__ = ["Handler"]

log = logging.getLogger(__name__)


class _LineReader:
    """The connection's reader while a request line and its headers are read: it remembers the last
    line, so a header block that ended at end-of-file (the client hung up) is told from a whole one."""

    def __init__(self, rfile: io.BufferedIOBase):
        self.rfile = rfile
        self.last = b""

    def readline(self, limit: int = -1) -> bytes:
        self.last = self.rfile.readline(limit)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rfile, name)


class Handler(BaseHTTPRequestHandler):
    """Forwards one client connection's requests; one instance per connection (keep-alive reuses it)."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: ProxyServer
    _upstream: http.client.HTTPConnection | None = None  # this connection's to the upstream, kept alive

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("moescope proxy: " + format, *args)

    def handle_one_request(self) -> None:
        """http.server's, with the proxy's bounds: wait for a request at most the idle timeout,
        read its line and headers within the header timeout, and never act on a header block the
        client did not finish."""
        server, limits = self.server, self.server.limits
        self.close_connection = True
        try:
            self.connection.settimeout(limits.idle_timeout_s)
            # the client closed, or the proxy hung up this idle connection
            if not cast(io.BufferedReader, self.rfile).peek(1):
                return
        except OSError:  # idle past --idle-timeout, or reset
            return
        if not server.connection_busy(self.connection, True):
            return  # hung up to make room just as a request came
        try:
            self._handle_request()
        finally:
            server.connection_busy(self.connection, False)

    def _handle_request(self) -> None:
        if not self._read_head():
            self.close_connection = True
            return
        self.connection.settimeout(self.server.limits.read_timeout_s)
        method = getattr(self, "do_" + self.command, None)
        if method is None:
            self.send_error(501, f"Unsupported method ({self.command!r})")
            return
        method()
        with contextlib.suppress(OSError):
            self.wfile.flush()

    def _read_head(self) -> bool:
        """Read the request line and headers within the header timeout; False when there is no
        whole request to act on (a 414 was answered, the client hung up or was too slow)."""
        server, limits = self.server, self.server.limits
        reader = _LineReader(self.rfile)
        self.rfile = reader  # type: ignore[assignment]
        self.connection.settimeout(limits.header_timeout_s)
        server.deadlines.arm(self.connection, time.monotonic() + limits.header_timeout_s)
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.send_error(414)
                return False
            parsed = bool(self.raw_requestline) and self.parse_request()
        except OSError:  # the header timeout, or a reset
            return False
        finally:
            server.deadlines.disarm(self.connection)
            self.rfile = reader.rfile
        if not parsed:
            return False
        if reader.last not in (b"\r\n", b"\n"):
            log.debug("moescope proxy: a client ended its connection inside a request's headers; not forwarded")
            return False
        return True

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        with self.server.answering():  # a stop waits for the requests being answered
            self._forward()
        if self.server.stopping.is_set():
            self.close_connection = True  # a kept-alive connection takes no more requests

    do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_HEAD = do_GET

    def _forward(self) -> None:
        server = self.server
        recorder = server.recorder
        if why := recorder.failed:
            self._answer_error(503, f"{why}; the proxy is stopping: send requests to the engine directly or "
                                    "restart the proxy", "unavailable")
            return
        try:
            body = request_body(self.rfile, self.headers)
            response = self._send_upstream(body)
        except ClientGone as e:
            log.debug("moescope proxy: request not forwarded: %s", e)
            self.close_connection = True
            return
        except BadRequest as e:
            self._answer_error(400, f"{e}; the request was not forwarded", "invalid_request_error")
            return
        except TimeoutError:
            recorder.count("upstream_timeout")
            self._answer_error(504, f"the upstream {server.upstream.url} did not answer within "
                                    f"--upstream-timeout {server.limits.upstream_timeout_s:g} s", "gateway_timeout")
            return
        except (OSError, http.client.HTTPException) as e:
            recorder.count("upstream_unreachable")
            self._answer_error(502, f"the upstream {server.upstream.url} did not answer: {e}", "bad_gateway")
            return
        ResponseRelay(self, response, request_tags(self.headers)).run()

    def _send_upstream(self, body: RequestBody) -> http.client.HTTPResponse:
        """The engine's response. Raises ClientGone / BadRequest (from a streamed body: the
        engine's connection is closed under the unfinished request), TimeoutError past the upstream
        timeout, OSError or HTTPException when the engine cannot be reached."""
        upstream = self.server.upstream
        headers = upstream_headers(self.headers, self.command, upstream, body)
        streamed = body is not None and not isinstance(body, bytes)
        if streamed:  # a streamed body cannot be sent twice: a fresh connection
            self.close_upstream()
        for attempt in (0, 1):
            conn = self._upstream
            fresh = conn is None
            if conn is None:
                conn = self._upstream = http.client.HTTPConnection(upstream.hostname, upstream.port,
                                                                   timeout=self.server.limits.upstream_timeout_s)
            try:
                conn.request(self.command, upstream.path + self.path, body=body, headers=headers,
                             encode_chunked=headers.get("Transfer-Encoding") == "chunked")
                return conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                conn.close()
                self._upstream = None
                if fresh or attempt or streamed:  # a kept-alive connection the upstream closed: retry once
                    raise OSError(str(e)) from e
            except BaseException:
                conn.close()  # a request cut short goes no further: the engine sees its connection end
                self._upstream = None
                raise
        raise AssertionError("unreachable")

    def close_upstream(self) -> None:
        """Close this connection's kept-alive connection to the engine; the next request opens a new one."""
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None

    def _answer_error(self, status: int, message: str, kind: str) -> None:
        """Answer the client with a JSON error (OpenAI's shape) and close its connection."""
        payload = json.dumps({"error": {"message": f"moescope proxy: {message}", "type": kind}}).encode()
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(payload)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        if self._upstream is not None:
            self._upstream.close()
