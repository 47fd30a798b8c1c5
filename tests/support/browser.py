"""Chromium driven by Playwright against a dashboard started as a user starts it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import urllib.request
from argparse import Namespace
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from moescope.cli import dashboard as cli
from tests.support.realparts import require_program

CHROMIUM = "/usr/bin/chromium"


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_dashboard(root, log_dir, tokenizer: str | None = None) -> Iterator[str]:
    """`moescope dashboard ROOT [--tokenizer PATH]` on a free 127.0.0.1 port, its URL once it answers
    its health check; stopped on leaving. Fails the test (with the server's log) if it never comes up."""
    port = free_port()
    args = Namespace(store=str(root), host="127.0.0.1", port=port, allow_writes=False, tokenizer=tokenizer,
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


@contextlib.contextmanager
def page_with_tables(root, log_dir, path: str, heading: str, tables: int = 2, tokenizer: str | None = None,
                     height: int = 5000) -> Iterator:
    """A headless Chromium page on `/<path>` of a dashboard over `root` (`running_dashboard`), once the
    page shows `heading` (an h3), its script run is over and its `tables`-th data grid has rows; closed
    on leaving. Skips where Chromium is missing (fails in CI)."""
    from playwright.sync_api import sync_playwright

    require_program(CHROMIUM, package="chromium")
    with running_dashboard(root, log_dir, tokenizer=tokenizer) as url, sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = chromium.new_page(viewport={"width": 1800, "height": height})
            page.goto(f"{url}/{path}")
            page.wait_for_selector(f"h3:has-text('{heading}')", timeout=240_000)
            page.wait_for_function("() => document.querySelector('[data-testid=stApp]')"
                                   ".getAttribute('data-test-script-state') === 'notRunning'", timeout=240_000)
            page.wait_for_function("() => { const grids = document.querySelectorAll('[data-testid=stDataFrame]');"
                                   f" return grids.length >= {tables}"
                                   f" && grids[{tables - 1}].querySelectorAll('tr td').length > 0; }}",
                                   timeout=60_000)
            yield page
        finally:
            chromium.close()


def grid_rows(page, index: int) -> list[dict[str, str]]:
    """The `index`-th data grid of `page` as its accessible table gives it, one dict per row drawn
    ({heading: cell text}; the grid draws the rows in view)."""
    header, *rows = page.evaluate("""index => [...document.querySelectorAll('[data-testid=stDataFrame]')[index]
        .querySelectorAll('tr')].map(tr => [...tr.querySelectorAll('th, td')].map(c => c.textContent))""", index)
    return [dict(zip(header, row)) for row in rows if len(row) == len(header)]


class Traffic:
    """What the page asked for and what its console said, since the last `clear()`."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.console_errors: list[tuple[str, str]] = []  # (message, URL it is about)

    def clear(self) -> None:
        self.urls.clear()
        self.console_errors.clear()

    def outside(self, server: str) -> list[str]:
        """The URLs asked of anything but `server` (data: and blob: URLs stay in the page)."""
        own = urlsplit(server).netloc
        return [u for u in self.urls if urlsplit(u).scheme not in ("data", "blob") and urlsplit(u).netloc != own]






def settle(page, charts: int, timeout_ms: int = 240_000) -> None:
    """Wait until Streamlit's script run is over and at least `charts` Plotly charts are drawn."""
    page.wait_for_function(
        "() => { const app = document.querySelector('[data-testid=stApp]');"
        " return app && app.getAttribute('data-test-script-state') === 'notRunning'; }", timeout=timeout_ms)
    page.wait_for_function(f"() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= {charts}",
                           timeout=timeout_ms)
    page.wait_for_timeout(800)  # let Plotly finish laying out before the screenshot


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium for a test module's pages (a fixture: tests/conftest.py registers this module)."""
    from playwright.sync_api import sync_playwright

    require_program(CHROMIUM, package="chromium")  # skips where it is missing, fails in CI
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()
