"""The Engine vs reference page in headless Chromium, on a store where the mismatch check compared a
STAND-IN engine (tests/support/engine_standin.py: the near-tied Mixtral in bfloat16 and another
batch layout, written as vLLM responses and imported) with the float32 model: both charts drawn,
the shares the raw Parquet rows give, and the tokens that differ listed with plain expert ids."""

from __future__ import annotations

import re

import pytest

from tests.support.browser import grid_rows, page_with_tables
from tests.support.deltafiles import snapshot_rows
from tests.support.jitter import mismatch_store

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return mismatch_store(tmp_path_factory.mktemp("mismatch-browser"))[0]


def test_the_page_draws_the_shares_and_lists_the_tokens_that_differ(store, tmp_path):
    rows = snapshot_rows(store, "mismatch").to_pandas()
    [whole] = rows[(rows.grouping == "all") & rows.layer.isna()].to_dict("records")
    tokens = snapshot_rows(store, "mismatch_tokens").to_pandas().sort_values(
        ["topk_margin", "layer", "step", "engine_rank", "sequence", "position"], kind="stable")
    with page_with_tables(store, tmp_path, "mismatch", "Tokens that differ") as page:
        assert page.locator('[data-testid="stException"]').count() == 0
        assert page.locator('[data-testid="stPlotlyChart"]').count() == 2
        metrics = page.locator('[data-testid="stMetricValue"]').all_inner_texts()
        assert f"{whole['set_changed'] / whole['pairs']:.2%}" in metrics
        assert f"{whole['tokens_set_changed'] / whole['tokens']:.2%}" in metrics
        shown = grid_rows(page, 1)
    assert 0 < len(shown) <= len(tokens)  # the grid draws the rows in view
    assert [(int(r["layer"]), int(r["step"]), int(r["sequence"]), int(r["position"])) for r in shown] == [
        (r.layer, r.step, r.sequence, r.position) for r in tokens.head(len(shown)).itertuples()]
    for row in shown:
        assert re.fullmatch(r"\[\d+, \d+\] → \[\d+, \d+\]", row["reference → engine"]), row
