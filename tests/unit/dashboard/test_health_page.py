"""The Expert health page on a store with health scores and a gated expert, against the raw rows.

The store is recorded by the real probe on a tiny Mixtral with `trust_gate="auto"`: one expert is
poisoned (NaN weights) until the policy masks it. The page, run by Streamlit's AppTest, must show
each expert's latest score, components and measurements, and the gate's current weights and
history, exactly as the raw `expert_health` and `trust_gate_events` Parquet rows hold them (read
here with pyarrow, not through the store's queries).
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

import moescope
from moescope.probe.health_sampling import _expert_tensors
from tests.support.pages import app_for, assert_clean, open_page
from tests.support.zoo import tiny_model

PAGE = "views/health.py"
COMPONENTS = ("load", "confidence", "output", "weight", "grad")


@pytest.fixture(scope="module")
def gated_store(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("health") / "store")
    model = tiny_model("mixtral")
    g = torch.Generator().manual_seed(7)
    session = moescope.attach(model, store=root, trust_gate="auto", window=1, run_id="health-run",
                              health_options=dict(sample_every=1))
    layer, expert = session.layers[0], 3
    try:
        with torch.no_grad():
            for _ in range(12):  # three healthy health windows
                model(torch.randint(0, 128, (2, 16), generator=g))
            for param, row in _expert_tensors(layer)[expert]:
                (param.view(-1) if row is None else param.view(layer.num_experts, -1)[row]).fill_(float("nan"))
            for _ in range(24):
                model(torch.randint(0, 128, (2, 16), generator=g))
                session.flush()
                if session.gate.weight(0, expert) == 0.0:
                    break
            assert session.gate.weight(0, expert) == 0.0, "the poisoned expert was not gated"
            for _ in range(8):  # two more windows with the expert masked
                model(torch.randint(0, 128, (2, 16), generator=g))
    finally:
        session.close()
    return {"root": root, "run": "health-run", "layer": 0, "expert": expert}


def _raw(root: str, table: str, run: str) -> pd.DataFrame:
    files = sorted(glob.glob(os.path.join(root, table, f"run_id={run}", "part-*.parquet")))
    assert files, f"no {table} rows were written"
    return pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)


def _same(a, b) -> bool:
    if a is None or (isinstance(a, float) and np.isnan(a)):
        return b is None or (isinstance(b, float) and np.isnan(b))
    if isinstance(a, (float, np.floating)):
        return b == pytest.approx(float(a), rel=1e-12, abs=1e-12)
    return a == b


def test_scores_components_and_gate_match_the_raw_rows(monkeypatch, gated_store):
    root, run = gated_store["root"], gated_store["run"]
    health = _raw(root, "expert_health", run)
    events = _raw(root, "trust_gate_events", run)
    at = open_page(app_for(monkeypatch, root), PAGE)
    assert_clean(at)
    frames = [d.value for d in at.dataframe]
    scores, gate_state, history = frames[0], frames[1], frames[2]

    # the latest window of each expert: one row per (layer, expert), worst score first
    latest = {}
    for row in health.to_dict("records"):
        key = (row["layer"], row["expert"])
        if key not in latest or row["step_end"] > latest[key]["step_end"]:
            latest[key] = row
    assert len(scores) == len(latest) == 2 * 8
    assert scores.score.tolist() == sorted(r["score"] for r in latest.values())
    shown_columns = [c for c in scores.columns if c in health.columns]
    assert {"score", "load_share_ratio", "trust_weight", *[c for c in COMPONENTS if health[c].notna().any()]} <= set(
        shown_columns)
    for shown in scores.to_dict("records"):
        raw = latest[(shown["layer"], shown["expert"])]
        for column in shown_columns:
            assert _same(raw[column], shown[column]), (shown["layer"], shown["expert"], column)

    # the poisoned expert: gated by the policy, its score low, its weight 0 in the latest rows
    layer, expert = gated_store["layer"], gated_store["expert"]
    mine = latest[(layer, expert)]
    assert mine["trust_weight"] == 0.0 and health[(health.layer == layer) & (health.expert == expert)].score.min() < 40
    worst = min(latest.values(), key=lambda r: r["score"])
    assert at.selectbox(key="he_layer").value == worst["layer"]
    assert at.selectbox(key="he_expert").value == worst["expert"]

    # the gate: the last change of each expert ever changed, and the whole history
    ordered = events.sort_values("step", kind="stable")
    last = ordered.groupby(["layer", "expert"]).tail(1)
    assert gate_state[["layer", "expert", "new_weight"]].values.tolist() == \
        last[["layer", "expert", "new_weight"]].values.tolist() == [[layer, expert, 0.0]]
    assert len(history) == len(events)
    assert sorted(history.new_weight.tolist()) == sorted(events.new_weight.tolist())
    assert any(f"History: {len(events)} changes" in e.label for e in at.expander)
    assert len(at.get("plotly_chart")) == 2  # the expert's score over time, the gate's history
