"""The Engine vs reference page in headless Chromium, on a store where the mismatch check compared a
STAND-IN engine (tests/support/engine_standin.py: the near-tied Mixtral in bfloat16 and another
batch layout, written as vLLM responses and imported) with the float32 model: both charts drawn,
the shares the raw Parquet rows give, and the tokens that differ listed with plain expert ids."""

from __future__ import annotations

import re

import pytest

import moescope
from moescope.ingest.importers import import_files
from tests.support.browser import CHROMIUM, CHROMIUM_ARGS, running_dashboard
from tests.support.deltafiles import snapshot_rows
from tests.support.engine_standin import engine_standin, fed, token_sequences, vllm_responses
from tests.support.jitter import near_tied_mixtral
from tests.support.realparts import require_program

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("mismatch-browser")
    model = near_tied_mixtral()
    requests = token_sequences(seed=3)
    keys = [(r, c) for r, (_, gens) in enumerate(requests) for c in range(len(gens))]
    sequences = [fed(requests[r][0], requests[r][1][c]) for r, c in keys]
    engine = dict(zip(keys, engine_standin(model, sequences)))
    (folder / "vllm.jsonl").write_text(vllm_responses(requests, engine))
    root = str(folder / "store")
    import_files("vllm", [str(folder / "vllm.jsonl")], root, run_id="engine")
    moescope.mismatch(model, store=root, run="engine", run_id="mm")
    return root


def test_the_page_draws_the_shares_and_lists_the_tokens_that_differ(store, tmp_path):
    from playwright.sync_api import sync_playwright

    require_program(CHROMIUM, package="chromium")  # skips where it is missing, fails in CI
    rows = snapshot_rows(store, "mismatch").to_pandas()
    [whole] = rows[(rows.grouping == "all") & rows.layer.isna()].to_dict("records")
    tokens = snapshot_rows(store, "mismatch_tokens").to_pandas().sort_values(
        ["topk_margin", "layer", "step", "engine_rank", "sequence", "position"], kind="stable")
    with running_dashboard(store, tmp_path) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1800, "height": 5000})
            page.goto(f"{url}/mismatch")
            page.wait_for_selector("h3:has-text('Tokens that differ')", timeout=240_000)
            page.wait_for_function("() => document.querySelector('[data-testid=stApp]')"
                                   ".getAttribute('data-test-script-state') === 'notRunning'", timeout=240_000)
            page.wait_for_function("() => { const grids = document.querySelectorAll('[data-testid=stDataFrame]');"
                                   " return grids.length > 1 && grids[1].querySelectorAll('tr td').length > 0; }",
                                   timeout=60_000)
            assert page.locator('[data-testid="stException"]').count() == 0
            assert page.locator('[data-testid="stPlotlyChart"]').count() == 2
            metrics = page.locator('[data-testid="stMetricValue"]').all_inner_texts()
            assert f"{whole['set_changed'] / whole['pairs']:.2%}" in metrics
            assert f"{whole['tokens_set_changed'] / whole['tokens']:.2%}" in metrics
            header, *table = page.evaluate("""() => [...document.querySelectorAll('[data-testid=stDataFrame]')[1]
                .querySelectorAll('tr')].map(tr => [...tr.querySelectorAll('th, td')].map(c => c.textContent))""")
            shown = [dict(zip(header, row)) for row in table if len(row) == len(header)]
            assert 0 < len(shown) <= len(tokens)  # the grid draws the rows in view
            assert [(int(r["layer"]), int(r["step"]), int(r["sequence"]), int(r["position"])) for r in shown] == [
                (r.layer, r.step, r.sequence, r.position) for r in tokens.head(len(shown)).itertuples()]
            for row in shown:
                assert re.fullmatch(r"\[\d+, \d+\] → \[\d+, \d+\]", row["reference → engine"]), row
        finally:
            browser.close()
