"""`moescope proxy`: record the routed experts a vLLM or SGLang server returns, live, per request.

The proxy sits in front of an OpenAI-compatible server and forwards every request and response
unchanged: status, headers and body, streamed chunk by chunk (server-sent events included) and
flushed as they arrive. On the side it keeps a copy of each successful response body and hands it
to a `RoutingRecorder`, which records a step per request into the store.

The recorder is the write pipeline's three layers, as for the probe: the request thread only hands
a captured body over (`RoutingRecorder.submit` is `BatchProcessor.emit` under the `drop` policy:
never blocking, a full queue drops the response and counts it); the processor's worker runs the
recorder's exporter, which parses the routed experts out of each body (`store.importers.responses`),
buffers the steps and writes them through the run's writer (`store.writer.run_writer`);
`store.schema` and `store.importers.tables` build the rows. A response without a routing field is
counted, not fatal. Request headers become step tags: `x-router-version: v2` becomes
`router_version=v2`, `x-moescope-tag-<key>: <value>` becomes `<key>=<value>`. Responses not
recorded are counted in `probe_stats` (table_name "steps", one row per reason), like the probe's
own drops, and the run's writer writes its final counts when the recorder shuts down.

Stopping: `RoutingProxy.stop_accepting()` stops the server taking requests (SIGTERM does it, see
`store.importers.cli`), `shutdown()` waits for the requests in flight, drains the recorder and
writes the final counts. Listens on 127.0.0.1 unless told otherwise; the upstream must be http://
(a proxy on the same host or network as the engine).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import http.client
import json
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from moescope.pipeline import BatchProcessor, current_host, new_run_id
from moescope.store.importers.responses import (
    is_sglang,
    is_vllm,
    merge_vllm_stream,
    sequences_step,
    sglang_sequences,
    vllm_sequences,
)
from moescope.store.importers.tables import (
    LayerShape,
    RunSpec,
    SourceFormatError,
    SourceStep,
    build_step_tables,
    check_new_run,
    check_tags,
    run_tables,
)
from moescope.store.layout import check_name
from moescope.store.location import StoreLocation, open_location
from moescope.store.writer import RunWriter, run_writer

log = logging.getLogger(__name__)

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "trailers", "transfer-encoding", "upgrade", "proxy-connection"}
TAG_HEADER_PREFIX = "x-moescope-tag-"
ROUTER_VERSION_HEADER = "x-router-version"
MAX_CAPTURE_BYTES = 64 * 1024 * 1024  # a response larger than this is forwarded but not recorded
READ_CHUNK = 64 * 1024


def parse_listen(listen: str) -> tuple[str, int]:
    """'HOST:PORT' (or ':PORT', meaning 127.0.0.1) as (host, port); raises ValueError."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen {listen!r}: write it as HOST:PORT, e.g. 127.0.0.1:8100")
    return host.strip("[]") or "127.0.0.1", int(port)


def request_tags(headers) -> dict[str, str]:
    """Step tags from request headers; a header that makes no valid tag is ignored."""
    tags = {}
    for name, value in headers.items():
        lower = name.lower()
        if lower == ROUTER_VERSION_HEADER:
            tags["router_version"] = value.strip()
        elif lower.startswith(TAG_HEADER_PREFIX) and len(lower) > len(TAG_HEADER_PREFIX):
            tags[lower[len(TAG_HEADER_PREFIX):]] = value.strip()
    valid = {}
    for key, value in tags.items():
        try:
            valid.update(check_tags({key: value}))
        except ValueError:
            log.debug("moescope proxy: ignoring tag header %s", key)
    return valid


@dataclass
class Captured:
    """One response as the request thread handed it over: a record of the write pipeline (one step
    if it holds routing; its body's bytes are what it costs in the queue)."""

    body: bytes
    content_type: str
    tags: dict[str, str]
    ts: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc))

    def rows(self) -> dict[str, int]:
        return {"steps": 1}

    @property
    def nbytes(self) -> int:
        return len(self.body)


def sse_events(body: bytes) -> list:
    """The JSON payloads of a server-sent event stream, `[DONE]` left out."""
    events, data = [], []
    for line in body.decode("utf-8", errors="replace").splitlines() + [""]:
        if line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        elif not line.strip() and data:
            payload = "\n".join(data).strip()
            data = []
            if payload and payload != "[DONE]":
                events.append(json.loads(payload))
    return events


class RoutingRecorder:
    """A write pipeline (`BatchProcessor`, policy "drop") whose exporter turns captured responses
    into steps of one run.

    `submit` never blocks and never raises. Steps are buffered and written every
    `flush_interval_s` or `max_steps`, whichever comes first; `shutdown()` drains the queue, writes
    what is left and the run's final counts, and is safe to call twice. `counts` says how many
    responses were recorded and, per reason, how many were not.
    """

    def __init__(self, root: str | os.PathLike | StoreLocation, num_experts: int, run_id: str | None = None,
                 tags: dict[str, str] | None = None, num_layers: int | None = None, top_k: int | None = None,
                 max_queue: int = 1024, flush_interval_s: float = 2.0, max_steps: int = 256,
                 model: str = "served model"):
        """`root`: the store, a folder or a URL (a `StoreLocation` carries its storage options).
        Raises ValueError for a bad option, a store URL that cannot be used or a run id the store
        already has, and OSError when the store does not take the run's first row."""
        if num_experts < 1:
            raise ValueError(f"--num-experts must be positive, not {num_experts}")
        self.location = open_location(root)
        self.root = self.location.redacted  # how messages name the store
        self.num_experts = num_experts
        self.num_layers, self.top_k = num_layers, top_k
        run_id = check_name("run_id", run_id) if run_id else new_run_id("proxy")
        check_new_run(self.location, run_id)
        self.spec = RunSpec(run_id=run_id, source="proxy", model=model, tags=check_tags(dict(tags or {})),
                            host=current_host(),
                            started_at=dt.datetime.now(dt.timezone.utc))
        self.flush_interval_s, self.max_steps = flush_interval_s, max_steps
        self._counts: Counter[str] = Counter()  # recorded, and each reason a response was not (but the queue's)
        self._lock = threading.Lock()
        self._shapes: dict[int, LayerShape] = {}
        self._pending: list[SourceStep] = []
        self._first_pending_at: float | None = None
        self._next_step = 0
        self.writer: RunWriter = run_writer(self.location, run_id)
        if not self.writer.write("runs", run_tables(self.spec, {}, [0])["runs"], retried=True):
            self.writer.release()
            raise OSError(f"cannot write to the store {self.root!r}: {self.writer.last_error}")
        self.processor = BatchProcessor([_ResponseExporter(self)], max_queue=max_queue, policy="drop",
                                        flush_interval_s=flush_interval_s, max_batch=max_steps,
                                        name="moescope-proxy-recorder")
        self.writer.watch(self.processor)  # the queue's drops (queue_full, closed) go into probe_stats

    # -- the request thread's side -------------------------------------------------------------

    def submit(self, captured: Captured) -> None:
        """Hand a response over; never blocks, never raises (a full queue drops and counts it)."""
        self.processor.emit(captured)

    def count(self, reason: str) -> None:
        """Count a response that was not recorded (too large, upstream error, no routing, ...)."""
        with self._lock:
            self._counts[reason] += 1
        self.writer.count_dropped("steps", reason, rows=1, records=1)

    @property
    def counts(self) -> Counter[str]:
        """Responses recorded, and per reason the ones that were not (the queue's drops included)."""
        with self._lock:
            counts = Counter(self._counts)
        counts.update(self.processor.drop_counts()[1])
        return counts

    # -- the exporter (the processor's worker) ----------------------------------------------------

    def _record(self, captured: Captured) -> None:
        try:
            sequences = self._sequences(captured)
            if sequences is None:
                self.count("no_routing")
                return
            step, _ = sequences_step(sequences, self._next_step, captured.ts, "response", tags=captured.tags)
            self._check(step)
        except (SourceFormatError, ValueError) as e:  # json errors are ValueErrors too
            log.warning("moescope proxy: a response's routing could not be read: %s", e)
            self.count("bad_routing")
            return
        self._next_step += 1
        self._pending.append(step)
        if self._first_pending_at is None:
            self._first_pending_at = time.monotonic()
        with self._lock:
            self._counts["recorded"] += 1

    def _sequences(self, captured: Captured):
        if "text/event-stream" in captured.content_type:
            bodies, stream = sse_events(captured.body), True
        else:
            value = json.loads(captured.body)
            bodies, stream = (value if isinstance(value, list) else [value]), False
        if any(is_vllm(b) for b in bodies):
            body = bodies[0] if len(bodies) == 1 and not stream else merge_vllm_stream(bodies, "response")
            return vllm_sequences(body, "response")
        if any(is_sglang(b) for b in bodies):
            return sglang_sequences(bodies, self.num_layers, self.top_k, "response", stream=stream)
        return None

    def _check(self, step: SourceStep) -> None:
        for layer, routes in step.routes.items():
            k = routes.expert_ids.shape[1]
            known = self._shapes.get(layer)
            if known is not None and known.top_k != k:
                raise SourceFormatError(f"layer {layer} routes {k} experts per token, earlier responses {known.top_k}")
            if len(routes.expert_ids) and int(routes.expert_ids.max()) >= self.num_experts:
                raise SourceFormatError(f"layer {layer} routes to expert {int(routes.expert_ids.max())}, outside "
                                        f"--num-experts {self.num_experts}")

    def _due(self) -> bool:
        return len(self._pending) >= self.max_steps or (
            self._first_pending_at is not None and time.monotonic() - self._first_pending_at >= self.flush_interval_s)

    def _write_pending(self) -> None:
        steps, self._pending, self._first_pending_at = self._pending, [], None
        if not steps:
            return
        new = {layer: LayerShape(self.num_experts, s.routes[layer].expert_ids.shape[1])
               for s in steps for layer in s.routes if layer not in self._shapes}
        self._shapes.update(new)
        tables = build_step_tables(steps, self.spec, self._shapes)
        if new:
            tables["layers"] = run_tables(self.spec, new, [0])["layers"]
        written = [self.writer.write(table, data) for table, data in tables.items()]  # refused rows are counted
        if not written[list(tables).index("steps")]:
            log.error("moescope proxy: writing %d steps to %s failed: %s", len(steps), self.root,
                      self.writer.last_error)
            with self._lock:
                self._counts["recorded"] -= len(steps)
                self._counts["write_failed"] += len(steps)

    # -- stopping --------------------------------------------------------------------------------

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Record everything submitted so far and write it; False on timeout."""
        return self.processor.force_flush(timeout_s)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Drain the queue, write what is left and the run's final counts; safe to call twice."""
        self.processor.shutdown(timeout_s)

    def report(self) -> str:
        counts = self.counts
        others = ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items()) if reason != "recorded" and n)
        return (f"moescope proxy: recorded {counts.get('recorded', 0)} responses into run {self.spec.run_id}"
                + (f"; not recorded: {others}" if others else ""))


class _ResponseExporter:
    """The recorder's exporter, on its processor's worker: parse, buffer, write (see RoutingRecorder)."""

    def __init__(self, recorder: RoutingRecorder):
        self.recorder = recorder
        self._closed = False

    def export(self, records: Sequence[Captured]) -> bool:
        for captured in records:
            self.recorder._record(captured)
        if self.recorder._due():
            self.recorder._write_pending()
        return True

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        self.recorder._write_pending()
        self.recorder.writer.write_changed_stats()
        return True

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.recorder._write_pending()
        self.recorder.writer.release()  # the last holder: the run's final probe_stats


class _Handler(BaseHTTPRequestHandler):
    """Forwards one client connection's requests; one instance per connection (keep-alive reuses it)."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: _ProxyServer
    _upstream: http.client.HTTPConnection | None = None  # this connection's to the upstream, kept alive

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        log.debug("moescope proxy: " + format, *args)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        with self.server.answering():  # a stop waits for the requests being answered
            self._forward()
        if self.server.stopping.is_set():
            self.close_connection = True  # a kept-alive connection takes no more requests

    do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_HEAD = do_GET

    def _request_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _upstream_headers(self, body: bytes) -> dict[str, str]:
        named = {h.strip().lower() for h in self.headers.get("Connection", "").split(",")}
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in HOP_BY_HOP | named | {"host", "content-length", "expect"}}
        headers["Host"] = self.server.upstream_host
        if body or self.command in ("POST", "PUT", "PATCH"):
            headers["Content-Length"] = str(len(body))
        return headers

    def _send_upstream(self, body: bytes) -> http.client.HTTPResponse:
        headers = self._upstream_headers(body)
        path = self.server.upstream_path + self.path
        for attempt in (0, 1):
            conn = self._upstream
            fresh = conn is None
            if conn is None:
                conn = self._upstream = http.client.HTTPConnection(self.server.upstream_hostname,
                                                                   self.server.upstream_port,
                                                                   timeout=self.server.upstream_timeout_s)
            try:
                conn.request(self.command, path, body=body or None, headers=headers)
                return conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                conn.close()
                self._upstream = None
                if fresh or attempt:  # a kept-alive connection the upstream closed: retry once on a new one
                    raise OSError(str(e)) from e
        raise AssertionError("unreachable")

    def _forward(self) -> None:
        recorder = self.server.recorder
        body = self._request_body()
        tags = request_tags(self.headers)
        try:
            response = self._send_upstream(body)
        except (OSError, http.client.HTTPException) as e:
            self._upstream = None
            recorder.count("upstream_unreachable")
            message = json.dumps({"error": {"message": f"moescope proxy: the upstream {self.server.upstream_url} "
                                                       f"did not answer: {e}", "type": "bad_gateway"}}).encode()
            self.send_response(502)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(message)))
            self.end_headers()
            self.wfile.write(message)
            return
        capture = (self.command == "POST" and 200 <= response.status < 300)
        content_type = response.getheader("Content-Type", "")
        if capture and "json" not in content_type and "event-stream" not in content_type:
            capture = False
        if self.command == "POST" and response.status >= 300:
            recorder.count(f"upstream_status_{response.status // 100}xx")
        kept: list[bytes] = []
        size, complete = 0, False

        def hand_over() -> None:
            # Once the engine's whole body is read, before the client's last bytes go out: a client
            # that has its response and flushes the recorder finds the request recorded.
            if not capture:
                return
            if size > MAX_CAPTURE_BYTES:
                recorder.count("too_large")
            else:
                recorder.submit(Captured(b"".join(kept), content_type, tags))

        try:
            self.send_response_only(response.status, response.reason)
            for name, value in response.getheaders():
                if name.lower() not in HOP_BY_HOP:
                    self.send_header(name, value)
            has_body = self.command != "HEAD" and response.status not in (204, 304) and response.status >= 200
            chunked = has_body and response.getheader("Content-Length") is None
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
            if response.will_close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            while has_body:
                piece = response.read1(READ_CHUNK) if chunked else response.read(READ_CHUNK)
                if not piece:
                    break
                if capture:
                    size += len(piece)
                    if size <= MAX_CAPTURE_BYTES:
                        kept.append(piece)
                if not chunked and not response.length:  # the last piece of a sized body
                    complete = True
                    hand_over()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if not complete:
                complete = True
                hand_over()
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError, socket.timeout) as e:  # the client went away, or stalled
            log.debug("moescope proxy: client connection ended mid-response: %s", e)
            self.close_connection = True
            if capture and not complete:
                recorder.count("client_disconnected")
        finally:
            if not complete or response.will_close:
                response.close()
                if self._upstream is not None:
                    self._upstream.close()
                    self._upstream = None

    def finish(self) -> None:
        super().finish()
        if self._upstream is not None:
            self._upstream.close()


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    recorder: RoutingRecorder
    upstream_url: str
    upstream_host: str
    upstream_hostname: str
    upstream_port: int
    upstream_path: str
    upstream_timeout_s: float

    def __init__(self, address: tuple[str, int]):
        super().__init__(address, _Handler)
        self.stopping = threading.Event()
        self._answering = 0
        self._idle = threading.Condition()

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
    until `stop_accepting()` (from another thread). `shutdown()` stops serving, waits for the
    requests in flight, and drains the recorder. `port=0` picks a free port (see `.port`). Raises
    ValueError for an upstream that is not http://HOST[:PORT], or a run id the store already has;
    OSError when the address cannot be bound or the store cannot be written.
    """

    def __init__(self, upstream: str, store: str | os.PathLike | StoreLocation, num_experts: int,
                 host: str = "127.0.0.1",
                 port: int = 8100, run_id: str | None = None, tags: dict[str, str] | None = None,
                 num_layers: int | None = None, top_k: int | None = None, max_queue: int = 1024,
                 flush_interval_s: float = 2.0, upstream_timeout_s: float = 600.0):
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--upstream {upstream!r}: give the engine's base URL as http://HOST:PORT")
        self.upstream_url = upstream.rstrip("/")
        self.recorder = RoutingRecorder(store, num_experts, run_id=run_id, tags=tags, num_layers=num_layers,
                                        top_k=top_k, max_queue=max_queue, flush_interval_s=flush_interval_s)
        try:
            self.server = _ProxyServer((host, port))
        except BaseException:
            self.recorder.shutdown()
            raise
        self.server.recorder = self.recorder
        self.server.upstream_url = self.upstream_url
        self.server.upstream_hostname = parts.hostname
        self.server.upstream_port = parts.port or 80
        self.server.upstream_host = parts.netloc
        self.server.upstream_path = parts.path.rstrip("/")
        self.server.upstream_timeout_s = upstream_timeout_s
        address = self.server.server_address
        assert isinstance(address, tuple) and isinstance(address[0], str)  # an AF_INET server's (host, port)
        self.host, self.port = address[0], address[1]
        self._thread: threading.Thread | None = None

    def start(self) -> RoutingProxy:
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.1,), name="moescope-proxy",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve on this thread until `stop_accepting()` is called from another."""
        self.server.serve_forever(0.1)

    def stop_accepting(self) -> None:
        """Take no more requests: the serving loop returns, and each kept-alive connection closes
        after the request it carries. Blocks until the loop has stopped (so call it from another
        thread than the loop's: `GracefulStop` runs it on one of its own)."""
        self.server.stopping.set()
        self.server.shutdown()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop serving, wait (at most `timeout_s`) for the requests in flight, then drain the
        recorder and write the run's final counts; safe to call twice."""
        self.server.stopping.set()
        if self._thread is not None:
            self.server.shutdown()
            self._thread.join(10)
            self._thread = None
        if not self.server.wait_idle(timeout_s):
            log.warning("moescope proxy: requests still in flight after %g s are not waited for; routing they "
                        "return is counted as not recorded (closed)", timeout_s)
        self.server.server_close()
        self.recorder.shutdown()

    def __enter__(self) -> RoutingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
