"""`moescope demo` in full (not `--quick`), once, as a user's shell runs it into a log: stdout and
stderr into one pipe, Python's default buffering (no PYTHONUNBUFFERED), and deprecation warnings
shown where moescope's own code is the caller.

- Issue 33, part 5: every figure of the demo that the README and the manual quote is the figure the
  full demo prints (the same on any machine for the default seed).
- Issue 33, part 9: no deprecation warning in the output, and no webhook line inside a progress bar.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support.paths import REPO

# The demo as `moescope demo` runs it, with DeprecationWarning and FutureWarning shown where a
# moescope module made the call (Python hides DeprecationWarnings outside __main__).
RUN_DEMO = """\
import runpy, warnings
for category in (DeprecationWarning, FutureWarning):
    warnings.filterwarnings("default", category=category, module=r"moescope(\\.|$)")
runpy.run_module("moescope.cli", run_name="__main__", alter_sys=True)
"""
DOCS = ("README.md", *sorted(f"docs/{name}" for name in os.listdir(os.path.join(REPO, "docs")) if name.endswith(".md")))


@pytest.fixture(scope="module")
def full_demo(tmp_path_factory) -> str:
    """The full demo's output, stdout and stderr as one stream, in the order they were written."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    store = tmp_path_factory.mktemp("demo-full") / "store"
    result = subprocess.run([sys.executable, "-c", RUN_DEMO, "demo", "--store", str(store)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    out = result.stdout.decode("utf-8", "replace")  # not text=True: its universal newlines would hide each "\r"
    assert result.returncode == 0, out[-3000:]
    return out


def _prose(path: str) -> str:
    """A docs page's text with its line breaks and runs of spaces as single spaces (quotes wrap)."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return re.sub(r"\s+", " ", f.read())


def _quoted_headlines() -> list[tuple[str, str]]:
    """(page, quote) for every quotation of the demo's headline sentence in the README and the manual."""
    return [(path, quote) for path in DOCS
            for quote in re.findall(r'"((?:Code|Prose|Arithmetic) used [^"]*)"', _prose(path))]


def test_the_docs_quote_the_figures_the_full_demo_prints(full_demo):
    out = re.sub(r"[ \t]+", " ", full_demo)
    quotes = _quoted_headlines()
    assert quotes, "the manual quotes the demo's headline (docs/getting-started.md): the pattern here is stale"
    for path, quote in quotes:
        assert quote in out, f"{path} quotes {quote!r}; the demo printed:\n" + \
            next(line for line in out.splitlines() if " used " in line and "drifts to" in line)
    printed_alerts = int(re.search(r"alerts received by the webhook: (\d+)", out).group(1))
    quoted_alerts = [(path, int(n)) for path in DOCS for n in re.findall(r"(\d+) alerts at the webhook", _prose(path))]
    assert quoted_alerts, "the manual quotes how many alerts reach the webhook: the pattern here is stale"
    for path, alerts in quoted_alerts:
        assert alerts == printed_alerts, \
            f"{path} says {alerts} alerts at the webhook; the demo printed {printed_alerts}"


def test_no_deprecation_warning_in_the_output(full_demo):
    """transformers logs its deprecations ("... are deprecated. Use ... instead.") through its logger,
    Python's through warnings: neither may appear in the middle of the story."""
    for line in full_demo.splitlines():
        assert not re.search(r"deprecat|DeprecationWarning|FutureWarning", line, re.IGNORECASE), line


def test_each_webhook_line_is_a_line_of_its_own(full_demo):
    """In a log, a progress bar is one line that every redraw extends (carriage returns); a webhook
    line printed while a bar is drawn lands inside it. Every webhook line must be whole and alone,
    and the receiver's lines must all be there."""
    lines = [line for line in full_demo.split("\n") if "webhook <-" in line]
    whole = re.compile(r"    webhook <- \[(firing|resolved)\] \w+ \(layers? \d+[^)\r]*step [\d-]+\)[^\r]*")
    for line in lines:
        assert whole.fullmatch(line), repr(line)
    notifications = re.search(r"alerts received by the webhook: \d+ in (\d+) notifications", full_demo)
    assert len(lines) == int(notifications.group(1))
