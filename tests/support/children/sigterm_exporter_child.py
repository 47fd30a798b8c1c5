"""A process serving the Prometheus exporter while a tiny probed model runs, until SIGTERM.

    python -m tests.support.children.sigterm_exporter_child STORE

The composition `moescope/prometheus/exporter.py` documents: GracefulStop around the serving loop, the probe
session inside it (its close drains the pipeline and writes the final probe_stats), then
`exporter.close()`. Prints `serving PORT`, `forward N` after each recorded forward, and at the end
whether its port refuses connections.
"""

from __future__ import annotations

import socket
import sys
import time

import torch

import moescope
from moescope.core.lifecycle import GracefulStop
from moescope.prometheus.exporter import PrometheusExporter
from tests.support.zoo import tiny_model

store = sys.argv[1]
torch.manual_seed(0)
model = tiny_model("mixtral")
exporter = PrometheusExporter()
generator = torch.Generator().manual_seed(1)
with GracefulStop(what="exporter process") as stop, \
        moescope.attach(model, store=store, exporters=[exporter], run_id="served", window=1,
                        flush_interval_s=60.0) as session:
    port = exporter.serve(port=0)
    print(f"serving {port}", flush=True)
    with torch.no_grad():
        while not stop.requested.is_set():
            model(torch.randint(0, 128, (2, 8), generator=generator))
            print(f"forward {session.step}", flush=True)
            time.sleep(0.01)
exporter.close()
exporter.close()  # safe twice
try:
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    refused = False
except ConnectionRefusedError:
    refused = True
print(f"closed; port {port} refuses connections: {refused}", flush=True)
sys.exit(0)
