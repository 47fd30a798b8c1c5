"""`--format json` of `summary`, `placement`, `traffic` and `whatif cache` on a small real store: stdout
is one JSON document and nothing else, its keys are exactly the documented ones (`DOCUMENTS`), and
every figure equals, to the last bit, the one the Python API's report gives (the report functions
the command calls; those figures are checked against raw rows in tests/unit/analyses). NaN is null;
errors keep their stderr line and exit status with nothing on stdout."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from moescope.analyses import traffic
from moescope.analyses.expert_cache import cache_report
from moescope.analyses.placement import placement_report
from moescope.analyses.placement_whatif import WhatIfSetup, placement_whatif
from moescope.analyses.summary import summary_report
from moescope.cli import main
from moescope.cli.output import DOCUMENTS, document_keys, jsonable
from moescope.metrics.placement import Placement
from moescope.store import Store
from moescope.store.writer import ParquetExporter
from tests.support.json_documents import check_keys, same, same_rows
from tests.support.store_records import make_record, run_info

LAYERS, EXPERTS = 3, 6


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("json") / "store")
    exporter = ParquetExporter(root, run_info("r", LAYERS, EXPERTS))
    rng = np.random.default_rng(5)
    exporter.export([make_record("r", step, rng, LAYERS, EXPERTS, skew=1.5, tags={"phase": "ab"[step % 2]})
                     for step in range(8)])
    exporter.shutdown()
    return root


def run_json(capsys, *argv: str) -> dict:
    """The command's stdout, which must parse as ONE JSON document (json.loads refuses trailing text);
    what it said on stderr is kept as `doc["_stderr"]`."""
    assert main([*argv, "--format", "json"]) == 0
    captured = capsys.readouterr()
    assert captured.out.endswith("\n") and captured.out.count("\n") == 1, captured.out[:500]
    return {**json.loads(captured.out), "_stderr": captured.err}


def test_summary(root, capsys):
    doc = run_json(capsys, "summary", root)
    check_keys({k: v for k, v in doc.items() if k != "_stderr"})
    with Store(root) as store:
        report = summary_report(store, "r")
    assert (doc["run_id"], doc["model_class"], doc["source"]) == ("r", report.model_class, report.source)
    same(doc["active_params_per_token"], report.active_params)
    assert (doc["forwards"], doc["tokens"], doc["ranks"]) == (report.counts.forwards, report.counts.tokens,
                                                               report.counts.ranks)
    same_rows(doc["layers"], pd.DataFrame(report.layers), list(report.layers[0]))
    same(doc["all"]["load_cv"], report.run.load_cv)
    same(doc["all"]["entropy"], report.run.entropy.nats)
    same(doc["all"]["dropped_rate"], report.run.dropped_token_rate)
    same_rows(doc["tags"], report.tags, ["key", "value", "steps", "tokens", "active_fraction"])
    assert [(t["key"], t["value"]) for t in doc["tags"]] == [("phase", "a"), ("phase", "b")]


def test_placement_with_the_whatif(root, capsys, tmp_path):
    export = tmp_path / "eplb.json"
    doc = run_json(capsys, "placement", root, "--ranks", "3", "--window", "2", "--whatif", "--rebalance-every",
                   "2", "--export", str(export))
    check_keys({k: v for k, v in doc.items() if k != "_stderr"})
    assert document_keys(doc)[:-1] == list(DOCUMENTS["placement"].keys)  # every key, with --whatif (and _stderr)
    assert f"wrote the eplb-every-2 placement to {export}" in doc["_stderr"]
    with Store(root) as store:
        report = placement_report(store, "r", Placement.contiguous(3), 2)
        whatif = placement_whatif(store, "r", 2, WhatIfSetup(ranks=3, rebalance_every=2))
    assert (doc["ranks"], doc["source"], doc["dispatch"]) == (3, report.source, report.dispatch)
    same_rows(doc["layers"], report.layers, list(report.layers.columns))
    assert doc["whatif"]["rebalance_every"] == 2 and doc["whatif"]["window_steps"] == 2
    same_rows(doc["whatif"]["candidates"], whatif.figures(),
              ["candidate", "fit", "later", "last", "windows", "decay", "gain"])
    same_rows(doc["whatif"]["windows"], whatif.summary, list(whatif.summary.columns))
    same_rows(doc["whatif"]["layers"], whatif.rows, list(whatif.rows.columns))
    assert json.loads(export.read_text()) == whatif.placements["eplb-every-2"].document()


def test_placement_rebalance(root, capsys):
    from moescope.analyses.rebalance import DEFAULT_POLICIES, RebalanceSetup, rebalance_report

    doc = run_json(capsys, "placement", root, "--ranks", "3", "--rebalance", "--expert-bytes", "1000")
    check_keys({k: v for k, v in doc.items() if k != "_stderr"})
    assert doc["command"] == "placement rebalance"
    with Store(root) as store:
        report = rebalance_report(store, "r", RebalanceSetup(ranks=3, expert_bytes=1000), DEFAULT_POLICIES)
    assert (doc["ranks"], doc["steps"], doc["dispatch"]) == (3, report.steps, report.dispatch)
    same(doc["expert_bytes"], report.expert_bytes)
    assert [p["policy"] for p in doc["policies"]] == [p.policy for p in report.policies]
    for row, policy in zip(doc["policies"], report.policies):
        for key in ("rearrangements", "mean_balancedness", "mean_overload", "moved_bytes", "moved_slots"):
            same(row[key], getattr(policy, key))
        same(row["balancedness"], policy.balancedness)
    same(doc["staleness"]["staleness"], report.staleness.staleness)
    assert doc["staleness"]["layers"] == report.staleness.layers


def test_traffic_with_comparisons_and_nan_as_null(root, capsys):
    doc = run_json(capsys, "traffic", root, "--ranks", "3", "--nodes", "2,1", "--compare", "default,coselection",
                   "--window", "4", "--max-nodes", "1")
    check_keys({k: v for k, v in doc.items() if k != "_stderr"})
    assert document_keys(doc)[:-1] == list(DOCUMENTS["traffic"].keys)  # every key, with the comparisons
    with Store(root) as store:
        placement = Placement.contiguous(3)
        rank_node = traffic.node_layout(3, nodes=[2, 1])
        setup = traffic.Wire(rank_node, traffic.default_home(store, "r"), None, 2.0, 2.0, 1, "normal")
        report = traffic.traffic_report(store, "r", placement, setup, 4)
        compared = traffic.compare_placements(store, "r", {
            placement.source: placement, "default (contiguous)": Placement.contiguous(3),
            "co-selection": traffic.coselection_placement(store, "r", placement, rank_node)}, setup)
        windowed, _ = traffic.coselection_by_window(store, "r", placement, setup, 4)
    assert (doc["ranks"], doc["nodes"], doc["home"], doc["mode"]) == (3, 2, report.home, "normal")
    same_rows(doc["layers"], report.layers, list(report.layers.columns))
    same_rows(doc["comparison"], compared, list(compared.columns))
    same_rows(doc["coselection_by_window"], windowed, list(windowed.columns))
    # no hidden size: bytes are not defined, and JSON says null (never NaN, which is not JSON)
    assert all(row["dispatch_bytes_per_forward"] is None for row in doc["layers"])
    assert any(isinstance(row["remote_ranks_mean"], float) for row in doc["layers"])


def test_whatif_cache(root, capsys):
    doc = run_json(capsys, "whatif", "cache", root, "--capacity", "2,4", "--tag", "phase=a")
    check_keys({k: v for k, v in doc.items() if k != "_stderr"})
    with Store(root) as store:
        report = cache_report(store, "r", tags={"phase": "a"}, capacities=[2, 4])
    assert doc["tags"] == [{"key": "phase", "value": "a"}] and doc["layer"] is None
    same_rows(doc["curves"], report, ["layer", "policy", "capacity", "hit_rate", "hits", "accesses", "tokens",
                                      "truncated"])


@pytest.mark.parametrize("argv", [["summary"], ["placement", "--ranks", "3"], ["traffic", "--ranks", "3"],
                                  ["whatif", "cache"]])
def test_an_error_is_the_same_line_and_status_and_nothing_on_stdout(root, capsys, argv):
    command = argv[:2] if argv[0] == "whatif" else argv[:1]
    assert main([*command, root, *argv[len(command):], "--run", "nosuchrun", "--format", "json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "'nosuchrun' is not in the store" in captured.err and captured.err.count("\n") == 1


def test_the_table_stays_the_default(root, capsys):
    assert main(["placement", root, "--ranks", "3"]) == 0
    assert capsys.readouterr().out.startswith("run r: 3 ranks")


def test_json_values():
    """Full precision, and a value JSON has no form for is null; a type without a rule is refused."""
    value = 0.1 + 0.2  # 0.30000000000000004: a rounded printer loses it
    frame = pd.DataFrame({"a": pd.array([1, None], dtype="Int64"), "b": [np.float32(0.1), np.nan],
                          "c": [np.array([1.5, np.inf]), None]})
    got = json.loads(json.dumps(jsonable({"v": value, "rows": frame, "t": (np.int64(3), np.bool_(True)),
                                          "n": [-math.inf, pd.NaT]}), allow_nan=False))
    assert got["v"] == value
    assert got["rows"] == [{"a": 1, "b": float(np.float32(0.1)), "c": [1.5, None]}, {"a": None, "b": None, "c": None}]
    assert got["t"] == [3, True] and got["n"] == [None, None]
    with pytest.raises(TypeError, match="no JSON form for object"):
        jsonable(object())


def test_every_analysis_command_takes_the_format():
    from moescope.cli import build_parser

    parser = build_parser()
    for argv in (["summary", "s"], ["placement", "s"], ["traffic", "s"], ["whatif", "cache", "s"],
                 ["jitter", "demo"], ["mismatch", "s", "--run", "r"]):
        assert parser.parse_args(argv).format == "table"
        assert parser.parse_args([*argv, "--format", "json"]).format == "json"
    assert set(DOCUMENTS) == {"summary", "placement", "placement rebalance", "traffic", "whatif cache", "jitter",
                              "mismatch"}
