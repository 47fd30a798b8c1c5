"""The placement page's traffic section on the store the probe recorded on a real tiny Mixtral: its
heatmap holds the tokens each home rank sends to each other rank, and its histogram the tokens by
remote ranks, as a plain loop over the raw `routes` rows gives them under the default layout."""

from __future__ import annotations

import base64
import glob
import json
import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from tests.support.pages import app_for, assert_clean, open_page


def _array(value) -> np.ndarray:
    """A trace's array as Plotly's JSON holds it: a list, or {"dtype", "bdata" (base64), "shape"}."""
    if isinstance(value, dict):
        shape = tuple(int(v) for v in str(value.get("shape", "-1")).split(","))
        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"]).reshape(shape)
    return np.asarray(value)


def _routes(root: str, run_id: str) -> pd.DataFrame:
    files = glob.glob(os.path.join(root, "routes", f"run_id={run_id}", "part-*.parquet"))
    return pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)


def test_traffic_section_is_the_raw_routes_per_link(monkeypatch, recorded):
    run_id = recorded["runs"][-1]
    at = open_page(app_for(monkeypatch, recorded["root"]), "views/placement.py")
    at.number_input(key="pl_ranks").set_value(2).run()
    assert_clean(at)
    charts = at.get("plotly_chart")
    matrix_chart, histogram = (json.loads(c.proto.spec) for c in charts[-2:])
    layer = int(at.selectbox(key="pl_traffic_layer").value)
    rows = _routes(recorded["root"], run_id)
    rows = rows[rows.layer == layer]
    experts = int(max(max(ids) for ids in rows.expert_ids)) + 1
    half = (experts + 1) // 2  # the default layout over 2 ranks: experts 0..half-1 on rank 0
    matrix = np.zeros((2, 2))
    remote = []
    for ids, kept, sequence in zip(rows.expert_ids, rows.kept, rows.sequence):
        home = int(sequence) % 2  # one process recorded it: sequences round-robin over the ranks
        dests = {0 if e < half else 1 for e, k in zip(ids, kept) if k}
        for d in dests:
            matrix[home, d] += 1
        remote.append(len(dests - {home}))
    z = _array(matrix_chart["data"][0]["z"]).astype(float)
    assert z[0, 1] == matrix[0, 1] and z[1, 0] == matrix[1, 0] and matrix[0, 1] > 0
    assert np.isnan(z[0, 0]) and np.isnan(z[1, 1])  # served at home: no wire
    bars = _array(histogram["data"][0]["y"])
    np.testing.assert_array_equal(bars, np.bincount(remote, minlength=2))
