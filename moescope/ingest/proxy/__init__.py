"""`moescope proxy`: record the routed experts a vLLM or SGLang server returns, live, per request.

The proxy sits in front of an OpenAI-compatible server and forwards every request and response
unchanged: status, headers and body, streamed chunk by chunk (server-sent events included) and
flushed as they arrive. On the side it keeps a copy of each successful response body and hands it
to a `RoutingRecorder`, which records a step per request into the store; request headers become
the step's tags. One module per idea:

    limits    what it listens on, forwards to, and lets a client or the engine hold (`ProxyLimits`)
    server    the HTTP server and `RoutingProxy`, which owns it and the recorder; starting, stopping
    handler   one client connection: each request read within the bounds and forwarded
    request   a request's body (whole or streamed) and the headers the engine gets
    relay     a response on its way back, and the copy of its body kept for the recorder
    bounds    what the server bounds across connections: capture bytes, header deadlines
    tags      step tags from request headers
    recorder  captured responses -> steps of one run, through the write pipeline
"""

from __future__ import annotations

from moescope.ingest.proxy.limits import DEFAULT_MAX_QUEUE_BYTES as DEFAULT_MAX_QUEUE_BYTES
from moescope.ingest.proxy.limits import MAX_CAPTURE_BYTES as MAX_CAPTURE_BYTES
from moescope.ingest.proxy.limits import ProxyLimits as ProxyLimits
from moescope.ingest.proxy.limits import Upstream as Upstream
from moescope.ingest.proxy.limits import parse_listen as parse_listen
from moescope.ingest.proxy.limits import parse_upstream as parse_upstream
from moescope.ingest.proxy.recorder import Captured as Captured
from moescope.ingest.proxy.recorder import RoutingRecorder as RoutingRecorder
from moescope.ingest.proxy.server import RecorderFailed as RecorderFailed
from moescope.ingest.proxy.server import RoutingProxy as RoutingProxy
from moescope.ingest.proxy.tags import request_tags as request_tags

__all__ = ["DEFAULT_MAX_QUEUE_BYTES", "MAX_CAPTURE_BYTES", "Captured", "ProxyLimits", "RecorderFailed",
           "RoutingProxy", "RoutingRecorder", "Upstream", "parse_listen", "parse_upstream", "request_tags"]
