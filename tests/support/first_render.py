"""How long each dashboard page takes to draw in Chromium the first time (tests/e2e/test_dashboard_first_render.py
and `python bench/dashboard.py --first-render`)."""

from __future__ import annotations

import ast
import os
import time

from tests.support.paths import REPO

# The run is over, and every Plotly chart on the page has drawn its SVG (Streamlit loads its Plotly element
# after the page, showing a skeleton in its place until then).
RENDERED = """() => { const app = document.querySelector('[data-testid=stApp]');
    const charts = [...document.querySelectorAll('[data-testid=stPlotlyChart]')];
    return app && app.getAttribute('data-test-script-state') === 'notRunning'
        && document.querySelectorAll('[data-testid=stSkeleton]').length === 0
        && charts.every(chart => chart.querySelector('.js-plotly-plot .main-svg')); }"""
SCATTER = ".st-key-cl_umap_chart .main-svg"  # the Semantic clusters page's UMAP scatter, drawn
# The Placement page's traffic charts, drawn on the run after its first render (`common.after_first_render`)
TRAFFIC = ".st-key-pl_traffic_fanout .main-svg"


def app_pages() -> list[tuple[str, str]]:
    """(path, title) of every page of the app's navigation, in its order, read from the
    `st.Page("views/....py", title=..., url_path=...)` calls of dashboard/app.py."""
    tree = ast.parse(open(os.path.join(REPO, "dashboard", "app.py"), encoding="utf-8").read())
    pages = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "Page" and node.args
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("views/")):
            options = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            pages.append((node.lineno, options["url_path"], options["title"]))
    return [(path, title) for _, path, title in sorted(pages)]


def first_render(page, server: str, path: str, title: str, timeout_ms: int = 600_000) -> float:
    """Seconds from asking for the page to its first render: its title shown, its script run over and
    every chart on it drawn (the UMAP scatter of a page still computing it is not on it yet)."""
    started = time.perf_counter()
    page.goto(f"{server}/{path}")
    page.wait_for_selector(f"h1:has-text('{title}')", timeout=timeout_ms)
    page.wait_for_function(RENDERED, timeout=timeout_ms)
    return time.perf_counter() - started
