"""The real dashboard server in headless Chromium (Debian's /usr/bin/chromium, driven by Playwright).

Opens every page, waits for Streamlit to finish the run and for the Plotly charts, asserts that
no exception box is shown, and saves a screenshot of each page (to $MOESCOPE_SCREENSHOTS, else
tests/dashboard/screenshots/, which git ignores). Then walks the newcomer's path: Overview ->
"Which tokens go there?" -> click a cell of the layer x expert heatmap -> the tokens of that cell.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.request
from argparse import Namespace
from collections.abc import Iterator

import pytest

from moescope.dashboard import cli
from tests.realparts import require_program

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
PAGES = [("", "Overview", 5), ("heatmaps", "Heatmaps", 3), ("clusters", "Semantic clusters", 3),
         ("drift", "Drift and alerts", 3), ("health", "Expert health", 0), ("training", "Training", 0),
         ("compare", "Compare", 3)]
SCREENSHOTS = os.environ.get("MOESCOPE_SCREENSHOTS") or os.path.join(os.path.dirname(__file__), "screenshots")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_dashboard(root, log_dir) -> Iterator[str]:
    """`moescope dashboard ROOT` on a free 127.0.0.1 port, its URL once it answers its health
    check; stopped on leaving. Fails the test (with the server's log) if it never comes up."""
    port = free_port()
    args = Namespace(store=str(root), host="127.0.0.1", port=port, allow_writes=False, tokenizer=None,
                     refresh_s=5.0, storage_option=[], state_dir=None)
    log_path = os.path.join(log_dir, "streamlit.log")
    with open(log_path, "w") as log:
        process = subprocess.Popen(cli.command(args), env=cli.environment(args), stdout=log,
                                   stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                with open(log_path) as f:
                    pytest.fail(f"the dashboard did not come up: {f.read()[-2000:]}")
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def server(recorded, tmp_path_factory):
    require_program(CHROMIUM, package="chromium")  # skips where it is missing, fails in CI
    with running_dashboard(recorded["root"], tmp_path_factory.mktemp("server")) as url:
        yield url


@pytest.fixture(scope="module")
def page(server, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")  # a fresh profile: no state from other runs
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1500, "height": 2400})
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()


def settle(page, charts: int, timeout_ms: int = 240_000) -> None:
    """Wait until Streamlit's script run is over and at least `charts` Plotly charts are drawn."""
    page.wait_for_function(
        "() => { const app = document.querySelector('[data-testid=stApp]');"
        " return app && app.getAttribute('data-test-script-state') === 'notRunning'; }", timeout=timeout_ms)
    page.wait_for_function(f"() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= {charts}",
                           timeout=timeout_ms)
    page.wait_for_timeout(800)  # let Plotly finish laying out before the screenshot


@pytest.mark.parametrize("path,title,charts", PAGES, ids=[p[1] for p in PAGES])
def test_page_in_a_real_browser(server, page, path, title, charts):
    page.goto(f"{server}/{path}")
    settle(page, charts)
    page.wait_for_selector(f"h1:has-text('{title}')")
    os.makedirs(SCREENSHOTS, exist_ok=True)
    page.screenshot(path=os.path.join(SCREENSHOTS, f"{path or 'overview'}.png"), full_page=True)
    assert page.locator('[data-testid="stException"]').count() == 0
    assert page.locator(".js-plotly-plot").count() >= charts
    drawn = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].filter(
        gd => gd.data && gd.data.length > 0 && gd.querySelector('.main-svg .trace, .main-svg .hm')).length""")
    assert drawn >= charts  # charts that hold data and drew a trace (lines, bars, points, heatmap cells)
    if path == "health":
        assert page.get_by_text("no expert-health score recorded", exact=False).count() == 1
    if path == "training":  # the recorded runs are inference runs: the page says how to record a training one
        assert page.get_by_text("not recorded with moescope.training", exact=False).count() == 1


def test_three_clicks_from_overview_to_a_hot_experts_tokens(server, page):
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
    page.screenshot(path=os.path.join(SCREENSHOTS, "heatmaps-clicked.png"), full_page=True)
