"""A fake clock and alert transitions for the delivery suites."""

from __future__ import annotations

from moescope.alerts.engine import AlertEngine
from moescope.alerts.observations import observations_from_record
from moescope.alerts.rules import parse_rules
from tests.support.alert_records import BALANCED, SKEWED, layer_step, step_record

PACK = parse_rules(
    "rules:\n  - name: Skew\n    expr: load_max_mean > 2.0\n    window: 1\n    for: 0\n    cooldown: 0\n"
    "    annotations: {summary: skewed}\n"
)


def transitions(layers=(0,)):
    """firing for each layer at step 0, resolved at step 1"""
    engine = AlertEngine(PACK)
    out = []
    for step, load in enumerate([SKEWED, BALANCED]):
        rec = step_record(step, [layer_step(layer, load) for layer in layers])
        out.extend(t for t in engine.ingest(observations_from_record(rec)) if t.notifies)
    return out


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self):
        return self.now
