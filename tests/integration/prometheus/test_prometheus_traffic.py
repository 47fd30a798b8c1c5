"""The traffic series in a real Prometheus: per layer, the mean remote ranks and nodes per token and
the intra-node share of the sends (no series per rank pair), equal to a plain loop over the routes
of the exporter's window; WideExpertDispatch, as `moescope alerts prometheus-rules` writes it, fires
on the layer whose tokens reach six ranks and not on the one whose tokens stay on three."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from moescope.alerts.rules import default_rules
from moescope.core.records import Routes
from moescope.metrics.placement import Placement
from moescope.prometheus.exporter import PrometheusExporter
from moescope.prometheus.rules import prometheus_rules_yaml
from tests.support.alert_records import layer_step, step_record
from tests.support.fixtures.servers import http_get_json, start_prometheus, wait_until

pytestmark = pytest.mark.integration

EXPERTS, RANKS, PER_NODE, TOKENS, STEPS, WINDOW = 16, 8, 4, 64, 6, 4
LAYERS = {0: [0, 2, 4, 6, 8, 10], 1: [0, 1, 2, 3, 4, 5]}  # expert e on rank e // 2: six ranks, three


def _records():
    rng = np.random.default_rng(0)
    out = []
    for step in range(STEPS):
        layers = []
        for layer, experts in LAYERS.items():
            ids = np.array([rng.permutation(experts) for _ in range(TOKENS)], dtype=np.int32)
            routes = Routes(expert_ids=ids, gate_weights=np.full(ids.shape, 1 / 6, dtype=np.float32),
                            kept=np.ones(ids.shape, dtype=bool), token_ids=None,
                            sequence=(np.arange(TOKENS) // 4).astype(np.int32),
                            position=(np.arange(TOKENS) % 4).astype(np.int32))
            layers.append(dataclasses.replace(layer_step(layer, np.bincount(ids.ravel(), minlength=EXPERTS)),
                                              tokens=TOKENS, routes=routes))
        out.append(step_record(step, layers, run_id="wire"))
    return out


def loop(records, layer: int) -> dict[str, float]:
    """The exporter's window (the last WINDOW records) of one layer, token by token."""
    tokens = ranks = nodes = intra = 0
    for record in records[-WINDOW:]:
        routes = next(ls for ls in record.layers if ls.layer == layer).routes
        for token, row in enumerate(routes.expert_ids):
            home = token % RANKS  # one process recorded it: a row's home is its place in the batch mod R
            dests = {int(e) // 2 for e in row} - {home}
            tokens += 1
            ranks += len(dests)
            nodes += len({d // PER_NODE for d in dests} - {home // PER_NODE})
            intra += sum(d // PER_NODE == home // PER_NODE for d in dests)
    return {"moescope_layer_remote_ranks_per_token": ranks / tokens,
            "moescope_layer_remote_nodes_per_token": nodes / tokens,
            "moescope_layer_intra_node_send_ratio": intra / ranks}


def test_traffic_series_and_wide_dispatch_in_prometheus(tmp_path):
    pack = default_rules()
    rule = next(r for r in pack.rules if r.name == "WideExpertDispatch")
    immediate = dataclasses.replace(pack, rules=(dataclasses.replace(rule, for_s=0.0),))
    exporter = PrometheusExporter(registry=CollectorRegistry(), window_steps=WINDOW,
                                  placement=Placement.contiguous(RANKS), ranks_per_node=PER_NODE)
    records = _records()
    exporter.export(records)
    port = exporter.serve(port=0)
    rules_file = tmp_path / "moescope.rules.yml"
    rules_file.write_text(prometheus_rules_yaml(immediate))
    prom = None
    try:
        prom, prom_url = start_prometheus(tmp_path, f"127.0.0.1:{port}", rules_file)

        def firing() -> set[str]:
            alerts = http_get_json(prom_url + "/api/v1/alerts")["data"]["alerts"]
            return {a["labels"]["layer"] for a in alerts if a["state"] == "firing"}

        wait_until(lambda: firing() == {"0"}, 40, what="WideExpertDispatch to fire on layer 0\n" + prom.log())
        for metric in ("moescope_layer_remote_ranks_per_token", "moescope_layer_remote_nodes_per_token",
                       "moescope_layer_intra_node_send_ratio"):
            result = http_get_json(f"{prom_url}/api/v1/query?query={metric}")["data"]["result"]
            assert sorted(r["metric"]["layer"] for r in result) == ["0", "1"]  # one series per layer, no more
            for r in result:
                assert float(r["value"][1]) == pytest.approx(loop(records, int(r["metric"]["layer"]))[metric])
        assert loop(records, 1)["moescope_layer_remote_ranks_per_token"] < 4
    finally:
        if prom is not None:
            prom.stop()
        exporter.close()
