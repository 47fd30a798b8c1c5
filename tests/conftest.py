"""The suite's tiers and the fixtures every tier may use.

- `tests/unit/` (marker `unit`, the default run: `pytest`): in-process, fast and exact;
- `tests/integration/` (`integration`): a real server, process, fork, compiler or engine;
- `tests/e2e/` (`e2e`): whole flows as a user runs them (the CLI, the demo, a browser, a wheel).

`pytest tests` runs every tier; `pytest tests -m integration` one of them. Each test gets its tier's
marker from its folder. The fixtures live in tests/support/fixtures/ (and the proxy suites' in
tests/support/proxy.py), defined once, registered here for every tier.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest_plugins = [
    "tests.support.fixtures.s3",
    "tests.support.fixtures.store",
    "tests.support.fixtures.servers",
    "tests.support.fixtures.dashboard",
    "tests.support.fixtures.demo",
    "tests.support.proxy",
    "tests.support.browser",
]

TIERS = ("unit", "integration", "e2e")
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            tier = Path(item.path).resolve().relative_to(_TESTS).parts[0]
        except ValueError:
            continue
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(autouse=True)
def _main_module_restored():
    """Put `sys.modules["__main__"]` back after each test. Streamlit's AppTest runs a page as
    `__main__`; left there, every process a later test spawns (multiprocessing, torch, Dask) runs the
    dashboard's entry file first, as spawn re-runs the parent's main module, and dies."""
    main = sys.modules.get("__main__")
    yield
    if sys.modules.get("__main__") is not main and main is not None:
        sys.modules["__main__"] = main
