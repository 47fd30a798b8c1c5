"""`moescope placement`: per-(layer, rank) slots and distinct tokens under a placement, each engine's
choice of a redundant expert's copy, and the what-if, checked against plain loops over the raw
`layer_steps` and `routes` Parquet rows and an independent EPLB (tests/support/eplb_reference.py);
bad placement files refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moescope.analyses.placement import placement_report, read_placement
from moescope.analyses.placement_whatif import WhatIfSetup, placement_whatif
from moescope.cli import main
from moescope.metrics.placement import Placement, PlacementError
from moescope.store import Store
from moescope.store.location import open_location
from moescope.store.writer import ParquetExporter
from tests.support.deltafiles import read_table
from tests.support.eplb_reference import reference_eplb
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


# -- distinct tokens per rank, each engine's choice of copy: a plain loop over the raw routes rows ---

REDUNDANT_LAYOUT = ((0, 1, 5), (2, 3, 5), (4, 5, 3))  # expert 5 three times, expert 3 twice


def _copy_ranks(layout) -> dict[int, list[int]]:
    copies: dict[int, list[int]] = {}
    for rank, experts in enumerate(layout):
        for e in experts:
            copies.setdefault(e, []).append(rank)
    return copies


def brute_force_tokens(root: str, layout, dispatch: str, homes_known: bool = False) -> dict:
    """{layer: (tokens [R], slots [R])}: per routes row, the probability each of its kept slots runs on
    each rank by the engine's rule, written as loops; a token counts 1 - prod(1 - p) on a rank (SGLang
    static of unknown homes: averaged over an enumeration of the homes)."""
    rows = read_table(open_location(root), "routes").to_pylist()
    rows.sort(key=lambda r: (r["layer"], r["step"], r["rank"], r["token"]))
    copies = _copy_ranks(REDUNDANT_LAYOUT)
    ranks = len(REDUNDANT_LAYOUT)
    out: dict = {}
    seen: dict = {}  # trtllm: (layer, step, rank, block, expert) -> slots so far
    for row in rows:
        tokens, slots = out.setdefault(row["layer"], ([0.0] * ranks, [0.0] * ranks))
        if dispatch == "sglang-static" and not homes_known:
            # the token comes from each rank alike; from home h, each slot goes to h where h holds a
            # copy, else to the copy h's fixed draw picked (each copy alike): given the home, the slots
            # of different experts are independent, but not over homes
            for home in range(ranks):
                miss = [1.0] * ranks
                for e, kept in zip(row["expert_ids"], row["kept"]):
                    if not kept:
                        continue
                    where = copies[e]
                    for r in range(ranks):
                        p = (1.0 if r == home else 0.0) if home in where else where.count(r) / len(where)
                        slots[r] += p / ranks
                        miss[r] *= 1.0 - p
                for r in range(ranks):
                    tokens[r] += (1.0 - miss[r]) / ranks
            continue
        k = len(row["expert_ids"])
        miss = [1.0] * ranks
        for j, (e, kept) in enumerate(zip(row["expert_ids"], row["kept"])):
            if not kept:
                continue
            where = copies[e]
            p = [0.0] * ranks
            if dispatch == "vllm":
                p[where[(row["token"] * k + j) % len(where)]] = 1.0
            elif dispatch in ("trtllm", "trtllm-tp"):
                block = (row["token"] * k + j) // 1024
                key = (row["layer"], row["step"], row["rank"], block, e)
                nth = seen.get(key, 0)
                seen[key] = nth + 1
                offset = row["rank"] % ranks if dispatch == "trtllm" else 0  # offset_by_ep_rank=use_dp
                p[where[(block + nth + offset) % len(where)]] = 1.0
            elif dispatch == "sglang-static" and homes_known and row["rank"] in where:
                p[row["rank"]] = 1.0
            else:
                for r in where:
                    p[r] += 1.0 / len(where)
            for r in range(ranks):
                slots[r] += p[r]
                miss[r] *= 1.0 - p[r]
        for r in range(ranks):
            tokens[r] += 1.0 - miss[r]
    return out


@pytest.mark.parametrize("dispatch", ["even", "vllm", "trtllm", "trtllm-tp", "sglang-static", "sglang-dynamic"])
def test_tokens_per_rank_follow_each_engines_choice_of_copy(root, dispatch):
    with Store(root) as store:
        report = placement_report(store, "r", Placement(3, default=REDUNDANT_LAYOUT, source="t"), dispatch=dispatch)
    expected = brute_force_tokens(root, REDUNDANT_LAYOUT, dispatch)
    for row in report.layers.itertuples():
        tokens, slots = expected[row.layer]
        np.testing.assert_allclose(row.rank_tokens, tokens)
        # a token counts once per rank: never more than its slots there, and every rank's at most all tokens
        assert (row.rank_tokens <= np.array(slots) + 1e-9).all() and (row.rank_tokens <= row.tokens).all()
        # slots of the routes rows: the layer_steps' split of the same loads, kept slots counted once
        np.testing.assert_allclose(np.sum(slots), row.slots)


@pytest.fixture(scope="module")
def three_rank_root(tmp_path_factory) -> str:
    """A run recorded by three ranks (a process each), so a routes row's rank is its token's home rank."""
    root = str(tmp_path_factory.mktemp("placement3") / "store")
    for rank in range(3):
        exporter = ParquetExporter(root, run_info("m", LAYERS, EXPERTS, rank=rank, world_size=3))
        rng = np.random.default_rng(10 + rank)
        exporter.export([make_record("m", step, rng, LAYERS, EXPERTS, skew=1.0) for step in range(4)])
        exporter.shutdown()
    return root


@pytest.mark.parametrize("dispatch", ["sglang-static", "trtllm", "trtllm-tp"])
def test_the_home_rank_counts_where_the_engine_uses_it(three_rank_root, dispatch):
    # SGLang static serves a token on its own rank when that rank holds a copy; TensorRT-LLM offsets
    # its round robin by the EP rank with attention DP, and not without it
    with Store(three_rank_root) as store:
        report = placement_report(store, "m", Placement(3, default=REDUNDANT_LAYOUT, source="t"), dispatch=dispatch)
    expected = brute_force_tokens(three_rank_root, REDUNDANT_LAYOUT, dispatch, homes_known=True)
    for row in report.layers.itertuples():
        np.testing.assert_allclose(row.rank_tokens, expected[row.layer][0])


def test_local_split_is_the_average_over_home_ranks():
    from moescope.metrics.ranks import replica_shares

    layout = REDUNDANT_LAYOUT
    slot_rank = [r for r, experts in enumerate(layout) for _ in experts]
    slot_expert = [e for experts in layout for e in experts]
    shares = replica_shares(np.array(slot_rank), np.array(slot_expert), 6, 3, "local")
    copies = _copy_ranks(layout)
    for e in range(6):
        expected = np.zeros(3)
        for home in range(3):
            if home in copies[e]:
                expected[home] += 1 / 3
            else:
                for r in copies[e]:
                    expected[r] += 1 / len(copies[e]) / 3
        np.testing.assert_allclose(shares[e], expected)


def test_the_runs_engine_picks_the_default_dispatch(root):
    from moescope.analyses.placement import dispatch_of_run
    from moescope.metrics.dispatch import ENGINE_OF_SOURCE

    assert ENGINE_OF_SOURCE == {"vllm": "vllm", "sglang": "sglang-static", "trtllm": "trtllm"}
    with Store(root) as store:
        assert dispatch_of_run(store, "r") == "even"  # the probe recorded it: no engine, an even split


# -- the engines' map files ----------------------------------------------------------------------

def test_trtllm_and_vllm_maps_are_read_with_slots_contiguous_per_rank(tmp_path):
    trt = tmp_path / "moe_load_balancer.yaml"
    trt.write_text("initial_global_assignments:\n  3: [5, 0, 1, 2, 3, 4, 5, 0]\n  4: [0, 1, 2, 3, 4, 5, 5, 1]\n"
                   "num_slots: 8\nlayer_updates_per_iter: 0\n")
    placement = read_placement(str(trt), ranks=4)
    assert placement.rank_experts(3, 6) == ((5, 0), (1, 2), (3, 4), (5, 0))
    assert placement.rank_experts(4, 6) == ((0, 1), (2, 3), (4, 5), (5, 1))
    with pytest.raises(PlacementError, match="give --ranks R"):
        read_placement(str(trt))
    vllm = tmp_path / "eplb_map.json"
    vllm.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 3, 3, 0]], "ranks": 3}))
    assert read_placement(str(vllm)).on_layers([0]).rank_experts(0, 4) == ((0, 1), (2, 3), (3, 0))
    with pytest.raises(PlacementError, match="places experts on 3 ranks, but --ranks is 2"):
        read_placement(str(vllm), ranks=2)
    bad = tmp_path / "bad.yaml"
    bad.write_text("initial_global_assignments:\n  3: [0, 1]\n  4: [0, 1, 2]\nnum_slots: 2\n")
    with pytest.raises(PlacementError, match="must list num_slots"):
        read_placement(str(bad), ranks=2)


def test_a_vllm_map_lands_on_the_moe_layers_of_a_model_with_dense_layers_first(tmp_path):
    # DeepSeek-V3's shape: dense layers 0..2, MoE layers from 3; vLLM's map has a row per MoE layer
    import dataclasses

    from moescope.analyses.traffic import Wire, traffic_report

    root = str(tmp_path / "dense_first")
    info = run_info("d", LAYERS, EXPERTS)
    info = dataclasses.replace(info, layers=tuple(dataclasses.replace(li, layer=li.layer + 3) for li in info.layers))
    exporter = ParquetExporter(root, info)
    rng = np.random.default_rng(5)
    records = [make_record("d", step, rng, LAYERS, EXPERTS, skew=1.5) for step in range(4)]
    for record in records:
        for layer_step in record.layers:
            layer_step.layer += 3
    exporter.export(records)
    exporter.shutdown()
    rows = [[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [2, 5, 0, 3, 1, 4]]
    path = tmp_path / "eplb_map.json"
    path.write_text(json.dumps({"physical_to_logical_map": rows, "ranks": 3}))
    raw = read_table(open_location(root), "layer_steps").to_pylist()
    with Store(root) as store:
        report = placement_report(store, "d", read_placement(str(path)))
        assert sorted(report.layers.layer) == [3, 4, 5]
        for row in report.layers.itertuples():
            layout = [rows[row.layer - 3][r * 2:(r + 1) * 2] for r in range(3)]
            expected = np.zeros(3)
            for raw_row in (r for r in raw if r["layer"] == row.layer):
                for expert, load in enumerate(raw_row["expert_load"]):
                    expected[[r for r in range(3) if expert in layout[r]][0]] += load
            np.testing.assert_allclose(row.rank_slots, expected)
        # the wire figures read the same layers: the map against the same layout written per layer
        spelled = Placement(3, {3 + i: tuple(tuple(r[j * 2:(j + 1) * 2]) for j in range(3))
                                for i, r in enumerate(rows)})
        setup = Wire(np.zeros(3, dtype=np.int64), "token", 64, 2.0, 2.0)
        by_map = traffic_report(store, "d", read_placement(str(path)), setup).layers
        by_layer = traffic_report(store, "d", spelled, setup).layers
        assert by_map.drop(columns=["rank_matrix", "node_matrix", "remote_ranks_histogram"]).equals(
            by_layer.drop(columns=["rank_matrix", "node_matrix", "remote_ranks_histogram"]))
    # the alerts take the MoE layers of the run they watch
    import argparse

    from moescope.cli.alerts import _placement

    watched = _placement(argparse.Namespace(placement=str(path), ranks=None, run=[], store=root))
    assert watched.layers == spelled.layers
    path.write_text(json.dumps({"physical_to_logical_map": rows + [rows[0]], "ranks": 3}))
    with Store(root) as store, pytest.raises(PlacementError, match="the map has 4 rows, but the run has 3 MoE layers"):
        placement_report(store, "d", read_placement(str(path)))


# -- the what-if: a plain loop over the raw layer_steps rows ---------------------------------------

def brute_force_windows(root: str, window: int) -> dict:
    """{window_start: {layer: [load per expert]}} summed by a loop over the raw rows."""
    out: dict = {}
    for row in read_table(open_location(root), "layer_steps").to_pylist():
        per_layer = out.setdefault(row["step"] // window * window, {})
        load = per_layer.setdefault(row["layer"], [0] * EXPERTS)
        for e, v in enumerate(row["expert_load"]):
            load[e] += v
    return out


def loop_balancedness(loads: dict, layout_of) -> float:
    """sum over layers of the mean rank / sum of the busiest rank, each copy taking an even share."""
    means = peaks = 0.0
    for layer, load in loads.items():
        layout = layout_of(layer)
        copies = _copy_ranks(layout)
        ranks = [0.0] * len(layout)
        for e, v in enumerate(load):
            for r in copies[e]:
                ranks[r] += v / len(copies[e])
        means += sum(ranks) / len(ranks)
        peaks += max(ranks)
    return means / peaks


def test_whatif_figures_match_the_raw_rows_and_an_independent_eplb(root):
    windows = brute_force_windows(root, 2)
    starts = sorted(windows)
    setup = WhatIfSetup(ranks=3, redundant=3, fit_window=1, rebalance_every=2)
    with Store(root) as store:
        report = placement_whatif(store, "r", 2, setup, dispatch="even")
    summary = report.summary.set_index(["candidate", "window_start"]).balancedness
    fit = windows[starts[1]]
    for t, start in enumerate(starts):
        default = loop_balancedness(windows[start], lambda layer: [[0, 1], [2, 3], [4, 5]])
        assert summary["default", start] == pytest.approx(default)
        eplb_fit = {layer: reference_eplb(np.array(fit[layer], float), 3, 1, 1, 3) for layer in fit}
        assert summary["eplb", start] == pytest.approx(loop_balancedness(windows[start], eplb_fit.get))
        # refitted every 2 windows on the window before: windows 2-3 use window 1's, 4-5 window 3's
        source = 1 if t <= 1 else 1 + 2 * ((t - 2) // 2)
        refit = {layer: reference_eplb(np.array(windows[starts[source]][layer], float), 3, 1, 1, 3)
                 for layer in fit}
        assert summary["eplb-every-2", start] == pytest.approx(loop_balancedness(windows[start], refit.get))
    figures = report.figures().set_index("candidate")
    later = [loop_balancedness(windows[s], lambda layer: [[0, 1], [2, 3], [4, 5]]) for s in starts[2:]]
    assert figures.loc["default", "later"] == pytest.approx(np.mean(later))
    assert figures.loc["eplb", "decay"] == pytest.approx(figures.loc["eplb", "fit"] - figures.loc["eplb", "later"])


def test_whatif_saved_rows_and_printed_table(root, tmp_path, capsys):
    import shutil

    copy = str(tmp_path / "store")
    shutil.copytree(root, copy)
    assert main(["placement", copy, "--ranks", "3", "--whatif", "--window", "4", "--redundant", "3", "--save",
                 "--export", str(tmp_path / "eplb.yaml")]) == 0
    out = capsys.readouterr().out
    windows = brute_force_windows(root, 4)
    starts = sorted(windows)
    default = [loop_balancedness(windows[s], lambda layer: [[0, 1], [2, 3], [4, 5]]) for s in starts]
    fit = f"{default[0]:>8.3f}{np.mean(default[1:]):>8.3f}{default[-1]:>8.3f}"
    assert f"  {'default':<18}{fit}" in out
    stored = read_table(open_location(copy), "placement_whatif").to_pylist()
    assert len(stored) == len(starts) * LAYERS * 3  # default, eplb, load-aware
    for row in stored:
        if row["candidate"] == "default":
            load = windows[row["window_start"]][row["layer"]]
            ranks = np.array([load[0] + load[1], load[2] + load[3], load[4] + load[5]], dtype=float)
            np.testing.assert_allclose(row["rank_load"], ranks)
            assert row["balancedness"] == pytest.approx(ranks.mean() / ranks.max())
    exported = read_placement(str(tmp_path / "eplb.yaml"))  # the fitted placement, a file an operator can use
    fitted = {layer: reference_eplb(np.array(windows[starts[0]][layer], float), 3, 1, 1, 3) for layer in range(3)}
    assert {layer: [list(r) for r in exported.rank_experts(layer, EXPERTS)] for layer in range(3)} == fitted


def test_the_command_offers_every_engines_dispatch(capsys):
    from moescope.cli.placement import DISPATCH_NAMES
    from moescope.metrics.dispatch import DISPATCH

    assert DISPATCH_NAMES == tuple(DISPATCH)  # the parser's choices (it imports no analysis) are the rules
    with pytest.raises(SystemExit):
        main(["placement", "--help"])
    help_text = capsys.readouterr().out
    assert "--whatif" in help_text and "--rebalance-every" in help_text and "examples:" in help_text
