"""The real dashboard server in headless Chromium (Debian's /usr/bin/chromium, driven by Playwright).

Opens every page, waits for Streamlit to finish the run and for the Plotly charts, asserts that
no exception box is shown, that the browser asked nothing of any host but the dashboard's own
(the tab icon ships with the package: offline, a fetch elsewhere fails and logs an error), that
the console logged no error, and that every chart's title fits its chart and overlaps no other
text of it; saves a screenshot of each page (to $MOESCOPE_SCREENSHOTS, else
tests/dashboard/screenshots/, which git ignores). Then walks the newcomer's path: Overview ->
"Which tokens go there?" -> click a cell of the layer x expert heatmap -> the tokens of that cell.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re

import pandas as pd
import pyarrow.parquet as pq
import pytest
from sklearn.metrics import normalized_mutual_info_score

from tests.support.browser import CHROMIUM, CHROMIUM_ARGS, Traffic, running_dashboard, settle
from tests.support.deltafiles import snapshot_rows
from tests.support.realparts import require_program


@pytest.fixture(scope="module")
def server(recorded, tmp_path_factory):
    require_program(CHROMIUM, package="chromium")  # skips where it is missing, fails in CI
    with running_dashboard(recorded["root"], tmp_path_factory.mktemp("server")) as url:
        yield url


@pytest.fixture(scope="module")
def traffic() -> Traffic:
    return Traffic()


@pytest.fixture(scope="module")
def page(server, traffic, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")  # a fresh profile: no state from other runs
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1500, "height": 2400})
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.on("request", lambda request: traffic.urls.append(request.url))
            page.on("console", lambda message: message.type == "error" and traffic.console_errors.append(
                (message.text, message.location.get("url", ""))))
            page.on("pageerror", lambda error: traffic.console_errors.append((f"uncaught: {error}", "")))
            yield page
        finally:
            context.close()

pytestmark = pytest.mark.integration

PAGES = [("", "Overview", 5), ("heatmaps", "Heatmaps", 3), ("cache", "Expert cache", 1),
         ("clusters", "Semantic clusters", 3), ("drift", "Drift and alerts", 3), ("health", "Expert health", 0),
         ("training", "Training", 0), ("compare", "Compare", 3), ("jitter", "Routing jitter", 0),
         ("placement", "Placement", 3)]
SCREENSHOTS = os.environ.get("MOESCOPE_SCREENSHOTS") or os.path.join(os.path.dirname(__file__), "screenshots")


def assert_only_local_and_quiet(server: str, traffic: Traffic, path: str = "") -> None:
    """Nothing was asked of another host, and the console logged no error, but one: opened at a page's
    own URL, Streamlit's frontend looks for the server under that path first (`PAGE/_stcore/health`
    and `/host-config`, a 404 each) before the root, which answers (streamlit/streamlit#7074)."""
    assert traffic.outside(server) == [], "the page asked a host other than the dashboard's own"
    probes = {f"{server}/{path}/_stcore/health", f"{server}/{path}/_stcore/host-config"} if path else set()
    errors = [(text, url) for text, url in traffic.console_errors
              if not (url in probes and "status of 404" in text)]
    assert errors == []


# Every text box of each chart: its title and subtitle (.gtitle, .gtitle-subtitle) and its
# annotations (subplot titles among them), as client rectangles, beside the chart's own rectangle.
CHART_TEXTS = """() => [...document.querySelectorAll('.js-plotly-plot')].map(gd => {
    const svg = gd.querySelector('.main-svg').getBoundingClientRect();
    const box = el => { const r = el.getBoundingClientRect();
                        return {text: el.textContent, left: r.left, right: r.right, top: r.top, bottom: r.bottom}; };
    return {key: (gd.closest('[class*="st-key-"]') || {className: ''}).className.match(/st-key-(\\S+)/)?.[1] || '',
            chart: {left: svg.left, right: svg.right, top: svg.top, bottom: svg.bottom},
            titles: [...gd.querySelectorAll('.infolayer text.gtitle, .infolayer text.gtitle-subtitle')].map(box),
            annotations: [...gd.querySelectorAll('.infolayer g.annotation text.annotation-text')].map(box)}; })"""


def overlaps(a: dict, b: dict) -> bool:
    return a["left"] < b["right"] and b["left"] < a["right"] and a["top"] < b["bottom"] and b["top"] < a["bottom"]


def assert_chart_texts_fit(charts: list[dict]) -> None:
    """Each chart's titles lie inside it (an SVG cuts what passes its edge) and no two of its text
    boxes (titles, subtitles, annotations) overlap."""
    for chart in charts:
        texts = [t for t in chart["titles"] + chart["annotations"] if t["text"].strip()]
        for title in chart["titles"]:
            if title["text"].strip():
                assert chart["chart"]["left"] <= title["left"] and title["right"] <= chart["chart"]["right"], (
                    chart["key"], title)
        for i, a in enumerate(texts):
            for b in texts[i + 1:]:
                assert not overlaps(a, b), (chart["key"], a["text"], b["text"])


def slot_nmi_of_layer(root: str, run_id: str, layer: int) -> float:
    """NMI(expert; domain) over the kept slots of one layer, by scikit-learn over the raw routes rows."""
    files = sorted(glob.glob(os.path.join(root, "routes", f"run_id={run_id}", "part-*.parquet")))
    routes = pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)
    routes = routes[routes.layer == layer]
    pairs = [(dict(tags)["domain"], int(expert)) for tags, ids, kept in zip(routes.tags, routes.expert_ids, routes.kept)
             for expert, k in zip(ids, kept) if k]
    return normalized_mutual_info_score(*zip(*pairs))


@pytest.mark.parametrize("path,title,charts", PAGES, ids=[p[1] for p in PAGES])
def test_page_in_a_real_browser(server, page, traffic, recorded, path, title, charts):
    traffic.clear()
    page.goto(f"{server}/{path}")
    settle(page, charts)
    page.wait_for_selector(f"h1:has-text('{title}')")
    os.makedirs(SCREENSHOTS, exist_ok=True)
    page.screenshot(path=os.path.join(SCREENSHOTS, f"{path or 'overview'}.png"), full_page=True)
    assert page.locator('[data-testid="stException"]').count() == 0
    assert_only_local_and_quiet(server, traffic, path)
    texts = page.evaluate(CHART_TEXTS)
    assert_chart_texts_fit(texts)
    # charts that hold data and drew a trace (lines, bars, points, heatmap cells); the clusters' scatter is
    # drawn when its UMAP fit, running in a process of its own, is done (cold on a fresh install)
    drawn_js = """() => [...document.querySelectorAll('.js-plotly-plot')].filter(
        gd => gd.data && gd.data.length > 0 && gd.querySelector('.main-svg .trace, .main-svg .hm')).length"""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    with contextlib.suppress(PlaywrightTimeout):
        page.wait_for_function(f"() => ({drawn_js})() >= {charts}", timeout=240_000)
    drawn = page.evaluate(drawn_js)
    if path == "clusters" and drawn < charts:
        # a cold fit (a fresh install compiles UMAP's numba code) may outlast the wait on a loaded machine:
        # the page then says what it computes, and every other chart is drawn
        assert page.get_by_text("Computing the UMAP embedding", exact=False).count() >= 1
        charts -= 1
    assert drawn >= charts
    assert page.locator(".js-plotly-plot").count() >= charts
    if path == "health":
        assert page.get_by_text("no expert-health score recorded", exact=False).count() == 1
    if path == "training":  # the recorded runs are inference runs: the page says how to record a training one
        assert page.get_by_text("not recorded with moescope.training", exact=False).count() == 1
    if path == "jitter":  # the probe's runs hold no jitter measurement: the page says how to take one
        assert page.get_by_text("No routing jitter measured in this run", exact=False).count() == 1
    if path == "clusters":  # the layer's value is drawn whole, inside the chart (assert_chart_texts_fit)
        spec = next(chart for chart in texts if chart["key"] == "cl_spec_chart")
        shown = " ".join(t["text"] for t in spec["titles"])
        layer = int(re.search(r"Layer (\d+):", shown).group(1))
        nmi = slot_nmi_of_layer(recorded["root"], recorded["runs"][-1], layer)  # the newest run is shown
        assert f"kept-slot specialisation NMI(expert; domain) = {nmi:.3f}" in shown
    if path == "compare":  # six panels, their titles apart (assert_chart_texts_fit)
        scalars = next(chart for chart in texts if chart["key"] == "cp_scalars_chart")
        assert len(scalars["annotations"]) == 6


def test_three_clicks_from_overview_to_a_hot_experts_tokens(server, page, traffic):
    traffic.clear()
    page.goto(server)
    settle(page, 5)
    page.get_by_text("Which tokens go there?").click()  # click 1
    settle(page, 3)
    page.wait_for_selector("h1:has-text('Heatmaps')")
    heading = page.locator("h3:has-text('Tokens routed to expert')")
    assert heading.count() == 1
    # Click 2: the cell (layer 1, expert 5) of the layer x expert heatmap, found through Plotly's axes.
    x, y = page.evaluate("""() => {
        const gd = document.querySelectorAll('.js-plotly-plot')[0];
        const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis, box = gd.getBoundingClientRect();
        return [box.left + xa._offset + xa.l2p(xa.d2c('5')), box.top + ya._offset + ya.l2p(ya.d2c('1'))]; }""")
    page.mouse.move(x, y)
    page.mouse.click(x, y)
    page.wait_for_selector("h3:has-text('Tokens routed to expert 5 of layer 1')", timeout=60_000)
    settle(page, 3)
    assert page.locator('[data-testid="stException"]').count() == 0
    assert page.locator('[data-testid="stDataFrame"]').count() >= 1
    assert_only_local_and_quiet(server, traffic)
    page.screenshot(path=os.path.join(SCREENSHOTS, "heatmaps-clicked.png"), full_page=True)


# -- issue 33: what the pages show -------------------------------------------------------------

def choose(page, label: str, option: str, where: str = "") -> None:
    """Pick `option` in the selectbox labelled `label` (in `where`, a CSS scope), then wait for the re-run."""
    page.locator(f'{where} [data-testid="stSelectbox"]').filter(has_text=label).first.click()
    page.get_by_role("option", name=option, exact=True).click()
    page.wait_for_timeout(500)
    settle(page, 0)


def chart(page, key: str) -> dict:
    """The drawn chart of `key`: its traces' names and x values, its axes, its plot area and legend boxes."""
    return page.evaluate("""key => { const gd = document.querySelector(`.st-key-${key} .js-plotly-plot`);
        const box = el => { if (!el) return null; const r = el.getBoundingClientRect();
                            return {left: r.left, right: r.right, top: r.top, bottom: r.bottom}; };
        const size = gd._fullLayout._size;
        return {traces: gd._fullData.map(t => ({name: t.name, x: Array.from(t.x || []), y: Array.from(t.y || [])})),
                yaxes: Object.keys(gd._fullLayout).filter(k => /^yaxis\\d*$/.test(k)).length,
                plot_width: size.w, width: gd._fullLayout.width,
                title: box(gd.querySelector('.infolayer text.gtitle')), legend: box(gd.querySelector('.legend'))}; }""",
                         key)


def test_the_swing_by_tag_keeps_to_the_sidebar_filter(server, page, recorded):
    """Issue 33, part 3: with domain=code chosen in the sidebar, the swing by domain shows only the
    domains of the steps tagged domain=code (from the raw steps rows), not every domain of the run."""
    page.goto(f"{server}/overview")
    settle(page, 5)
    assert set(chart(page, "ov_tag_chart")["traces"][0]["x"]) == {"code", "math", "prose"}
    choose(page, "Filter by tag", "domain", '[data-testid="stSidebar"]')
    page.get_by_text("Only steps tagged domain=code").wait_for()
    settle(page, 5)
    steps = snapshot_rows(recorded["root"], "steps").to_pandas()
    steps = steps[steps.run_id == recorded["runs"][-1]]  # the newest run is shown
    expected = {dict(t)["domain"] for t in steps.tags if dict(t).get("domain") == "code"}
    assert set(chart(page, "ov_tag_chart")["traces"][0]["x"]) == expected == {"code"}


@pytest.mark.parametrize("path,title,charts", [("overview", "Overview", 5)] + PAGES[1:], ids=[p[1] for p in PAGES])
def test_each_page_has_the_address_its_name_says(server, page, path, title, charts):
    """Issue 33, part 10: /overview opened "Page not found" (Streamlit serves its default page at "/"
    only); every page opens at its own address, with no such modal, and "/" opens Overview at /overview."""
    page.goto(f"{server}/{path}")
    settle(page, charts)
    page.wait_for_selector(f"h1:has-text('{title}')")
    assert page.get_by_text("Page not found").count() == 0
    assert page.url == f"{server}/{path}"
    if path == "overview":
        page.goto(server)
        settle(page, charts)
        page.wait_for_url(f"{server}/overview")
        assert page.get_by_text("Page not found").count() == 0


def test_the_drift_titles_fit_a_laptop_screen(server, page):
    """Issue 33, part 7: the Jensen-Shannon chart's title ran past its half-width column on a 1280 px screen."""
    page.set_viewport_size({"width": 1280, "height": 2000})
    try:
        page.goto(f"{server}/drift")
        settle(page, 3)
        texts = page.evaluate(CHART_TEXTS)
        assert {t["key"] for t in texts} >= {"dr_kl_chart", "dr_js_chart"}
        assert_chart_texts_fit(texts)
    finally:
        page.set_viewport_size({"width": 1500, "height": 2400})


def test_the_overviews_small_charts_keep_their_width_and_one_panel_per_layer(server, page, recorded):
    """Issue 33, part 7: a legend at the right took half of each small chart; the router entropy's
    lines of every layer tangled in one panel: it has a panel per layer (the raw `layers` rows)."""
    page.goto(f"{server}/overview")
    settle(page, 5)
    for key in ("ov_spread_chart", "ov_entropy_chart", "ov_dropped_chart"):
        drawn = chart(page, key)
        assert drawn["plot_width"] > 0.7 * drawn["width"], (key, drawn["plot_width"], drawn["width"])
        if drawn["legend"] is not None:  # a legend above the plot stays clear of the title
            assert not overlaps(drawn["legend"], drawn["title"]), key
    layers = snapshot_rows(recorded["root"], "layers").to_pandas()
    layers = set(layers[layers.run_id == recorded["runs"][-1]].layer)
    entropy = chart(page, "ov_entropy_chart")
    assert entropy["yaxes"] == len(layers) == len(entropy["traces"]) > 1
    assert [t["name"] for t in entropy["traces"]] == [f"layer {v}" for v in sorted(layers)]


def test_compare_asks_for_the_tag_before_its_values(server, page):
    """Issue 33, part 12: in "two tag values" mode the Value A / Value B pickers stood above the Tag picker."""
    page.goto(f"{server}/compare")
    settle(page, 3)
    page.get_by_text("two tag values").click()
    page.wait_for_timeout(500)
    settle(page, 3)
    boxes = page.locator('[data-testid="stMain"] [data-testid="stSelectbox"]')
    top = {label: boxes.filter(has_text=label).first.bounding_box()["y"] for label in ("Tag", "Value A", "Value B")}
    assert top["Tag"] < top["Value A"] and top["Tag"] < top["Value B"], top
