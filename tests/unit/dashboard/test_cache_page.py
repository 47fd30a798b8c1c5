"""The Expert cache page and its figure, on the store the probe recorded on a real tiny Mixtral.

The replay itself is checked against a brute-force loop in tests/unit/metrics/test_expert_cache.py and
tests/unit/analyses/test_whatif.py; here the page must show the curves of the raw routes rows.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from moescope.analyses.expert_cache import cache_report
from moescope.dashboard import figures as fg
from moescope.metrics.expert_cache import POLICIES, cache_curves, expert_accesses
from moescope.store.store import Store
from tests.support.pages import app_for, assert_clean, open_page


def _raw_curves(root: str, run_id: str, layer: int, experts: int) -> dict:
    files = glob.glob(os.path.join(root, "routes", f"run_id={run_id}", "part-*.parquet"))
    rows = pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)
    rows = rows[rows.layer == layer].sort_values(["step", "rank", "token"])
    ids = np.stack(rows.expert_ids.to_numpy())
    kept = np.stack(rows.kept.to_numpy())
    return cache_curves(expert_accesses(ids, experts, kept), experts)


def test_cache_figure_draws_every_policy_of_the_report(recorded):
    run_id = recorded["runs"][-1]
    with Store(recorded["root"]) as store:
        report = cache_report(store, run_id, layer=1)
    fig = fg.cache_hit_figure(report)
    assert [trace.name for trace in fig.data] == list(POLICIES)
    for trace in fig.data:
        line = report[report.policy == trace.name].sort_values("capacity")
        np.testing.assert_array_equal(trace.x, line.capacity)
        np.testing.assert_allclose(trace.y, line.hit_rate * 100)
    assert fg.cache_hit_figure(report.iloc[:0]).layout.annotations  # an empty report says why


def test_cache_page_shows_the_curves_of_the_recorded_routes(monkeypatch, recorded):
    run_id = recorded["runs"][-1]
    at = open_page(app_for(monkeypatch, recorded["root"]), "views/cache.py")
    assert_clean(at)
    assert at.title[0].value == "Expert cache" and len(at.get("plotly_chart")) == 1
    layer = at.selectbox(key="cache_layer").value
    with Store(recorded["root"]) as store:
        experts = int(store.layers(run_id).set_index("layer").num_experts[layer])
    curves = _raw_curves(recorded["root"], run_id, layer, experts)
    shown = at.dataframe[0].value
    for policy in POLICIES:
        np.testing.assert_allclose(shown[f"{policy} %"].to_numpy(), np.round(curves[policy].hit_rate * 100, 1))
    assert any(f"{curves['lru'].accesses:,} expert accesses" in c.value for c in at.caption)
