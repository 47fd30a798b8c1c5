"""The rebalance replay (`moescope.metrics.rebalance`) against independent computations: plain loops
over the loads for every figure, DeepSeek's EPLB re-derived in the tests (tests/support/eplb_reference.py)
for every fitted map, a brute-force diff of consecutive physical-to-logical maps for the bytes moved,
the engines' schedules written out by hand from their code (vLLM's 3/4 start, SGLang's N + 1), and a
rotating-hotspot workload on which refitting at the rotation period beats never refitting."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moescope.metrics.placement import Placement
from moescope.metrics.rebalance import (
    NEVER,
    EveryN,
    SglangPolicy,
    VllmPolicy,
    engine_initial,
    replay,
    staleness,
)
from tests.support.eplb_reference import reference_eplb

LAYERS = [2, 5]
EXPERTS, RANKS = 8, 4


def skewed_loads(steps: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.gamma(0.6, 50.0, size=(steps, len(LAYERS), EXPERTS)).round()


def loop_figures(loads: np.ndarray, layout_of, ranks: int, nodes: int = 1) -> dict[str, list[float]]:
    """Per step, by loops: balancedness (sum of mean ranks / sum of busiest), the overload (per layer
    busiest / mean, averaged over the layers), across-node and in-node balancedness."""
    out: dict[str, list[float]] = {"balancedness": [], "overload": [], "node": [], "in_node": []}
    per_node = ranks // nodes
    for t, step in enumerate(loads):
        means = peaks = node_means = node_peaks = in_means = in_peaks = 0.0
        ratios = []
        for i, layer in enumerate(LAYERS):
            rank = [0.0] * ranks
            rows = layout_of(t, layer)
            for r, experts in enumerate(rows):
                for e in experts:  # each slot of an expert serves an even share of its load
                    rank[r] += step[i][e] / sum(x == e for row in rows for x in row)
            means += sum(rank) / ranks
            peaks += max(rank)
            ratios.append(max(rank) / (sum(rank) / ranks))
            node = [sum(rank[n * per_node:(n + 1) * per_node]) for n in range(nodes)]
            node_means += sum(node) / nodes
            node_peaks += max(node)
            for n in range(nodes):
                members = rank[n * per_node:(n + 1) * per_node]
                in_means += sum(members) / per_node
                in_peaks += max(members)
        out["balancedness"].append(means / peaks)
        out["overload"].append(sum(ratios) / len(ratios))
        out["node"].append(node_means / node_peaks)
        out["in_node"].append(in_means / in_peaks)
    return out


def contiguous(t: int, layer: int) -> list[list[int]]:
    per = EXPERTS // RANKS
    return [list(range(r * per, (r + 1) * per)) for r in range(RANKS)]


@pytest.mark.parametrize("policy", [NEVER, EveryN(50), VllmPolicy(window_size=10, step_interval=200),
                                    SglangPolicy(rebalance_num_iterations=30)])
def test_an_interval_past_the_run_is_the_static_placement(policy):
    loads = skewed_loads(30)
    result = replay(loads, Placement.contiguous(RANKS), policy, LAYERS, nodes=2)
    expected = loop_figures(loads, contiguous, RANKS, nodes=2)
    assert result.rearrangements == [] and result.moved_bytes == 0
    np.testing.assert_allclose(result.balancedness, expected["balancedness"], rtol=1e-12)
    np.testing.assert_allclose(result.overload, expected["overload"], rtol=1e-12)
    np.testing.assert_allclose(result.node_balancedness, expected["node"], rtol=1e-12)
    np.testing.assert_allclose(result.in_node_balancedness, expected["in_node"], rtol=1e-12)


@pytest.mark.parametrize("nodes,groups,redundant", [(1, 1, 0), (2, 4, 0), (2, 4, 4), (1, 1, 4)])
def test_every_map_is_deepseeks_eplb_on_its_fit_window_and_serves_from_the_next_step(nodes, groups, redundant):
    loads = skewed_loads(24, seed=nodes + groups + redundant)
    result = replay(loads, engine_initial(RANKS, EXPERTS, redundant), EveryN(5), LAYERS, nodes=nodes,
                    groups=groups, redundant=redundant, expert_bytes=1.0)
    assert [r.step for r in result.rearrangements] == [4, 9, 14, 19]
    assert [r.fit_start for r in result.rearrangements] == [0, 5, 10, 15]
    layouts: dict[int, dict[int, list[list[int]]]] = {}
    for r in result.rearrangements:
        window = loads[r.fit_start:r.step + 1].sum(axis=0)
        for i, layer in enumerate(LAYERS):
            expected = reference_eplb(window[i], RANKS, nodes, groups, redundant)
            assert [list(x) for x in r.placement.rank_experts(layer, EXPERTS)] == expected
            layouts.setdefault(r.step + 1, {})[layer] = expected
    # the figures: each step served by the last map fitted before it (even split over copies)
    starts = sorted(layouts)
    initial = engine_initial(RANKS, EXPERTS, redundant)

    def layout_of(t: int, layer: int) -> list[list[int]]:
        fitted = [s for s in starts if s <= t]
        return layouts[fitted[-1]][layer] if fitted else [list(x) for x in initial.rank_experts(layer, EXPERTS)]

    expected = loop_figures(loads, layout_of, RANKS, nodes=nodes)
    np.testing.assert_allclose(result.balancedness, expected["balancedness"], rtol=1e-12)
    np.testing.assert_allclose(result.overload, expected["overload"], rtol=1e-12)


def test_bytes_moved_are_a_brute_force_diff_of_consecutive_maps():
    loads = skewed_loads(40, seed=7)
    result = replay(loads, engine_initial(RANKS, EXPERTS, 4), EveryN(3), LAYERS, redundant=4, expert_bytes=1000.0)
    assert len(result.rearrangements) == 13
    previous = {layer: [e for row in engine_initial(RANKS, EXPERTS, 4).rank_experts(layer, EXPERTS) for e in row]
                for layer in LAYERS}
    for r in result.rearrangements:
        moved = sent = 0
        for layer in LAYERS:
            rows = r.placement.rank_experts(layer, EXPERTS)
            now = [e for row in rows for e in row]
            per_rank = len(now) // RANKS
            for slot, expert in enumerate(now):
                if previous[layer][slot] != expert:
                    moved += 1
                    rank = slot // per_rank
                    if expert not in previous[layer][rank * per_rank:(rank + 1) * per_rank]:
                        sent += 1
            previous[layer] = now
        assert (r.moved_slots, r.sent_slots) == (moved, sent)
        assert (r.moved_bytes, r.sent_bytes) == (moved * 1000.0, sent * 1000.0)
    assert result.moved_bytes == sum(r.moved_slots for r in result.rearrangements) * 1000.0
    assert result.moved_bytes > 0


def test_vllms_schedule_starts_three_quarters_in_and_reads_a_partly_filled_window():
    loads = skewed_loads(30)
    # step_interval 8: the counter starts at 6, so passes 2, 10, 18, 26 rearrange (t = pass - 1)
    result = replay(loads, Placement.contiguous(RANKS), VllmPolicy(window_size=4, step_interval=8), LAYERS)
    assert [r.step for r in result.rearrangements] == [1, 9, 17, 25]
    assert [r.fit_start for r in result.rearrangements] == [0, 6, 14, 22]  # 2 passes so far, then the last 4
    # under 4 the quarter is 0: the counter starts at the interval and the first pass rearranges
    for interval, expected in ((1, list(range(30))), (3, [0, 3, 6, 9, 12, 15, 18, 21, 24, 27]),
                               (4, [0, 4, 8, 12, 16, 20, 24, 28])):
        steps = [r.step for r in replay(loads, Placement.contiguous(RANKS), VllmPolicy(2, interval),
                                        LAYERS).rearrangements]
        assert steps == expected, interval


def test_sglangs_schedule_rebalances_after_n_plus_one_passes_on_its_buffer():
    loads = skewed_loads(20)
    result = replay(loads, Placement.contiguous(RANKS), SglangPolicy(rebalance_num_iterations=4, buffer_size=2),
                    LAYERS)
    assert [r.step for r in result.rearrangements] == [4, 8, 12, 16]  # passes 5, 9, 13, 17
    assert [r.fit_start for r in result.rearrangements] == [3, 7, 11, 15]
    default = replay(loads, Placement.contiguous(RANKS), SglangPolicy(rebalance_num_iterations=4), LAYERS)
    assert [r.fit_start for r in default.rearrangements] == [1, 5, 9, 13]  # the buffer defaults to N passes


def test_sglangs_utilisation_trigger_skips_while_the_mean_of_the_last_passes_is_above_it():
    even = np.full((12, len(LAYERS), EXPERTS), 10.0)  # every rank equal: utilisation exactly 1
    skewed = skewed_loads(12)
    for threshold, loads, skips in ((0.999, even, 2), (1.0, even, 0), (0.999, skewed, 0)):
        result = replay(loads, Placement.contiguous(RANKS), SglangPolicy(5, min_utilization=threshold), LAYERS)
        assert result.skipped == skips and len(result.rearrangements) == 2 - skips, threshold
    # the trigger reads the mean over every pass so far of (mean + 1e-5) / (max + 1e-5), by a loop
    mixed = np.concatenate([even[:5], skewed[:1]])
    rates = []
    for step in mixed:
        per_layer = []
        for i in range(len(LAYERS)):
            ranks = [sum(step[i][e] for e in row) for row in contiguous(0, 0)]
            per_layer.append((sum(ranks) / RANKS + 1e-5) / (max(ranks) + 1e-5))
        rates.append(sum(per_layer) / len(per_layer))
    threshold = sum(rates) / len(rates)
    above = replay(mixed, Placement.contiguous(RANKS), SglangPolicy(5, min_utilization=threshold - 1e-9), LAYERS)
    at = replay(mixed, Placement.contiguous(RANKS), SglangPolicy(5, min_utilization=min(1.0, threshold + 1e-9)),
                LAYERS)
    assert (above.skipped, at.skipped) == (1, 0)


def rotating_hotspot(period: int, rotations: int) -> np.ndarray:
    """Two hot experts (load 40 against 1-4, the cold ones' batch-to-batch noise) that move to the next
    pair every `period` steps."""
    noise = np.random.default_rng(11).integers(1, 5, size=(period * rotations, len(LAYERS), EXPERTS))
    loads = noise.astype(float)
    for t in range(len(loads)):
        hot = (2 * (t // period)) % EXPERTS
        loads[t, :, [hot, hot + 1]] = 40.0
    return loads


def test_on_a_rotating_hotspot_refitting_at_its_period_beats_never_and_every_step_moves_the_most():
    period = 6
    loads = rotating_hotspot(period, 8)
    runs = {policy.name: replay(loads, Placement.contiguous(RANKS), policy, LAYERS, expert_bytes=2.0)
            for policy in (NEVER, EveryN(1), EveryN(period), EveryN(2 * period), EveryN(3))}
    assert np.nanmean(runs[f"every-{period}"].balancedness) > np.nanmean(runs["never"].balancedness) + 0.1
    others = [r.moved_bytes for name, r in runs.items() if name != "every-1"]
    assert runs["every-1"].moved_bytes > max(others) and runs["never"].moved_bytes == 0


def test_staleness_is_the_share_of_balancedness_a_fresh_fit_wins_back():
    load = skewed_loads(1, seed=3)[0]
    fresh = Placement(RANKS, {layer: tuple(tuple(r) for r in reference_eplb(load[i], RANKS, 1, 1, 0))
                              for i, layer in enumerate(LAYERS)})
    assert staleness(load, fresh, LAYERS)[0] == pytest.approx(0.0, abs=1e-12)
    stale, now, best, per_layer = staleness(load, Placement.contiguous(RANKS), LAYERS)
    loop_now = loop_figures(load[None], contiguous, RANKS)["balancedness"][0]
    fitted = lambda t, layer: [list(r) for r in fresh.layers[layer]]  # noqa: E731
    loop_best = loop_figures(load[None], fitted, RANKS)["balancedness"][0]
    assert (now, best) == (pytest.approx(loop_now), pytest.approx(loop_best))
    assert stale == pytest.approx(1 - loop_now / loop_best) and stale > 0
    for i, layer in enumerate(LAYERS):  # per layer: that layer's mean/max over ranks, by a loop
        now_ranks = [sum(load[i][e] for e in row) for row in contiguous(0, layer)]
        best_ranks = [sum(load[i][e] for e in row) for row in fresh.layers[layer]]
        expected = 1 - (np.mean(now_ranks) / max(now_ranks)) / (np.mean(best_ranks) / max(best_ranks))
        assert per_layer[i] == pytest.approx(expected)


def test_bad_knobs_say_which():
    loads = skewed_loads(3)
    with pytest.raises(ValueError, match="buffer_size"):
        replay(loads, Placement.contiguous(RANKS), SglangPolicy(4, buffer_size=8), LAYERS)
    with pytest.raises(ValueError, match="N >= 1"):
        replay(loads, Placement.contiguous(RANKS), EveryN(0), LAYERS)
    with pytest.raises(ValueError, match="nodes"):
        replay(loads, Placement.contiguous(RANKS), NEVER, LAYERS, nodes=3)
    assert math.isinf(NEVER.steps)


def test_sglang_rebalances_when_the_utilisation_equals_its_threshold():
    # SGLang skips only when the mean is strictly above the threshold. Two equal passes and two equal
    # layers keep every mean exact: the threshold is the utilisation itself, computed as SGLang does
    step = [6.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # ranks of the contiguous layout: 8, 2, 2, 2
    loads = np.array([[step, step]] * 2)
    ranks = [8.0, 2.0, 2.0, 2.0]
    rate = (sum(ranks) / 4 + 1e-5) / (max(ranks) + 1e-5)
    result = replay(loads, Placement.contiguous(RANKS), SglangPolicy(1, min_utilization=rate), LAYERS)
    assert result.skipped == 0 and result.rearrangements[0].step == 1
