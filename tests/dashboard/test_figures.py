"""Figure builders: the numbers in the traces, checked against independent computations."""

from __future__ import annotations

import glob
import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from sklearn.metrics import mutual_info_score

from dashboard import figures as fg
from dashboard import queries as q
from store.store import Store


@pytest.fixture(scope="module")
def store(recorded) -> Store:
    return Store(recorded["root"])


def routes_of(root: str, run_id: str) -> pd.DataFrame:
    files = sorted(glob.glob(os.path.join(root, "routes", f"run_id={run_id}", "part-*.parquet")))
    return pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)


def test_layer_share_heatmap_matches_a_loop_over_routes(store, recorded):
    run_id = recorded["runs"][1]
    routes = routes_of(recorded["root"], run_id)
    share = np.zeros((2, 8))
    for layer, ids, kept in zip(routes.layer, routes.expert_ids, routes.kept):
        for expert, k in zip(ids, kept):
            share[layer, expert] += k
    share /= share.sum(axis=1, keepdims=True)
    fig = fg.layer_share_heatmap(q.layer_expert_load(store, run_id))
    heat, clicks = fig.data
    assert np.allclose(np.asarray(heat.z, dtype=float), share)
    # The click layer: one point per cell, its customdata names the cell.
    custom = np.asarray(clicks.customdata, dtype=float)
    assert len(custom) == 16
    for layer, expert, tokens, cell_share in custom:
        assert cell_share == pytest.approx(share[int(layer), int(expert)])
        assert str(int(expert)) in clicks.x and str(int(layer)) in clicks.y


def test_load_heatmap_columns_are_bucket_shares(store, recorded):
    run_id = recorded["runs"][0]
    matrix = q.load_matrix(store, run_id, 0, max_buckets=6)
    fig = fg.load_heatmap(matrix, 0)
    z = np.asarray(fig.data[0].z, dtype=float)
    assert z.shape == (8, matrix.step_start.nunique())
    assert np.allclose(z.sum(axis=0), 1.0)
    routes = routes_of(recorded["root"], run_id)
    first = routes[(routes.layer == 0) & (routes.step <= int(matrix.step_end.min()))]
    counts = np.bincount(np.concatenate(first.expert_ids.to_numpy()), minlength=8)
    assert np.allclose(z[:, 0], counts / counts.sum())
    custom = np.asarray(fig.data[1].customdata, dtype=float)
    assert {(int(c[1]), int(c[2])) for c in custom} == set(zip(matrix.step_start, matrix.step_end))


def test_coselection_affinity_is_conditional_share():
    counts = np.array([[10, 4, 0], [4, 8, 2], [0, 2, 5]])
    fig = fg.coselection_heatmap(counts, 0)
    z = np.asarray(fig.data[0].z, dtype=float)
    assert np.isnan(np.diag(z)).all()
    assert z[0, 1] == pytest.approx(0.4) and z[1, 0] == pytest.approx(0.5) and z[2, 1] == pytest.approx(0.4)
    assert "no co-selection" in fg.coselection_heatmap(None, 3).layout.annotations[0].text


def test_mutual_information_matches_sklearn():
    rng = np.random.default_rng(0)
    experts = rng.integers(0, 8, 5000)
    tags = (experts // 3 + rng.integers(0, 2, 5000)) % 3  # tag depends on the expert, noisily
    counts = np.zeros((8, 3))
    np.add.at(counts, (experts, tags), 1)
    assert fg.mutual_information_bits(counts) == pytest.approx(mutual_info_score(experts, tags) / np.log(2))
    assert fg.mutual_information_bits(np.ones((4, 3))) == pytest.approx(0.0, abs=1e-12)
    assert np.isnan(fg.mutual_information_bits(np.zeros((2, 2))))


def test_specialisation_figure_from_the_store(store, recorded):
    run_id = recorded["runs"][0]
    load = q.expert_tag_load(store, run_id, "domain")
    counts, experts, values = fg.contingency(load, 1)
    assert values == ["code", "math", "prose"] and experts == list(range(8))
    fig = fg.specialisation_figure(counts, experts, values, "domain", 1)
    assert np.allclose(np.nansum(np.asarray(fig.data[0].z, dtype=float), axis=0), 1.0)
    assert f"{fg.mutual_information_bits(counts):.4f} bits" in fig.layout.title.text
    # Every token of a step counts k times (top-k slots): totals are tokens x top_k.
    assert counts.sum() == q.step_totals(store, run_id)["tokens"] * 2


def test_active_fraction_figures_show_percent(store, recorded):
    run_id = recorded["runs"][0]
    over_time = q.active_fraction_over_time(store, run_id, max_buckets=10)
    assert len(over_time) <= 10
    fig = fg.active_fraction_figure(over_time)
    assert np.allclose(fig.data[2].y, over_time.active_fraction * 100)
    by_tag = q.active_fraction_by_tag(store, run_id, "domain")
    bars = fg.active_by_tag_figure(by_tag, "domain").data[0]
    assert list(bars.x) == ["code", "math", "prose"]
    assert np.allclose(bars.y, by_tag.active_fraction * 100)


def test_load_spread_numbers():
    spread = fg.load_spread([2, 2, 4, 0])
    assert spread["cv"] == pytest.approx(np.std([2, 2, 4, 0]) / 2)
    assert spread["max_mean"] == pytest.approx(2.0)
    assert spread["top_share"] == pytest.approx(0.5) and spread["hottest"] == 2
    assert spread["dead_fraction"] == pytest.approx(0.25)
    assert np.isnan(fg.load_spread([0, 0])["cv"])


def test_divergence_figure_draws_rule_thresholds():
    frame = pd.DataFrame({"layer": [0, 0, 1], "window_start": [0, 4, 0], "window_end": [4, 8, 4],
                          "expert_load": [[5, 5], [9, 1], [5, 5]], "baseline_load": [[5, 5], [5, 5], [1, 9]]})
    div = fg.divergence_over_time(frame)
    p = np.array([9.5, 1.5]) / 11  # 0.5 pseudo-tokens per expert, as the rules smooth
    assert div.kl.iloc[0] == pytest.approx(0.0) and div.kl.iloc[1] == pytest.approx(np.sum(p * np.log(p / 0.5)))
    fig = fg.divergence_figure(div, "kl", [("RoutingDriftFromBaseline", 0.1)])
    assert [s.y0 for s in fig.layout.shapes] == [0.1]
    assert len(fig.data) == 2


def test_alert_states_and_firing_now():
    ts = pd.to_datetime(["2026-01-01 00:00", "2026-01-01 00:01", "2026-01-01 00:02", "2026-01-01 00:03"], utc=True)
    alerts = pd.DataFrame({"fingerprint": ["a", "a", "b", "b"], "alertname": ["X", "X", "Y", "Y"],
                           "layer": [0, 0, 1, 1], "state": ["pending", "firing", "firing", "resolved"], "ts": ts})
    firing = fg.firing_now(alerts)
    assert list(firing.fingerprint) == ["a"]
    fig = fg.alert_timeline(alerts, "ts", "alertname")
    assert {t.name for t in fig.data} == {"pending", "firing", "resolved"}
    assert fg.firing_now(pd.DataFrame()).empty


def test_empty_frames_give_a_message_not_an_error():
    empty = pd.DataFrame()
    for fig in (fg.active_fraction_figure(empty), fg.layer_share_heatmap(empty), fg.entropy_figure(empty),
                fg.load_heatmap(empty, 0), fg.alert_timeline(empty, "ts", "alertname"),
                fg.compare_scalars_figure(empty), fg.divergence_figure(empty, "js")):
        assert fig.layout.annotations and fig.layout.annotations[0].text
