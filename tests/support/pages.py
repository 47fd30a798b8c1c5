"""Running the dashboard's pages in Streamlit's AppTest, and what every page must show."""

from __future__ import annotations

import os

from streamlit.testing.v1 import AppTest

from moescope.dashboard import data, settings
from moescope.dashboard.embedding import embedding_jobs
from tests.support.paths import REPO

APP = os.path.join(REPO, "dashboard", "app.py")


def app_for(monkeypatch, store: str, allow_writes: bool = False) -> AppTest:
    monkeypatch.setenv(settings.ENV_STORE, store)
    monkeypatch.setenv(settings.ENV_ALLOW_WRITES, "1" if allow_writes else "0")
    monkeypatch.delenv(settings.ENV_TOKENIZER, raising=False)
    return AppTest.from_file(APP, default_timeout=240)


def open_page(at: AppTest, page: str) -> AppTest:
    """`page` run in `at`, with any UMAP embedding it asked for drawn: the Semantic clusters page fits
    off its run and draws the points on the run after (in a browser, its fragment asks for that run),
    and with every section it computes after its first render drawn (`settle`)."""
    at.run()
    if page != "views/overview.py":
        at.switch_page(page).run()
    jobs = embedding_jobs()
    if jobs.pending():
        assert jobs.wait(timeout=600), "the UMAP embedding did not finish in 10 minutes"
        at.run()
    return settle(at)


def settle(at: AppTest) -> AppTest:
    """Run the page again once the sections it computes off its run are there
    (`moescope.dashboard.common.after_first_render`; in a browser their fragment asks for that run)."""
    if data.off_the_run_pending() or any("drawn when it is computed" in c.value for c in at.caption):
        assert data.off_the_run_wait(timeout=600), "a section computed off the page's run took over 10 minutes"
        at.run()
    return at


def assert_clean(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
