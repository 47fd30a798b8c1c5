"""Each health component against hand-computed values, and the scorer's windows on real records."""

from __future__ import annotations

import datetime as dt
import math

import numpy as np
import pytest

from moescope.alerts.health_score import (
    HealthConfig,
    HealthScorer,
    band_score,
    combine,
    confidence_component,
    grad_component,
    load_component,
    output_component,
    weight_component,
)
from moescope.core.records import LayerStep, StepRecord

CFG = HealthConfig()


def test_band_score():
    assert band_score(1.0, 4) == 100 and band_score(4.0, 4) == 100 and band_score(0.25, 4) == 100
    assert band_score(16.0, 4) == pytest.approx(25.0) and band_score(1 / 16, 4) == pytest.approx(25.0)
    assert band_score(0.0, 4) == 0 and band_score(math.inf, 4) == 0 and band_score(math.nan, 4) == 0


def test_load_component_needs_both_peers_and_own_baseline_to_flag():
    assert load_component(0.0, None, CFG) == 0  # dead against its peers, no baseline yet
    assert load_component(16.0, None, CFG) == pytest.approx(50.0)  # 8 / 16
    assert load_component(0.05, 0.05, CFG) == 100  # always this cold: normal for itself
    assert load_component(0.05, 1.0, CFG) == pytest.approx(100 * 8 * 0.05)  # cold now, for peers and itself


def test_confidence_output_weight_grad_components():
    assert confidence_component(0.5, 0.5, CFG) == 100
    assert confidence_component(0.1, 0.5, CFG) == pytest.approx(40.0)  # ratio 0.2 / floor 0.5
    assert output_component(1.0, 1, 1.0, None, CFG) == 0  # one NaN output is enough
    assert output_component(1000.0, 0, 1.0, None, CFG) == pytest.approx(0.4)
    assert output_component(3.0, 0, 1.0, None, CFG) == 100
    assert output_component(10.0, 0, 1.0, 10.0, CFG) == 100  # an outlier for peers, normal for itself
    # below the peers the band is output_low_band (16): a quiet, barely-routed expert passes, a vanishing one not
    assert output_component(0.085, 0, 1.0, None, CFG) == 100
    assert output_component(0.01, 0, 1.0, None, CFG) == pytest.approx(100 * 16 * 0.01)
    assert output_component(0.0, 0, 1.0, None, CFG) == 0
    assert weight_component(1.0, 1.0, CFG) == 100
    assert weight_component(0.75, 1.0, CFG) == pytest.approx(50.0)  # (0.75 - 0.5) / 0.5
    assert weight_component(1.0, 1000.0, CFG) == pytest.approx(0.15)
    assert weight_component(math.nan, 1.0, CFG) == 0
    assert grad_component(100.0, 1.0, CFG) == pytest.approx(10.0) and grad_component(math.inf, 1.0, CFG) == 0


def test_combine_is_a_weighted_geometric_mean_of_what_is_present():
    weights = dict(load=0.25, output=0.75)
    assert combine(dict(load=100.0, output=100.0), weights) == pytest.approx(100)
    assert combine(dict(load=50.0, output=None), weights) == pytest.approx(50)
    assert combine(dict(load=25.0, output=100.0), weights) == pytest.approx(100 * 0.25 ** 0.25)
    assert combine(dict(load=100.0, output=0.0), weights) == 0
    assert combine({}, weights) == 100


def _step(step, load, gate, samples=None, norms=None, nonfinite=None, cosine=None, ratio=None, trust=None):
    return StepRecord(run_id="r", step=step, ts=dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc), duration_s=0.0,
                      tokens=int(sum(load)), batch_size=1, seq_len=int(sum(load)), active_params=0.0, total_params=1,
                      layers=[LayerStep(layer=0, tokens=int(sum(load)), expert_load=np.array(load, dtype=np.int64),
                                        gate_weight_sum=np.array(gate, dtype=np.float64), router_entropy_mean=0.0,
                                        router_entropy_p95=0.0, top1_margin_mean=0.0, dropped_tokens=0,
                                        dropped_assignments=0, capacity=None, capacity_use=None,
                                        active_params_per_token=0.0,
                                        expert_output_samples=None if samples is None else np.array(samples),
                                        expert_output_norm_sum=None if norms is None else np.array(norms, float),
                                        expert_output_nonfinite=None if nonfinite is None else np.array(nonfinite),
                                        expert_weight_cosine=None if cosine is None else np.array(cosine, float),
                                        expert_weight_norm_ratio=None if ratio is None else np.array(ratio, float),
                                        trust_weight=None if trust is None else np.array(trust, float))])


def test_scorer_windows_components_and_gated_experts():
    scorer = HealthScorer(HealthConfig(window_steps=2))
    load, gate = [10, 10, 10, 0], [5.0, 5.0, 5.0, 0.0]
    kw = dict(samples=[2, 2, 2, 2], norms=[2.0, 2.0, 2.0, 2.0], nonfinite=[0, 0, 0, 0])
    assert scorer.observe(_step(0, load, gate, **kw)) == []
    rows = scorer.observe(_step(1, load, gate, cosine=[1, 1, 1, 1], ratio=[1, 1, 1, 1], **kw))
    assert [r.window for r in rows] == [0] * 4 and rows[0].step_start == 0 and rows[0].step_end == 1
    dead = rows[3]
    # idle is routing news, not ill health: load is reported (and its reason kept), not scored
    assert dead.load == 0 and dead.score == pytest.approx(100) and "load dead" in dead.reasons
    assert dead.confidence is None
    assert rows[0].load_share_ratio == pytest.approx(4 / 3) and rows[0].gate_weight_mean == pytest.approx(0.5)
    assert rows[0].output_norm_mean == pytest.approx(1.0) and rows[0].score == pytest.approx(100)
    # gated: load and confidence are the gate's doing and are left out; NaN outputs count
    trust = [1, 1, 1, 0]
    scorer.observe(_step(2, load, gate, trust=trust, samples=[2] * 4, norms=[2.0] * 3 + [0.0], nonfinite=[0, 0, 0, 2]))
    rows = scorer.observe(_step(3, load, gate, trust=trust, **kw))
    assert rows[3].load is None and rows[3].confidence is None and rows[3].output == 0 and rows[3].trust_weight == 0
    assert "non-finite outputs: 2/4" in rows[3].reasons


def test_small_windows_do_not_read_as_dead_experts():
    """Decode steps route a few tokens: an empty expert there is chance, not a dead expert."""
    cfg = HealthConfig(window_steps=2)
    # 4 experts, 20 assignments in the window (over min_window_assignments=16) but a fair share of
    # 5 per expert, under min_expected_per_expert=8: two empty experts say nothing yet.
    scorer = HealthScorer(cfg)
    scorer.observe(_step(0, [6, 4, 0, 0], [3.0, 2.0, 0.0, 0.0]))
    rows = scorer.observe(_step(1, [4, 6, 0, 0], [2.0, 3.0, 0.0, 0.0]))
    assert all(r.load is None for r in rows) and all(r.score == 100 for r in rows)
    # The same empty expert with 8 or more expected assignments is flagged.
    scorer = HealthScorer(cfg)
    scorer.observe(_step(0, [8, 8, 8, 0], [4.0, 4.0, 4.0, 0.0]))
    rows = scorer.observe(_step(1, [8, 8, 8, 0], [4.0, 4.0, 4.0, 0.0]))
    assert rows[3].load == 0 and "load dead" in rows[3].reasons


def test_output_and_weight_verdicts_carry_over_windows_without_a_visit():
    """The sampler visits one expert per forward; between visits the last measurement stands."""
    scorer = HealthScorer(HealthConfig(window_steps=1))
    load, gate = [10, 10, 10, 10], [5.0] * 4
    bad = dict(samples=[0, 0, 2, 0], norms=[0.0, 0.0, 0.0, 0.0], nonfinite=[0, 0, 2, 0],
               cosine=[1, 1, 0.2, 1], ratio=[1, 1, 1, 1])
    first = scorer.observe(_step(0, load, gate, **bad))[2]
    assert first.output == 0 and first.weight == 0 and first.score == 0
    later = scorer.observe(_step(1, load, gate, samples=[2, 0, 0, 0], norms=[2.0, 0, 0, 0], nonfinite=[0] * 4))
    assert later[2].output == 0 and later[2].weight == 0 and "(last measured)" in later[2].reasons
    assert later[1].output is None  # never measured: nothing to carry
    # the other experts measured (its peers), then the expert healed
    scorer.observe(_step(3, load, gate, samples=[0, 2, 0, 2], norms=[0, 2.0, 0, 2.0], nonfinite=[0] * 4))
    healed = scorer.observe(_step(4, load, gate, samples=[0, 0, 2, 0], norms=[0, 0, 2.0, 0], nonfinite=[0] * 4,
                                  cosine=[1] * 4, ratio=[1] * 4))[2]
    assert healed.output == 100 and healed.weight == 100


def test_an_output_is_judged_against_the_other_experts_never_itself():
    """The sampler visits one or two experts of a layer per window: a window's own median of the
    sampled norms would be the faulty expert itself (the old flaw, a x1000 expert scoring 100)."""
    scorer = HealthScorer(HealthConfig(window_steps=1))
    load, gate = [10] * 8, [5.0] * 8
    healthy = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0, 1.3, 0.7]  # each expert's own mean norm

    def visit(step, experts, norms):
        samples = [2 if e in experts else 0 for e in range(8)]
        sums = [2 * norms[e] if e in experts else 0.0 for e in range(8)]
        return scorer.observe(_step(step, load, gate, samples=samples, norms=sums, nonfinite=[0] * 8))

    rows = visit(0, (0, 1), healthy)
    assert rows[0].output is None and rows[1].output is None  # one peer each: not judged yet
    visit(1, (2, 3), healthy)
    rows = visit(2, (4, 5), healthy)
    # peers: the other experts' last norms; expert 4 against the median of 0, 1, 2, 3, 5 = 1.0
    assert rows[4].output == 100 and rows[5].output == 100
    broken = list(healthy)
    broken[6] = 1e7
    rows = visit(3, (6, 7), broken)
    others = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0, 0.7]  # 0-5 and 7 at its norm of this window
    expected = 100 * CFG.output_band / (1e7 / float(np.median(others)))
    assert rows[6].output == pytest.approx(expected) and rows[6].score < 1
    assert "vs the other experts' median 1" in rows[6].reasons
    # expert 7 is judged against 0-6, the broken one among them: the median stands one outlier
    assert rows[7].output == 100


def test_load_is_reported_not_scored_unless_weighted():
    """An expert the traffic left idle scores on what it computes; a user who weights load gets the
    old judgement back (any component at 0 takes the weighted geometric mean to 0)."""
    load, gate = [12, 12, 12, 0], [6.0, 6.0, 6.0, 0.0]  # a fair share of 9 >= min_expected_per_expert
    for weights, expected in ((None, 100.0), (dict(load=0.25, output=0.35, weight=0.25), 0.0)):
        cfg = HealthConfig(window_steps=1) if weights is None else HealthConfig(window_steps=1, weights=weights)
        row = HealthScorer(cfg).observe(_step(0, load, gate, cosine=[1] * 4, ratio=[1] * 4))[3]
        assert row.load == 0 and row.weight == 100 and row.score == pytest.approx(expected)
