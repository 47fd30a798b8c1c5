"""The demo's store (`moescope demo --quick`, run once as a process: the session's `demo` fixture,
which the other e2e tests share): every alert a receiver got is a row of the alerts table and the
webhooks' drift values and the Overview's numbers equal a loop over the raw Parquet rows."""

from __future__ import annotations

import math
import os
import re

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import pytest
from streamlit.testing.v1 import AppTest

from moescope.dashboard import settings
from tests.support.paths import REPO

APP = os.path.join(REPO, "dashboard", "app.py")


def _app(monkeypatch, root: str) -> AppTest:
    monkeypatch.setenv(settings.ENV_STORE, root)
    monkeypatch.setenv(settings.ENV_ALLOW_WRITES, "0")
    monkeypatch.delenv(settings.ENV_TOKENIZER, raising=False)
    return AppTest.from_file(APP, default_timeout=240)


def _loads_of_first_forwards(rows: pd.DataFrame, forwards: int, experts: int) -> list[np.ndarray]:
    """The expert loads of `rows`, in their order, until they cover `forwards` forwards (a row is never split)."""
    covered, loads = 0, []
    for row in rows.itertuples():
        if covered >= forwards:
            break
        loads.append(np.asarray(row.expert_load)[:experts])
        covered += row.forwards
    return loads


def test_every_alert_a_receiver_got_is_a_row_of_alerts_and_vice_versa(demo):
    root, out, summary = demo
    alerts = ds.dataset(os.path.join(root, "alerts"), format="parquet").to_table().to_pandas()
    notified = alerts[alerts.state.isin(["firing", "resolved"])]
    rows = sorted(zip(notified.state, notified.fingerprint, notified.step.astype(int)))
    delivered = sorted((d["status"], d["fingerprint"], int(d["step"])) for d in summary["alerts_delivered"])
    assert rows == delivered
    assert {"rules", "health", "trust_gate"} <= set(alerts.source)  # every source lands in the one table
    # the run ended: every alert that fired was resolved, those still open with the reason
    latest = alerts.sort_values(["step", "ts"]).groupby("fingerprint").tail(1)
    assert set(latest.state) <= {"resolved", "inactive"}
    assert (alerts.reason == "run ended").any()
    assert re.search(r"webhook <- \[resolved\] \w+ \(.*\) .*\(run ended\)", out)


def test_the_webhooks_drift_values_equal_the_raw_rows(demo):
    """kl_baseline as the receiver got it, against the raw layer_steps rows: the rows covering the
    rule's last window_steps forwards up to the alert's step, and the run's first baseline_steps."""
    from scipy.stats import entropy

    root, _, _ = demo
    def table(name: str) -> pd.DataFrame:  # the run id from the folder: the store also holds the rollout's runs
        return ds.dataset(os.path.join(root, name), format="parquet", partitioning="hive").to_table().to_pandas()

    alerts, layer_steps, layers = table("alerts"), table("layer_steps"), table("layers")
    experts = int(layers.num_experts.iloc[0])
    fired = alerts[(alerts.alertname == "RoutingDriftFromBaseline") & (alerts.state == "firing")]
    assert len(fired)
    for alert in fired.itertuples():
        rows = layer_steps[(layer_steps.layer == alert.layer) & (layer_steps.run_id == alert.run_id)]
        rows = rows.sort_values("step")
        base = _loads_of_first_forwards(rows, alert.baseline_steps, experts)
        window = _loads_of_first_forwards(rows[rows.step <= alert.step].iloc[::-1], alert.window_steps, experts)
        p, q = np.sum(window, axis=0) + 0.5, np.sum(base, axis=0) + 0.5
        assert dict(alert.signal_values)["kl_baseline"] == pytest.approx(entropy(p / p.sum(), q / q.sum()), rel=1e-9)


def test_demo_overview_numbers_equal_the_raw_rows(monkeypatch, demo):
    root, _, _ = demo
    layer_steps = ds.dataset(os.path.join(root, "layer_steps"), format="parquet").to_table().to_pandas()
    layers = ds.dataset(os.path.join(root, "layers"), format="parquet").to_table().to_pandas()
    width = int(layers.num_experts.iloc[0] + layers.zero_experts.iloc[0])
    tokens = layer_steps.tokens.to_numpy(float)
    entropy = float(np.sum(layer_steps.router_entropy_mean * tokens) / tokens.sum())
    at = _app(monkeypatch, str(root))
    at.run()
    assert not at.exception and not at.error
    metrics = {m.label: m for m in at.metric}
    assert metrics["Router entropy"].value == f"{entropy:.3f} nats"
    assert f"H / ln E = {entropy / math.log(width):.3f}" in [c.value for c in at.caption]
    assert metrics["Alerts firing now"].value == "0"  # a finished run resolved its alerts
