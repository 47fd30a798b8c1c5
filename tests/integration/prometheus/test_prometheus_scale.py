"""A real Prometheus scrapes the exporter of a 64-expert, 48-layer model: the series stay bounded and
the per-expert ones name exactly the experts the model's own routers made hottest and coldest.

Series in all: 1492. 48 layers x 31 = 1488 carry a `layer` label, whatever the experts and ranks,
and 4 describe the run (run info, forwards, the last forward's time, active parameters; a probe with
no store writes no rows, so no row counters). Per layer: 2 counters (tokens, dropped tokens), 15
signal gauges with data (load cv, max/mean, balancedness, KL from uniform, from the baseline and from
it over the window's latest half,
router entropy and its rise over the baseline, dead, lost-expert, lost-expert-alone and dropped ratios and the drop
rate's rise, the window's tokens, active parameters; this run records no capacity and no routes),
the dead-expert count, Jain's fairness index, 4 rank figures under a placement on 8 ranks
(balancedness, imbalance, the hottest rank and its share), and 2K = 8 expert series for K = 4. The
mechanism it replaced, a counter per expert, would have added 64 x 48 = 3072.
"""

from __future__ import annotations

import urllib.parse

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from moescope import probe
from moescope.metrics.placement import Placement
from moescope.prometheus.exporter import PrometheusExporter
from tests.support.fixtures.servers import http_get_json, start_prometheus, wait_until
from tests.support.zoo import tiny_model

pytestmark = pytest.mark.integration

EXPERTS, LAYERS, TOP_K, K, RANKS = 64, 48, 2, 4, 8
PER_LAYER = 2 + 15 + 2 + 4 + 2 * K  # see the module's docstring


def _query(prom_url: str, expr: str) -> list[dict]:
    body = http_get_json(f"{prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def test_a_64_expert_48_layer_model_keeps_8_expert_series_per_layer_in_a_real_prometheus(tmp_path):
    model = tiny_model("mixtral", num_local_experts=EXPERTS, num_hidden_layers=LAYERS, num_experts_per_tok=TOP_K,
                       hidden_size=16, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1)
    exporter = PrometheusExporter(registry=CollectorRegistry(), baseline_steps=2, hot_cold_experts=K,
                                  placement=Placement.contiguous(RANKS))
    generator = torch.Generator().manual_seed(0)
    loads = np.zeros((LAYERS, EXPERTS), dtype=np.int64)  # from the model's own router logits
    # one window of two forwards: one record, so the series are the window's extremes and no leaver
    with probe.attach(model, exporters=[exporter], window=2, window_s=None), torch.no_grad():
        for _ in range(2):
            out = model(torch.randint(0, 128, (4, 32), generator=generator), output_router_logits=True)
            for layer, logits in enumerate(out.router_logits):
                chosen = torch.topk(logits, TOP_K, dim=-1).indices.flatten().numpy()
                loads[layer] += np.bincount(chosen, minlength=EXPERTS)
    port = exporter.serve(port=0)
    rules = tmp_path / "none.rules.yml"
    rules.write_text("groups: []\n")
    prom = None
    try:
        prom, prom_url = start_prometheus(tmp_path, f"127.0.0.1:{port}", rules)
        wait_until(lambda: _query(prom_url, 'count({__name__=~"moescope_.+"})'), 60, interval_s=0.5,
                   what="a first scrape")
        per_layer = {int(r["metric"]["layer"]): int(r["value"][1])
                     for r in _query(prom_url, 'count by (layer) ({__name__=~"moescope_.+", layer!=""})')}
        assert per_layer == {layer: PER_LAYER for layer in range(LAYERS)}  # 31 each: 1488 layer series
        total = int(_query(prom_url, 'count({__name__=~"moescope_.+"})')[0]["value"][1])
        run_level = {r["metric"]["__name__"] for r in _query(prom_url, '{__name__=~"moescope_.+", layer=""}')}
        assert run_level == {"moescope_run_info", "moescope_steps_total", "moescope_last_step_timestamp_seconds",
                             "moescope_active_param_ratio"}
        assert total == LAYERS * PER_LAYER + len(run_level) == 1492
        experts = _query(prom_url, "moescope_expert_load_ratio")
        assert len(experts) == LAYERS * 2 * K
        for layer in range(LAYERS):
            load = loads[layer]
            by_hot = sorted(range(EXPERTS), key=lambda e: (-load[e], e))  # ties to the lower id
            by_cold = sorted(range(EXPERTS), key=lambda e: (load[e], e))
            got = {int(r["metric"]["expert"]): float(r["value"][1]) for r in experts
                   if r["metric"]["layer"] == str(layer)}
            assert set(got) == set(by_hot[:K]) | set(by_cold[:K]), layer
            for expert, share in got.items():
                assert share == pytest.approx(load[expert] / load.sum())
            rank_slots = [load[r * EXPERTS // RANKS:(r + 1) * EXPERTS // RANKS].sum() for r in range(RANKS)]
            value = lambda name: float(_query(prom_url, f'{name}{{layer="{layer}"}}')[0]["value"][1])  # noqa: E731
            assert value("moescope_layer_rank_balancedness_ratio") == pytest.approx(
                np.mean(rank_slots) / max(rank_slots))
            assert value("moescope_layer_rank_imbalance") == pytest.approx(
                (max(rank_slots) - np.mean(rank_slots)) / np.mean(rank_slots))
            assert value("moescope_layer_hottest_rank") == rank_slots.index(max(rank_slots))
            assert value("moescope_layer_dead_experts") == sum(1 for x in load if x == 0)
            assert value("moescope_layer_load_fairness_ratio") == pytest.approx(
                float(load.sum()) ** 2 / (EXPERTS * float((load.astype(float) ** 2).sum())))
    finally:
        if prom is not None:
            prom.stop()
        exporter.close()
