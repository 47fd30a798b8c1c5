"""The engine over a real store: new data is picked up, transitions land in `alerts`, restarts repeat nothing."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest

from moescope.alerts.notify import WebhookNotifier
from moescope.alerts.outbox import Outbox
from moescope.alerts.rules import parse_rules
from moescope.alerts.storage import StoreAlertRunner, read_alerts
from tests.support.alert_records import (
    BALANCED,
    SKEWED,
    T0,
    drift_per_1000,
    routes_for,
    write_steps,
)

PACK = parse_rules(
    """\
rules:
  - name: Skew
    expr: load_max_mean > 2.0
    window: 2
    for: 2s
    cooldown: 2s
  - name: Drift
    expr: routing_drift_rate > 2000
    window: 2
  - name: Baseline
    expr: kl_baseline > 0.1
    window: 2
    for: 0
baseline: {first_steps: 2}
"""
)






def test_runner_reads_new_steps_writes_alerts_and_survives_restart(tmp_path, receiver):
    root = str(tmp_path / "store")
    write_steps(root, [BALANCED] * 2 + [SKEWED] * 4, close=False)  # a run still being recorded
    outbox_path = str(tmp_path / "outbox.db")
    outbox = Outbox(outbox_path, [WebhookNotifier(receiver.url + "/hook")])
    runner = StoreAlertRunner(root, PACK, sinks=[outbox])
    first = runner.poll_once()
    got = [(t.alertname, t.layer, t.step, t.state) for t in first]
    # Skew: window [1,2] is 88/32 > 2 at step 2 -> pending, firing 2 s later (step 4).
    # Baseline: first two steps balanced -> KL of the skewed window crosses 0.1 at step 2.
    assert ("Skew", 0, 2, "pending") in got and ("Skew", 0, 4, "firing") in got
    assert ("Baseline", 0, 2, "pending") in got and ("Baseline", 0, 2, "firing") in got
    assert not [g for g in got if g[1] == 1]  # layer 1 stayed balanced
    assert not [g for g in got if g[0] == "Drift"]  # drift is per 1000 pairs: never above 2000
    assert runner.poll_once() == []  # nothing new landed
    table = read_alerts(runner.store)
    assert len(table) == len(first)
    assert set(table.state) == {"pending", "firing"}
    # the values are kept with each transition: max/mean of the window's load, by hand
    values = {(a, int(s), st): dict(v) for a, s, st, v in zip(table.alertname, table.step, table.state,
                                                                 table.signal_values)}
    assert values[("Skew", 2, "pending")] == {"load_max_mean": pytest.approx((16 + 72) / 32)}  # steps 1, 2
    assert values[("Skew", 4, "firing")] == {"load_max_mean": pytest.approx(72 / 16)}  # steps 3, 4
    outbox.flush(5)
    assert sorted(r.json()["alert"]["name"] for r in receiver.received()) == ["Baseline", "Skew"]

    # a restart replays the store: no transition is written twice, no alert is sent twice
    outbox.close()
    outbox = Outbox(outbox_path, [WebhookNotifier(receiver.url + "/hook")])
    runner = StoreAlertRunner(root, PACK, sinks=[outbox])
    assert runner.poll_once() == []
    assert len(read_alerts(runner.store)) == len(first)
    outbox.flush(5)
    assert len(receiver.received()) == 2

    # new steps land: skew ends, and the alert resolves after its cooldown
    writer = write_steps(root, [BALANCED] * 5, start=6, close=False)
    later = [(t.alertname, t.step, t.state) for t in runner.poll_once()]
    # window [5,6] is still skewed (last true at 6); false from 7; resolved 2 s after 6, at 8.
    # Baseline keeps firing: its cooldown is the default 5 minutes.
    assert later == [("Skew", 8, "resolved")]
    outbox.flush(5)
    statuses = [(r.json()["alert"]["name"], r.json()["status"]) for r in receiver.received()]
    assert ("Skew", "resolved") in statuses and len(statuses) == len(set(statuses))

    # the session closes (a run_ends row after the last step): Baseline resolves, "run ended",
    # at the run's last step, and the receiver gets the resolve
    writer.shutdown()
    ended = runner.poll_once()
    assert [(t.alertname, t.step, t.state, t.reason) for t in ended] == [("Baseline", 10, "resolved", "run ended")]
    assert runner.poll_once() == []  # once
    table = read_alerts(runner.store)
    resolved_rows = table[table.state == "resolved"]
    assert dict(zip(resolved_rows.alertname, resolved_rows.reason.fillna(""))) == {"Skew": "", "Baseline": "run ended"}
    outbox.flush(5)
    resolved = [r.json()["alert"] for r in receiver.received() if r.json()["status"] == "resolved"]
    assert [(a["name"], a["annotations"].get("resolved_reason")) for a in resolved] == [
        ("Skew", None), ("Baseline", "run ended")]
    outbox.close()


def test_runner_filters_runs_and_computes_route_signals_from_the_store(tmp_path):
    root = str(tmp_path / "store")
    write_steps(root, [SKEWED] * 3, run_id="a")
    write_steps(root, [SKEWED] * 3, run_id="b")
    runner = StoreAlertRunner(root, PACK, run_ids=["b"], write_alerts=False)
    found = runner.poll_once()
    assert {t.run_id for t in found} == {"b"}
    rule = PACK.rules[1]
    vals = runner.engine.signals(rule, "b", 0)
    assert vals["routing_drift_rate"] == pytest.approx(drift_per_1000([routes_for(np.array(SKEWED))] * 2))
    obs = list(runner.engine._runs["b"].history[0].items)
    assert [o.step for o in obs] == [1, 2]  # history is bounded by the longest window
    assert np.array_equal(obs[0].expert_load, SKEWED) and obs[0].expert_ids.shape == (128, 2)
    assert obs[0].ts == T0 + dt.timedelta(seconds=1) and obs[0].active_param_fraction == pytest.approx(2000 / 100_000)
    assert read_alerts(runner.store).empty


def test_baseline_from_another_run_in_the_store(tmp_path):
    root = str(tmp_path / "store")
    write_steps(root, [SKEWED] * 3, run_id="golden")
    write_steps(root, [SKEWED] * 3, run_id="now")
    pack = parse_rules("baseline: {run_id: golden, first_steps: 3}\n"
                       "rules:\n  - {name: B, expr: kl_baseline > 0.1, for: 0}\n")
    runner = StoreAlertRunner(root, pack, run_ids=["now"])
    assert runner.poll_once() == []  # same load as the golden run: no drift
    assert runner.engine.baseline("now", 0).tolist() == (np.array(SKEWED) * 3).tolist()


def test_the_alerts_table_keeps_what_a_full_disk_refused_and_a_later_handle_writes_it(tmp_path):
    import pyarrow.parquet as pq

    from moescope.alerts.engine import AlertTransition
    from moescope.alerts.storage import AlertTableWriter
    from moescope.store.writer import open_writers

    transition = AlertTransition(
        fingerprint="f", alertname="Skew", state="firing", previous_state="pending", at=T0, step=3,
        run_id="run-a", layer=0, severity="warning", expr="load_max_mean > 2.0", labels={}, annotations={},
        values={}, starts_at=T0, ends_at=None)
    blocker = tmp_path / "alerts"
    blocker.write_text("no room: a file where the table's folder should be")
    table = AlertTableWriter(str(tmp_path))
    table.handle([transition])  # written on the run writer's thread, never the caller's
    assert table.flush(10)
    assert [row["fingerprint"] for row in table.unwritten] == ["f"] and table.last_error and table.lost == 0
    blocker.unlink()
    table.handle([])  # a later call, even with nothing new, writes what waited
    assert table.unwritten == [] and table.last_error is None
    assert pq.read_table(tmp_path / "alerts" / "run_id=run-a").column("step").to_pylist() == [3]
    table.close()
    assert not [w for w in open_writers() if w.root == str(tmp_path)]  # the run's writer was given back
