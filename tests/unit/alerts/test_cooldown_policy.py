"""The routing cooldown policy: hand-built records with exact signals in, cooldowns, rows, alerts and
webhooks out.

Records come from tests/support/alert_records.py (exact loads, router entropy and capacity use), go
through the probe session's real pipeline (its writer thread) to the policy, which drives a real
RouterCooldown on a tiny Mixtral's optimizer. Expected values come from the records' numbers and the
scheduler's formula; the events and alerts are read back from the raw Parquet files with pyarrow,
and the webhooks from a real local HTTP receiver.
"""

from __future__ import annotations

import math
import os

import pyarrow.parquet as pq
import pytest
import torch

from moescope import probe
from moescope.alerts.cooldown_policy import ALERT_NAME, CooldownConfig, CooldownPolicy, bind_cooldown
from moescope.alerts.notify import WebhookNotifier
from moescope.alerts.outbox import Outbox
from moescope.alerts.rules import default_rules
from moescope.probe.router_cooldown import RouterCooldownError
from moescope.store import delta
from tests.support.alert_records import layer_step, step_record
from tests.support.zoo import training_mixtral

torch.set_num_threads(1)
EXPERTS = 4
LN_E = math.log(EXPERTS)
BASE_LR = 0.2
FAST = dict(for_duration="0s", window=1, period_steps=3, min_gap_steps=2, max_share=0.5)


def _lr(step: int) -> float:
    return BASE_LR * 0.5 ** step


class Run:
    """A probe session, an optimizer with a scheduler, and the bound policy."""

    def __init__(self, tmp_path, config: CooldownConfig | None = None, sink=None):
        self.model = training_mixtral()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=BASE_LR)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 0.5 ** s)
        self.session = probe.attach(self.model, [], recording=probe.Recording(window=1))
        self.root = tmp_path / "store"
        self.policy = bind_cooldown(self.session, self.optimizer, self.scheduler, config, self.root, sink)
        self.actuator = self.policy.actuator
        self.forward = 0
        self.optimizer_steps = 0

    def record(self, layers: dict[int, tuple[float, float | None]], seconds_per_step: float = 1.0) -> None:
        """One record: layer -> (normalised router entropy, capacity use), through the pipeline."""
        steps = [layer_step(layer, [10, 10, 10, 10], entropy=h * LN_E, capacity_use=c)
                 for layer, (h, c) in layers.items()]
        self.session.processor.emit(step_record(self.forward, steps, run_id=self.session.run.run_id,
                                                seconds_per_step=seconds_per_step))
        self.forward += 1
        assert self.session.processor.force_flush(10)

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.optimizer.step()  # no gradients: nothing moves, but the step hooks run
            self.scheduler.step()
            self.optimizer_steps += 1
        assert self.session.processor.force_flush(10)

    def table(self, name: str) -> list[dict]:
        """Raw rows of a table's committed Parquet files (the Delta snapshot's), in the order they were
        written: part names end in -<seq>-<ns>.parquet, the writer's sequence."""
        run_id = self.session.run.run_id
        paths = [os.path.join(self.root, name, part.path) for part in delta.snapshot(self.root, name).files
                 if part.run_id == run_id]
        rows = []
        for path in sorted(paths, key=lambda p: int(os.path.basename(p)[: -len(".parquet")].split("-")[-2])):
            # run_id is the partition's (in the folder name and the log, not in the file)
            rows.extend({**row, "run_id": run_id} for row in pq.read_table(path).to_pylist())
        return rows

    def close(self) -> None:
        self.session.close()


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path, CooldownConfig(**FAST))
    try:
        yield r
    finally:
        r.close()


COLLAPSED = (0.1, 0.99)  # entropy 0.1 < 0.25, capacity use 0.99 > 0.95: the rule holds
HEALTHY = (0.8, 0.5)


def test_firing_starts_a_cooldown_the_period_ends_it_and_all_is_recorded(tmp_path, receiver):
    outbox = Outbox(str(tmp_path / "outbox.db"), [WebhookNotifier(receiver.url + "/hook")])
    run = Run(tmp_path, CooldownConfig(**FAST), sink=outbox)
    try:
        run.steps(1)  # the schedule under way: lr 0.1
        run.record({0: HEALTHY, 1: HEALTHY})
        assert run.actuator.cooling() == {}
        run.record({0: COLLAPSED, 1: HEALTHY})
        assert set(run.actuator.cooling()) == {0}
        assert run.actuator.lr_in_force(0) == pytest.approx(0.1 * _lr(1), rel=1e-12)
        assert run.actuator.lr_in_force(1) == pytest.approx(_lr(1), rel=1e-12)
        run.steps(2)
        assert set(run.actuator.cooling()) == {0}
        run.steps(1)  # the third optimizer step of the cooldown ends it, in the step hook
        assert run.actuator.cooling() == {} and run.actuator.lr_in_force(0) == pytest.approx(_lr(4), rel=1e-12)
        outbox.deliver_due()
    finally:
        run.close()
        outbox.close()

    rows = run.table("routing_cooldown_events")
    assert [(r["action"], r["layer"], r["step"], r["source"], r["period_steps"]) for r in rows] == [
        ("start", 0, 1, "auto", 3), ("end", 0, 4, "auto", 3)]
    start, end = rows
    assert start["lr_before"] == pytest.approx(_lr(1), rel=1e-12)
    assert start["lr_after"] == pytest.approx(0.1 * _lr(1), rel=1e-12)
    # the end comes in the step hook of the cooldown's last step, before the scheduler moves on:
    # lr_before is what that step used
    assert end["lr_before"] == pytest.approx(0.1 * _lr(3), rel=1e-12)
    assert end["lr_after"] == pytest.approx(_lr(3), rel=1e-12)
    assert start["router_entropy"] == pytest.approx(0.1, rel=1e-12) and start["capacity_use"] == 0.99
    assert start["lr_factor"] == 0.1 and start["epsilon"] == 0.01 and start["rank"] == 0
    assert start["reason"] == "RoutingCooldown fired: router_entropy 0.1 < 0.25, capacity_use 0.99 > 0.95"
    assert end["reason"] == "cooldown period over" and end["ts"] > start["ts"]
    assert start["run_id"] == run.session.run.run_id

    alerts = [a for a in run.table("alerts") if a["alertname"] == ALERT_NAME]
    assert [(a["state"], a["previous_state"], a["layer"], a["source"]) for a in alerts] == [
        ("firing", "inactive", 0, "cooldown"), ("resolved", "firing", 0, "cooldown")]
    assert alerts[0]["fingerprint"] == alerts[1]["fingerprint"]
    assert alerts[0]["starts_at"] == alerts[1]["starts_at"] and alerts[1]["ends_at"] is not None
    assert dict(alerts[0]["signal_values"])["lr_after"] == pytest.approx(0.1 * _lr(1), rel=1e-12)

    posts = receiver.received("/hook")
    assert [p.json()["status"] for p in posts] == ["firing", "resolved"]
    assert {p.json()["alert"]["name"] for p in posts} == {ALERT_NAME}
    assert posts[0].json()["alert"]["labels"]["layer"] == "0"
    assert "router lr x0.1" in posts[0].json()["alert"]["annotations"]["summary"]


def test_guard_rails_block_with_a_recorded_row(run):
    both = {0: COLLAPSED, 1: (0.05, 0.99)}  # layer 1 is the more collapsed: it goes first
    run.record(both)
    run.record(both)  # still blocked: no second row for the same rail
    assert set(run.actuator.cooling()) == {1}
    run.steps(3)  # layer 1's cooldown ends at optimizer step 3
    run.record(both)  # layer 1 within its min gap; layer 0 may cool now
    assert set(run.actuator.cooling()) == {0}
    run.steps(3)  # layer 0 ends at step 6; layer 1 ended 3 steps ago, its gap (2) is over
    run.record(both)
    assert set(run.actuator.cooling()) == {1}
    run.close()

    rows = run.table("routing_cooldown_events")
    got = [(r["action"], r["layer"], r["step"]) for r in rows]
    assert got == [("blocked", 0, 0), ("start", 1, 0), ("end", 1, 3), ("blocked", 1, 3), ("start", 0, 3),
                   ("end", 0, 6), ("blocked", 0, 6), ("start", 1, 6), ("end", 1, 6)]
    blocked = [r for r in rows if r["action"] == "blocked"]
    assert "at most 1 of 2 MoE layers cool at once (max_share 0.5)" in blocked[0]["reason"]
    assert "layer 1's last cooldown ended 0 optimizer steps ago; min_gap_steps is 2" in blocked[1]["reason"]
    assert "at most 1 of 2" in blocked[2]["reason"]
    assert all(r["lr_before"] == r["lr_after"] for r in blocked)
    assert rows[-1]["reason"] == "run ended"  # closing the session ended the last one


def test_no_capacity_no_cooldown_and_a_healthy_router_stays_alone(run):
    for _ in range(3):
        run.record({0: (0.1, None), 1: HEALTHY})  # a dropless router: capacity use is "no data"
    run.steps(1)
    assert run.actuator.cooling() == {} and run.policy.rows == []
    assert run.actuator.lr_in_force(0) == pytest.approx(_lr(1), rel=1e-12)


def test_the_default_for_waits_two_minutes_of_event_time(tmp_path):
    run = Run(tmp_path, CooldownConfig(window=1))  # the default pack's `for`: 2m
    try:
        for forward in range(4):
            run.record({0: COLLAPSED}, seconds_per_step=30)  # 0 s, 30 s, 60 s, 90 s
            assert run.actuator.cooling() == {}, forward
        run.record({0: COLLAPSED}, seconds_per_step=30)  # 120 s after it began to hold
        assert set(run.actuator.cooling()) == {0}
        assert run.actuator.cooling()[0].ends_at_step == 100  # the default period
    finally:
        run.close()


def test_session_close_ends_the_cooldown_and_resolves_its_alert(run):
    run.record({0: COLLAPSED})
    assert set(run.actuator.cooling()) == {0}
    run.steps(1)
    run.close()
    assert run.actuator.closed and not run.optimizer._optimizer_step_pre_hooks
    assert [g["lr"] for g in run.optimizer.param_groups] == pytest.approx([_lr(1)] * 3, rel=1e-12)
    rows = run.table("routing_cooldown_events")
    assert [(r["action"], r["step"], r["reason"], r["period_steps"]) for r in rows] == [
        ("start", 0, rows[0]["reason"], 3), ("end", 1, "run ended", 1)]
    resolved = [a for a in run.table("alerts") if a["state"] == "resolved"]
    assert len(resolved) == 1 and resolved[0]["reason"] == "run ended"
    run.policy.shutdown()  # twice is safe
    assert len(run.table("routing_cooldown_events")) == 2


def test_a_manual_cooldown_is_recorded_too(run):
    run.actuator.start(1, factor=0.5, epsilon=0.0, reason="operator: suspicious router")
    run.steps(2)
    run.actuator.end(1, "operator: done")
    run.steps(0)
    rows = run.table("routing_cooldown_events")
    assert [(r["action"], r["source"], r["reason"], r["lr_factor"]) for r in rows] == [
        ("start", "manual", "operator: suspicious router", 0.5), ("end", "manual", "operator: done", 0.5)]
    assert rows[0]["period_steps"] is None and rows[1]["period_steps"] == 2
    assert rows[1]["lr_before"] == pytest.approx(0.5 * _lr(2), rel=1e-12)
    assert [a["state"] for a in run.table("alerts")] == ["firing", "resolved"]


def test_threshold_overrides_change_the_rule():
    config = CooldownConfig(thresholds={"router_entropy": 0.05}, window=8, for_duration="30s")
    rule = config.resolved_rule()
    default = next(r for r in default_rules().rules if r.name == "RoutingCooldown")
    assert rule.expr == "router_entropy < 0.05 and capacity_use > 0.95"
    assert (rule.window.steps, rule.for_s, rule.cooldown_s) == (8, 30.0, 0.0)
    assert (default.window.steps, default.for_s) == (32, 120.0)  # the pack's, left alone
    assert CooldownConfig().resolved_rule().expr == default.expr


def test_an_overridden_threshold_is_what_fires(tmp_path):
    run = Run(tmp_path, CooldownConfig(**FAST, thresholds={"router_entropy": 0.05}))
    try:
        run.record({0: COLLAPSED})  # 0.1 is not below 0.05
        assert run.actuator.cooling() == {}
        run.record({0: (0.04, 0.99)})
        assert set(run.actuator.cooling()) == {0}
    finally:
        run.close()


@pytest.mark.parametrize("kwargs, message", [
    (dict(factor=0), "factor multiplies the router's lr and must lie in \\(0, 1\\]"),
    (dict(factor=1.5), "factor multiplies"),
    (dict(epsilon=-0.1), "epsilon is the router jitter's half-width"),
    (dict(epsilon=1), "epsilon is the router jitter's half-width"),
    (dict(period_steps=0), "period_steps counts optimizer steps"),
    (dict(period_steps=2.5), "period_steps counts optimizer steps"),
    (dict(min_gap_steps=-1), "min_gap_steps counts optimizer steps"),
    (dict(max_share=0), "max_share is a share of the MoE layers"),
    (dict(max_share=1.5), "max_share is a share"),
    (dict(window=0), "window counts forwards"),
    (dict(for_duration="soon"), "for_duration: 'soon' is not a duration"),
    (dict(thresholds={"load_cv": 1.0}), "'load_cv' is not a signal of RoutingCooldown"),
    (dict(thresholds={"router_entropy": float("nan")}), "must be a finite number"),
    (dict(rule="RoutingCooldown"), "must be an alerts.rules.Rule"),
])
def test_bad_config_values_say_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CooldownConfig(**kwargs)


def test_binding_errors_are_clear(tmp_path):
    model = training_mixtral()
    layers = probe.find_moe_layers(model)
    routers = {id(p) for layer in layers for p in layer.router.parameters()}
    subset = torch.optim.SGD([p for p in model.parameters() if id(p) not in routers], lr=0.1)
    with probe.attach(model, []) as session:
        with pytest.raises(RouterCooldownError, match="not in the optimizer"):
            bind_cooldown(session, subset)
        with pytest.raises(ValueError, match="CooldownConfig"):
            bind_cooldown(session, torch.optim.SGD(model.parameters(), lr=0.1), config={"factor": 0.1})
    with pytest.raises(ValueError, match="session is closed"):
        bind_cooldown(session, torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(CooldownPolicy().config, CooldownConfig)
