"""RankImbalance: the default rule on the slots per expert-parallel rank under a placement, its value
against a plain loop over the window's loads, silent without a placement, and `moescope alerts run
--ranks R` writing it to the store."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moescope.alerts.engine import AlertEngine
from moescope.alerts.observations import observations_from_record
from moescope.alerts.rules import default_rules
from moescope.metrics.placement import Placement
from tests.support.alert_records import BALANCED, layer_step, step_record

# expert 0 and 1 hot, side by side on rank 0 of the default layout over 4 ranks
HOT_PAIR = [40, 40, 8, 8, 8, 8, 8, 8]


def _pack():
    pack = default_rules()
    rule = next(r for r in pack.rules if r.name == "RankImbalance")
    return dataclasses.replace(pack, rules=(dataclasses.replace(rule, for_s=0.0),))


def _run(engine: AlertEngine, steps: int = 40) -> list:
    out = []
    for step in range(steps):
        record = step_record(step, [layer_step(0, HOT_PAIR), layer_step(1, BALANCED)])
        out.extend(engine.ingest(observations_from_record(record)))
    return out


def test_rank_imbalance_fires_on_the_layer_whose_hot_experts_share_a_rank():
    engine = AlertEngine(_pack(), placement=Placement.contiguous(4))
    transitions = _run(engine)
    firing = [t for t in transitions if t.state == "firing"]
    assert {t.labels["layer"] for t in firing} == {"0"}
    # the loop: 32 steps of HOT_PAIR, experts 2r and 2r+1 on rank r
    ranks = [32 * (HOT_PAIR[2 * r] + HOT_PAIR[2 * r + 1]) for r in range(4)]
    assert firing[0].values["rank_balancedness"] == pytest.approx(np.mean(ranks) / max(ranks))
    rule = engine.pack.rules[0]
    values = engine.signals(rule, "run-a", 1)
    assert values["rank_balancedness"] == pytest.approx(1.0)  # the even layer stays quiet


def test_copies_of_the_hot_pair_quiet_it_and_no_placement_is_no_data():
    # layer 0: experts 0 and 1 on three ranks each: ranks serve 34.7, 34.7, 24, 34.7 per step (0.92);
    # layer 1 (even load) keeps the default layout: the same copies there would load rank 2 at 1.5x
    spread = Placement(4, layers={0: ((0, 1, 2), (0, 1, 3), (4, 5, 6), (7, 0, 1))}, source="hot pair copied")
    engine = AlertEngine(_pack(), placement=spread)
    assert not [t for t in _run(engine) if t.state == "firing"]
    assert engine.signals(engine.pack.rules[0], "run-a", 0)["rank_balancedness"] == pytest.approx(32 / (8 + 80 / 3))
    engine = AlertEngine(_pack())
    assert _run(engine) == []
    assert np.isnan(engine.signals(engine.pack.rules[0], "run-a", 0)["rank_balancedness"])


def test_the_threshold_is_imbalance_a_quarter():
    rule = next(r for r in default_rules().rules if r.name == "RankImbalance")
    assert [str(c) for c in rule.conditions] == ["rank_balancedness < 0.8"]  # 1 / (1 + 0.25)


def test_alerts_run_with_ranks_writes_rank_imbalance(tmp_path, capsys):
    from moescope.cli import main
    from moescope.store.location import open_location
    from moescope.store.writer import ParquetExporter
    from tests.support.deltafiles import read_table
    from tests.support.store_records import make_record, run_info

    root = str(tmp_path / "store")
    exporter = ParquetExporter(root, run_info("r", 1, 8))
    rng = np.random.default_rng(0)
    exporter.export([make_record("r", step, rng, 1, 8, tokens=64, skew=3.0) for step in range(40)])
    exporter.shutdown()
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\nrules:\n  - name: RankImbalance\n    expr: rank_balancedness < 0.8\n    for: 0s\n")
    args = ["alerts", "run", root, "--once", "--rules", str(rules), "--outbox", str(tmp_path / "outbox.db")]
    assert main([*args, "--ranks", "2"]) == 0
    alerts = read_table(open_location(root), "alerts").to_pylist()
    firing = [a for a in alerts if a["alertname"] == "RankImbalance" and a["state"] == "firing"]
    assert firing
    # skew 3: expert e drawn in proportion to 1 + 3e, so experts 4..7 (rank 1) carry 3x rank 0's slots
    step = firing[0]["step"]  # the rule's window: the 32 steps up to the one it fired at
    rows = read_table(open_location(root), "layer_steps").to_pylist()
    load = np.sum([r["expert_load"] for r in rows if step - 32 < r["step"] <= step], axis=0)
    ranks = np.array([load[:4].sum(), load[4:].sum()], dtype=float)
    assert dict(firing[0]["signal_values"])["rank_balancedness"] == pytest.approx(ranks.mean() / ranks.max())
