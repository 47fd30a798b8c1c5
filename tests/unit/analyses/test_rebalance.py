"""`moescope placement --rebalance` and `rebalance_report` on a recorded rotating-hotspot run: every
figure against plain loops over the loads the test wrote, an independent EPLB
(tests/support/eplb_reference.py) for the refits, a brute-force diff of consecutive maps for the
bytes, and the run's own recorded parameters (16,000 over 2 layers x 8 experts, bf16) for an expert's
bytes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moescope.analyses.rebalance import RebalanceSetup, rebalance_report
from moescope.cli import main
from moescope.metrics.placement import PlacementError
from moescope.metrics.rebalance import NEVER, EveryN, VllmPolicy
from moescope.store import Store
from moescope.store.writer import ParquetExporter
from tests.support.alert_records import layer_step, run_info, step_record
from tests.support.eplb_reference import reference_eplb

EXPERTS, RANKS, PERIOD, STEPS = 8, 4, 6, 24
EXPERT_BYTES = 16_000 / (2 * EXPERTS) * 2  # the run's routed_expert_params per expert, bf16
CONTIGUOUS = [[0, 1], [2, 3], [4, 5], [6, 7]]


NOISE = np.random.default_rng(5).integers(1, 5, size=(STEPS, EXPERTS))  # the cold experts' batch-to-batch noise


def load_at(step: int, layer: int) -> list[int]:
    """Two hot experts (40 slots against 1-4) that move on every PERIOD steps; layer 1 mirrored."""
    hot = (2 * (step // PERIOD)) % EXPERTS
    load = [int(v) for v in NOISE[step]]
    load[hot] = load[hot + 1] = 40
    return load if layer == 0 else load[::-1]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("rebalance") / "store")
    exporter = ParquetExporter(root, run_info("r"))
    exporter.export([step_record(step, [layer_step(layer, load_at(step, layer)) for layer in (0, 1)], run_id="r")
                     for step in range(STEPS)])
    exporter.shutdown()
    return root


def balancedness(step: int, layout) -> float:
    means = peaks = 0.0
    for layer in (0, 1):
        ranks = [sum(load_at(step, layer)[e] for e in experts) for experts in layout[layer]]
        means += sum(ranks) / RANKS
        peaks += max(ranks)
    return means / peaks


def every_n(n: int):
    """By loops: per step the layout serving it, and each refit's (moved, sent) slots."""
    layout = {0: CONTIGUOUS, 1: CONTIGUOUS}
    served, costs = [], []
    for step in range(STEPS):
        served.append(layout)
        if (step + 1) % n == 0:
            fitted = {}
            for layer in (0, 1):
                window = np.sum([load_at(s, layer) for s in range(step + 1 - n, step + 1)], axis=0)
                fitted[layer] = reference_eplb(window, RANKS, 1, 1, 0)
            moved = sent = 0
            for layer in (0, 1):
                for rank, (old, new) in enumerate(zip(layout[layer], fitted[layer])):
                    for slot, expert in enumerate(new):
                        if old[slot] != expert:
                            moved += 1
                            sent += expert not in old
            costs.append((moved, sent))
            layout = fitted
    return served, costs


def test_each_policy_keeps_the_balancedness_and_moves_the_bytes_the_loops_say(root):
    with Store(root) as store:
        report = rebalance_report(store, "r", RebalanceSetup(ranks=RANKS), [EveryN(PERIOD), EveryN(1), NEVER],
                                  dispatch="even")
    hours = (STEPS - 1) / 3600  # steps a second apart
    assert report.expert_bytes == EXPERT_BYTES and report.hours == pytest.approx(hours)
    by_name = {p.policy: p for p in report.policies}
    for n, name in ((PERIOD, f"every-{PERIOD}"), (1, "every-1"), (10**9, "never")):
        served, costs = every_n(n)
        result = by_name[name]
        expected = [balancedness(step, served[step]) for step in range(STEPS)]
        np.testing.assert_allclose(result.balancedness, expected, rtol=1e-12)
        assert result.mean_balancedness == pytest.approx(np.mean(expected))
        assert result.rearrangements == len(costs)
        assert (result.moved_slots, result.sent_slots) == tuple(np.sum(costs, axis=0).astype(int)) if costs else (0, 0)
        assert result.moved_bytes == result.moved_slots * EXPERT_BYTES
        assert result.moved_bytes_per_hour == pytest.approx(result.moved_bytes / hours)
    # the operator's trade: refitting at the hotspot's period beats never, every step moves the most
    assert by_name[f"every-{PERIOD}"].mean_balancedness > by_name["never"].mean_balancedness + 0.1
    assert by_name["every-1"].moved_bytes > by_name[f"every-{PERIOD}"].moved_bytes > by_name["never"].moved_bytes
    curve = report.curve()
    assert list(curve.policy) == [f"every-{PERIOD}", "every-1", "never"]


def test_the_live_maps_staleness_is_against_a_fresh_fit_on_the_latest_window(root):
    with Store(root) as store:
        report = rebalance_report(store, "r", RebalanceSetup(ranks=RANKS, staleness_steps=PERIOD), [NEVER],
                                  dispatch="even")
    latest = range(STEPS - PERIOD, STEPS)
    fresh = {layer: reference_eplb(np.sum([load_at(s, layer) for s in latest], axis=0), RANKS, 1, 1, 0)
             for layer in (0, 1)}

    def over_window(layout) -> float:
        means = peaks = 0.0
        for layer in (0, 1):
            ranks = [sum(load_at(s, layer)[e] for s in latest for e in experts) for experts in layout[layer]]
            means += sum(ranks) / RANKS
            peaks += max(ranks)
        return means / peaks

    now, best = over_window({0: CONTIGUOUS, 1: CONTIGUOUS}), over_window(fresh)
    stale = report.staleness
    assert (stale.window_start, stale.window_end) == (STEPS - PERIOD, STEPS)
    assert stale.current_balancedness == pytest.approx(now) and stale.fresh_balancedness == pytest.approx(best)
    assert stale.staleness == pytest.approx(1 - now / best) and stale.staleness > 0.3


def test_knobs_are_in_steps_and_must_divide_by_the_window(root):
    with Store(root) as store:
        by_window = rebalance_report(store, "r", RebalanceSetup(ranks=RANKS, window_steps=2), [EveryN(PERIOD)],
                                     dispatch="even")
        assert by_window.policies[0].rearrangement_steps == [5, 11, 17, 23]  # every 3 windows of 2 steps
        with pytest.raises(PlacementError, match="not a multiple of the window"):
            rebalance_report(store, "r", RebalanceSetup(ranks=RANKS, window_steps=4), [VllmPolicy(6, 6)])


def test_the_command_prints_each_policy_and_the_staleness(root, capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 4, "moe_intermediate_size": 8, "torch_dtype": "float32"}))
    assert main(["placement", root, "--ranks", str(RANKS), "--rebalance", "--policy", f"every:{PERIOD}",
                 "--policy", "never", "--model-config", str(config), "--dispatch", "even",
                 "--staleness-window", str(PERIOD)]) == 0
    out = capsys.readouterr().out
    assert f"every-{PERIOD}" in out and "never" in out and "staleness of the live map" in out
    assert "an expert is 384 B" in out  # 3 x 4 x 8 float32 parameters
    # the live contiguous map on the last hotspot, which it does not fit: alerts/placement_rules.yaml's
    # rule fires per layer (over the whole run the hotspot has visited every rank: no rule fires there)
    assert "ALERT PlacementStale firing on layer 0 (warning): placement_staleness" in out
    assert "ALERT PlacementStale firing on layer 1" in out


def test_a_stale_map_fires_the_default_placement_rule_into_the_store_with_save(root, capsys, tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("version: 1\nrules:\n  - name: VeryStale\n    expr: placement_staleness > 0.99\n")
    assert main(["placement", root, "--ranks", str(RANKS), "--rebalance", "--policy", "never", "--rules",
                 str(rules), "--dispatch", "even"]) == 0
    assert "ALERT" not in capsys.readouterr().out  # a rules file of one's own replaces the default
    assert main(["placement", root, "--ranks", str(RANKS), "--rebalance", "--policy", "never", "--save",
                 "--staleness-window", str(PERIOD), "--dispatch", "even"]) == 0
    assert "wrote 2 alert(s)" in capsys.readouterr().out
    with Store(root) as store:
        alerts = store.alert_transitions("r")
    assert sorted(alerts.layer) == [0, 1] and set(alerts.alertname) == {"PlacementStale"}
    assert set(alerts.source) == {"placement"}
    assert main(["placement", root, "--ranks", str(RANKS), "--rebalance", "--policy", "hourly"]) == 1
    err = capsys.readouterr().err
    assert "unknown policy 'hourly'" in err and "vllm:WINDOW:INTERVAL" in err
