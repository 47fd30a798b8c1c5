"""`moescope_layer_expert_cache_hit_ratio`: the Prometheus exporter's expert-cache gauge, on routes the
probe recorded from a real LongCat-Flash (zero experts included), against a brute-force replay."""

from __future__ import annotations

import urllib.request

import pytest
import torch
from prometheus_client import CollectorRegistry

from moescope import probe
from moescope.core.exporters import InMemoryExporter
from moescope.metrics.expert_cache import POLICIES
from moescope.prometheus.exporter import PrometheusExporter
from tests.support.cache_oracle import brute_force_hits
from tests.support.zoo import tiny_model

ROUTED_EXPERTS = 8  # the zoo's LongCat: 8 routed + 2 zero experts per layer
WINDOW_STEPS = 3


def _run(exporter: PrometheusExporter, routes: bool = True) -> list:
    model = tiny_model("longcat_flash")
    captured = InMemoryExporter()  # the records as they were handed to the exporters
    generator = torch.Generator().manual_seed(1)
    with probe.attach(model, exporters=[exporter, captured], routes=routes, window=1), torch.no_grad():
        for _ in range(5):
            model(torch.randint(1, 128, (2, 10), generator=generator))
    return captured.records


def test_gauge_replays_the_window_of_routes():
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry, window_steps=WINDOW_STEPS, cache_capacity=3, cache_max_tokens=50)
    records = _run(exporter)
    assert len(records) == 5
    for layer in (0, 1):
        tokens = []
        for record in records[-WINDOW_STEPS:]:  # the exporter's window: the last 3 forwards
            routes = record.layers[layer].routes
            for ids, kept in zip(routes.expert_ids.tolist(), routes.kept.tolist()):
                chosen: list[int] = []
                for expert, k in zip(ids, kept):
                    if k and expert < ROUTED_EXPERTS and expert not in chosen:
                        chosen.append(expert)
                tokens.append(chosen)
        tokens = tokens[-50:]  # cache_max_tokens: the window's last 50 tokens
        accesses = sum(len(t) for t in tokens)
        assert accesses < 2 * len(tokens)  # some slots went to zero experts
        for policy in POLICIES:
            got = registry.get_sample_value("moescope_layer_expert_cache_hit_ratio",
                                            {"layer": str(layer), "policy": policy})
            assert got == pytest.approx(brute_force_hits(tokens, 3, policy) / accesses, abs=1e-12), (layer, policy)
    port = exporter.serve(port=0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        exporter.close()
    assert 'moescope_layer_expert_cache_hit_ratio{layer="1",policy="belady"}' in body


def test_no_series_without_routes_or_without_a_capacity():
    registry = CollectorRegistry()
    _run(PrometheusExporter(registry=registry, cache_capacity=2), routes=False)
    assert registry.get_sample_value("moescope_layer_expert_cache_hit_ratio", {"layer": "0", "policy": "lru"}) is None
    registry = CollectorRegistry()
    _run(PrometheusExporter(registry=registry))
    assert registry.get_sample_value("moescope_layer_expert_cache_hit_ratio", {"layer": "0", "policy": "lru"}) is None
    with pytest.raises(ValueError, match="cache_capacity"):
        PrometheusExporter(registry=CollectorRegistry(), cache_capacity=0)
