"""The one rule for tests that need a real program installed on the machine: Prometheus, promtool,
Alertmanager, Chromium.

Where the program is missing, the test skips, saying which package to install. In CI (the `CI`
environment variable set to true, as GitHub Actions, GitLab CI and `.ci/run` set it) the test
fails instead: a run that could not start a real server or browser is never green.
"""

from __future__ import annotations

import os
import shutil

import pytest

TRUE = ("1", "true", "yes")


def in_ci() -> bool:
    """Whether this run is CI's (CI=true): then a missing real part fails the test, never skips it."""
    return os.environ.get("CI", "").strip().lower() in TRUE


def require_program(*names: str, package: str) -> str:
    """The path of the first of `names` that is installed (a name on PATH or an absolute path).

    Skips the calling test when none is, naming the Debian package to install; fails it instead
    when `in_ci()`.
    """
    for name in names:
        path = name if os.path.isabs(name) and os.access(name, os.X_OK) else shutil.which(name)
        if path:
            return path
    message = (f"{names[0]} is not installed: install it with `sudo apt-get install -y {package}` "
               "(Debian/Ubuntu; `.ci/run` does)")
    if in_ci():
        pytest.fail(f"{message}. CI=true: a test that needs a real server or browser fails without it",
                    pytrace=False)
    pytest.skip(message)
