"""The dashboard in headless Chromium on the stores a first-time user opens: `moescope demo`'s (with the
demo model's tokenizer, as the demo tells them to start it) and one that holds only a jitter run.
Expected values come from the raw rows (read through the Delta log), never from the page's queries."""

from __future__ import annotations

import math
import os

import pytest

import moescope
from tests.support.browser import running_dashboard, settle
from tests.support.deltafiles import snapshot_rows
from tests.support.jitter import near_tied_mixtral, token_lists
from tests.support.paths import REPO

pytestmark = pytest.mark.integration
TOKENIZER = os.path.join(REPO, "moescope", "demo", "model")


@pytest.fixture(scope="module")
def demo_page(demo, browser, tmp_path_factory):
    root, _, _ = demo
    with running_dashboard(root, tmp_path_factory.mktemp("server"), tokenizer=TOKENIZER) as url:
        page = browser.new_page(viewport={"width": 1500, "height": 2400})
        try:
            yield url, page, str(root)
        finally:
            page.close()


def table_cells(page, index: int = 0) -> list[list[str]]:
    """The rows of the page's `index`-th data frame as the grid's accessible table gives them (header first)."""
    return page.evaluate("""i => [...document.querySelectorAll('[data-testid=stDataFrame]')[i].querySelectorAll('tr')]
        .map(tr => [...tr.querySelectorAll('th, td')].map(c => c.textContent))""", index)


def test_a_dead_experts_score_leaves_out_the_windows_that_did_not_measure_it(demo_page):
    """Issue 33, part 7: the score of a window where the layer measured no load (too few tokens) was the
    weights' 100 alone, between windows at 0: it drew as flapping. Those windows are gaps now, and the
    page says what the score is made of."""
    url, page, root = demo_page
    health = snapshot_rows(root, "expert_health").to_pandas()
    health = health[health.run_id == health.run_id.max()]  # the newest run: the one the page shows
    # the demo's dead expert: loaded at 0 in some window, unmeasured in another
    layer, expert = 1, 0
    rows = health[(health.layer == layer) & (health.expert == expert)].sort_values("step_end")
    in_layer = health[health.layer == layer]
    components = [c for c in ("load", "confidence", "output", "weight", "grad") if in_layer[c].notna().any()]
    # a window where the layer measured none of a component it measures in other windows
    partial = {int(end) for end, group in in_layer.groupby("step_end") if group[components].isna().all().any()}
    no_load = {int(end) for end, group in in_layer.groupby("step_end") if group.load.isna().all()}
    assert no_load and (rows.load == 0).any(), "the demo should hold a dead expert and windows without load"
    page.goto(f"{url}/health")
    settle(page, 2)
    page.locator('[data-testid="stSelectbox"]').filter(has_text="Layer").first.click()
    page.get_by_role("option", name=str(layer), exact=True).click()
    page.wait_for_timeout(500)
    settle(page, 2)
    page.locator('[data-testid="stSelectbox"]').filter(has_text="Expert").first.click()
    page.get_by_role("option", name=str(expert), exact=True).click()
    page.wait_for_selector(f"text=Layer {layer}, expert {expert}: health score")
    settle(page, 2)
    score = page.evaluate("""() => { const gd = document.querySelector('.st-key-he_trend_chart .js-plotly-plot');
        const t = gd._fullData.find(t => t.name === 'score'); return [Array.from(t.x), Array.from(t.y)]; }""")
    drawn = {int(x): y for x, y in zip(*score)}
    assert set(drawn) == set(rows.step_end.astype(int))
    for end, value in zip(rows.step_end.astype(int), rows.score):
        if end in partial:
            assert drawn[end] is None or math.isnan(drawn[end]), end
        else:
            assert drawn[end] == pytest.approx(value), end
    assert no_load <= partial
    assert page.get_by_text("What the score is made of", exact=False).count() == 1


def test_the_token_table_shows_whitespace_and_marks_the_token_apart_from_code(demo_page):
    """Issue 33, part 7: a space or newline token showed as a blank cell, and [brackets] around the token
    read as the code's own. Whitespace tokens are ␣ / ↵, the token sits between « »."""
    url, page, _ = demo_page
    page.goto(f"{url}/heatmaps")
    settle(page, 3)
    header, *rows = table_cells(page)
    token, context = header.index("token"), header.index("context")
    assert rows
    assert all(row[token].strip() for row in rows), "a token cell is blank"
    assert all(row[context].count("«") == 1 and row[context].count("»") == 1 for row in rows)
    assert any(set(row[token]) <= {"␣", "↵", "⇥"} for row in rows), "the demo's code has whitespace tokens"
    for row in rows:
        inside = row[context].split("«", 1)[1].rsplit("»", 1)[0]
        assert inside == row[token]


def test_the_cache_caption_says_how_many_tokens_were_replayed_and_how_many_reached_an_expert(demo_page):
    """Issue 33, part 12: "19,048 tokens ... (the first 20,000 recorded tokens only)" read as a
    contradiction: the caption says the first 20,000 were replayed and how many of them reached an expert."""
    url, page, root = demo_page
    routes = snapshot_rows(root, "routes").to_pandas()
    routes = routes[routes.run_id == routes.run_id.max()]
    assert (routes.layer == routes.layer.min()).sum() > 20_000, "the demo should record more than the replay takes"
    page.goto(f"{url}/cache")
    settle(page, 1)
    caption = " ".join(page.locator('[data-testid="stCaptionContainer"]').all_inner_texts())
    assert "Replayed the first 20,000 tokens recorded" in caption
    assert "of them reached a routed expert" in caption
    assert "recorded tokens only" not in caption


@pytest.fixture(scope="module")
def jitter_only(browser, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("jitter-only") / "store")
    moescope.jitter(near_tied_mixtral(), token_lists(), conditions=("repeat", "batched"), batch_size=4,
                    store=root, run_id="jit")
    with running_dashboard(root, tmp_path_factory.mktemp("server")) as url:
        page = browser.new_page(viewport={"width": 1500, "height": 1600})
        try:
            yield url, page
        finally:
            page.close()


def test_a_jitter_only_store_says_where_its_results_are(jitter_only):
    """Issue 33, part 12: on a store holding only a jitter run, Overview said "no step recorded yet ...
    once the probe has flushed them", which waits for what never comes."""
    url, page = jitter_only
    page.goto(f"{url}/overview")
    settle(page, 0)
    page.wait_for_selector("h1:has-text('Overview')")
    assert page.get_by_text("routing-jitter measurement", exact=False).count() == 1
    assert page.get_by_text("once the probe has flushed them", exact=False).count() == 0
    page.get_by_text("Open Routing jitter").click()
    page.wait_for_selector("h1:has-text('Routing jitter')")
    assert page.url.endswith("/jitter")
