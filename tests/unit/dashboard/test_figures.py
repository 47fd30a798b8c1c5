"""Figure builders: the numbers in the traces, checked against independent computations."""

from __future__ import annotations

import glob
import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from sklearn.metrics import normalized_mutual_info_score

from moescope.dashboard import data
from moescope.dashboard import figures as fg
from moescope.metrics import signals
from moescope.store.store import Store


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
    chose = share.copy()
    share /= share.sum(axis=1, keepdims=True)
    tokens = {layer: int((routes.layer == layer).sum()) for layer in (0, 1)}  # a routes row is a token
    fig = fg.layer_share_heatmap(store.expert_share(run_id), tokens)
    heat, clicks = fig.data
    assert np.allclose(np.asarray(heat.z, dtype=float), share)  # colour: share of the layer's slots
    # The click layer: one point per cell, its customdata names the cell and says tokens and slots.
    custom = np.asarray(clicks.customdata, dtype=float)
    assert len(custom) == 16
    for layer, expert, chosen, token_share, slot_share in custom:
        assert chosen == chose[int(layer), int(expert)]
        assert token_share == pytest.approx(chose[int(layer), int(expert)] / tokens[int(layer)])
        assert slot_share == pytest.approx(share[int(layer), int(expert)])
        assert str(int(expert)) in clicks.x and str(int(layer)) in clicks.y
    assert "of the layer's tokens" in clicks.hovertemplate and "of its slots" in clicks.hovertemplate


def test_load_heatmap_columns_are_bucket_shares(store, recorded):
    run_id = recorded["runs"][0]
    matrix = store.load_heatmap(run_id, 0, max_buckets=6)
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
    # a probability: the colour scale is pinned to [0, 1] and starts white, so a 0 cell reads as 0
    assert (fig.data[0].zmin, fig.data[0].zmax) == (0, 1)
    assert fig.data[0].colorscale[0][1].lower() in ("rgb(247,251,255)", "#f7fbff")
    assert "no co-selection" in fg.coselection_heatmap(None, 3).layout.annotations[0].text


def test_specialisation_is_sklearns_nmi():
    rng = np.random.default_rng(0)
    experts = rng.integers(0, 8, 5000)
    tags = (experts // 3 + rng.integers(0, 2, 5000)) % 3  # tag depends on the expert, noisily
    counts = np.zeros((8, 3))
    np.add.at(counts, (experts, tags), 1)
    assert signals.normalized_mutual_information(counts) == pytest.approx(
        normalized_mutual_info_score(experts, tags), abs=1e-12)
    assert signals.normalized_mutual_information(np.ones((4, 3))) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="empty"):
        signals.normalized_mutual_information(np.zeros((2, 2)))


def test_specialisation_figure_from_the_store(store, recorded):
    run_id = recorded["runs"][0]
    load = store.expert_tag_load(run_id, "domain")
    counts, experts, values = signals.expert_tag_contingency(load, 1)
    assert values == ["code", "math", "prose"] and experts == list(range(8))
    fig = fg.specialisation_figure(counts, experts, values, "domain", 1)
    assert np.allclose(np.nansum(np.asarray(fig.data[0].z, dtype=float), axis=0), 1.0)
    # The value sits in the subtitle, the title stays short: one long title was cut before its value.
    assert fig.layout.title.text == "Layer 1: domain share per expert"
    nmi = normalized_mutual_info_score(*zip(*[(e, v) for e, row in zip(experts, counts) for v, n in zip(values, row)
                                              for _ in range(int(n))]))
    assert fig.layout.title.subtitle.text == f"kept-slot specialisation NMI(expert; domain) = {nmi:.3f}"
    # Every token of a step counts k times (top-k slots): totals are tokens x top_k.
    assert counts.sum() == store.step_totals(run_id)["tokens"] * 2
    per_layer = signals.specialisation_by_layer(load)
    assert per_layer.nmi.tolist() == [
        signals.normalized_mutual_information(signals.expert_tag_contingency(load, layer)[0]) for layer in (0, 1)]


def test_active_fraction_figures_show_percent(store, recorded):
    run_id = recorded["runs"][0]
    over_time = store.active_fraction_buckets(run_id, max_buckets=10)
    assert len(over_time) <= 10
    fig = fg.active_fraction_figure(over_time)
    assert np.allclose(fig.data[2].y, over_time.active_fraction * 100)
    by_tag = store.active_fraction_by_tag(run_id, "domain")
    bars = fg.active_by_tag_figure(by_tag, "domain").data[0]
    assert list(bars.x) == ["code", "math", "prose"]
    assert np.allclose(bars.y, by_tag.active_fraction * 100)


def test_active_fraction_noise_draws_flat():
    # Every token uses k experts: the fraction is constant up to float noise in the 17th digit, which
    # must neither show as swings nor as a tick like 37.32601895089993604.
    noisy = 0.3732601895089993 + np.array([0, 2e-17, -3e-17, 5e-17])
    over_time = pd.DataFrame({"step_start": [0, 32, 64, 96], "step_end": [31, 63, 95, 110],
                              "active_fraction": noisy, "active_min": noisy, "active_max": noisy})
    fig = fg.active_fraction_figure(over_time)
    assert len(set(fig.data[2].y)) == 1
    lo, hi = fig.layout.yaxis.range
    assert hi - lo >= 1.0 and lo < 37.326 < hi
    assert fig.layout.yaxis.tickformat == ".2f"
    assert fig.layout.xaxis.range[1] == pytest.approx(110.5)  # ends at the run's last step


def test_divergence_figure_draws_rule_thresholds():
    frame = pd.DataFrame({"layer": [0, 0, 1], "window_start": [0, 4, 0], "window_end": [4, 8, 4],
                          "expert_load": [[5, 5], [9, 1], [5, 5]], "baseline_load": [[5, 5], [5, 5], [1, 9]]})
    div = signals.divergence_over_time(frame)
    p = np.array([9.5, 1.5]) / 11  # 0.5 pseudo-tokens per expert, as the rules smooth
    assert div.kl.iloc[0] == pytest.approx(0.0) and div.kl.iloc[1] == pytest.approx(np.sum(p * np.log(p / 0.5)))
    fig = fg.divergence_figure(div, "kl", [("RoutingDriftFromBaseline", 0.1)], steps=(0, 6))
    assert [s.y0 for s in fig.layout.shapes] == [0.1]
    assert len(fig.data) == 2
    assert fig.layout.xaxis.range[1] == pytest.approx(6.5)  # the axis stops at the run's last step
    # a window's x is its last recorded step, never past the run
    div = signals.divergence_over_time(frame.assign(last_step=[3, 6, 3]))
    assert div.step_end.tolist() == [3, 6, 3]


def test_alert_states_and_firing_now():
    ts = pd.to_datetime(["2026-01-01 00:00", "2026-01-01 00:01", "2026-01-01 00:02", "2026-01-01 00:03"], utc=True)
    alerts = pd.DataFrame({"fingerprint": ["a", "a", "b", "b"], "alertname": ["X", "X", "Y", "Y"],
                           "layer": [0, 0, 1, 1], "state": ["pending", "firing", "firing", "resolved"], "ts": ts,
                           "previous_state": ["inactive", "pending", "pending", "firing"], "step": [3, 5, 7, 9],
                           "expert": [None, None, 4, 4], "reason": [None, None, None, "run ended"]})
    firing = data.firing_now(alerts)
    assert list(firing.fingerprint) == ["a"]
    fig = fg.alert_timeline(alerts, steps=(0, 9))
    assert {t.name for t in fig.data} == {"pending", "firing", "resolved"}
    resolved = next(t for t in fig.data if t.name == "resolved")
    assert list(resolved.x) == [9] and list(resolved.y) == ["Y · layer 1 · expert 4"]  # in steps, names the expert
    assert list(resolved.customdata) == [" (run ended)"]
    assert fig.layout.xaxis.title.text == "step"
    assert data.firing_now(pd.DataFrame()).empty


def test_gate_history_spans_the_run_and_names_the_expert():
    events = pd.DataFrame({"layer": [2, 2], "expert": [5, 5], "step": [40, 70], "old_weight": [1.0, 0.0],
                           "new_weight": [0.0, 1.0]})
    fig = fg.gate_history(events, (0, 120))
    line = fig.data[0]
    assert list(line.x) == [0, 40, 70, 120] and list(line.y) == [1.0, 0.0, 1.0, 1.0]
    assert line.name == "layer 2, expert 5" and "layer 2 expert 5" in fig.layout.title.text
    assert list(fig.layout.xaxis.range) == [-0.5, 120.5]


def test_compare_panels_of_non_negative_metrics_start_at_zero():
    values = pd.DataFrame({"side": ["A", "B", "A", "B"], "metric": ["dropped tokens (%)"] * 2 + ["CV"] * 2,
                           "value": [0.0, 0.0, 0.4, 0.5]})
    fig = fg.compare_scalars_figure(values)
    assert list(fig.layout.yaxis.range) == [0, 1]  # nothing dropped: 0 to 1, not -1 to 1
    assert list(fig.layout.yaxis2.range) == pytest.approx([0, 0.55])


def test_compare_panels_wrap_their_titles_three_to_a_row():
    # Six panels in one row of a 1500 px window: each title was wider than its panel and overlapped
    # its neighbours. Three a row, titles broken into lines of at most 24 characters.
    metrics = ["active params / token (%)", "load CV (token-weighted over layers)", "router entropy (nats)",
               "router entropy H / ln E", "dropped tokens (% of layer-tokens)", "latency / token (ms)"]
    values = pd.DataFrame({"side": ["A", "B"] * 6, "metric": [m for m in metrics for _ in "AB"],
                           "value": np.arange(12, dtype=float)})
    fig = fg.compare_scalars_figure(values)
    titles = [a.text for a in fig.layout.annotations]
    assert [t.replace("<br>", " ") for t in titles] == metrics
    assert max(len(line) for t in titles for line in t.split("<br>")) <= 24
    domains = {(tuple(fig.layout[f"xaxis{i or ''}"].domain), tuple(fig.layout[f"yaxis{i or ''}"].domain))
               for i in ("", 2, 3, 4, 5, 6)}
    assert len({x for x, _ in domains}) == 3 and len({y for _, y in domains}) == 2  # a 2 x 3 grid
    for i, (metric, axis) in enumerate(zip(metrics, ("yaxis", "yaxis2", "yaxis3", "yaxis4", "yaxis5", "yaxis6"))):
        assert list(fig.layout[axis].range) == pytest.approx([0, 1.1 * (2 * i + 1)]), metric


def test_active_by_position_bars_start_at_zero():
    # Bars from 18% up made a 37% -> 29% drift look like a halving: the axis starts at 0.
    by_position = pd.DataFrame({"position_start": [0, 32, 64, 96], "position_end": [32, 64, 96, 128],
                                "active_fraction": [0.3706, 0.3412, 0.3097, 0.2911], "tokens": [64] * 4,
                                "dropped_slots": [0.1, 0.3, 0.6, 0.8], "kept_slots": [7.9, 7.7, 7.4, 7.2]})
    fig = fg.active_by_position_figure(by_position)
    assert fig.layout.yaxis.range[0] == 0
    assert fig.layout.yaxis.range[1] >= 37.06
    assert list(fig.data[0].y) == pytest.approx([37.06, 34.12, 30.97, 29.11])


def test_empty_frames_give_a_message_not_an_error():
    empty = pd.DataFrame()
    for fig in (fg.active_fraction_figure(empty), fg.layer_share_heatmap(empty, {}), fg.entropy_figure(empty),
                fg.load_heatmap(empty, 0), fg.alert_timeline(empty), fg.layer_spread_figure([]),
                fg.compare_scalars_figure(empty), fg.divergence_figure(empty, "js"), fg.host_load_figure({})):
        assert fig.layout.annotations and fig.layout.annotations[0].text


def test_host_load_figure_draws_a_bar_per_host_of_each_layers_max_over_mean():
    loads = {"alpha": {0: [4, 2, 2, 0], 1: [2, 2, 2, 2]}, "beta": {0: [1, 1, 1, 5]}}
    per_host = {host: [signals.layer_figures(layer, load, 4, 0, sum(load) // 2, float("nan"), 0)
                       for layer, load in layers.items()] for host, layers in loads.items()}
    fig = fg.host_load_figure(per_host)
    assert [trace.name for trace in fig.data] == ["alpha", "beta"]
    for trace in fig.data:
        want = loads[trace.name]
        assert list(trace.x) == [str(layer) for layer in want]
        assert list(trace.y) == pytest.approx([max(v) / np.mean(v) for v in want.values()])


# -- issue 33, part 7 ---------------------------------------------------------------------------

def health_rows(rows: list[tuple]) -> pd.DataFrame:
    """expert_health rows (step_end, expert, score, load, weight) of layer 0."""
    frame = pd.DataFrame(rows, columns=["step_end", "expert", "score", "load", "weight"])
    return frame.assign(layer=0, confidence=np.nan, output=np.nan, grad=np.nan)


def test_health_trend_leaves_out_the_score_of_a_window_whose_layer_measured_no_load():
    """A dead expert: load 0 -> score 0, then a window too small for the layer to judge load, where the
    weights alone made it 100: drawn, that read as flapping. The score there is a gap; the load too."""
    nan = np.nan
    health = health_rows([(3, 0, 0.0, 0.0, 100.0), (3, 1, 100.0, 100.0, 100.0),
                          (7, 0, 100.0, nan, 100.0), (7, 1, 100.0, nan, 100.0),  # the layer measured no load
                          (11, 0, 0.0, 0.0, 100.0), (11, 1, 90.0, 80.0, 100.0),
                          (15, 0, 100.0, nan, 100.0), (15, 1, 100.0, 100.0, 100.0)])  # expert 0 gated, say
    fig = fg.health_trend(health, ["score", "load", "weight"], 0, 0)
    score, load, weight = (next(t for t in fig.data if t.name == n) for n in ("score", "load", "weight"))
    assert list(score.x) == [3, 7, 11, 15]
    np.testing.assert_array_equal(score.y, [0.0, nan, 0.0, 100.0])  # 15: the layer measured load (expert 1)
    np.testing.assert_array_equal(load.y, [0.0, nan, 0.0, nan])
    np.testing.assert_array_equal(weight.y, [100.0] * 4)
    [left_out] = [t for t in fig.data if t.name == "score left out"]
    assert list(left_out.x) == [7] and list(left_out.customdata) == ["load"]


def test_divergence_titles_are_short_with_a_subtitle():
    frame = pd.DataFrame({"layer": [0, 0], "step_end": [3, 7], "kl": [0.1, 0.2], "js": [0.01, 0.02]})
    for measure, name in (("kl", "KL divergence"), ("js", "Jensen-Shannon divergence")):
        fig = fg.divergence_figure(frame, measure)
        assert fig.layout.title.text == name
        assert fig.layout.title.subtitle.text == "each window's load against the baseline"


def test_router_entropy_draws_a_panel_per_layer_and_a_heatmap_past_the_panels():
    steps = np.arange(0, 40, 4)
    frame = pd.DataFrame([{"layer": layer, "step_start": s, "router_entropy": 0.1 * layer + s / 1000}
                          for layer in range(3) for s in steps])
    fig = fg.entropy_figure(frame)
    assert [t.name for t in fig.data] == ["layer 0", "layer 1", "layer 2"]
    assert [t.yaxis for t in fig.data] == ["y", "y2", "y3"]  # one panel each
    for layer, trace in enumerate(fig.data):
        np.testing.assert_allclose(trace.y, 0.1 * layer + steps / 1000)
    many = pd.DataFrame([{"layer": layer, "step_start": s, "router_entropy": float(layer)}
                         for layer in range(fg.ENTROPY_PANELS + 1) for s in steps])
    [heat] = fg.entropy_figure(many).data
    assert heat.type == "heatmap" and np.asarray(heat.z).shape == (fg.ENTROPY_PANELS + 1, len(steps))
    np.testing.assert_array_equal(np.asarray(heat.z)[:, 0], np.arange(fg.ENTROPY_PANELS + 1))


def test_the_overviews_small_charts_put_their_legend_above_the_plot(store, recorded):
    run_id = recorded["runs"][1]
    layers = signals.layer_figures_of(store.layer_totals(run_id).itertuples())
    for fig in (fg.dropped_figure(store.layer_buckets(run_id)), fg.layer_spread_figure(layers)):
        assert fig.layout.legend.orientation == "h" and fig.layout.legend.y == 1.0


def test_tokens_show_their_whitespace_and_the_centre_token_sits_between_guillemets():
    assert data.visible_token(" the") == "␣the"
    assert data.visible_token("\n\t") == "↵⇥"
    # without a tokenizer, ids: "#id" joined by spaces; the centre one marked, never with code's brackets
    assert data.context_text([5, 6, 7], [0, 1, 2], 1, None) == "#5 «#6» #7"


# Every public name of dashboard/figures.py before it became a package of a module per page.
ONE_MODULE_NAMES = (
    "COMPARE_COLUMNS", "ENTROPY_PANELS", "HEIGHT", "JITTER_FIGURES", "MISMATCH_FIGURES", "PALETTE",
    "SLOT_SPECIALISATION", "STATE_COLOURS", "active_by_position_figure", "active_by_tag_figure",
    "active_fraction_figure", "alert_label", "alert_timeline", "balancedness_over_time_figure", "before_after_figure",
    "cache_hit_figure", "cluster_scatter", "compare_layers_figure", "compare_scalars_figure", "coselection_heatmap",
    "divergence_figure", "dropped_figure", "empty_figure", "entropy_figure", "expert_grad_heatmap", "gate_history",
    "health_trend", "host_load_figure", "jitter_heatmap", "jitter_margin_figure", "layer_share_heatmap",
    "layer_spread_figure", "load_heatmap", "mismatch_heatmap", "rank_layer_heatmap", "specialisation_figure",
    "specialisation_figure_by_layer", "training_figure",
    # and the placement page's traffic section's, from dashboard/traffic_charts.py
    "fanout_histogram", "rank_matrix_heatmap",
)


def test_every_name_of_the_one_module_imports_from_the_package():
    import importlib

    from moescope import dashboard

    namespace: dict = {}
    exec(f"from moescope.dashboard.figures import {', '.join(ONE_MODULE_NAMES)}", namespace)
    assert all(namespace[name] is getattr(dashboard.figures, name) for name in ONE_MODULE_NAMES)
    assert set(ONE_MODULE_NAMES) <= set(fg.__all__) and len(fg.__all__) == len(set(fg.__all__))
    assert all(hasattr(fg, name) for name in fg.__all__)
    # the dashboard package's own list: each a module, importable by attribute before any import of it
    for name in dashboard.__all__:
        assert getattr(dashboard, name) is importlib.import_module(f"moescope.dashboard.{name}")
