"""The Engine vs reference page's log-prob gap section, on a store where the mismatch check measured
an engine STAND-IN (tests/support/engine_standin.py: the reference Mixtral with one router layer
perturbed, its routing and log-probs written as vLLM responses and imported) with --per-layer.
Expected values come from the raw Parquet rows (read through the Delta log), never the page's query."""

from __future__ import annotations

import pytest

import moescope
from moescope.dashboard import figures as fg
from tests.support.deltafiles import snapshot_rows
from tests.support.engine_standin import first_and_third, logprob_engine, routing_sensitive_mixtral
from tests.support.pages import app_for, assert_clean, open_page

PAGE = "views/mismatch.py"


@pytest.fixture(scope="module")
def gap_store(tmp_path_factory) -> str:
    model = routing_sensitive_mixtral()
    root, *_ = logprob_engine(model, str(tmp_path_factory.mktemp("gap")), choose={1: first_and_third})
    moescope.mismatch(model, store=root, run="engine", run_id="mm", per_layer=True)
    return root


def test_gap_figure_draws_each_flip_bucket_with_and_without_replay(gap_store):
    rows = snapshot_rows(gap_store, "mismatch_logprob_gap").to_pandas()
    own, replay = fg.logprob_gap_figure(rows).data
    for bars, routing in ((own, "reference"), (replay, "replay")):
        for name, value in zip(bars.x, bars.y):
            grouping, group = ("all", "all") if name == "whole run" else ("flips", name.removesuffix(" flipped"))
            [row] = rows[(rows.routing == routing) & (rows.grouping == grouping) & (rows.group_name == group)
                         & rows.left_out_layer.isna()].to_dict("records")
            assert value == pytest.approx(row["k3_mean"], rel=1e-12)
    [layers] = fg.gap_layers_figure(rows).data
    full = rows[(rows.routing == "replay") & (rows.grouping == "all")].k3_mean.iloc[0]
    for layer, carried in zip(layers.x, layers.y):
        [row] = rows[(rows.routing == "replay-but-layer") & (rows.grouping == "all")
                     & (rows.left_out_layer == int(layer))].to_dict("records")
        assert carried == pytest.approx(row["k3_mean"] - full, rel=1e-9, abs=1e-15)
    assert fg.logprob_gap_figure(rows.iloc[:0]).layout.annotations  # an empty run says why


def test_page_shows_the_gap_with_and_without_replay(monkeypatch, gap_store):
    at = open_page(app_for(monkeypatch, gap_store), PAGE)
    assert_clean(at)
    rows = snapshot_rows(gap_store, "mismatch_logprob_gap").to_pandas()
    whole = rows[(rows.grouping == "all") & rows.left_out_layer.isna()].set_index("routing")
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["k3 KL, reference's routing"] == f"{whole.k3_mean['reference']:.3g}"
    assert metrics["k3 KL, engine's routing replayed"] == f"{whole.k3_mean['replay']:.3g}"
    assert metrics["Removed by replay"] == f"{1 - whole.k3_mean['replay'] / whole.k3_mean['reference']:.1%}"
    assert len(at.get("plotly_chart")) == 4  # the heatmap, the gap, the layers carrying it, the margins
