"""Every rule of the default pack, as `moescope alerts prometheus-rules` writes it, fires in a real
Prometheus on the layer built to trip it, and on no other.

The exporter is fed hand-built records: one MoE layer per situation, each designed (numbers in the
comments) to cross exactly the thresholds named in EXPECTED. Prometheus scrapes the exporter and
evaluates the generated rules (with `for: 0`, so that it fires at its first evaluation); the
firing (alert, layer) pairs it reports must be EXPECTED exactly.
"""

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
from tests.support.alert_records import BALANCED, SKEWED, layer_step, routes_for, step_record
from tests.support.fixtures.servers import http_get_json, start_prometheus, wait_until

pytestmark = pytest.mark.integration

# the exporter's window: the last 8 steps (8 x 128 = 1024 tokens, what ExpertLoadSkew asks for); baseline: the first 2
STEPS, WINDOW, BASELINE = 10, 8, 2
BIASED = [31, 31, 31, 31, 1, 1, 1, 1]  # KL(load || uniform) = 0.54 > 0.5; max/mean = 1.94 < 2
DRIFTED = [24, 24, 24, 24, 8, 8, 8, 8]  # KL against the balanced baseline = 0.13 > 0.1; vs uniform 0.13 < 0.5
DEAD = [18, 18, 18, 18, 18, 18, 20, 0]  # one expert of 8 never chosen, the rest as before; max/mean 1.25, KL 0.13
SHIFTED = [0, 40, 40, 8, 8, 8, 8, 16]  # expert 0 left by a shift that moves every share
# Two ranks: even experts on one, odd on the other, so the loads above are even over ranks (DEAD:
# 74 / 54 slots, balancedness 0.86; SHIFTED 56 / 72, 0.89); SKEWED's layers put its hot expert alone
# (72 / 56, 0.89), and layer 11 the contiguous layout, under which DRIFTED's load is 96 / 32 slots:
# balancedness 0.67 < 0.8.
PLACEMENT = Placement(ranks=2, default=((0, 2, 4, 6), (1, 3, 5, 7)),
                      layers={10: ((0,), (1, 2, 3, 4, 5, 6, 7)), 11: ((0, 1, 2, 3), (4, 5, 6, 7)),
                              13: ((0,), (1, 2, 3, 4, 5, 6, 7))})


def _no_locality() -> Routes:
    """Balanced routes whose top-1 expert changes at every adjacent pair: 1000 changes per 1000 pairs."""
    top1 = np.arange(128) % 8
    return Routes(expert_ids=np.stack([top1, (top1 + 1) % 8], axis=1).astype(np.int32),
                  gate_weights=np.full((128, 2), 0.5, dtype=np.float32), kept=np.ones((128, 2), dtype=bool),
                  token_ids=None, sequence=(np.arange(128) // 16).astype(np.int32),
                  position=(np.arange(128) % 16).astype(np.int32))


def _layers(step: int) -> list:
    healthy = dict(entropy=1.5, capacity_use=0.5)  # entropy / ln 8 = 0.72; half the capacity used
    return [
        layer_step(0, BALANCED, **healthy),  # nothing
        layer_step(1, BIASED, **healthy),
        layer_step(2, BALANCED if step < BASELINE else DRIFTED, **healthy),
        # an expert with a real baseline share (1/8) that gets nothing: lost; the load moved, KL 0.13 > 0.1
        layer_step(3, BALANCED if step < BASELINE else DEAD, **healthy),
        layer_step(4, BALANCED, entropy=0.3, capacity_use=0.97),  # 0.3 / ln 8 = 0.14 < 0.25, and 0.97 > 0.95
        layer_step(5, BALANCED, entropy=0.3, capacity_use=0.5),  # collapsed entropy alone: no cooldown
        layer_step(6, BALANCED, entropy=1.5, capacity_use=0.97),  # full experts alone: no cooldown
        # 2 of 128 tokens dropped in the baseline, 22 after it: the rate rose by 0.16 > 0.1
        layer_step(7, BALANCED, dropped=2 if step < BASELINE else 22, **healthy),
        dataclasses.replace(layer_step(8, BALANCED, **healthy), routes=_no_locality()),  # 1000 > 900
        dataclasses.replace(layer_step(9, BALANCED, **healthy), routes=routes_for(np.array(BALANCED), sticky=True)),
        layer_step(10, SKEWED, **healthy),  # max/mean 4.5 > 2, and KL vs uniform 0.54 > 0.5
        layer_step(11, DRIFTED, **healthy),  # ranks 96 / 32 (PLACEMENT): balancedness 0.67 < 0.8; nothing else
        # per-token entropy 0.3 -> 1.9 nats: (1.9 - 0.3) / ln 8 = 0.77 of ln E over the baseline > 0.25
        layer_step(12, BALANCED, entropy=0.3 if step < BASELINE else 1.9, capacity_use=0.5),
        # balanced, then skewed: max/mean 4.5 and KL vs uniform 0.54, but drifted from the baseline (KL 0.54 >
        # 0.1): the skew and the bias are the drift's news (`unless`), held back by Prometheus' own `unless`
        layer_step(13, BALANCED if step < BASELINE else SKEWED, **healthy),
        # a shift: expert 0 gets nothing (lost) and the others' shares move too (KL 0.39; max/mean 2.5 over
        # 1024 tokens): the drift alone, neither DeadExpert (not lost alone) nor the skew (held back)
        layer_step(14, BALANCED if step < BASELINE else SHIFTED, **healthy),
    ]


EXPECTED = {
    ("ExpertLoadSkew", "10"),
    ("LoadBiasedAgainstUniform", "1"), ("LoadBiasedAgainstUniform", "10"),
    ("RoutingDriftFromBaseline", "2"), ("RoutingDriftFromBaseline", "3"), ("RoutingDriftFromBaseline", "13"),
    ("RoutingDriftFromBaseline", "14"),
    ("DeadExpert", "3"),
    ("RoutingCooldown", "4"),
    ("DroppedTokens", "7"),
    ("RouterEntropyRise", "12"),
    ("RoutingDriftRate", "8"),
    ("RankImbalance", "11"),
}


def test_every_default_rule_fires_in_prometheus_on_its_layer_only(tmp_path):
    pack = default_rules()
    # every rule, each exercised; WideExpertDispatch needs more than 4 ranks (PLACEMENT has 2): it has its own
    # Prometheus test, tests/integration/prometheus/test_prometheus_traffic.py
    assert {name for name, _ in EXPECTED} == {rule.name for rule in pack.rules} - {"WideExpertDispatch"}
    immediate = dataclasses.replace(pack, rules=tuple(dataclasses.replace(r, for_s=0.0) for r in pack.rules))
    exporter = PrometheusExporter(registry=CollectorRegistry(), window_steps=WINDOW, baseline_steps=BASELINE,
                                  placement=PLACEMENT)
    exporter.export([step_record(step, _layers(step), run_id="designed") for step in range(STEPS)])
    port = exporter.serve(port=0)
    rules_file = tmp_path / "moescope.rules.yml"
    rules_file.write_text(prometheus_rules_yaml(immediate))
    prom = None
    try:
        prom, prom_url = start_prometheus(tmp_path, f"127.0.0.1:{port}", rules_file)

        def firing() -> set[tuple[str, str]]:
            alerts = http_get_json(prom_url + "/api/v1/alerts")["data"]["alerts"]
            return {(a["labels"]["alertname"], a["labels"]["layer"]) for a in alerts if a["state"] == "firing"}

        wait_until(lambda: EXPECTED <= firing(), 40, what=f"Prometheus to fire {sorted(EXPECTED)}\n" + prom.log())
        # one more evaluation: nothing else fires on the layers built not to trip a rule
        rounds = http_get_json(prom_url + "/api/v1/rules")["data"]["groups"][0]["lastEvaluation"]
        wait_until(lambda: http_get_json(prom_url + "/api/v1/rules")["data"]["groups"][0]["lastEvaluation"] != rounds,
                   10, what="another rule evaluation")
        got = firing()
        assert got == EXPECTED, (sorted(got - EXPECTED), sorted(EXPECTED - got))
        health = http_get_json(prom_url + "/api/v1/rules")["data"]["groups"][0]["rules"]
        assert {r["name"]: r["health"] for r in health} == {r.name: "ok" for r in pack.rules}
    finally:
        if prom is not None:
            prom.stop()
        exporter.close()
