"""The policy's hysteresis, guard rails and overrides, on a real gate of a tiny model."""

from __future__ import annotations

import datetime as dt

import pytest
import torch

import moescope
from moescope.alerts.health_score import ExpertHealth
from moescope.alerts.trust_policy import TrustPolicy, TrustPolicyConfig
from moescope.probe.trust_gate import TrustGateError
from moescope.store.store import Store
from tests.support.zoo import tiny_model

torch.set_num_threads(1)


def _row(expert: int, score: float, window: int, layer: int = 0) -> ExpertHealth:
    return ExpertHealth(run_id="r", window=window, step_start=window, step_end=window,
                        ts=dt.datetime(2025, 1, 1, 0, 0, window, tzinfo=dt.timezone.utc), layer=layer, expert=expert,
                        score=score, load=None, confidence=None, output=score, weight=None, grad=None,
                        load_share_ratio=None, gate_weight_mean=None, output_norm_mean=None,
                        output_nonfinite_fraction=None, weight_cosine=None, weight_norm_ratio=None, grad_norm=None,
                        trust_weight=1.0, reasons="test")


@pytest.fixture
def session(tmp_path):
    model = tiny_model("mixtral")
    policy = TrustPolicy(TrustPolicyConfig(gate_after=2, lift_after=3, max_gated_share=0.25))
    with moescope.attach(model, store=tmp_path, trust_gate="auto", trust_policy=policy) as s:
        yield s


def test_hysteresis_gates_after_n_bad_and_lifts_after_m_good(session):
    policy, gate = session.trust, session.gate
    policy.judge([_row(2, 10, 0)], 0)
    assert gate.weight(0, 2) == 1  # one bad window is not enough
    policy.judge([_row(2, 55, 1)], 1)  # in between: the run of bad windows is broken
    policy.judge([_row(2, 10, 2)], 2)
    assert gate.weight(0, 2) == 1
    policy.judge([_row(2, 10, 3)], 3)
    assert gate.weight(0, 2) == 0
    for window in (4, 5):
        policy.judge([_row(2, 90, window)], window)
        assert gate.weight(0, 2) == 0
    policy.judge([_row(2, 90, 6)], 6)
    assert gate.weight(0, 2) == 1
    assert [(a.alertname, a.state) for a in policy.alerts] == [
        ("TrustGateChanged", "firing"), ("ExpertUnhealthy", "firing"),
        ("TrustGateChanged", "resolved"), ("ExpertUnhealthy", "resolved")]


def test_guard_rails_cap_the_share_and_worst_goes_first(session):
    policy, gate = session.trust, session.gate  # 8 experts, 25%: at most 2 gated
    for window in range(2):
        policy.judge([_row(e, s, window) for e, s in ((1, 30), (4, 5), (6, 20))], window)
    assert (gate.weights(0) == 0).nonzero()[0].tolist() == [4, 6]
    blocked = [a for a in policy.alerts if a.alertname == "ExpertUnhealthy" and a.labels["expert"] == "1"]
    assert "guard rail: at most 25%" in blocked[0].annotations["action"]


def test_min_active_experts():
    model = tiny_model("mixtral")
    policy = TrustPolicy(TrustPolicyConfig(max_gated_share=1.0, min_active=6))
    with moescope.attach(model, trust_gate="auto", trust_policy=policy) as s:
        for window in range(2):
            policy.judge([_row(e, 0, window) for e in range(8)], window)
        assert int((s.gate.weights(0) == 0).sum()) == 2


def test_override_pins_and_events_land_in_the_table(session, tmp_path):
    policy, gate = session.trust, session.gate
    policy.override(0, 5, 0.5, "operator: suspicious")
    for window in range(4):
        policy.judge([_row(5, 95, window)], window)
    assert gate.weight(0, 5) == 0.5  # pinned: the policy leaves it alone
    policy.release(0, 5)
    assert gate.weight(0, 5) == 1
    with pytest.raises(TrustGateError):
        policy.override(0, 5, 2.0, "bad weight")
    session.close()
    events = Store(tmp_path).sql(
        "SELECT expert, old_weight, new_weight, source, reason FROM trust_gate_events ORDER BY ts")
    assert events.values.tolist() == [[5, 1.0, 0.5, "override", "operator: suspicious"],
                                      [5, 0.5, 1.0, "override", "override released"]]


def test_health_without_gate_alerts_but_changes_nothing():
    model = tiny_model("mixtral")
    with moescope.attach(model, health=True) as s:  # the composition root binds a policy to health
        assert s.gate is None
        for window in range(2):
            s.trust.judge([_row(3, 0, window)], window)
        assert [(a.alertname, a.state) for a in s.trust.alerts] == [("ExpertUnhealthy", "firing")]
        assert "trust gate off" in s.trust.alerts[0].annotations["action"]
        with pytest.raises(RuntimeError, match="trust_gate="):
            s.trust.override(0, 3, 0.0, "no gate")


def test_routing_only_anomalies_are_alerted_not_gated(tmp_path):
    """Low load or confidence is what the router does with an expert (a traffic shift does it too):
    alert, but gate only when the expert's own outputs, weights or gradients fail."""
    from dataclasses import replace

    def shy(window):  # chosen only as a weak second choice: confidence 0, outputs fine
        return replace(_row(3, 20, window), confidence=0.0, output=100.0, load=80.0, load_share_ratio=0.5)

    model = tiny_model("mixtral")
    policy = TrustPolicy(TrustPolicyConfig(gate_after=2))
    with moescope.attach(model, trust_gate="auto", trust_policy=policy) as s:
        for window in range(3):
            policy.judge([shy(window)], window)
        assert s.gate.weight(0, 3) == 1
        fired = [a for a in policy.alerts if a.alertname == "ExpertUnhealthy"]
        assert fired and "only its routing looks wrong (confidence)" in fired[0].annotations["action"]
    # a user who wants routing anomalies gated says so
    policy = TrustPolicy(TrustPolicyConfig(gate_after=2, gate_on=("confidence", "output")))
    with moescope.attach(model, trust_gate="auto", trust_policy=policy) as s:
        for window in range(2):
            policy.judge([shy(window)], window)
        assert s.gate.weight(0, 3) == 0
    with pytest.raises(ValueError, match="gate_on names health components"):
        TrustPolicyConfig(gate_on=("latency",))


def test_dashboard_requests_are_applied_once_only_when_accepted(tmp_path):
    from moescope.dashboard.gate_requests import write_request

    model = tiny_model("mixtral")
    x = torch.randint(0, 128, (1, 4))
    refused = TrustPolicy()
    with moescope.attach(model, store=tmp_path / "a", trust_gate="manual", trust_policy=refused) as s:
        write_request(tmp_path / "a", s.run.run_id, 0, 3, 0.0, "looks broken")
        with torch.no_grad():
            model(x)
        s.flush()
        assert s.gate.weight(0, 3) == 1 and refused.applied_requests == {}

    policy = TrustPolicy(accept_requests=True, request_poll_s=0)
    root = tmp_path / "b"
    with moescope.attach(model, store=root, trust_gate="manual", trust_policy=policy) as s:
        first = write_request(root, s.run.run_id, 0, 3, 0.0, "looks broken")
        write_request(root, s.run.run_id, 0, 99, 0.0, "no such expert")
        with torch.no_grad():
            model(x)
        s.flush()
        assert s.gate.weight(0, 3) == 0
        assert policy.applied_requests[first["request_id"]] == "applied"
        assert sum(v.startswith("refused") for v in policy.applied_requests.values()) == 1
        with torch.no_grad():  # a later poll does not apply the same request twice
            model(x)
        s.flush()
        write_request(root, s.run.run_id, 0, 3, 1.0, "fixed", action="release")
        with torch.no_grad():
            model(x)
        s.flush()
        assert s.gate.weight(0, 3) == 1
    events = Store(root).sql("SELECT expert, new_weight, reason, source FROM trust_gate_events ORDER BY ts")
    assert events.new_weight.tolist() == [0.0, 1.0]
    assert "looks broken (requested by dashboard@" in events.reason[0] and set(events.source) == {"override"}
