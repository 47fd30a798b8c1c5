"""The exporter's per-layer dead-expert count and Jain's fairness index on a layer with zero experts
(LongCat-Flash's identity experts: the router may choose them, they hold no parameters). Both are
over the routed experts only, as their help texts say: a zero expert is never dead and never makes
the routed experts' load look uneven. `expert_load` lists the routed experts first, then the zero
experts; expected values are written out by hand (issue 46 part 6)."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from moescope.prometheus.exporter import PrometheusExporter
from tests.support.alert_records import layer_step, run_info, step_record

ROUTED, ZERO = 6, 2


def attached(registry: CollectorRegistry) -> PrometheusExporter:
    exporter = PrometheusExporter(registry=registry, window_steps=2, hot_cold_experts=1, expert_grace_s=0)
    info = run_info()
    exporter.on_attach(dataclasses.replace(info, layers=tuple(
        dataclasses.replace(layer, num_experts=ROUTED, zero_experts=ZERO) for layer in info.layers)))
    return exporter


def test_dead_experts_and_fairness_leave_the_zero_experts_out():
    registry = CollectorRegistry()
    exporter = attached(registry)
    # two steps: the routed experts evenly loaded (5 + 5 each), zero expert 6 chosen 3 times, zero expert 7 never
    exporter.export([step_record(step, [layer_step(0, [5, 5, 5, 5, 5, 5, 3 * step, 0]),
                                        layer_step(1, [9, 1, 0, 5, 5, 4, 2, 2])]) for step in range(2)])
    get = lambda name, layer: registry.get_sample_value(name, {"layer": str(layer)})  # noqa: E731

    assert get("moescope_layer_dead_experts", 0) == 0  # zero expert 7, idle, is no dead expert
    assert get("moescope_layer_load_fairness_ratio", 0) == 1.0  # 10 tokens each: even
    # layer 1 over the window: routed [18, 2, 0, 10, 10, 8]: one dead; (sum x)^2 / (n sum x^2) by hand
    assert get("moescope_layer_dead_experts", 1) == 1
    assert get("moescope_layer_load_fairness_ratio", 1) == pytest.approx(48 ** 2 / (6 * (324 + 4 + 0 + 100 + 100 + 64)))
