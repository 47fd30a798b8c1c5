"""The trace checks' findings on the Engine vs reference page, on a store where a STAND-IN engine's
trace (tests/support/engine_standin.py: a tiny Mixtral in bfloat16) was imported with its final rows
zero-filled (verl's signature). Expected values come from the raw Parquet rows of `trace_findings`."""

from __future__ import annotations

import copy

import pytest

from moescope.ingest.importers import import_files
from tests.support.engine_standin import vllm_responses
from tests.support.importing import parquet_rows
from tests.support.pages import app_for, open_page
from tests.support.trace_faults import final_row, standin_trace

PAGE = "views/mismatch.py"


@pytest.fixture(scope="module")
def broken_store(tmp_path_factory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp("broken")
    requests, clean, _, _, experts = standin_trace()
    engine = copy.deepcopy(clean)
    final_row(requests, engine, experts)
    path = str(folder / "vllm.jsonl")
    with open(path, "w") as f:
        f.write(vllm_responses(requests, engine))
    root = str(folder / "store")
    return root, import_files("vllm", [path], root).run_id


def test_the_page_shows_what_the_trace_checks_found_in_the_engine_run(monkeypatch, broken_store):
    root, run = broken_store
    at = open_page(app_for(monkeypatch, root), PAGE)
    assert not at.exception, [e.value for e in at.exception]
    [stored] = parquet_rows(root, "trace_findings", run).to_pylist()
    [error] = at.error
    assert f"run `{run}`" in error.value and "failed 1 trace check" in error.value
    shown = at.dataframe[0].value
    assert shown.check.tolist() == [stored["check_name"]] == ["final_row_zero"]
    assert shown["count"].tolist() == [stored["count"]] and shown["of"].tolist() == [stored["checked"]]
    assert shown["what it means"].tolist() == [stored["detail"]]
