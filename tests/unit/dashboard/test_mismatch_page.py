"""The Engine vs reference page and its heatmap, on a store where the mismatch check compared a
STAND-IN engine (tests/support/engine_standin.py: the near-tied Mixtral in bfloat16, another batch
layout, written as vLLM responses and imported) with the float32 model. Expected values come from
the raw Parquet rows (read through the Delta log), never from the page's own query."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import moescope
from moescope.dashboard import figures as fg
from tests.support.deltafiles import snapshot_rows
from tests.support.jitter import mismatch_store as stored_mismatch
from tests.support.jitter import near_tied_mixtral
from tests.support.pages import app_for, assert_clean, open_page

PAGE = "views/mismatch.py"


@pytest.fixture(scope="module")
def mismatch_store(tmp_path_factory) -> tuple[str, dict]:
    return stored_mismatch(tmp_path_factory.mktemp("mismatch"))


def raw(root: str, table: str) -> pd.DataFrame:
    return snapshot_rows(root, table).to_pandas()


def test_heatmap_draws_each_groups_share_per_layer_and_over_every_layer(mismatch_store):
    root, _ = mismatch_store
    rows = raw(root, "mismatch")
    frame = rows.assign(set_changed_fraction=rows.set_changed / rows.pairs,
                        tokens_set_changed_fraction=rows.tokens_set_changed / rows.tokens)
    [heat] = fg.mismatch_heatmap(frame, "set_changed_fraction").data
    assert list(heat.x) == ["0", "1", "every layer"] and heat.y[0] == "whole run"
    for i, group in enumerate(heat.y):
        for j, layer in enumerate(heat.x):
            grouping, name = ("all", "all") if group == "whole run" else group.split(": ")
            picked = rows[(rows.grouping == grouping) & (rows.group_name == name)
                          & (rows.layer.isna() if layer == "every layer" else rows.layer == int(layer))]
            if picked.empty:
                assert np.isnan(heat.z[i][j])
                continue
            [row] = picked.to_dict("records")
            assert heat.z[i][j] == pytest.approx(100 * row["set_changed"] / row["pairs"], rel=1e-12)
    assert fg.mismatch_heatmap(frame.iloc[:0]).layout.annotations  # an empty run says why


def test_page_shows_the_shares_and_the_tokens_that_differ_in_context(monkeypatch, mismatch_store):
    root, sequences = mismatch_store
    at = open_page(app_for(monkeypatch, root), PAGE)
    assert_clean(at)
    assert at.title[0].value == "Engine vs reference" and len(at.get("plotly_chart")) == 2
    rows = raw(root, "mismatch")
    [whole] = rows[(rows.grouping == "all") & rows.layer.isna()].to_dict("records")
    assert whole["set_changed"] > 0
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Decisions that differ"] == f"{whole['set_changed'] / whole['pairs']:.2%}"
    assert metrics["Tokens differing in ≥ 1 layer"] == f"{whole['tokens_set_changed'] / whole['tokens']:.2%}"

    at.selectbox(key="mm_layer").set_value(1).run()
    assert_clean(at)
    tokens = raw(root, "mismatch_tokens")
    expected = tokens[tokens.layer == 1].sort_values("topk_margin", kind="stable")
    listed = at.dataframe[1].value
    assert len(listed) == len(expected) > 0
    np.testing.assert_array_equal(listed["reference top-k margin"], expected.topk_margin)
    for context, row in zip(listed["in context"], expected.itertuples()):
        ids = sequences[(row.step, row.sequence)]
        assert f"«#{ids[row.position]}»" in context  # the token itself, between « »


def test_a_run_without_a_mismatch_says_how_to_measure_it(monkeypatch, tmp_path):
    model = near_tied_mixtral()
    with moescope.attach(model, store=str(tmp_path)), torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    at = open_page(app_for(monkeypatch, str(tmp_path)), PAGE)
    assert_clean(at)
    assert any("moescope mismatch STORE" in i.value for i in at.info)
    assert not at.get("plotly_chart")


def test_overview_of_a_mismatch_run_points_to_its_page(monkeypatch, mismatch_store):
    """The comparison run records no forward pass of traffic: the Overview says what the run is and links
    to the Engine vs reference page instead of waiting for steps that will never come."""
    root, _ = mismatch_store
    assert raw(root, "runs").sort_values("started_at").run_id.iloc[-1] == "mm"  # the run the sidebar opens on
    at = open_page(app_for(monkeypatch, root), "views/overview.py")
    assert_clean(at)
    [info] = [i.value for i in at.info]
    assert "engine-vs-reference comparison" in info and "no step recorded yet" not in info
