"""The engine's state machine: for, cooldown, no flapping, fingerprints, baselines, live exporter."""

from __future__ import annotations

import numpy as np
import pytest

from moescope.alerts.engine import AlertEngine, EngineExporter, fingerprint
from moescope.alerts.observations import LayerObservation, compute_signals, observations_from_record
from moescope.alerts.rules import parse_rules
from moescope.metrics import signals as sig
from moescope.metrics.capacity import whatif_capacity
from tests.support.alert_records import BALANCED, EXPERTS, SKEWED, drift_per_1000, layer_step, step_record

PACK = """\
version: 1
baseline: {first_steps: 3}
rules:
  - name: Skew
    expr: load_max_mean > 2.0
    window: 2
    for: 3s
    cooldown: 2s
    labels: {team: infra}
"""


def run_steps(engine, loads_by_step, run_id="run-a"):
    out = []
    for step, load in enumerate(loads_by_step):
        rec = step_record(step, [layer_step(0, load), layer_step(1, BALANCED)], run_id=run_id)
        out.extend(engine.ingest(observations_from_record(rec)))
    return out


def test_pending_firing_resolved_with_for_and_cooldown():
    engine = AlertEngine(parse_rules(PACK))
    loads = [BALANCED] * 5 + [SKEWED] * 8 + [BALANCED] * 8
    got = [(t.step, t.previous_state, t.state) for t in run_steps(engine, loads)]
    # step 5: window [4,5] sums to max/mean 88/32 = 2.75 -> pending; fires 3 s later at step 8;
    # step 13's window still holds step 12 (true); false from 14, resolved 2 s later at 15
    assert got == [(5, "inactive", "pending"), (8, "pending", "firing"), (15, "firing", "resolved")]
    transitions = run_steps(AlertEngine(parse_rules(PACK)), loads)
    firing = transitions[1]
    assert firing.labels == {"alertname": "Skew", "severity": "warning", "run_id": "run-a", "layer": "0",
                             "team": "infra"}
    assert firing.fingerprint == fingerprint(firing.labels)
    assert firing.values["load_max_mean"] == pytest.approx(72 / 16)
    assert firing.notifies and not transitions[0].notifies
    assert transitions[2].ends_at == transitions[2].at and transitions[2].starts_at == firing.starts_at
    assert transitions[1].idempotency_key() != transitions[2].idempotency_key()


@pytest.mark.parametrize("seconds_per_step", [0.01, 1.0, 60.0])
def test_step_counted_for_and_cooldown_ignore_the_clock(seconds_per_step):
    """`for: 3 steps` / `cooldown: 2 steps`: the same transitions at the same steps whether a step
    took 10 ms or a minute (a duration-counted rule moves with the clock; this one must not)."""
    pack = parse_rules(PACK.replace("for: 3s", "for: 3 steps").replace("cooldown: 2s", "cooldown: 2 steps"))
    rule = pack.rules[0]
    assert (rule.for_steps, rule.cooldown_steps) == (3, 2)
    loads = [BALANCED] * 5 + [SKEWED] * 8 + [BALANCED] * 8
    engine = AlertEngine(pack)
    got = []
    for step, load in enumerate(loads):
        rec = step_record(step, [layer_step(0, load), layer_step(1, BALANCED)], seconds_per_step=seconds_per_step)
        got.extend((t.step, t.state) for t in engine.ingest(observations_from_record(rec)))
    # the window [4,5] is skewed first at step 5 (pending), still true 3 steps later (8: firing);
    # its last true step is 13 (window [12,13]), false from 14, 2 steps later (15) resolved
    assert got == [(5, "pending"), (8, "firing"), (15, "resolved")]


def test_a_step_count_is_refused_where_prometheus_needs_time():
    from moescope.alerts.rules import RulesError
    from moescope.prometheus.rules import prometheus_rules

    with pytest.raises(RulesError, match="counted in steps has no Prometheus equivalent"):
        prometheus_rules(parse_rules(PACK.replace("cooldown: 2s", "cooldown: 40 steps")))
    with pytest.raises(RulesError, match="200 steps"):
        parse_rules(PACK.replace("cooldown: 2s", "cooldown: 2 fortnights"))


def test_no_flapping_inside_cooldown_and_pending_that_clears():
    engine = AlertEngine(parse_rules(PACK.replace("window: 2", "window: 1")))
    # skewed long enough to fire, then alternating every step: never false for 2 s -> no resolve
    loads = [SKEWED] * 5 + [BALANCED, SKEWED] * 6
    got = [(t.step, t.state) for t in run_steps(engine, loads)]
    assert got == [(0, "pending"), (3, "firing")]
    engine = AlertEngine(parse_rules(PACK.replace("window: 2", "window: 1")))
    got = [(t.step, t.state) for t in run_steps(engine, [SKEWED, SKEWED, BALANCED, BALANCED])]
    assert got == [(0, "pending"), (2, "inactive")]


def test_replay_gives_identical_transitions_and_runs_are_separate():
    loads = [BALANCED] * 3 + [SKEWED] * 6
    a = run_steps(AlertEngine(parse_rules(PACK)), loads)
    b = run_steps(AlertEngine(parse_rules(PACK)), loads)
    assert [t.idempotency_key() for t in a] == [t.idempotency_key() for t in b]
    engine = AlertEngine(parse_rules(PACK))
    x = run_steps(engine, loads, run_id="x")
    y = run_steps(engine, loads, run_id="y")
    assert {t.fingerprint for t in x}.isdisjoint({t.fingerprint for t in y})


def test_baseline_is_pinned_first_steps_or_loaded_run():
    pack = parse_rules(PACK.replace("load_max_mean > 2.0", "kl_baseline > 0.1"))
    engine = AlertEngine(pack)
    run_steps(engine, [BALANCED] * 3 + [SKEWED] * 2)
    expected_baseline = np.array(BALANCED) * 3
    assert np.array_equal(engine.baseline("run-a", 0), expected_baseline)
    vals = engine.signals(pack.rules[0], "run-a", 0)
    assert vals["kl_baseline"] == pytest.approx(sig.kl_divergence(np.array(SKEWED) * 2, expected_baseline))
    seen = []
    def loader(run_id, layer, steps):
        seen.append((run_id, layer, steps))
        return np.array(SKEWED)

    pack2 = parse_rules(PACK.replace("{first_steps: 3}", "{run_id: golden, first_steps: 5}"))
    engine2 = AlertEngine(pack2, baseline_loader=loader)
    run_steps(engine2, [SKEWED] * 2)
    assert engine2.baseline("run-a", 0).tolist() == SKEWED and ("golden", 0, 5) in seen


def test_compute_signals_over_a_window_with_routes():
    recs = [step_record(s, [layer_step(0, SKEWED, dropped=2, capacity_use=0.9, routes=True)]) for s in range(3)]
    obs = [o for r in recs for o in observations_from_record(r)]
    vals = compute_signals(obs)
    load = np.array(SKEWED) * 3
    assert vals["load_max_mean"] == pytest.approx(sig.max_mean_ratio(load))
    assert vals["kl_uniform"] == pytest.approx(sig.kl_divergence(load, np.ones(EXPERTS)))
    assert vals["dropped_token_rate"] == pytest.approx(6 / 384)
    assert vals["window_tokens"] == 384
    assert vals["capacity_use"] == pytest.approx(0.9)
    assert vals["dead_expert_fraction"] == 0.0
    assert np.isnan(vals["kl_baseline"])  # no baseline given
    assert vals["router_entropy"] == pytest.approx(1.5 / np.log(EXPERTS))
    # what-if: 128 tokens, k=2, 8 experts -> capacity 32 at cf 1.0; computed per step, summed
    per_step = whatif_capacity(recs[0].layers[0].routes.expert_ids, EXPERTS)
    assert vals["whatif_drop_rate_cf1"] == pytest.approx(per_step[1.0].dropped_tokens / 128)
    assert vals["routing_drift_rate"] == pytest.approx(drift_per_1000([r.layers[0].routes for r in recs]))
    assert isinstance(obs[0], LayerObservation) and obs[0].active_param_fraction == pytest.approx(2000 / 100_000)


class ListSink:
    def __init__(self):
        self.got = []

    def handle(self, transitions):
        self.got.extend(transitions)


class BrokenSink:
    def handle(self, transitions):
        raise RuntimeError("receiver exploded")


def test_engine_exporter_on_the_live_stream_survives_a_broken_sink():
    sink = ListSink()
    exporter = EngineExporter(AlertEngine(parse_rules(PACK)), [BrokenSink(), sink])
    records = [step_record(s, [layer_step(0, SKEWED)]) for s in range(5)]
    assert exporter.export(records[:2]) is False  # pending found, broken sink counted
    exporter.export(records[2:])
    assert [t.state for t in sink.got] == ["pending", "firing"]
    assert exporter.sink_errors == 2 and exporter.force_flush(1.0)
    exporter.shutdown()  # the session closed: the run ended, its firing alert resolves, sinks hear it
    exporter.shutdown()
    assert exporter.export(records) is False
    assert [(t.state, t.previous_state, t.step, t.reason) for t in sink.got[2:]] == [
        ("resolved", "firing", 4, "run ended")]
    ended = sink.got[2]
    assert ended.ends_at == ended.at == records[4].ts and ended.starts_at == sink.got[1].starts_at
    assert ended.annotations["resolved_reason"] == "run ended" and ended.fingerprint == sink.got[1].fingerprint
    assert exporter.sink_errors == 3  # the broken sink failed on the resolve too; the good one got it


def test_rise_signals_and_lost_experts_compare_with_the_runs_own_baseline_rows():
    pack = parse_rules(PACK.replace("load_max_mean > 2.0",
                                    "router_entropy_rise > 0.25 and dropped_token_rate_rise > 0.1 "
                                    "and lost_expert_fraction > 0"))
    engine = AlertEngine(pack)
    rare = [100, 100, 100, 100, 100, 100, 100, 1]  # expert 7: 1 slot in 701 in the baseline
    lost = [0, 200, 100, 100, 100, 100, 100, 0]   # expert 0 lost (expected 100 of 700), expert 7 empty by chance
    steps = [layer_step(0, rare, entropy=0.5, dropped=7)] * 3 + [layer_step(0, lost, entropy=1.5, dropped=140)] * 2
    for step, ls in enumerate(steps):
        engine.ingest(observations_from_record(step_record(step, [ls])))
    vals = engine.signals(pack.rules[0], "run-a", 0)
    # by hand: entropies are equal per row, so the token-weighted means are the rows' own
    assert vals["router_entropy_rise"] == pytest.approx((1.5 - 0.5) / np.log(8))
    assert vals["dropped_token_rate_rise"] == pytest.approx(280 / 1400 - 21 / 2103)
    # expert 0's baseline share predicts 1400 * 100/701 = 200 slots: lost; expert 7's 2 slots: not news
    assert vals["lost_expert_fraction"] == pytest.approx(1 / 8)
    # a baseline from another run holds its load alone: the rises are no data, the lost experts are not
    golden = PACK.replace("{first_steps: 3}", "{run_id: golden, first_steps: 3}").replace(
        "load_max_mean > 2.0", "router_entropy_rise > 0.25 and lost_expert_fraction > 0")
    engine2 = AlertEngine(parse_rules(golden), baseline_loader=lambda run_id, layer, steps: np.array(rare) * 3)
    for step, ls in enumerate(steps):
        engine2.ingest(observations_from_record(step_record(step, [ls])))
    vals2 = engine2.signals(engine2.pack.rules[0], "run-a", 0)
    assert np.isnan(vals2["router_entropy_rise"]) and vals2["lost_expert_fraction"] == pytest.approx(1 / 8)


UNLESS_PACK = """\
version: 1
baseline: {first_steps: 3}
rules:
  - name: Skew
    expr: load_max_mean > 2.0
    window: 2
    for: 0 steps
    cooldown: 0 steps
    unless: [Drift]
  - name: Drift
    expr: kl_baseline > 0.1
    window: 64
    for: 0 steps
"""


def _kl_by_hand(load, reference):
    p = (np.asarray(load, float) + 0.5) / (np.asarray(load, float) + 0.5).sum()
    q = (np.asarray(reference, float) + 0.5) / (np.asarray(reference, float) + 0.5).sum()
    return float(np.sum(p * np.log(p / q)))


def _fired(transitions, name):
    return [t.step for t in transitions if t.alertname == name and t.state == "firing"]


def test_unless_holds_a_rule_back_while_the_named_expression_holds_over_its_own_window():
    """PromQL's `A unless B`: the skew of a drift from the baseline is the drift's news; B is judged over
    A's window (2 steps), not B's own (64), so A stays silent from the first skewed step."""
    engine = AlertEngine(parse_rules(UNLESS_PACK))
    skew, drift = engine.pack.rules
    assert skew.signals == ("load_max_mean", "kl_baseline")
    got = run_steps(engine, [BALANCED] * 33 + [SKEWED] * 4)
    assert _fired(got, "Skew") == []
    # by hand over the skew's window (the last 2 steps): far past the drift's 0.1 ...
    values = engine.signals(skew, "run-a", 0)
    assert values["kl_baseline"] == pytest.approx(_kl_by_hand(np.array(SKEWED) * 2, np.array(BALANCED) * 3))
    assert values["kl_baseline"] > 0.1 and values["load_max_mean"] == pytest.approx(4.5)
    # ... while over the drift's own 64 steps (all 37 here) it is still under it: judged there, A would fire
    assert _kl_by_hand(np.array(BALANCED) * 33 + np.array(SKEWED) * 4, np.array(BALANCED) * 3) < 0.1
    assert _fired(got, "Drift") == []


def test_unless_lets_a_standing_condition_through_and_a_named_signal_of_no_data_holds_nothing_back():
    # skewed from the first step: no drift from the baseline, the skew is the news (before the baseline
    # is complete, kl_baseline is no data: no element of B, so A passes, as in PromQL)
    standing = run_steps(AlertEngine(parse_rules(UNLESS_PACK)), [SKEWED] * 6)
    assert _fired(standing, "Skew") == [0]
    assert [t.state for t in standing if t.alertname == "Skew"] == ["pending", "firing"]  # and it stays firing
    # a baseline run that cannot be loaded: kl_baseline is no data throughout, the drift holds nothing back
    golden = UNLESS_PACK.replace("{first_steps: 3}", "{run_id: golden, first_steps: 3}")
    engine = AlertEngine(parse_rules(golden), baseline_loader=lambda *a: None)
    unknown = run_steps(engine, [BALANCED] * 33 + [SKEWED] * 4)
    assert _fired(unknown, "Skew") == [33]
    firing = next(t for t in unknown if t.alertname == "Skew" and t.state == "firing")
    assert firing.values == {"load_max_mean": pytest.approx(88 / 32), "kl_baseline": None}  # steps 32-33


def test_a_figure_judged_once_honours_unless():
    from moescope.alerts.engine import fire_once
    pack = parse_rules(UNLESS_PACK)
    def names(values):
        return [t.alertname for t in fire_once(pack, values, run_id="r", layer=0, source="rules")]
    assert names({"load_max_mean": 3.0, "kl_baseline": 0.5}) == ["Drift"]
    assert names({"load_max_mean": 3.0, "kl_baseline": 0.05}) == ["Skew"]
    assert names({"load_max_mean": 3.0, "kl_baseline": float("nan")}) == ["Skew"]


# a layer's baseline traffic (max/mean 30/16 = 1.875) and the traffic it shifts to: the busiest expert
# barely gains (34/16 = 2.125) while most others move, as the demo model's layer 2 on its domain shift
BASE_MIX = [30, 20, 14, 12, 14, 14, 12, 12]
SHIFTED_MIX = [34, 34, 24, 6, 6, 12, 6, 6]


def _shipped_skew_pack():
    """The default pack's ExpertLoadSkew and the rules it names, as shipped but for `for: 0 steps`
    (the alert benchmark's), so each step's verdict shows."""
    import dataclasses

    from moescope.alerts.rules import default_rules
    pack = default_rules()
    keep = [dataclasses.replace(r, for_s=0.0, for_steps=0, cooldown_s=0.0, cooldown_steps=48) for r in pack.rules
            if r.name in ("ExpertLoadSkew", "RoutingDriftFromBaseline", "DeadExpert")]
    return dataclasses.replace(pack, rules=tuple(keep))


def _one_layer(engine, loads, first=0):
    out = []
    for step, load in enumerate(loads, start=first):
        out.extend(engine.ingest(observations_from_record(step_record(step, [layer_step(0, load)]))))
    return out


def test_the_shipped_skew_is_silent_while_the_routing_moves_and_fires_on_a_steady_skew():
    """A shift lifts the busiest expert over 2x the mean 17 forwards in, when the skew's 32 forwards hold
    15 old ones: their KL against the baseline is still under the drift's 0.1, but over the latest 16
    forwards (all shifted) it is past it, so the skew waits; once the whole window has moved, the drift's
    own expression holds it back. The same skew standing from the start fires."""
    base, shifted = np.array(BASE_MIX), np.array(SHIFTED_MIX)
    engine = AlertEngine(_shipped_skew_pack())
    skew = next(r for r in engine.pack.rules if r.name == "ExpertLoadSkew")
    got = _one_layer(engine, [BASE_MIX] * 48 + [SHIFTED_MIX] * 17)
    values = engine.signals(skew, "run-a", 0)
    # by hand: the window's 32 forwards (15 old, 17 shifted) and its latest 16, against the first 32 forwards
    assert values["load_max_mean"] == pytest.approx((15 * 30 + 17 * 34) / (32 * 16)) and values["load_max_mean"] > 2
    assert values["kl_baseline"] == pytest.approx(_kl_by_hand(15 * base + 17 * shifted, 32 * base))
    assert values["kl_baseline"] < 0.1
    assert values["kl_baseline_latest_half"] == pytest.approx(_kl_by_hand(16 * shifted, 32 * base))
    assert values["kl_baseline_latest_half"] > 0.1
    more = _one_layer(engine, [SHIFTED_MIX] * 40, first=65)
    assert _fired(got + more, "ExpertLoadSkew") == []
    assert engine.signals(skew, "run-a", 0)["kl_baseline"] > 0.1  # the whole window moved: the drift's news
    # a skew the baseline has too (the model on its traffic as deployed) still fires, once 1024 tokens are in
    steady = AlertEngine(_shipped_skew_pack())
    assert _fired(_one_layer(steady, [SHIFTED_MIX] * 64), "ExpertLoadSkew") == [7]
    assert steady.signals(skew, "run-a", 0)["kl_baseline_latest_half"] == pytest.approx(
        _kl_by_hand(16 * shifted, 32 * shifted))  # the same shares: only the smoothing's 1e-7
