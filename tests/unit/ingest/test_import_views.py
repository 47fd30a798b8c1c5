"""The dashboard over imported runs: what an engine does not hand out reads "not recorded by this
source", never zero or nan.

The runs are vLLM routed-experts responses built to vLLM's documented layout (the engine cannot
run here); every page is run by Streamlit's AppTest against the store the importer wrote.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from moescope.dashboard import settings
from moescope.ingest.importers import import_files
from tests.support.paths import REPO

APP = os.path.join(REPO, "dashboard", "app.py")
E, L, K = 6, 2, 2


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("imported")
    rng = np.random.default_rng(0)
    root = str(folder / "store")
    for run, skew in (("replay-a", 1.0), ("replay-b", 4.0)):
        p = np.array([1, 1, 1, 1, 1, skew])
        lines = []
        for r in range(8):
            ids = [[rng.choice(E, K, replace=False, p=p / p.sum()).tolist() for _ in range(L)] for _ in range(12)]
            lines.append(json.dumps({"id": f"{run}-{r}", "model": "test-moe", "created": 1_700_000_000 + r,
                                     "prompt_token_ids": list(range(12)), "prompt_routed_experts": ids,
                                     "choices": []}))
        path = str(folder / f"{run}.jsonl")
        with open(path, "w") as f:
            f.write("\n".join(lines))
        import_files("vllm", [path], root, run_id=run, num_experts=E)
    return root


def open_page(monkeypatch, root: str, page: str) -> AppTest:
    monkeypatch.setenv(settings.ENV_STORE, root)
    monkeypatch.setenv(settings.ENV_ALLOW_WRITES, "0")
    monkeypatch.delenv(settings.ENV_TOKENIZER, raising=False)
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    if page != "views/overview.py":
        at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    return at


def texts(at: AppTest, kind: str) -> list[str]:
    return [str(e.value) for e in at.get(kind)]


def test_overview_says_what_the_source_did_not_record(monkeypatch, imported):
    at = open_page(monkeypatch, imported, "views/overview.py")
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Router entropy"] == metrics["Dropped tokens"] == metrics["Active parameters / token"] == "—"
    assert metrics["Tokens"] == f"{8 * 12:,}"
    captions = " ".join(texts(at, "caption"))
    assert "Active parameters, router entropy, dropped tokens: not recorded by this source (vllm)" in captions
    assert not any("nan" in t for t in texts(at, "caption") + texts(at, "markdown") + list(metrics.values()))


def test_other_pages_say_not_recorded_instead_of_blank_numbers(monkeypatch, imported):
    clusters = open_page(monkeypatch, imported, "views/clusters.py")
    assert any("Router inputs: not recorded by this source (vllm)" in t for t in texts(clusters, "info"))
    heatmaps = open_page(monkeypatch, imported, "views/heatmaps.py")
    assert any("Gate weights and capacity drops (kept): not recorded by this source" in t
               for t in texts(heatmaps, "caption"))
    compare = open_page(monkeypatch, imported, "views/compare.py")
    assert any("router entropy (nats)" in t and "not recorded by this source" in t for t in texts(compare, "caption"))
    drift = open_page(monkeypatch, imported, "views/drift.py")
    assert len(drift.get("plotly_chart")) >= 1  # drift needs only loads: it works as for a probed run
