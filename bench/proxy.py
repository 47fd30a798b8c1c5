"""Latency `moescope proxy` adds to a request, direct and through the proxy side by side.

A stand-in engine (a local HTTP server answering in vLLM's response format with
`prompt_routed_experts` and `choices[0].routed_experts`, one fixed body of `--prompt-tokens` x
`--layers` x `--top-k` ids) runs in this process; the proxy runs as its own process, started with
the real `moescope proxy` command, recording into a temporary store. Requests alternate between
the engine directly and the proxy (keep-alive connections, one client), so both sides see the
same machine at the same moment. Prints p50 / p90 / p99 of each, the p50 added latency and the
median of the per-pair differences, then what the proxy recorded once stopped with SIGTERM.
With --idle-connections N, N sockets connect to the proxy and send nothing for the whole
measurement (with more than --max-connections of them the proxy hangs up the idle ones to make
room: the timed client must not notice).

    python bench/proxy.py                       # 2000 requests of each
    python bench/proxy.py --requests 5000 --prompt-tokens 512 --layers 48
    python bench/proxy.py --idle-connections 1000 --max-connections 64
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stand_in_engine(body: bytes) -> ThreadingHTTPServer:
    """A stand-in for a vLLM server (none can run here): every POST gets `body`."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_post(conn: http.client.HTTPConnection, request: bytes) -> float:
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", request, {"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    return time.perf_counter() - started


def _closed(sock: socket.socket) -> bool:
    """Whether the proxy has closed this idle socket (a read returns end-of-file at once)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def percentiles(values: list[float]) -> tuple[float, float, float]:
    ms = np.asarray(values) * 1000
    return tuple(float(np.percentile(ms, q)) for q in (50, 90, 99))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="requests of each kind (default 2000)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--idle-connections", type=int, default=0,
                        help="sockets held open to the proxy, sending nothing, while it is measured (default 0)")
    parser.add_argument("--max-connections", type=int, default=256, help="the proxy's --max-connections (default 256)")
    args = parser.parse_args()

    rng = np.random.default_rng(0)

    def routing(rows: int) -> list:
        return rng.integers(0, args.experts, (rows, args.layers, args.top_k)).tolist()

    body = json.dumps({"id": "cmpl-bench", "object": "text_completion", "created": int(time.time()), "model": "bench",
                       "prompt_routed_experts": routing(args.prompt_tokens),
                       "choices": [{"index": 0, "text": "x" * args.gen_tokens,
                                    "routed_experts": routing(args.gen_tokens - 1)}],
                       "usage": {"prompt_tokens": args.prompt_tokens, "completion_tokens": args.gen_tokens}}).encode()
    engine = stand_in_engine(body)
    port = free_port()
    store = tempfile.mkdtemp(prefix="moescope-proxy-bench-")
    proxy = subprocess.Popen([sys.executable, "-m", "moescope.cli", "proxy", "--upstream",
                              f"http://127.0.0.1:{engine.server_address[1]}", "--store", store, "--num-experts",
                              str(args.experts), "--listen", f"127.0.0.1:{port}", "--max-queue", "100000",
                              "--max-connections", str(args.max_connections)],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        print(proxy.stdout.readline().strip())
        request = json.dumps({"model": "bench", "prompt": "hello", "max_tokens": args.gen_tokens}).encode()
        # Opened first: past --max-connections the proxy hangs up the connection idle longest, which
        # must be one of these, not the timed client's kept-alive one (a pooled client would reconnect).
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(args.idle_connections)]
        direct = http.client.HTTPConnection("127.0.0.1", engine.server_address[1])
        via = http.client.HTTPConnection("127.0.0.1", port)
        for _ in range(50):  # warm both paths (connections, the proxy's imports and first writes)
            timed_post(direct, request)
            timed_post(via, request)
        times: dict[str, list[float]] = {"direct": [], "proxy": []}
        for i in range(args.requests):
            order = (("direct", direct), ("proxy", via)) if i % 2 else (("proxy", via), ("direct", direct))
            for name, conn in order:
                times[name].append(timed_post(conn, request))
        hung_up = sum(_closed(sock) for sock in idle)
        for sock in idle:
            sock.close()
        print(f"\n{args.requests} non-streaming requests each, response {len(body) / 1024:.0f} KiB "
              f"({args.prompt_tokens}+{args.gen_tokens} tokens x {args.layers} layers x top-{args.top_k})"
              + (f", {args.idle_connections} idle connections held ({hung_up} hung up by the proxy to make room, "
                 f"--max-connections {args.max_connections})" if idle else "") + ":")
        print(f"{'':<10}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}")
        for name in ("direct", "proxy"):
            print(f"{name:<10}" + "".join(f"{v:>10.3f}" for v in percentiles(times[name])))
        added = statistics.median(times["proxy"]) - statistics.median(times["direct"])
        paired = statistics.median(p - d for p, d in zip(times["proxy"], times["direct"]))
        print(f"added by the proxy: p50 {added * 1000:.3f} ms (median of paired differences {paired * 1000:.3f} ms)")
    finally:
        proxy.send_signal(signal.SIGTERM)  # as a service manager stops it: it drains and writes everything
        out, _ = proxy.communicate(timeout=60)
        print(out.strip().splitlines()[-1] if out.strip() else "(the proxy printed no report)",
              f"(exit status {proxy.returncode})")
        engine.shutdown()
        shutil.rmtree(store, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
