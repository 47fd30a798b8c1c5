"""The Grafana dashboard: every panel's PromQL answers with data from a real Prometheus scraping a probed run."""

from __future__ import annotations

import json
import math
import threading
import urllib.parse

import pytest
import torch
import yaml
from prometheus_client import CollectorRegistry

import moescope
from moescope.cli import main as cli_main
from moescope.metrics.placement import Placement
from moescope.prometheus.exporter import PrometheusExporter
from moescope.prometheus.grafana import RATE, dashboard_json, panel_queries, provisioning
from tests.support.fixtures.servers import http_get_json, start_prometheus, wait_until
from tests.support.zoo import tiny_model

pytest.importorskip("grafana_foundation_sdk", reason="moescope grafana needs grafana-foundation-sdk (Python 3.11+)")

# Grafana replaces $__rate_interval with at least four scrape intervals; the test scrapes every second.
RATE_WINDOW = "10s"


def _answers(prom_url: str, expr: str) -> list[float]:
    """The finite values an instant query returns now."""
    query = urllib.parse.urlencode({"query": expr.replace(RATE, RATE_WINDOW)})
    body = http_get_json(f"{prom_url}/api/v1/query?{query}")
    assert body["status"] == "success", (expr, body)
    return [float(v) for _, v in (r["value"] for r in body["data"]["result"]) if math.isfinite(float(v))]


def test_every_panel_query_answers_from_a_real_prometheus_scraping_a_probed_run(tmp_path, capsys):
    assert cli_main(["grafana"]) == 0
    model_json = json.loads(capsys.readouterr().out)
    assert model_json == dashboard_json()
    queries = panel_queries(model_json)
    assert len(queries) >= 12 and len({title for title, _ in queries}) == len(model_json["panels"])
    spots = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in model_json["panels"]}
    assert len(spots) == len(model_json["panels"])  # no panel drawn over another

    # Switch: a capacity (real drops), expert modules (measured compute time); a ring smaller than
    # a forward's tokens, so the probe really drops routes rows (ring_full) for the drops panel.
    # A placement of its 8 experts on 2 ranks for the rank panels.
    exporter = PrometheusExporter(registry=CollectorRegistry(), window_steps=8, baseline_steps=4, cache_capacity=2,
                                  placement=Placement.contiguous(2))
    port = exporter.serve(port=0)
    model = tiny_model("switch_transformers").eval()
    rules = tmp_path / "none.rules.yml"
    rules.write_text("groups: []\n")
    stop = threading.Event()
    failures: list[BaseException] = []

    def serve_traffic() -> None:
        generator = torch.Generator().manual_seed(0)
        try:
            with torch.no_grad(), moescope.attach(model, store=tmp_path / "runs", exporters=[exporter], window=1,
                                                  compute_time=True, routes=True, ring_tokens=16) as session:
                while not stop.is_set():
                    ids = torch.randint(0, 128, (2, 12), generator=generator)
                    model(input_ids=ids, decoder_input_ids=ids)
                    session.flush()
                    stop.wait(0.05)
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            failures.append(e)

    worker = threading.Thread(target=serve_traffic, daemon=True)
    worker.start()
    prom = None
    try:
        prom, prom_url = start_prometheus(tmp_path, f"127.0.0.1:{port}", rules)
        pending = dict(queries)

        def all_answered() -> bool:
            for title, expr in list(pending.items()):
                if _answers(prom_url, expr):
                    del pending[title]
            return not pending and not failures

        try:
            wait_until(all_answered, 60, interval_s=0.5, what="every panel to have data")
        except AssertionError:
            raise AssertionError(f"panel queries with no data: {pending}; traffic errors: {failures}") from None
        # the labels the legends name are on the series
        for title, expr in queries:
            body = http_get_json(f"{prom_url}/api/v1/query?"
                                 + urllib.parse.urlencode({"query": expr.replace(RATE, RATE_WINDOW)}))
            panel = next(p for p in model_json["panels"] if p["title"] == title)
            legend = next(t["legendFormat"] for t in panel["targets"] if t["expr"] == expr)
            for label in (part.split("}}")[0] for part in legend.split("{{")[1:]):
                assert all(label in r["metric"] for r in body["data"]["result"]), (title, label)
    finally:
        stop.set()
        worker.join(30)
        if prom is not None:
            prom.stop()
        exporter.close()
    assert not failures, failures


def test_provisioning_files_point_grafana_at_the_dashboard_and_prometheus(tmp_path):
    paths = provisioning(tmp_path / "grafana", "http://127.0.0.1:9090")
    board, provider, source = paths
    assert json.loads(board.read_text()) == dashboard_json()
    providers = yaml.safe_load(provider.read_text())["providers"]
    assert providers[0]["type"] == "file" and providers[0]["options"]["path"] == str(board.parent.resolve())
    sources = yaml.safe_load(source.read_text())["datasources"]
    assert sources[0]["type"] == "prometheus" and sources[0]["url"] == "http://127.0.0.1:9090"
