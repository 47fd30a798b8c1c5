"""`moescope placement`: per-(layer, rank) slots under a placement, checked against a plain loop over the
raw `layer_steps` Parquet rows; a redundant expert's slots split evenly; bad placement files refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moescope.analyses.placement import Placement, PlacementError, placement_report, read_placement
from moescope.cli import main
from moescope.store import Store
from moescope.store.location import open_location
from moescope.store.writer import ParquetExporter
from tests.support.deltafiles import read_table
from tests.support.store_records import make_record, run_info

LAYERS, EXPERTS = 3, 6


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("placement") / "store")
    exporter = ParquetExporter(root, run_info("r", LAYERS, EXPERTS))
    rng = np.random.default_rng(3)
    exporter.export([make_record("r", step, rng, LAYERS, EXPERTS, skew=1.5, tags={"phase": "ab"[step % 2]})
                     for step in range(8)])
    exporter.shutdown()
    return root


def brute_force(root: str, rank_of_slots: list[list[int]], window: int | None, phase: str | None) -> dict:
    """{(layer, window_start): per-rank slots} by a loop over the raw rows: each expert's load split
    over its copies, one copy at a time."""
    rows = read_table(open_location(root), "layer_steps").to_pylist()
    out: dict = {}
    for row in rows:
        if phase is not None and dict(row["tags"]).get("phase") != phase:
            continue
        key = (row["layer"], None if window is None else row["step"] // window * window)
        ranks = out.setdefault(key, [0.0] * len(rank_of_slots))
        for expert, load in enumerate(row["expert_load"]):
            copies = [r for r, experts in enumerate(rank_of_slots) for e in experts if e == expert]
            for r in copies:
                ranks[r] += load / len(copies)
    return out


def test_contiguous_layout_matches_the_raw_rows(root):
    with Store(root) as store:
        report = placement_report(store, "r", Placement.contiguous(4))
    expected = brute_force(root, [[0, 1], [2, 3], [4], [5]], None, None)
    assert len(report.layers) == LAYERS
    for row in report.layers.itertuples():
        ranks = np.array(expected[(row.layer, None)])
        np.testing.assert_allclose(row.rank_slots, ranks)
        assert row.balancedness == pytest.approx(ranks.mean() / ranks.max())
        assert row.imbalance == pytest.approx((ranks.max() - ranks.mean()) / ranks.mean())
        assert row.hottest_rank == int(np.argmax(ranks))
        assert row.slots == pytest.approx(ranks.sum())


def test_redundant_slots_split_evenly_by_window_and_tag(root, tmp_path):
    layout = [[0, 5], [1, 2, 5], [3, 4, 5]]  # expert 5 (the busiest under skew) on every rank
    path = tmp_path / "p.yaml"
    path.write_text("ranks: 3\nnum_experts: 6\nlayers:\n  '*': " + json.dumps(layout) + "\n")
    with Store(root) as store:
        report = placement_report(store, "r", read_placement(str(path)), window_steps=4, tags={"phase": "a"})
    expected = brute_force(root, layout, 4, "a")
    assert len(report.layers) == len(expected) == LAYERS * 2
    total_slots = 0.0
    for row in report.layers.itertuples():
        np.testing.assert_allclose(row.rank_slots, expected[(row.layer, row.window_start)])
        total_slots += row.rank_slots.sum()
        assert row.rank_slots.sum() == pytest.approx(row.slots)  # never double counted
    raw = read_table(open_location(root), "layer_steps").to_pylist()
    assert total_slots == pytest.approx(sum(sum(r["expert_load"]) for r in raw if dict(r["tags"])["phase"] == "a"))


def test_hottest_rank_names_its_top_experts(root):
    layout = [[0, 1, 2, 3, 4], [5]]
    with Store(root) as store:
        report = placement_report(store, "r", Placement(2, default=tuple(map(tuple, layout)), source="t"),
                                  top_experts=2)
    rows = read_table(open_location(root), "layer_steps").to_pylist()
    for row in report.layers.itertuples():
        load = np.sum([r["expert_load"] for r in rows if r["layer"] == row.layer], axis=0)
        on_rank = {e: load[e] for e in layout[row.hottest_rank]}
        top = sorted(on_rank, key=lambda e: (-on_rank[e], e))[:2]
        assert row.hottest_experts == top
        assert row.hottest_expert_slots == pytest.approx([on_rank[e] for e in top])


@pytest.mark.parametrize("document, message", [
    ({"ranks": 2, "layers": {"*": [[0, 1, 2], [3, 4, 5], [0]]}}, "lists 3 ranks, but ranks is 2"),
    ({"ranks": 2, "num_experts": 6, "layers": {"*": [[0, 1, 2], [3, 4]]}}, "expert(s) 5 have no slot"),
    ({"ranks": 2, "num_experts": 6, "layers": {"1": [[0, 1, 2], [3, 4, 9]]}}, "expert 9, outside 0..5"),
    ({"ranks": 2, "layers": {"1": [[0, -1], [3]]}}, "slot holds -1"),
    ({"ranks": 0, "layers": {}}, "`ranks` must be"),
    ({"ranks": 2, "layers": {"one": [[0], [1]]}}, "not a layer number"),
    ({"ranks": 2, "layer": {}}, "unknown key(s) layer"),
])
def test_bad_placement_files_say_what_is_wrong(tmp_path, document, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(document))
    with pytest.raises(PlacementError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        read_placement(str(path))


def test_a_placement_missing_an_expert_of_the_run_is_refused(root):
    with Store(root) as store, pytest.raises(PlacementError, match=r"layer 0 \(6 experts\).*expert\(s\) 5"):
        placement_report(store, "r", Placement(2, default=((0, 1, 2), (3, 4)), source="p.yaml"))


def test_sglang_map_slots_are_contiguous_per_rank():
    placement = Placement.from_physical_to_logical(np.array([[0, 1, 2, 3, 3, 0]]), 3, source="dump.pt")
    assert placement.rank_experts(0, 4) == ((0, 1), (2, 3), (3, 0))
    np.testing.assert_allclose(placement.shares(0, 4), [[.5, 0, .5], [1, 0, 0], [0, 1, 0], [0, .5, .5]])
    with pytest.raises(PlacementError, match="do not split evenly over 4 ranks"):
        Placement.from_physical_to_logical(np.zeros((1, 6), dtype=int), 4, source="dump.pt")


def test_the_command_prints_each_layer(root, capsys):
    assert main(["placement", root, "--ranks", "4", "--tag", "phase=b", "--top", "1"]) == 0
    out = capsys.readouterr().out
    expected = brute_force(root, [[0, 1], [2, 3], [4], [5]], None, "b")
    for layer in range(LAYERS):
        ranks = np.array(expected[(layer, None)])
        assert f"layer {layer}: " in out
        assert f"balancedness (vLLM, mean/max) {ranks.mean() / ranks.max():.3f}" in out
        assert f"imbalance (TensorRT-LLM, (max-mean)/mean) {(ranks.max() - ranks.mean()) / ranks.mean():.3f}" in out
        assert f"hottest rank {int(np.argmax(ranks))}: expert " in out


def test_the_command_needs_a_placement(root, capsys):
    assert main(["placement", root]) != 0
    assert "--ranks R" in capsys.readouterr().err
