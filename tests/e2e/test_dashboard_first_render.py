"""Issue 33, part 6: every page of a freshly started dashboard draws its first render in under 10 s, in
headless Chromium, on the demo's store (`moescope demo --quick`), with nothing cached: a new server, an
empty embedding cache and an empty numba cache (what a fresh install meets: numba compiles UMAP).

A first render is the page's title shown, its script run over and every chart on it drawn
(`tests/support/first_render.py`). The Semantic clusters page draws everything but its UMAP scatter
while the embedding is computed in a process of its own, says so in a status box naming what it
computes, and draws the scatter when it is there; the test then asks for it and for its reuse from
disk by a second server.

Calibrated on the 2-core CPU machine this project's figures come from (2026-12-05, load average 2 to
4 from other work; `python bench/dashboard.py --first-render runs/demo --cold-numba`, docs/benchmarks.md):
first renders 0.5-4.3 s, the server's first page (Overview) slowest, the clusters page about 3 s (its
run waits up to 2 s for the embedding before handing it to the status box), its scatter 32 s after the
first visit with an empty numba cache. Before the fix the clusters page took 26 s there, and 121 s at
load average 12. The 10 s bound is the issue's goal, with no slack added: the slowest page measured
under half of it. On a 2-core machine under heavy load from other work every page slows (Overview took
6.7 s at load average 12); the scatter's own wait is given minutes, since it is what load stretches most.
"""

from __future__ import annotations

import pytest

from tests.support.browser import running_dashboard
from tests.support.first_render import SCATTER, app_pages, first_render

pytestmark = pytest.mark.integration
GOAL_S = 10.0


def test_every_page_of_a_fresh_dashboard_renders_within_10_s(demo, browser, tmp_path, monkeypatch):
    root, _, _ = demo
    # Nothing cached: the server's embedding cache and numba's compiled UMAP start empty.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba-cache"))
    pages = app_pages()
    assert ("clusters", "Semantic clusters") in pages and len(pages) >= 9
    with running_dashboard(root, tmp_path) as url:
        page = browser.new_page(viewport={"width": 1500, "height": 2400})
        try:
            times = {title: first_render(page, url, path, title) for path, title in pages}
            slow = {title: round(s, 1) for title, s in times.items() if s > GOAL_S}
            assert slow == {}, f"first renders over {GOAL_S:g} s: {slow} (all: {times})"

            page.goto(f"{url}/clusters")  # the embedding asked for on the first visit is drawn
            page.wait_for_selector(SCATTER, timeout=600_000)
            assert page.locator('[data-testid="stException"]').count() == 0
        finally:
            page.close()


def test_the_clusters_page_says_what_it_computes_and_a_restarted_server_reads_it_back(demo, browser, tmp_path,
                                                                                        monkeypatch):
    root, _, _ = demo
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba-cache"))  # a fit of some seconds, surely
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    page = browser.new_page(viewport={"width": 1500, "height": 2400})
    try:
        with running_dashboard(root, tmp_path / "first") as url:
            first_render(page, url, "clusters", "Semantic clusters")
            status = page.locator('[data-testid="stExpander"]', has_text="Computing the UMAP embedding of")
            assert status.count() == 1, "the page names what it computes while the points are not there"
            assert "router inputs of layer 0" in status.inner_text()
            assert page.locator(".st-key-cl_mi_chart .main-svg").count() >= 1  # the rest of the page is drawn
            page.wait_for_selector(SCATTER, timeout=600_000)
            assert page.locator('[data-testid="stExpander"]', has_text="Computing the UMAP").count() == 0
        with running_dashboard(root, tmp_path / "second") as url:  # a new server: the disk cache has it
            assert first_render(page, url, "clusters", "Semantic clusters") < GOAL_S
            assert page.locator(SCATTER).count() >= 1
    finally:
        page.close()
