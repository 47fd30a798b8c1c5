"""One home rule for every view: an imported run (one request a step, rank 0, `sequence` the choice
index) spreads its tokens over the ranks, and `moescope traffic`, the rules engine's traffic signal
and the Prometheus exporter give the same remote-ranks figure, equal to a loop over the raw routes."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from moescope.alerts.observations import compute_signals
from moescope.alerts.rules import default_rules
from moescope.alerts.storage import StoreAlertRunner
from moescope.analyses.traffic import Wire, default_home, node_layout, traffic_report
from moescope.cli import main
from moescope.core.records import Routes
from moescope.ingest.importers import import_files
from moescope.metrics.placement import Placement, wire_layout
from moescope.prometheus.exporter import PrometheusExporter
from moescope.store import Store
from tests.support.alert_records import layer_step, step_record
from tests.support.importing import parquet_rows

E, L, K, RANKS, PER_NODE, REQUESTS = 8, 2, 2, 4, 2, 6


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[str, str]:
    """Six vLLM responses (one request each, choice index 0) imported by the real importer."""
    folder = tmp_path_factory.mktemp("home")
    rng = np.random.default_rng(11)
    paths = []
    for r in range(REQUESTS):
        prompt = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(7 + r)])
        generated = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(3)])
        body = {"id": f"cmpl-{r}", "object": "text_completion", "created": 1_700_000_000 + r, "model": "m",
                "prompt_token_ids": rng.integers(10, 1000, len(prompt)).tolist(),
                "prompt_routed_experts": prompt.tolist(),
                "choices": [{"index": 0, "text": "x", "token_ids": rng.integers(10, 1000, 4).tolist(),
                             "routed_experts": generated.tolist()}]}
        paths.append(str(folder / f"r{r}.json"))
        with open(paths[-1], "w") as f:
            json.dump(body, f)
    root = str(folder / "store")
    summary = import_files("vllm", paths, root, num_experts=E)
    return root, summary.run_id


def loop(root: str, run_id: str, layer: int) -> tuple[float, np.ndarray]:
    """(mean remote ranks per token, rank x rank matrix) of one layer, a token's home its row in its
    step modulo the ranks, expert e on rank e // 2 (the contiguous layout of 8 experts on 4 ranks)."""
    rows = [r for r in parquet_rows(root, "routes", run_id).to_pylist() if r["layer"] == layer]
    assert rows and {r["rank"] for r in rows} == {0} and {r["sequence"] for r in rows} == {0}
    matrix = np.zeros((RANKS, RANKS))
    remote = 0
    for row in rows:
        home = row["token"] % RANKS
        dests = {e // (E // RANKS) for e in row["expert_ids"]}
        for d in dests:
            matrix[home, d] += 1
        remote += len(dests - {home})
    return remote / len(rows), matrix


def _records(root: str, run_id: str) -> list:
    """The run's steps as the records the exporter would see pass (routes only: the traffic signals)."""
    rows = parquet_rows(root, "routes", run_id).to_pylist()
    records = []
    for step in sorted({r["step"] for r in rows}):
        layers = []
        for layer in range(L):
            mine = sorted((r for r in rows if r["step"] == step and r["layer"] == layer), key=lambda r: r["token"])
            ids = np.array([r["expert_ids"] for r in mine], dtype=np.int32)
            routes = Routes(expert_ids=ids, gate_weights=np.full(ids.shape, 0.5, dtype=np.float32),
                            kept=np.ones(ids.shape, dtype=bool), token_ids=None,
                            sequence=np.array([r["sequence"] for r in mine], dtype=np.int32),
                            position=np.array([r["position"] for r in mine], dtype=np.int32),
                            token=np.array([r["token"] for r in mine], dtype=np.int32))
            layers.append(dataclasses.replace(layer_step(layer, np.bincount(ids.ravel(), minlength=E)),
                                              tokens=len(mine), routes=routes))
        records.append(step_record(step, layers, run_id=run_id))
    return records


def test_an_imported_run_spreads_its_tokens_and_every_view_agrees(imported, capsys):
    root, run_id = imported
    placement = Placement.contiguous(RANKS)
    rank_node = node_layout(RANKS, PER_NODE, None)
    with Store(root) as store:
        assert default_home(store, run_id) == "token"
        report = traffic_report(store, run_id, placement, Wire(rank_node, default_home(store, run_id)))
    runner = StoreAlertRunner(root, default_rules(), run_ids=[run_id], write_alerts=False, placement=placement)
    observations = runner._observations(run_id)
    exporter = PrometheusExporter(registry=(registry := CollectorRegistry()), window_steps=REQUESTS,
                                  placement=placement, ranks_per_node=PER_NODE)
    exporter.export(_records(root, run_id))
    main(["traffic", root, "--run", run_id, "--ranks", str(RANKS), "--ranks-per-node", str(PER_NODE), "--matrix"])
    printed = capsys.readouterr().out
    assert "home ranks: token" in printed
    for layer in range(L):
        remote, matrix = loop(root, run_id, layer)
        row = report.layers[report.layers.layer == layer].iloc[0]
        assert (matrix.sum(axis=1) > 0).sum() == RANKS  # every rank sends: not one row
        np.testing.assert_array_equal(np.asarray(row.rank_matrix), matrix)
        assert row.remote_ranks_mean == pytest.approx(remote)
        mine = [o for o in observations if o.layer == layer]
        signal = compute_signals(mine, ["remote_ranks_per_token"], num_experts=E,
                                 wire_layout=wire_layout(placement, layer, E, rank_node))
        assert signal["remote_ranks_per_token"] == pytest.approx(remote)
        gauge = registry.get_sample_value("moescope_layer_remote_ranks_per_token", {"layer": str(layer)})
        assert gauge == pytest.approx(remote)
        printed_remote = re.findall(rf"layer {layer}:.*\n  remote ranks per token ([0-9.]+)", printed)
        assert printed_remote and float(printed_remote[0]) == pytest.approx(remote, abs=0.005)


def test_a_run_recorded_by_several_ranks_is_counted_from_its_ranks_in_every_view(tmp_path):
    from moescope.store.writer import ParquetExporter
    from tests.support.store_records import make_record, run_info

    root, ranks, experts = str(tmp_path / "store"), 2, 6
    for rank in range(ranks):
        exporter = ParquetExporter(root, run_info("m", 2, experts, rank=rank, world_size=ranks))
        rng = np.random.default_rng(20 + rank)
        exporter.export([make_record("m", step, rng, 2, experts, drop_rate=0.0) for step in range(3)])
        exporter.shutdown()
    placement = Placement.contiguous(ranks)
    rank_node = node_layout(ranks, 1, None)
    with Store(root) as store:
        assert default_home(store, "m") == "recorded"
        report = traffic_report(store, "m", placement, Wire(rank_node, default_home(store, "m")))
    observations = StoreAlertRunner(root, default_rules(), run_ids=["m"], write_alerts=False,
                                    placement=placement)._observations("m")
    for layer in range(2):
        rows = [r for r in parquet_rows(root, "routes", "m").to_pylist() if r["layer"] == layer]
        remote = sum(len({e // 3 for e in r["expert_ids"]} - {r["rank"]}) for r in rows) / len(rows)
        assert report.layers[report.layers.layer == layer].remote_ranks_mean.iloc[0] == pytest.approx(remote)
        signal = compute_signals([o for o in observations if o.layer == layer], ["remote_ranks_per_token"],
                                 num_experts=experts, wire_layout=wire_layout(placement, layer, experts, rank_node))
        assert signal["remote_ranks_per_token"] == pytest.approx(remote)
