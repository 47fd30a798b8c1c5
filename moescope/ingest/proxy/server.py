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
`store.schema` and `store.importers.tables` build the rows. A response without a routing field, or
one whose body cannot be read (any error while parsing it), is counted and skipped: one odd body
never stops the recorder. Should its thread end all the same, `RoutingRecorder.failed` says why,
the proxy answers 503 instead of passing traffic it cannot record, and its serving loop stops
(`RoutingProxy.failure`; the command exits 1). Request headers become step tags:
`x-router-version: v2` becomes `router_version=v2`, `x-moescope-tag-<key>: <value>` becomes
`<key>=<value>`; a value `check_tags` refuses (control characters, too long) is left out. Prompt
and generated token ids are left out of `routes.token_id` (null) unless `record_token_ids` is set:
with a tokenizer they give the user's text back. Responses not recorded are counted in
`probe_stats` (table_name "steps", one row per reason), like the probe's own drops, and the run's
writer writes its final counts when the recorder shuts down.

Bounds (`ProxyLimits`; each is a flag of the command): at most `max_connections` client
connections; when they are all taken the one idle longest is hung up to make room, and with none
idle new clients wait in the listen backlog until one is free (a request in flight is never cut
off). A kept-alive connection is closed after `idle_timeout_s` without a request, a request
whose line and headers take longer than `header_timeout_s` in all is dropped, and the client must
send each piece of a body and take each piece of a response within `read_timeout_s`; the engine
must answer within `upstream_timeout_s` per read. Request bodies are streamed to the engine (one of up to
`BUFFERED_BODY_BYTES` is read whole first), and a request the client cut short (its headers or
its body) never reaches the engine whole: the engine's connection is closed under it. Responses
waiting to be recorded hold at most `max_queue_bytes` in the queue plus as much again being
captured. When the engine fails mid-response (closes early, or stalls past the upstream timeout)
the client's connection is closed at once, so the client sees the failure as it would directly,
and the response is counted as `upstream_incomplete` or `upstream_timeout`.

The upstream is http://[USER:PASSWORD@]HOST[:PORT][/PATH]: credentials in it are sent as
`Authorization: Basic` (replacing any the client sent) and never printed, logged or returned;
`RoutingProxy.upstream_url` is the URL without them.

Stopping: `RoutingProxy.stop_accepting()` stops the server taking requests (SIGTERM does it, see
`store.importers.cli`), `shutdown()` waits for the requests in flight, drains the recorder and
writes the final counts. Listens on 127.0.0.1 unless told otherwise; the upstream must be http://
(a proxy on the same host or network as the engine).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import http.client
import io
import json
import logging
import os
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import cast
from urllib.parse import unquote, urlsplit

from moescope.core.pipeline import BatchProcessor, current_host, new_run_id
from moescope.ingest.importers.responses import (
    is_sglang,
    is_vllm,
    merge_vllm_stream,
    sequences_step,
    sglang_sequences,
    vllm_sequences,
)
from moescope.ingest.importers.tables import (
    LayerShape,
    RunSpec,
    SourceFormatError,
    SourceStep,
    build_step_tables,
    check_new_run,
    check_tags,
    run_tables,
)
from moescope.store.location import StoreLocation, open_location
from moescope.store.naming import check_name
from moescope.store.writer import RunWriter, run_writer

log = logging.getLogger(__name__)

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "trailers", "transfer-encoding", "upgrade", "proxy-connection"}
TAG_HEADER_PREFIX = "x-moescope-tag-"
ROUTER_VERSION_HEADER = "x-router-version"
MAX_CAPTURE_BYTES = 64 * 1024 * 1024  # a response larger than this is forwarded but not recorded
READ_CHUNK = 64 * 1024
# A request body up to this size is read whole before it is sent, so a kept-alive engine connection
# that turns out closed can be retried on a new one; a larger body (or a chunked one) is streamed.
BUFFERED_BODY_BYTES = 1024 * 1024
# Connections the kernel holds for the proxy while its loop is busy (Linux caps it at somaxconn);
# http.server's default of 5 made a burst of clients wait a second or more for a SYN retry.
LISTEN_BACKLOG = 1024
DEFAULT_MAX_QUEUE_BYTES = 256 * 1024 * 1024
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")


@dataclass(frozen=True)
class ProxyLimits:
    """What one client or a slow engine may hold of the proxy (see the module doc); raises
    ValueError for a value that is not positive, naming the command's flag."""

    max_connections: int = 256
    idle_timeout_s: float = 60.0
    header_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    upstream_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name, flag in (("max_connections", "--max-connections"), ("idle_timeout_s", "--idle-timeout"),
                           ("header_timeout_s", "--header-timeout"), ("read_timeout_s", "--read-timeout"),
                           ("upstream_timeout_s", "--upstream-timeout")):
            value = getattr(self, name)
            if not (0 < value < float("inf")):
                raise ValueError(f"{flag} must be a positive number, not {value!r}")


@dataclass(frozen=True)
class Upstream:
    """The engine the proxy forwards to, from `--upstream`; `url` never holds the credentials."""

    url: str
    hostname: str
    port: int
    host_header: str
    path: str
    authorization: str | None = field(default=None, repr=False)


def parse_upstream(text: str) -> Upstream:
    """http://[USER:PASSWORD@]HOST[:PORT][/PATH] as an `Upstream` (credentials percent-decoded into
    an `Authorization: Basic` value); raises ValueError, whose message never holds the password."""
    parts = urlsplit(text.strip())
    userinfo, at, hostport = parts.netloc.rpartition("@")
    shown = f"{parts.scheme}://{'***@' if at else ''}{hostport}{parts.path}"
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"--upstream {shown!r}: the port must be a number from 1 to 65535") from None
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"--upstream {shown!r}: give the engine's base URL as http://HOST:PORT")
    if parts.query or parts.fragment:
        raise ValueError(f"--upstream {shown!r}: give the base URL without a query or fragment")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    host_header = f"{host}:{port}" if port else host
    authorization = None
    if at:
        user, _, password = userinfo.partition(":")
        token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode("ascii")
        authorization = f"Basic {token}"
    path = parts.path.rstrip("/")
    return Upstream(url=f"http://{host_header}{path}", hostname=parts.hostname, port=port or 80,
                    host_header=host_header, path=path, authorization=authorization)


def parse_listen(listen: str) -> tuple[str, int]:
    """'HOST:PORT' (or ':PORT', meaning 127.0.0.1) as (host, port); raises ValueError."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen {listen!r}: write it as HOST:PORT, e.g. 127.0.0.1:8100")
    return host.strip("[]") or "127.0.0.1", int(port)


def request_tags(headers) -> dict[str, str]:
    """Step tags from request headers; a header that makes no valid tag (`check_tags` refuses it:
    a bad key, a value too long or holding control characters) is left out."""
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
        except ValueError as e:
            log.debug("moescope proxy: a tag header is left out: %s", e)
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
    responses were recorded and, per reason, how many were not. The queue holds at most
    `max_queue` responses and `max_queue_bytes` of their bodies. Token ids are stored only with
    `record_token_ids` (see the module doc).
    """

    def __init__(self, root: str | os.PathLike | StoreLocation, num_experts: int, run_id: str | None = None,
                 tags: dict[str, str] | None = None, num_layers: int | None = None, top_k: int | None = None,
                 max_queue: int = 1024, flush_interval_s: float = 2.0, max_steps: int = 256,
                 model: str = "served model", max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
                 record_token_ids: bool = False):
        """`root`: the store, a folder or a URL (a `StoreLocation` carries its storage options).
        Raises ValueError for a bad option, a store URL that cannot be used or a run id the store
        already has, and OSError when the store does not take the run's first row."""
        if num_experts < 1:
            raise ValueError(f"--num-experts must be positive, not {num_experts}")
        if max_queue < 1:
            raise ValueError(f"--max-queue must be positive, not {max_queue}")
        if max_queue_bytes < 1:
            raise ValueError(f"--max-queue-mb must be positive, not {max_queue_bytes / 2**20:g}")
        self.location = open_location(root)
        self.root = self.location.redacted  # how messages name the store
        self.num_experts = num_experts
        self.num_layers, self.top_k = num_layers, top_k
        self.record_token_ids = record_token_ids
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
        self._failure: str | None = None
        self.writer: RunWriter = run_writer(self.location, run_id)
        if not self.writer.write("runs", run_tables(self.spec, {}, [0])["runs"], retried=True):
            self.writer.release()
            raise OSError(f"cannot write to the store {self.root!r}: {self.writer.last_error}")
        self.processor = BatchProcessor([_ResponseExporter(self)], max_queue=max_queue, policy="drop",
                                        flush_interval_s=flush_interval_s, max_batch=max_steps,
                                        max_queue_bytes=max_queue_bytes, name="moescope-proxy-recorder")
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

    @property
    def failed(self) -> str | None:
        """Why the recorder can record nothing more (its worker thread ended before `shutdown`), or None."""
        if self._failure is None:
            if self.processor.worker_died:
                self._failure = "the recorder's thread ended unexpectedly, so no response can be recorded"
        return self._failure

    # -- the exporter (the processor's worker) ----------------------------------------------------

    def _record(self, captured: Captured) -> None:
        try:
            sequences = self._sequences(captured)
            if sequences is None:
                self.count("no_routing")
                return
            if not self.record_token_ids:  # the prompt's text, given a tokenizer: kept only when asked
                for sequence in sequences:
                    sequence.token_ids = None
            step, _ = sequences_step(sequences, self._next_step, captured.ts, "response", tags=captured.tags)
            self._check(step)
        except (SourceFormatError, ValueError) as e:  # json errors are ValueErrors too
            log.warning("moescope proxy: a response's routing could not be read: %s", e)
            self.count("bad_routing")
            return
        except Exception as e:  # any body at all (a null where a number belongs, nesting past the recursion limit)
            log.warning("moescope proxy: a response's body could not be read (%s: %.200s); skipped",
                        type(e).__name__, e)
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
        try:
            new = {layer: LayerShape(self.num_experts, s.routes[layer].expert_ids.shape[1])
                   for s in steps for layer in s.routes if layer not in self._shapes}
            tables = build_step_tables(steps, self.spec, {**self._shapes, **new})
            if new:
                tables["layers"] = run_tables(self.spec, new, [0])["layers"]
        except Exception:
            log.exception("moescope proxy: %d steps could not be made into rows; they are counted as write_failed",
                          len(steps))
            ok = False
        else:
            self._shapes.update(new)
            written = [self.writer.write(table, data) for table, data in tables.items()]  # refused rows are counted
            ok = written[list(tables).index("steps")]
            if not ok:
                log.error("moescope proxy: writing %d steps to %s failed: %s", len(steps), self.root,
                          self.writer.last_error)
        if not ok:
            with self._lock:
                self._counts["recorded"] -= len(steps)
                self._counts["write_failed"] += len(steps)

    # -- stopping --------------------------------------------------------------------------------

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Record everything submitted so far and write it; False on timeout."""
        return self.processor.force_flush(timeout_s)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Drain the queue, write what is left and the run's final counts; safe to call twice."""
        _ = self.failed  # noticed before the shutdown ends the thread as it should
        self.processor.shutdown(timeout_s)

    def report(self) -> str:
        counts = self.counts
        others = ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items()) if reason != "recorded" and n)
        return (f"moescope proxy: recorded {counts.get('recorded', 0)} responses into run {self.spec.run_id}"
                + (f"; not recorded: {others}" if others else "")
                + (f"; {why}" if (why := self.failed) else ""))


class _ResponseExporter:
    """The recorder's exporter, on its processor's worker: parse, buffer, write (see RoutingRecorder).
    It never raises: each response is counted once, as recorded or with its reason."""

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


class _ClientGone(Exception):
    """The client hung up or went quiet before its request was whole: nothing may reach the engine."""


class _BadRequest(Exception):
    """The request cannot be forwarded as sent (its framing is broken); the message says why."""


class _CaptureBudget:
    """Bytes of response bodies being captured, across every connection: at most `limit`."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


class _Deadlines:
    """One thread that hangs up connections past a deadline (a request's headers must be whole by
    then): a socket timeout bounds each read, this bounds them all together, so a client sending a
    byte now and then cannot hold a connection. It looks every `tick_s` rather than being woken
    per request (a wake-up per request cost a context switch on the hot path); a deadline is kept
    to within that tick."""

    def __init__(self, tick_s: float = 0.1) -> None:
        self.tick_s = tick_s
        self._due: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._run, name="moescope-proxy-deadlines", daemon=True).start()

    def arm(self, sock: socket.socket, at: float) -> None:
        with self._lock:
            self._due[sock] = at

    def disarm(self, sock: socket.socket) -> None:
        """After this returns the socket is not hung up by this object."""
        with self._lock:
            self._due.pop(sock, None)

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(self.tick_s):
            now = time.monotonic()
            with self._lock:
                for sock, at in list(self._due.items()):
                    if at <= now:
                        del self._due[sock]
                        _hang_up(sock)


def _hang_up(sock: socket.socket) -> None:
    """End a connection another thread is serving: its blocked read returns end-of-file and that
    thread closes the socket (closing it here could free a descriptor it is still using)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class _LineReader:
    """The connection's reader while a request line and its headers are read: it remembers the last
    line, so a header block that ended at end-of-file (the client hung up) is told from a whole one."""

    def __init__(self, rfile):
        self.rfile = rfile
        self.last = b""

    def readline(self, limit: int = -1) -> bytes:
        self.last = self.rfile.readline(limit)
        return self.last

    def __getattr__(self, name: str):
        return getattr(self.rfile, name)


class _Handler(BaseHTTPRequestHandler):
    """Forwards one client connection's requests; one instance per connection (keep-alive reuses it)."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: _ProxyServer
    _upstream: http.client.HTTPConnection | None = None  # this connection's to the upstream, kept alive

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
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
        server, limits = self.server, self.server.limits
        reader = _LineReader(self.rfile)
        self.rfile = reader  # type: ignore[assignment]
        self.connection.settimeout(limits.header_timeout_s)
        server.deadlines.arm(self.connection, time.monotonic() + limits.header_timeout_s)
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.send_error(414)
                return
            parsed = bool(self.raw_requestline) and self.parse_request()
        except OSError:  # the header timeout, or a reset
            self.close_connection = True
            return
        finally:
            server.deadlines.disarm(self.connection)
            self.rfile = reader.rfile
        if not parsed:
            self.close_connection = True
            return
        if reader.last not in (b"\r\n", b"\n"):
            log.debug("moescope proxy: a client ended its connection inside a request's headers; not forwarded")
            self.close_connection = True
            return
        self.connection.settimeout(limits.read_timeout_s)
        method = getattr(self, "do_" + self.command, None)
        if method is None:
            self.send_error(501, f"Unsupported method ({self.command!r})")
            return
        method()
        with contextlib.suppress(OSError):
            self.wfile.flush()

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        with self.server.answering():  # a stop waits for the requests being answered
            self._forward()
        if self.server.stopping.is_set():
            self.close_connection = True  # a kept-alive connection takes no more requests

    do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_HEAD = do_GET

    # -- the request ----------------------------------------------------------------------------

    def _request_body(self) -> bytes | Iterator[bytes] | None:
        """The body to send: bytes when read whole, an iterator of pieces when streamed, None when
        there is none. Raises _BadRequest for framing that cannot be forwarded, _ClientGone."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._chunked_pieces()
        lengths = {v.strip() for v in self.headers.get_all("Content-Length") or []}
        if not lengths:
            return None
        length = lengths.pop()
        if lengths or not length.isdigit():
            raise _BadRequest("Content-Length must be one non-negative whole number of bytes")
        size = int(length)
        if size > BUFFERED_BODY_BYTES:
            return self._sized_pieces(size)
        return b"".join(self._sized_pieces(size))

    def _read_piece(self, size: int) -> bytes:
        try:
            piece = self.rfile.read1(size)
        except OSError as e:  # --read-timeout, or a reset
            raise _ClientGone(f"reading the request body failed: {e}") from e
        if not piece:
            raise _ClientGone("the client ended its connection inside the request body")
        return piece

    def _read_line(self, what: str) -> bytes:
        try:
            line = self.rfile.readline(1025)
        except OSError as e:
            raise _ClientGone(f"reading the request body failed: {e}") from e
        if not line.endswith(b"\n"):
            if len(line) > 1024:
                raise _BadRequest(f"a chunked request body's {what} line is longer than 1024 bytes")
            raise _ClientGone("the client ended its connection inside the request body")
        return line

    def _sized_pieces(self, size: int) -> Iterator[bytes]:
        left = size
        while left:
            piece = self._read_piece(min(left, READ_CHUNK))
            left -= len(piece)
            yield piece

    def _chunked_pieces(self) -> Iterator[bytes]:
        while True:
            token = self._read_line("chunk size").split(b";")[0].strip()
            if not _HEX.fullmatch(token):
                raise _BadRequest(f"a chunked request body has a bad chunk size {token[:20]!r}")
            left = int(token, 16)
            if not left:
                while self._read_line("trailer") not in (b"\r\n", b"\n"):
                    pass
                return
            while left:
                piece = self._read_piece(min(left, READ_CHUNK))
                left -= len(piece)
                yield piece
            if self._read_line("chunk end") not in (b"\r\n", b"\n"):
                raise _BadRequest("a chunk of the request body is longer than its size says")

    def _upstream_headers(self, body: bytes | Iterator[bytes] | None) -> dict[str, str]:
        upstream = self.server.upstream
        named = {h.strip().lower() for h in self.headers.get("Connection", "").split(",")}
        dropped = HOP_BY_HOP | named | {"host", "content-length", "expect"}
        if upstream.authorization:
            dropped.add("authorization")  # the upstream's own credentials replace the client's
        headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
        headers["Host"] = upstream.host_header
        if upstream.authorization:
            headers["Authorization"] = upstream.authorization
        if isinstance(body, bytes):
            headers["Content-Length"] = str(len(body))
        elif body is not None and "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            headers["Transfer-Encoding"] = "chunked"
        elif body is not None:
            headers["Content-Length"] = self.headers["Content-Length"].strip()
        elif self.command in ("POST", "PUT", "PATCH"):
            headers["Content-Length"] = "0"
        return headers

    def _send_upstream(self, body: bytes | Iterator[bytes] | None) -> http.client.HTTPResponse:
        """The engine's response. Raises _ClientGone / _BadRequest (from a streamed body: the
        engine's connection is closed under the unfinished request), TimeoutError past the upstream
        timeout, OSError or HTTPException when the engine cannot be reached."""
        upstream = self.server.upstream
        headers = self._upstream_headers(body)
        streamed = body is not None and not isinstance(body, bytes)
        if streamed and self._upstream is not None:  # a streamed body cannot be sent twice: a fresh connection
            self._upstream.close()
            self._upstream = None
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

    def _forward(self) -> None:
        server = self.server
        recorder = server.recorder
        if why := recorder.failed:
            self._answer_error(503, f"{why}; the proxy is stopping: send requests to the engine directly or "
                                    "restart the proxy", "unavailable")
            return
        try:
            body = self._request_body()
            response = self._send_upstream(body)
        except _ClientGone as e:
            log.debug("moescope proxy: request not forwarded: %s", e)
            self.close_connection = True
            return
        except _BadRequest as e:
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
        self._relay(response, request_tags(self.headers))

    # -- the response ---------------------------------------------------------------------------

    def _relay(self, response: http.client.HTTPResponse, tags: dict[str, str]) -> None:
        """Send the engine's response on to the client as it arrives, and hand a successful POST's
        body to the recorder once the engine has sent all of it."""
        server = self.server
        recorder, budget = server.recorder, server.capture_budget
        content_type = response.getheader("Content-Type", "")
        capture = (self.command == "POST" and 200 <= response.status < 300
                   and ("json" in content_type or "event-stream" in content_type))
        if self.command == "POST" and response.status >= 300:
            recorder.count(f"upstream_status_{response.status // 100}xx")
        kept: list[bytes] = []
        size = reserved = 0
        handed = False
        failure: str | None = None  # why the engine's body ended before it was whole

        def hand_over() -> None:
            # Once the engine's whole body is read, before the client's last bytes go out: a client
            # that has its response and flushes the recorder finds the request recorded.
            nonlocal handed
            handed = True
            if not capture:
                return
            if size > MAX_CAPTURE_BYTES:
                recorder.count("too_large")
            elif kept or not size:
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
                try:
                    piece = response.read1(READ_CHUNK) if chunked else response.read(READ_CHUNK)
                except TimeoutError:
                    failure = "upstream_timeout"
                    break
                except (OSError, http.client.HTTPException, ValueError):  # closed inside a chunk, reset
                    failure = "upstream_incomplete"
                    break
                if not piece:
                    if not chunked and response.length:  # closed before the length it declared
                        failure = "upstream_incomplete"
                    break
                if capture:
                    size += len(piece)
                    if size > MAX_CAPTURE_BYTES:  # forwarded, not recorded: keep nothing more
                        kept.clear()
                    elif budget.take(len(piece)):
                        kept.append(piece)
                        reserved += len(piece)
                    else:  # every connection's captures together are at their bound
                        capture = False
                        recorder.count("capture_bytes_full")
                        kept.clear()
                if not chunked and not response.length:  # the last piece of a sized body
                    hand_over()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            if failure:
                # The client sees the engine's failure as it would directly: its connection ends now,
                # short of the declared length or the last chunk.
                log.warning("moescope proxy: the upstream's response to %s %s ended early (%s)", self.command,
                            self.path[:200], failure)
                recorder.count(failure)
                self.close_connection = True
                return
            if not handed:
                hand_over()
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
        except OSError as e:  # writing to the client failed: it went away, or stalled past --read-timeout
            log.debug("moescope proxy: client connection ended mid-response: %s", e)
            self.close_connection = True
            if capture and not handed:
                recorder.count("client_disconnected")
        finally:
            budget.give(reserved)
            if failure or not handed or response.will_close:
                response.close()
                if self._upstream is not None:
                    self._upstream.close()
                    self._upstream = None

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        if self._upstream is not None:
            self._upstream.close()


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], upstream: Upstream, recorder: RoutingRecorder,
                 limits: ProxyLimits, capture_bytes: int):
        super().__init__(address, _Handler)
        self.upstream, self.recorder, self.limits = upstream, recorder, limits
        self.capture_budget = _CaptureBudget(capture_bytes)
        self.deadlines = _Deadlines(tick_s=min(0.1, limits.header_timeout_s / 5))
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
                    _hang_up(idle)
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
                    _hang_up(sock)

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


class RecorderFailed(RuntimeError):
    """The recorder's thread ended while the proxy was serving: it stops rather than pass traffic
    it cannot record."""


class RoutingProxy:
    """The proxy: a threading HTTP server forwarding to `upstream`, and its recorder.

    `start()` serves on a background thread (tests, embedding); `serve_forever()` in the caller's,
    until `stop_accepting()` (from another thread) or until the recorder fails (then `failure`
    says why). `shutdown()` stops serving, waits for the requests in flight, and drains the
    recorder. `port=0` picks a free port (see `.port`). `limits` bounds connections and time
    (`ProxyLimits`), `max_queue_bytes` the response bytes waiting to be recorded (and as much again
    being captured). Raises ValueError for an upstream that is not http://HOST[:PORT], a bad
    limit, or a run id the store already has; OSError when the address cannot be bound or the
    store cannot be written.
    """

    def __init__(self, upstream: str, store: str | os.PathLike | StoreLocation, num_experts: int,
                 host: str = "127.0.0.1",
                 port: int = 8100, run_id: str | None = None, tags: dict[str, str] | None = None,
                 num_layers: int | None = None, top_k: int | None = None, max_queue: int = 1024,
                 flush_interval_s: float = 2.0, limits: ProxyLimits | None = None,
                 max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES, record_token_ids: bool = False):
        self.upstream = parse_upstream(upstream)
        self.upstream_url = self.upstream.url  # without credentials: what messages show
        self.limits = limits or ProxyLimits()
        self.failure: str | None = None
        self.recorder = RoutingRecorder(store, num_experts, run_id=run_id, tags=tags, num_layers=num_layers,
                                        top_k=top_k, max_queue=max_queue, flush_interval_s=flush_interval_s,
                                        max_queue_bytes=max_queue_bytes, record_token_ids=record_token_ids)
        try:
            self.server = _ProxyServer((host, port), self.upstream, self.recorder, self.limits, max_queue_bytes)
        except BaseException:
            self.recorder.shutdown()
            raise
        address = self.server.server_address
        assert isinstance(address, tuple) and isinstance(address[0], str)  # an AF_INET server's (host, port)
        self.host, self.port = address[0], address[1]
        self._thread: threading.Thread | None = None

    def start(self) -> RoutingProxy:
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
