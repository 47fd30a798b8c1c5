"""The Placement page on the store the probe recorded on a real tiny Mixtral: its heatmap holds the
per-rank slots a plain loop over the raw `layer_steps` rows gives under the default layout, its lines
the balancedness of each candidate, and a what-if written to the store is the one it shows. Its
traffic section's heatmap holds the tokens each home rank sends to each other rank, and its histogram
the tokens by remote ranks, as a plain loop over the raw `routes` rows gives them."""

from __future__ import annotations

import base64
import glob
import json
import os
import shutil
import threading

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from moescope.cli import main
from moescope.dashboard import data
from tests.support.pages import app_for, assert_clean, open_page, settle


def _array(value) -> np.ndarray:
    """A trace's array as Plotly's JSON holds it: a list, or {"dtype", "bdata" (base64), "shape"}."""
    if isinstance(value, dict):
        shape = tuple(int(v) for v in str(value.get("shape", "-1")).split(","))
        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"]).reshape(shape)
    return np.asarray(value)


def _raw(root: str, table: str, run_id: str) -> pd.DataFrame:
    files = glob.glob(os.path.join(root, table, f"run_id={run_id}", "part-*.parquet"))
    return pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)


def _layer_steps(root: str, run_id: str) -> pd.DataFrame:
    return _raw(root, "layer_steps", run_id)


def test_placement_page_heatmap_is_the_raw_rows_per_rank(monkeypatch, recorded):
    run_id = recorded["runs"][-1]
    at = open_page(app_for(monkeypatch, recorded["root"]), "views/placement.py")
    assert_clean(at)
    assert at.title[0].value == "Placement"
    settle(at.number_input(key="pl_ranks").set_value(2).run())
    assert_clean(at)
    charts = at.get("plotly_chart")
    assert len(charts) == 6  # and the traffic section's two (test_traffic_section_is_the_raw_routes_per_link)
    curve = json.loads(next(c for c in charts if c.key == "pl_rebalance_curve").proto.spec)["data"][0]
    points = dict(zip(curve["text"], _array(curve["x"])))
    assert len(points) == 6 and points["never"] == 0  # a policy per point; never moves nothing
    heatmap = json.loads(next(c for c in charts if c.key == "pl_heatmap").proto.spec)["data"][0]
    rows = _layer_steps(recorded["root"], run_id)
    for column, layer in enumerate(heatmap["x"]):
        load = np.sum([np.asarray(v) for v in rows[rows.layer == int(layer)].expert_load], axis=0)
        experts = len(load)  # the tiny Mixtral has no zero experts
        half = (experts + 1) // 2
        ranks = np.array([load[:half].sum(), load[half:].sum()], dtype=float)
        np.testing.assert_allclose(_array(heatmap["z"])[:, column], ranks / ranks.mean())


def test_placement_page_shows_a_stored_whatif(monkeypatch, recorded, tmp_path):
    root = str(tmp_path / "store")
    shutil.copytree(recorded["root"], root)
    run_id = recorded["runs"][-1]
    assert main(["placement", root, "--run", run_id, "--ranks", "2", "--whatif", "--window", "2", "--save"]) == 0
    at = open_page(app_for(monkeypatch, root), "views/placement.py")
    assert_clean(at)
    assert any("stored by `moescope placement --whatif --save` (2 ranks" in c.value for c in at.caption)


def test_placement_page_fits_eplb_when_the_ranks_do_not_divide_the_experts(monkeypatch, recorded):
    at = open_page(app_for(monkeypatch, recorded["root"]), "views/placement.py")
    at.number_input(key="pl_ranks").set_value(3).run()
    assert_clean(at)
    assert not at.warning, [w.value for w in at.warning]
    assert {"pl_heatmap", "pl_over_time", "pl_before_after"} <= {c.key for c in at.get("plotly_chart")}
    experts = int(_layer_steps(recorded["root"], recorded["runs"][-1]).expert_load.map(len).max())
    assert any(f"3 ranks, {-experts % 3} redundant slot(s)" in c.value for c in at.caption)


def test_traffic_section_is_the_raw_routes_per_link(monkeypatch, recorded, tmp_path):
    """The page's first render does not wait for its traffic (a pass over the routes rows): that is
    computed off the page's run (here behind a computation that holds the server's worker) and drawn
    on the run after."""
    run_id = recorded["runs"][-1]
    root = str(tmp_path / "store")  # a store of its own: no traffic of it in the caches yet
    shutil.copytree(recorded["root"], root)
    gate = threading.Event()
    data.off_the_run(gate.wait, 120)
    try:
        at = app_for(monkeypatch, root)
        at.run()
        at.switch_page("views/placement.py").run()
        at.number_input(key="pl_ranks").set_value(2).run()
        assert_clean(at)
        assert [c.key for c in at.get("plotly_chart")] == ["pl_heatmap", "pl_over_time", "pl_before_after",
                                                           "pl_rebalance_curve"]
        assert any("routes for its traffic on the wire" in i.value for i in at.info)
    finally:
        gate.set()
    settle(at)
    assert_clean(at)
    assert not any("routes for its traffic on the wire" in i.value for i in at.info)
    charts = at.get("plotly_chart")
    matrix_chart, histogram = (json.loads(c.proto.spec) for c in charts[-2:])
    layer = int(at.selectbox(key="pl_traffic_layer").value)
    rows = _raw(root, "routes", run_id)
    rows = rows[rows.layer == layer]
    experts = int(max(max(ids) for ids in rows.expert_ids)) + 1
    half = (experts + 1) // 2  # the default layout over 2 ranks: experts 0..half-1 on rank 0
    matrix = np.zeros((2, 2))
    remote = []
    for ids, kept, token in zip(rows.expert_ids, rows.kept, rows.token):
        home = int(token) % 2  # one process recorded it: rows of a forward round-robin over the ranks
        dests = {0 if e < half else 1 for e, k in zip(ids, kept) if k}
        for d in dests:
            matrix[home, d] += 1
        remote.append(len(dests - {home}))
    z = _array(matrix_chart["data"][0]["z"]).astype(float)
    assert z[0, 1] == matrix[0, 1] and z[1, 0] == matrix[1, 0] and matrix[0, 1] > 0
    assert np.isnan(z[0, 0]) and np.isnan(z[1, 1])  # served at home: no wire
    bars = _array(histogram["data"][0]["y"])
    np.testing.assert_array_equal(bars, np.bincount(remote, minlength=2))


def _default_layout_balancedness(rows: pd.DataFrame, ranks: int, window: int) -> dict[int, float]:
    """Per window of `window` steps, sum over layers of the mean rank's slots over the busiest rank's,
    the experts laid out contiguously on `ranks` ranks, by a plain loop over raw `layer_steps` rows."""
    out = {}
    for start in sorted({int(s) // window * window for s in rows.step}):
        means = peaks = 0.0
        for layer in sorted(set(rows.layer)):
            part = rows[(rows.layer == layer) & (rows.step // window * window == start)]
            load = np.sum([np.asarray(v, dtype=float) for v in part.expert_load], axis=0)
            per_rank = load.reshape(ranks, -1).sum(axis=1)
            means += per_rank.mean()
            peaks += per_rank.max()
        out[start] = means / peaks
    return out


def _lines(at) -> dict[str, dict[int, float]]:
    spec = json.loads(next(c for c in at.get("plotly_chart") if c.key == "pl_over_time").proto.spec)
    return {t["name"]: dict(zip(_array(t["x"]).astype(int).tolist(), _array(t["y"]).astype(float).tolist()))
            for t in spec["data"]}


def test_placement_page_starts_where_placements_can_differ(monkeypatch, recorded):
    """Issue 47 part 4: the page opens at the most ranks (up to 8) that hold two or more experts each,
    where the what-if's placements part; with one expert per rank they cannot, and the page says why."""
    run_id = recorded["runs"][-1]
    rows = _layer_steps(recorded["root"], run_id)
    experts = int(rows.expert_load.map(len).max())
    expected = max(r for r in range(1, 9) if experts % r == 0 and experts // r >= 2)
    at = open_page(app_for(monkeypatch, recorded["root"]), "views/placement.py")
    assert_clean(at)
    assert at.number_input(key="pl_ranks").value == expected
    lines = _lines(at)
    for start, value in _default_layout_balancedness(rows, expected, 32).items():
        assert abs(lines["default"][start] - value) < 1e-9
    spread = [max(line[s] for line in lines.values()) - min(line[s] for line in lines.values())
              for s in lines["default"]]
    assert max(spread) > 0.01, lines  # the fitted placements part from the default layout
    assert not any("same balancedness" in i.value for i in at.info)

    at.number_input(key="pl_ranks").set_value(experts).run()
    assert_clean(at)
    lines = _lines(at)
    assert all(abs(line[s] - lines["default"][s]) < 1e-9 for line in lines.values() for s in line)
    note = [i.value for i in at.info if "same balancedness" in i.value]
    assert note and f"each of the {experts} ranks holds exactly one of the {experts} experts" in note[0]
