"""The shipped mismatch rule pack (alerts/mismatch_rules.yaml) judges a check's layers as its comment
says: above 5% of a layer's (token, layer) pairs differing, over at least 1000 pairs; and on a
recorded run's steps its signals are no data, so `moescope alerts run` never fires on them."""

from __future__ import annotations

import datetime as dt
import math

import numpy as np
import pandas as pd

from moescope.alerts.observations import LayerObservation, compute_signals
from moescope.alerts.rules import mismatch_rules
from moescope.analyses.mismatch import MismatchReport
from moescope.cli.mismatch import judge, judge_gap


def _report(layers: list[tuple[int, int, int]]) -> MismatchReport:
    rows = [dict(grouping="all", group_name="all", layer=layer, pairs=pairs, tokens=pairs, set_changed=changed,
                 set_changed_fraction=changed / pairs) for layer, pairs, changed in layers]
    pairs = sum(p for _, p, _ in layers)
    rows.append(dict(grouping="all", group_name="all", layer=None, pairs=pairs, tokens=pairs // len(layers),
                     set_changed=sum(c for *_, c in layers), tokens_set_changed_fraction=0.5,
                     set_changed_fraction=sum(c for *_, c in layers) / pairs))
    return MismatchReport(pd.DataFrame(rows), pd.DataFrame(), [], "engine", 2, [0, 1, 2, 3], run_id="mm")


def test_the_default_rule_fires_above_five_percent_of_at_least_a_thousand_pairs():
    report = _report([(0, 2000, 101), (1, 2000, 100), (2, 999, 500), (3, 1000, 51)])
    fired = judge(report, mismatch_rules())
    assert [(t.alertname, t.layer) for t in fired] == [("RoutingMismatch", 0), ("RoutingMismatch", 3)]
    assert fired[0].values == {"mismatch_decision_share": 101 / 2000, "mismatch_pairs": 2000.0}
    assert all(t.run_id == "mm" and t.labels["engine_run"] == "engine" and t.source == "mismatch" for t in fired)


def test_on_recorded_steps_the_mismatch_signals_are_no_data():
    step = LayerObservation(run_id="r", layer=0, step=0, ts=dt.datetime.now(dt.timezone.utc), tokens=8,
                            expert_load=np.array([4, 4, 4, 4]), router_entropy_mean=1.0, dropped_tokens=0,
                            capacity_use=None, active_param_fraction=None)
    values = compute_signals([step], ["mismatch_decision_share", "mismatch_token_share", "mismatch_pairs",
                                      "load_max_mean"])
    assert values["load_max_mean"] == 1.0  # the step is data for the window's own signals
    assert all(math.isnan(values[name]) for name in ("mismatch_decision_share", "mismatch_token_share",
                                                     "mismatch_pairs"))


def _gap_report(own_k3: float, tokens: int) -> MismatchReport:
    from moescope.analyses.logprob_gap import GAP_COLUMNS, LogprobGapReport

    rows = pd.DataFrame([dict(routing=routing, left_out_layer=None, grouping="all", group_name="all", group_order=0,
                              tokens=tokens, k3_mean=k3, abs_mean=0.1, sq_mean=0.02, extreme_2=0.01, extreme_5=0.0)
                         for routing, k3 in (("reference", own_k3), ("replay", own_k3 / 4))], columns=list(GAP_COLUMNS))
    report = _report([(0, 2000, 10)])
    report.gap = LogprobGapReport(rows, pd.DataFrame(), [0])
    return report


def test_the_gap_rule_fires_once_above_a_k3_of_a_thousandth_over_a_thousand_tokens():
    # the rule's comment: AReaL's Moonlight R3 run left 0.000373 with replay; 0.001 is about 2.7 times that
    assert [(t.alertname, t.layer) for t in judge_gap(_gap_report(0.00101, 1000), mismatch_rules())] == \
        [("LogprobGap", None)]
    fired = judge_gap(_gap_report(0.00101, 1000), mismatch_rules())
    assert fired[0].values == {"mismatch_logprob_k3": 0.00101, "mismatch_logprob_tokens": 1000.0}
    assert judge_gap(_gap_report(0.00099, 5000), mismatch_rules()) == []  # under the threshold
    assert judge_gap(_gap_report(0.05, 999), mismatch_rules()) == []  # too few tokens
    assert judge_gap(_report([(0, 2000, 10)]), mismatch_rules()) == []  # no log-probs: nothing to judge
    assert judge(_gap_report(0.05, 5000), mismatch_rules()) == []  # the per-layer judge leaves the gap rule alone
