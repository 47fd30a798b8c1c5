"""The proxy's HTTP server: `RoutingProxy` forwards every request to the engine and records the
routing the responses carry.

The server takes client connections within `ProxyLimits.max_connections` (when all are taken the
one idle longest is hung up to make room; with none idle new clients wait in the listen backlog),
serves each on its own thread (`Handler`), and stops serving once its recorder has failed
(`RoutingProxy.failure`; the command exits 1), answering 503 rather than passing traffic it cannot
record.

Stopping: `RoutingProxy.stop_accepting()` stops the server taking requests (SIGTERM does it, see
`moescope.cli.ingest`), `shutdown()` waits for the requests in flight, drains the recorder and
writes the final counts. Listens on 127.0.0.1 unless told otherwise; the upstream must be http://
(a proxy on the same host or network as the engine).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

from moescope.ingest.proxy.bounds import CaptureBudget, Deadlines, hang_up
from moescope.ingest.proxy.handler import Handler
from moescope.ingest.proxy.limits import DEFAULT_MAX_QUEUE_BYTES, LISTEN_BACKLOG, ProxyLimits, Upstream, parse_upstream
from moescope.ingest.proxy.recorder import RoutingRecorder
from moescope.ingest.trace_checks import EngineMap
from moescope.store.location import StoreLocation

__all__ = ["ProxyServer", "RecorderFailed", "RoutingProxy"]

log = logging.getLogger(__name__)


class RecorderFailed(RuntimeError):
    """The recorder's thread ended while the proxy was serving: it stops rather than pass traffic
    it cannot record."""


class ProxyServer(ThreadingHTTPServer):
    """A threading HTTP server of `Handler`s that forward to `upstream`, holding what they share:
    the recorder, the limits, the capture budget, the header deadlines, and which connections are
    open and which of them wait for a request."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], upstream: Upstream, recorder: RoutingRecorder,
                 limits: ProxyLimits, capture_bytes: int):
        super().__init__(address, Handler)
        self.upstream, self.recorder, self.limits = upstream, recorder, limits
        self.capture_budget = CaptureBudget(capture_bytes)
        self.deadlines = Deadlines(tick_s=min(0.1, limits.header_timeout_s / 5))
        self.stopping = threading.Event()
        self._answering = 0
        self._idle = threading.Condition()
        # Open client connections -> whether each waits for a request (insertion order: idle longest first).
        self._connections: dict[socket.socket, bool] = {}
        self._connections_changed = threading.Condition()

    def service_actions(self) -> None:
        """Between two polls of the serving loop: stop serving once the recorder has failed."""
        if why := self.recorder.failed:
            raise RecorderFailed(why)

    def process_request(self, request, client_address) -> None:
        """Serve a new connection once there is room: when every one of `max_connections` is taken
        the one idle longest is hung up; with none idle the serving loop waits for one to free up
        (new clients wait in the listen backlog meanwhile, as for an engine's own queue)."""
        with self._connections_changed:
            while len(self._connections) >= self.limits.max_connections:
                idle = next((sock for sock, waiting in self._connections.items() if waiting), None)
                if idle is not None:
                    del self._connections[idle]  # its thread sees the connection end and returns
                    hang_up(idle)
                    break
                if self.stopping.is_set() or self.recorder.failed:
                    super().shutdown_request(request)
                    return
                self._connections_changed.wait(0.1)
            self._connections[request] = True
        super().process_request(request, client_address)

    def connection_busy(self, sock: socket.socket, busy: bool) -> bool:
        """Mark a connection as answering a request or waiting for one; False if it was hung up."""
        with self._connections_changed:
            if sock not in self._connections:
                return False
            del self._connections[sock]
            self._connections[sock] = not busy
            self._connections_changed.notify_all()
            return True

    def hang_up_idle(self) -> None:
        """End every connection waiting for a request (stopping: none of them gets another)."""
        with self._connections_changed:
            for sock, waiting in self._connections.items():
                if waiting:
                    hang_up(sock)

    def shutdown_request(self, request) -> None:
        with self._connections_changed:
            self._connections.pop(request, None)
            self._connections_changed.notify_all()
        super().shutdown_request(request)

    def server_close(self) -> None:
        super().server_close()
        self.deadlines.close()

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        with self._idle:
            self._answering += 1
        try:
            yield
        finally:
            with self._idle:
                self._answering -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout_s: float | None) -> bool:
        """Wait until no request is being answered; False if some still are after `timeout_s`."""
        with self._idle:
            return self._idle.wait_for(lambda: self._answering == 0, timeout_s)


class RoutingProxy:
    """The proxy: a threading HTTP server forwarding to `upstream`, and its recorder.

    `start()` serves on a background thread (tests, embedding); `serve_forever()` in the caller's,
    until `stop_accepting()` (from another thread) or until the recorder fails (then `failure`
    says why). `shutdown()` stops serving, waits for the requests in flight, and drains the
    recorder. `limits` bounds connections and time (`ProxyLimits`), `max_queue_bytes` the response
    bytes waiting to be recorded (and as much again being captured).
    """

    def __init__(self, upstream: str, store: str | os.PathLike | StoreLocation, num_experts: int,
                 host: str = "127.0.0.1",
                 port: int = 8100, run_id: str | None = None, tags: dict[str, str] | None = None,
                 num_layers: int | None = None, top_k: int | None = None, max_queue: int = 1024,
                 flush_interval_s: float = 2.0, limits: ProxyLimits | None = None,
                 max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES, record_token_ids: bool = False,
                 engine_map: EngineMap | None = None):
        """Bind the address and open the run; nothing is served before `start()` or `serve_forever()`.

        Args:
            upstream: the engine, `http://[USER:PASSWORD@]HOST[:PORT][/PATH]` (`parse_upstream`).
            store: the store, a folder or a URL (a `StoreLocation` carries its storage options).
            num_experts: experts per layer, as the recorder takes it (`RoutingRecorder`).
            host: the address to listen on.
            port: the port to listen on (`port=0`: a free port, see `.port`).
            run_id: the recorder's (`RoutingRecorder`), as are the arguments below but `limits`.
            tags: the recorder's.
            num_layers: the recorder's.
            top_k: the recorder's.
            max_queue: the recorder's.
            flush_interval_s: the recorder's.
            limits: the connection and time bounds (`ProxyLimits()` when None).
            max_queue_bytes: the recorder's; the server bounds what it captures by it too.
            record_token_ids: the recorder's.
            engine_map: the recorder's: the engine's map, for the physical_ids trace check.

        Raises:
            ValueError: an upstream that is not http://HOST[:PORT], a bad limit, a map of another
                expert count, or a run id the store already has.
            OSError: the address cannot be bound or the store cannot be written.
        """
        self.upstream = parse_upstream(upstream)
        self.upstream_url = self.upstream.url  # without credentials: what messages show
        self.limits = limits or ProxyLimits()
        self.failure: str | None = None
        self.recorder = RoutingRecorder(store, num_experts, run_id=run_id, tags=tags, num_layers=num_layers,
                                        top_k=top_k, max_queue=max_queue, flush_interval_s=flush_interval_s,
                                        max_queue_bytes=max_queue_bytes, record_token_ids=record_token_ids,
                                        engine_map=engine_map)
        try:
            self.server = ProxyServer((host, port), self.upstream, self.recorder, self.limits, max_queue_bytes)
        except BaseException:
            self.recorder.shutdown()
            raise
        address = self.server.server_address
        assert isinstance(address, tuple) and isinstance(address[0], str)  # an AF_INET server's (host, port)
        self.host, self.port = address[0], address[1]
        self._thread: threading.Thread | None = None

    def start(self) -> RoutingProxy:
        """Serve on a background thread (tests, embedding); returns this proxy."""
        self._thread = threading.Thread(target=self.serve_forever, name="moescope-proxy", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve on this thread until `stop_accepting()` is called from another, or the recorder
        fails (`failure` then says why, and requests still arriving are answered 503)."""
        try:
            self.server.serve_forever(0.1)
        except RecorderFailed as e:
            self.failure = str(e)
            self.server.stopping.set()
            log.error("moescope proxy: %s; it stops taking requests", e)

    def stop_accepting(self) -> None:
        """Take no more requests: the serving loop returns, and each kept-alive connection closes
        after the request it carries. Blocks until the loop has stopped (so call it from another
        thread than the loop's: `GracefulStop` runs it on one of its own)."""
        self.server.stopping.set()
        self.server.shutdown()
        self.server.hang_up_idle()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop serving, wait (at most `timeout_s`) for the requests in flight, then drain the
        recorder and write the run's final counts; safe to call twice."""
        self.server.stopping.set()
        if self._thread is not None:
            self.server.shutdown()
            self._thread.join(10)
            self._thread = None
        self.server.hang_up_idle()
        if not self.server.wait_idle(timeout_s):
            log.warning("moescope proxy: requests still in flight after %g s are not waited for; routing they "
                        "return is counted as not recorded (closed)", timeout_s)
        self.server.server_close()
        self.recorder.shutdown()

    def __enter__(self) -> RoutingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
