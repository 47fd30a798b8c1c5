"""The Routing jitter page and its figures, on a store the jitter check wrote for a real tiny Mixtral
with near-tied routers (so bfloat16 flips tokens). Expected values come from the raw Parquet rows
(read through the Delta log), never from the page's own query."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import moescope
from moescope.analyses.jitter import MARGIN_EDGES
from moescope.dashboard import figures as fg
from tests.support.deltafiles import snapshot_rows
from tests.support.jitter import near_tied_mixtral, token_lists
from tests.support.pages import app_for, assert_clean, open_page

PAGE = "views/jitter.py"


@pytest.fixture(scope="module")
def jitter_store(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("jitter") / "store")
    moescope.jitter(near_tied_mixtral(), token_lists(), conditions=("repeat", "batched", "dtype"),
                    dtypes=("bfloat16",), batch_size=4, store=root, run_id="jit")
    return root


def raw(root: str, table: str) -> pd.DataFrame:
    return snapshot_rows(root, table).to_pandas()


def test_heatmap_draws_each_conditions_share_per_layer(jitter_store):
    rows = raw(jitter_store, "jitter")
    frame = rows.assign(set_changed_fraction=rows.set_changed / rows.tokens)
    fig = fg.jitter_heatmap(frame, "set_changed_fraction")
    [heat] = fig.data
    assert list(heat.y) == ["repeat", "batch=4", "bfloat16"] and list(heat.x) == ["0", "1"]
    for i, condition in enumerate(heat.y):
        for j, layer in enumerate(heat.x):
            [row] = rows[(rows.condition == condition) & (rows.layer == int(layer))].to_dict("records")
            assert heat.z[i][j] == pytest.approx(100 * row["set_changed"] / row["tokens"], rel=1e-12)
    assert fg.jitter_heatmap(frame.iloc[:0]).layout.annotations  # an empty run says why


def test_margin_figure_pools_the_layers_histograms(jitter_store):
    rows = raw(jitter_store, "jitter")
    picked = rows[rows.condition == "bfloat16"]
    fig = fg.margin_figure(picked)
    changed, unchanged = fig.data
    counts = np.zeros(len(MARGIN_EDGES), dtype=int)
    for histogram in picked.changed_by_margin:
        counts += np.asarray(histogram)
    assert counts.sum() == picked.set_changed.sum() > 0
    np.testing.assert_array_equal(changed.customdata, counts)
    np.testing.assert_allclose(changed.y, counts / counts.sum() * 100)
    assert unchanged.customdata.sum() == (picked.tokens - picked.set_changed).sum()
    assert list(changed.x) == [f"≥{edge:g}" for edge in MARGIN_EDGES]


def test_page_shows_the_run_and_its_flipped_tokens_in_context(monkeypatch, jitter_store):
    at = open_page(app_for(monkeypatch, jitter_store), PAGE)
    assert_clean(at)
    assert at.title[0].value == "Routing jitter" and len(at.get("plotly_chart")) == 2
    rows = raw(jitter_store, "jitter")
    shown = at.dataframe[0].value
    assert len(shown) == len(rows)
    for row in rows.itertuples():
        line = shown[(shown.condition == row.condition) & (shown.layer == row.layer)].iloc[0]
        assert line["set changed %"] == round(100 * row.set_changed / row.tokens, 3)
        assert line["top-1 changed %"] == round(100 * row.top1_changed / row.tokens, 3)
        assert line["compared with"] == row.baseline and line["dtype"] == row.dtype

    assert at.selectbox(key="jit_condition").value == "bfloat16"
    at.selectbox(key="jit_layer").set_value(1).run()
    assert_clean(at)
    tokens = raw(jitter_store, "jitter_tokens")
    expected = tokens[(tokens.condition == "bfloat16") & (tokens.layer == 1)].sort_values("topk_margin")
    listed = at.dataframe[1].value
    assert len(listed) == len(expected) > 0
    np.testing.assert_array_equal(listed["top-k margin"], expected.topk_margin)
    np.testing.assert_array_equal(listed.position, expected.position)
    inputs = token_lists()
    for context, row in zip(listed["in context"], expected.itertuples()):
        assert f"«#{inputs[row.sequence][row.position]}»" in context  # the token itself, between « »
        assert context.split() == [f"«#{t}»" if p == row.position else f"#{t}" for p, t in
                                   enumerate(inputs[row.sequence]) if row.context_start <= p <= row.position + 4]


def test_a_run_without_jitter_says_how_to_measure_it(monkeypatch, tmp_path):
    model = near_tied_mixtral()
    with moescope.attach(model, store=str(tmp_path)), torch.no_grad():
        model(input_ids=torch.tensor([token_lists()[0]]))
    at = open_page(app_for(monkeypatch, str(tmp_path)), PAGE)
    assert_clean(at)
    assert any("moescope jitter MODEL --store STORE" in i.value for i in at.info)
    assert not at.get("plotly_chart")
