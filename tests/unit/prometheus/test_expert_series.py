"""The exporter's bounded per-expert series (the K hottest and coldest experts of each layer, with a
grace period for leavers), the dead-expert count, Jain's fairness index and the rank figures under a
placement. Expected values come from plain loops written here, never from the exporter's own helpers."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from moescope.metrics import signals as sig
from moescope.metrics.placement import Placement
from moescope.prometheus.exporter import PrometheusExporter
from tests.support.alert_records import layer_step, step_record


def brute_extremes(load, k):
    """The k hottest and k coldest expert ids, ties to the lower id, by sorting (load, id) pairs."""
    by_hot = sorted(range(len(load)), key=lambda e: (-load[e], e))
    by_cold = sorted(range(len(load)), key=lambda e: (load[e], e))
    return by_hot[:k], by_cold[:k]


def shown(registry, layer=0):
    """{expert: value} of the layer's expert series."""
    return {int(s.labels["expert"]): s.value for m in registry.collect() if m.name == "moescope_expert_load_ratio"
            for s in m.samples if s.labels["layer"] == str(layer)}


def feed(exporter, loads, start=0, layers=(0,)):
    exporter.export([step_record(start + i, [layer_step(layer, load) for layer in layers])
                     for i, load in enumerate(loads)])


@pytest.mark.parametrize("seed", range(5))
def test_extreme_experts_match_a_sort_with_ties_to_the_lower_id(seed):
    rng = np.random.default_rng(seed)
    load = rng.integers(0, 4, size=int(rng.integers(1, 40)))  # many ties
    for k in (0, 1, 3, 50):
        hot, cold = sig.extreme_experts(load, k)
        assert (hot.tolist(), cold.tolist()) == brute_extremes(load.tolist(), k)
    rows = rng.integers(0, 4, size=(6, 20))  # layers of one width, ranked in one call
    hot, cold = sig.extreme_experts(rows, 3)
    for row, hot_ids, cold_ids in zip(rows.tolist(), hot.tolist(), cold.tolist()):
        assert (hot_ids, cold_ids) == brute_extremes(row, 3)
    with pytest.raises(ValueError, match="k must be >= 0"):
        sig.extreme_experts(load, -1)
    with pytest.raises(ValueError, match="non-negative"):
        sig.extreme_experts([1, -1], 1)


def test_jain_fairness_by_its_definition_and_its_known_values():
    rng = np.random.default_rng(0)
    for _ in range(20):
        load = rng.integers(0, 100, size=int(rng.integers(1, 64))).astype(float)
        load[0] += 1  # at least one token
        total = squares = 0.0
        for x in load:
            total += x
            squares += x * x
        assert sig.jain_fairness(load) == pytest.approx(total * total / (len(load) * squares))
        cv = load.std() / load.mean()
        assert sig.jain_fairness(load) == pytest.approx(1 / (1 + cv * cv))  # Jain's own identity
    assert sig.jain_fairness([5, 0, 0, 0]) == 0.25  # one of n takes it all: 1/n
    assert sig.jain_fairness([3, 3, 0, 0, 0, 0]) == pytest.approx(2 / 6)  # k of n share it evenly: k/n
    assert sig.jain_fairness([7] * 9) == 1.0
    assert np.isnan(sig.jain_fairness([0, 0]))
    assert sig.dead_expert_count([0, 3, 0, 1]) == 2 and np.isnan(sig.dead_expert_count([0, 0]))


def test_each_layer_shows_its_k_hottest_and_coldest_experts_with_their_slot_shares():
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry, window_steps=3, hot_cold_experts=2, expert_grace_s=0)
    rng = np.random.default_rng(1)
    loads = rng.integers(0, 20, size=(3, 16))
    feed(exporter, loads.tolist(), layers=(0, 5))
    window = loads.sum(axis=0)
    hot, cold = brute_extremes(window.tolist(), 2)  # no grace: the shorter windows' extremes are gone
    for layer in (0, 5):
        got = shown(registry, layer)
        assert set(got) == set(hot) | set(cold)
        for expert, value in got.items():
            assert value == pytest.approx(window[expert] / window.sum())
        get = lambda name: registry.get_sample_value(name, {"layer": str(layer)})  # noqa: E731
        assert get("moescope_layer_dead_experts") == sum(1 for x in window if x == 0)
        assert get("moescope_layer_load_fairness_ratio") == pytest.approx(
            window.sum() ** 2 / (16 * (window.astype(float) ** 2).sum()))


def test_a_leaver_keeps_its_series_for_the_grace_period_in_event_time_then_loses_it():
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry, window_steps=1, hot_cold_experts=1, expert_grace_s=10)
    first = [50, 10, 10, 10, 10, 10, 10, 1]  # hottest 0, coldest 7
    second = [10, 10, 10, 50, 10, 10, 10, 1]  # hottest 3, coldest 7
    feed(exporter, [first] * 5)  # steps 0..4, one second apart: 0 last among the hottest at t=4
    assert set(shown(registry)) == {0, 7}
    feed(exporter, [second] * 10, start=5)  # t = 5..14: 0 out for at most 10 s
    series = shown(registry)
    assert set(series) == {0, 3, 7}
    assert series[0] == pytest.approx(10 / sum(second))  # its share now, not when it was hot
    for scrape in range(3):  # scrapes alone never end a grace period: only records' time does
        assert set(shown(registry)) == {0, 3, 7}
    feed(exporter, [second], start=15)  # t = 15: out for 11 s
    assert set(shown(registry)) == {3, 7}


def test_at_most_k_leavers_are_kept_the_one_out_longest_going_first():
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry, window_steps=1, hot_cold_experts=1, expert_grace_s=1000)
    hot_at = lambda e: [50 if i == e else 10 for i in range(7)] + [1]  # noqa: E731
    feed(exporter, [hot_at(0), hot_at(3)])
    assert set(shown(registry)) == {0, 3, 7}  # 0 left: one leaver, K = 1 allowed
    feed(exporter, [hot_at(5)], start=2)
    assert set(shown(registry)) == {3, 5, 7}  # 3 left too: 0, out longer, goes


@pytest.mark.parametrize("experts, ranks", [(16, 2), (256, 64)])
def test_series_per_layer_stay_bounded_whatever_the_experts_and_ranks(experts, ranks):
    k = 4
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry, window_steps=2, baseline_steps=1, hot_cold_experts=k,
                                  placement=Placement.contiguous(ranks))
    rng = np.random.default_rng(experts)
    for step in range(40):  # the hot and cold sets churn at every step
        feed(exporter, [rng.integers(1, 100, size=experts).tolist()], start=step, layers=(0, 1, 2))
        per_layer = [sum(1 for m in registry.collect() for s in m.samples if s.labels.get("layer") == str(layer))
                     for layer in (0, 1, 2)]
        expert_series = [len(shown(registry, layer)) for layer in (0, 1, 2)]
        assert all(2 * k <= n <= 3 * k for n in expert_series), expert_series
        # besides the experts': 2 counters (tokens, dropped), 15 signal gauges with data (cv, max/mean,
        # balancedness, KL from uniform, from the baseline and from it over the window's latest half, router
        # entropy and its rise over the baseline, dead experts, lost experts and lost alone, dropped ratio and
        # its rise, window tokens, active parameters; no capacity, no routes), dead experts, fairness, and 4
        # rank figures (balancedness, imbalance, the hottest rank and its share): 23
        assert [n - e for n, e in zip(per_layer, expert_series)] == [23, 23, 23]


def test_rank_figures_split_a_redundant_experts_load_evenly_over_its_slots():
    registry = CollectorRegistry()
    placement = Placement(ranks=3, layers={0: ((0, 1, 7), (2, 3, 7), (4, 5, 6))}, source="test")
    exporter = PrometheusExporter(registry=registry, window_steps=2, placement=placement)
    loads = [[9, 1, 2, 2, 0, 3, 1, 20], [3, 1, 0, 2, 4, 3, 1, 4]]
    feed(exporter, loads)
    window = np.sum(loads, axis=0)
    slots_of = {}
    for rank, experts in enumerate(placement.layers[0]):
        for expert in experts:
            slots_of.setdefault(expert, []).append(rank)
    per_rank = [0.0, 0.0, 0.0]
    for expert, ranks in slots_of.items():
        for rank in ranks:
            per_rank[rank] += window[expert] / len(ranks)
    get = lambda name: registry.get_sample_value(name, {"layer": "0"})  # noqa: E731
    mean = np.mean(per_rank)
    assert get("moescope_layer_rank_balancedness_ratio") == pytest.approx(mean / max(per_rank))
    assert get("moescope_layer_rank_imbalance") == pytest.approx((max(per_rank) - mean) / mean)
    assert get("moescope_layer_hottest_rank") == per_rank.index(max(per_rank))
    assert get("moescope_layer_hottest_rank_load_ratio") == pytest.approx(max(per_rank) / sum(per_rank))


def test_a_placement_that_does_not_fit_a_layer_drops_only_its_rank_series(caplog):
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry, placement=Placement(ranks=2, layers={1: ((0, 1), (2,))}))
    with caplog.at_level(logging.WARNING, logger="moescope.metrics.placement"):
        feed(exporter, [[4, 3, 2, 1]], layers=(0, 1))  # layer 1's placement leaves expert 3 without a slot
        registry.collect()
        list(registry.collect())
    assert registry.get_sample_value("moescope_layer_rank_balancedness_ratio", {"layer": "0"}) == pytest.approx(5 / 7)
    assert registry.get_sample_value("moescope_layer_rank_balancedness_ratio", {"layer": "1"}) is None
    assert registry.get_sample_value("moescope_layer_tokens_total", {"layer": "1"}) == 10
    assert sum("layer 1" in r.getMessage() for r in caplog.records) == 1  # warned once, not at every scrape


def test_the_exporter_and_the_rules_engine_share_one_placements_shares(monkeypatch):
    from moescope.alerts.engine import AlertEngine
    from moescope.alerts.observations import observations_from_record
    from moescope.alerts.rules import default_rules
    from moescope.metrics import placement as placement_module

    calls = []
    real = placement_module.replica_shares
    monkeypatch.setattr(placement_module, "replica_shares", lambda *a, **k: calls.append(a) or real(*a, **k))
    placement = Placement.contiguous(2)
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry, placement=placement)
    engine = AlertEngine(default_rules(), placement=placement)
    loads = [[4, 3, 2, 1], [2, 2, 1, 1]]
    feed(exporter, loads, layers=(0, 1))
    for i, load in enumerate(loads):
        engine.ingest(observations_from_record(step_record(i, [layer_step(layer, load) for layer in (0, 1)])))
    list(registry.collect())
    list(registry.collect())
    assert len(calls) == 2  # one per layer, for both readers and every scrape and evaluation
    # what both read: slots per rank of the window's summed load, experts 0 and 1 on rank 0, 2 and 3 on rank 1
    summed = [sum(load[e] for load in loads) for e in range(4)]
    ranks = [summed[0] + summed[1], summed[2] + summed[3]]
    for layer in ("0", "1"):
        assert registry.get_sample_value("moescope_layer_rank_balancedness_ratio", {"layer": layer}) == pytest.approx(
            sum(ranks) / 2 / max(ranks))
    rule = next(r for r in engine.pack.rules if "rank_balancedness" in r.signals)
    assert engine.signals(rule, "run-a", 0)["rank_balancedness"] == pytest.approx(sum(ranks) / 2 / max(ranks))


def test_no_expert_series_with_k_zero_and_bad_settings_say_what_to_give():
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry, hot_cold_experts=0)
    feed(exporter, [[4, 3, 2, 1]])
    assert shown(registry) == {}
    assert registry.get_sample_value("moescope_layer_dead_experts", {"layer": "0"}) == 0
    with pytest.raises(ValueError, match="hot_cold_experts"):
        PrometheusExporter(hot_cold_experts=-1)
    with pytest.raises(ValueError, match="expert_grace_s"):
        PrometheusExporter(expert_grace_s=float("nan"))
    with pytest.raises(ValueError, match="Placement.contiguous"):
        PrometheusExporter(placement=object())  # type: ignore[arg-type]
