"""A process serving the Prometheus exporter stops cleanly on SIGTERM: the probe's pipeline is
drained into the store (read from its raw Parquet files), the HTTP server is shut down and its
port is free. No moescope command serves the exporter alone; it lives in the model's process."""

from __future__ import annotations

import socket
import sys
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from moescope.prometheus.exporter import PrometheusExporter
from tests.support.alert_records import SKEWED, layer_step, step_record
from tests.support.sigterm import parquet_rows, started


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def refused(port: int) -> bool:
    """Whether a connection to `port` is refused: nothing listens there any more (a server that
    stopped answering but kept its socket would still accept connections into its backlog)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_close_from_several_threads_frees_the_port_once_and_it_can_serve_again():
    exporter = PrometheusExporter(registry=CollectorRegistry())
    port = exporter.serve(port=0)
    try:
        assert exporter.port == port
        exporter.export([step_record(0, [layer_step(0, SKEWED)])])
        assert scrape(port)['moescope_layer_load_max_over_mean{layer="0"}'] == 4.5
        closers = [threading.Thread(target=exporter.close) for _ in range(4)]  # e.g. a signal's on_stop and a finally
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(10)
        assert not any(closer.is_alive() for closer in closers) and exporter.port is None
        assert refused(port)  # free once close() returned
        assert exporter.serve(port=port) == port  # the same port again, the last values still there
        assert scrape(port)['moescope_layer_load_max_over_mean{layer="0"}'] == 4.5
    finally:
        exporter.close()
        exporter.close()


@pytest.mark.integration
def test_sigterm_drains_the_probe_into_the_store_shuts_the_server_down_and_exits_0(tmp_path):
    store = tmp_path / "store"
    with started([sys.executable, "-m", "tests.support.children.sigterm_exporter_child", str(store)]) as child:
        port = int(child.wait_for_line("serving", "out").split()[1])
        child.wait_for(lambda: scrape(port).get("moescope_steps_total", 0) >= 5, what="5 forwards on /metrics")
        steps_before = len(parquet_rows(store, "steps"))  # the store flushes every 60 s: none yet
        sent = child.signal()
        assert child.exit_status(15) == 0, child.output()
        took = time.monotonic() - sent
    assert took < 10, f"stopped {took:.1f} s after SIGTERM; the grace period is 10 s"
    forwards = [int(line.split()[1]) for line in child.out if line.startswith("forward")]
    assert f"closed; port {port} refuses connections: True" in child.out  # before the process ended

    steps = parquet_rows(store, "steps")
    assert steps_before == 0 < len(steps) == len(forwards) == forwards[-1]  # every forward, written by the drain
    final = [r for r in parquet_rows(store, "probe_stats") if r["table_name"] == "steps" and r["reason"] is None]
    assert final and final[-1]["written_rows"] == len(steps)  # the final probe_stats, after the last forward
    assert [r["last_step"] for r in parquet_rows(store, "run_ends")] == [len(steps) - 1]
