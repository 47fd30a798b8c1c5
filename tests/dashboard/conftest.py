from __future__ import annotations

import os

import pytest

from tests.dashboard.recording import record_alerts, record_store


@pytest.fixture(scope="session")
def embedding_cache(tmp_path_factory) -> str:
    """One UMAP disk cache for the whole session (AppTest and the browser's server share it)."""
    folder = str(tmp_path_factory.mktemp("xdg-cache"))
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = folder
    yield folder
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="session")
def recorded(tmp_path_factory, embedding_cache) -> dict:
    """A store recorded by the probe on a real tiny Mixtral: two runs, tags, routes, alerts."""
    root = str(tmp_path_factory.mktemp("store") / "store")
    run_ids = record_store(root)
    transitions = record_alerts(root)
    return {"root": root, "runs": run_ids, "transitions": transitions}
