"""`moescope summary` says what the trace checks found in an engine's trace: a line per check with
its count, from the run's `trace_findings` rows (read here from the raw Parquet files)."""

from __future__ import annotations

import copy

from moescope.analyses.summary import format_summary
from moescope.ingest.importers import import_files
from tests.support.engine_standin import vllm_responses
from tests.support.importing import parquet_rows
from tests.support.trace_faults import repeated, standin_trace, zero_rows


def test_summary_lists_each_finding_and_nothing_for_a_clean_trace(tmp_path):
    requests, clean, _, _, experts = standin_trace()
    engine = copy.deepcopy(clean)
    zero_rows(requests, engine, experts)
    repeated(requests, engine, experts)
    runs = {}
    for name, routing in (("clean", clean), ("broken", engine)):
        path = str(tmp_path / f"{name}.jsonl")
        with open(path, "w") as f:
            f.write(vllm_responses(requests, routing))
        runs[name] = import_files("vllm", [path], str(tmp_path / "store"), run_id=name).run_id
    text = format_summary(str(tmp_path / "store"), "broken", program="moescope")
    stored = {r["check_name"]: r for r in parquet_rows(str(tmp_path / "store"), "trace_findings", "broken").to_pylist()}
    assert set(stored) == {"zero_rows", "repeated_ids"}
    assert "trace checks: 2 findings" in text
    for check, row in stored.items():
        assert f"  {check}: {row['count']:,} of {row['checked']:,} (import): {row['detail']}" in text
    assert "check " in text and "--run broken" in text
    assert "trace checks" not in format_summary(str(tmp_path / "store"), "clean", program="moescope")
