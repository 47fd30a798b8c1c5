"""`moescope traffic`: per (layer, window, tag) traffic of a three-rank run under a placement with
redundant experts and uneven nodes, checked against a plain loop over the raw `routes` Parquet rows
and the placement's lists; other placements and node-limited routing alike; the command's output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moescope.analyses.placement import read_placement
from moescope.analyses.traffic import (
    Wire,
    bytes_text,
    compare_placements,
    coselection_by_window,
    coselection_placement,
    eplb_placement,
    node_layout,
    traffic_report,
)
from moescope.cli import main
from moescope.metrics.placement import Placement, PlacementError
from moescope.store import Store
from moescope.store.location import open_location
from moescope.store.writer import ParquetExporter
from tests.support.deltafiles import read_table
from tests.support.store_records import make_record, run_info

LAYERS, EXPERTS, TOP_K, STEPS = 2, 6, 3, 6
LAYOUT = [[0, 1, 5], [2, 3, 5], [0, 4]]  # expert 5 on ranks 0 and 1, expert 0 on ranks 0 and 2
NODES = [0, 0, 1]  # uneven: two ranks, then one


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("traffic") / "store")
    for rank in range(3):
        rng = np.random.default_rng(rank)
        exporter = ParquetExporter(root, run_info("t", LAYERS, EXPERTS, TOP_K, rank=rank, world_size=3))
        exporter.export([make_record("t", step, rng, LAYERS, EXPERTS, TOP_K, skew=1.0,
                                     tags={"phase": "ab"[step % 2]}) for step in range(STEPS)])
        exporter.shutdown()
    return root


@pytest.fixture(scope="module")
def placement_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("p") / "p.json"
    path.write_text(json.dumps({"ranks": 3, "num_experts": EXPERTS, "layers": {"*": LAYOUT}}))
    return str(path)


def serving(per_rank, home: int, expert: int) -> int:
    copies = sorted(r for r, es in enumerate(per_rank) if expert in es)
    if home in copies:
        return home
    near = [r for r in copies if NODES[r] == NODES[home]]
    if near:
        return near[0]
    far = [r for r in copies if NODES[r] != NODES[home]]
    return far[home % len(far)]


def brute_force(root: str, per_rank, home_rule: str, window: int | None, phase: str | None, max_nodes=None):
    """{(layer, window_start): figures} by a loop over the raw routes rows."""
    out: dict = {}
    for row in read_table(open_location(root), "routes").to_pylist():
        if phase is not None and dict(row["tags"]).get("phase") != phase:
            continue
        home = row["rank"] if home_rule == "recorded" else row["sequence"] % 3
        key = (row["layer"], None if window is None else row["step"] // window * window)
        f = out.setdefault(key, dict(tokens=0, rr=0, rn=0, matrix=np.zeros((3, 3), int), steps=set(), changed=0,
                                     moved=0.0, rr_hist={}, rn_hist={}))
        slots = [(serving(per_rank, home, e), w) for e, w, k in zip(row["expert_ids"], row["gate_weights"], row["kept"])
                 if k]
        dests = {d for d, _ in slots}
        f["tokens"] += 1
        f["steps"].add(row["step"])
        f["rr"] += len(dests - {home})
        f["rn"] += len({NODES[d] for d in dests} - {NODES[home]})
        remote_ranks, remote_nodes = len(dests - {home}), len({NODES[d] for d in dests} - {NODES[home]})
        f["rr_hist"][remote_ranks] = f["rr_hist"].get(remote_ranks, 0) + 1
        f["rn_hist"][remote_nodes] = f["rn_hist"].get(remote_nodes, 0) + 1
        for d in dests:
            f["matrix"][home, d] += 1
        if max_nodes is not None:
            score: dict = {}
            for node in {NODES[d] for d in dests}:
                score[node] = sum(sorted((w for d, w in slots if NODES[d] == node), reverse=True)[:TOP_K // max_nodes])
            allowed = sorted(score, key=lambda n: (-score[n], n))[:max_nodes]
            total = sum(w for _, w in slots)
            if len(score) > max_nodes:
                f["changed"] += 1
                f["moved"] += sum(w for d, w in slots if NODES[d] not in allowed) / total
            # under the limit: the experts on the allowed nodes stay (the approximation cannot name the rest)
            stay = {d for d in dests if NODES[d] in allowed}
            lim = f.setdefault("limited", dict(rr=0, rn=0, matrix=np.zeros((3, 3), int), rr_hist={}, rn_hist={}))
            remote_ranks, remote_nodes = len(stay - {home}), len({NODES[d] for d in stay} - {NODES[home]})
            lim["rr"] += remote_ranks
            lim["rn"] += remote_nodes
            lim["rr_hist"][remote_ranks] = lim["rr_hist"].get(remote_ranks, 0) + 1
            lim["rn_hist"][remote_nodes] = lim["rn_hist"].get(remote_nodes, 0) + 1
            for d in stay:
                lim["matrix"][home, d] += 1
    return out


@pytest.mark.parametrize("home,window,phase", [("recorded", None, None), ("sequence", 4, "a"), ("recorded", 2, "b")])
def test_traffic_matches_the_raw_routes(root, placement_file, home, window, phase):
    setup = Wire(np.array(NODES), home, hidden_size=64, dispatch_bytes=1, combine_bytes=2, max_nodes=1)
    with Store(root) as store:
        report = traffic_report(store, "t", read_placement(placement_file), setup, window,
                                None if phase is None else {"phase": phase})
    expected = brute_force(root, LAYOUT, home, window, phase, max_nodes=1)
    assert len(report.layers) == len(expected)
    for row in report.layers.itertuples():
        f = expected[(row.layer, None if window is None else int(row.window_start))]
        sends = f["matrix"] - np.diag(np.diag(f["matrix"]))
        assert row.tokens == f["tokens"] and row.forwards == len(f["steps"])
        assert row.remote_ranks_mean == pytest.approx(f["rr"] / f["tokens"])
        assert row.remote_nodes_mean == pytest.approx(f["rn"] / f["tokens"])
        np.testing.assert_array_equal(row.rank_matrix, f["matrix"])
        assert row.gpu_sends == sends.sum() and row.rdma_sends == f["rn"]
        assert row.intra_node_share == pytest.approx((sends[0, 1] + sends[1, 0]) / sends.sum())
        assert row.busiest_link_tokens == sends.max()
        # fp8: a byte per element and a float32 scale for the one block of (up to) 128 elements
        assert row.dispatch_bytes_per_forward == pytest.approx(sends.sum() * (64 * 1 + 4) / len(f["steps"]))
        assert row.combine_bytes_per_forward == pytest.approx(sends.sum() * 64 * 2 / len(f["steps"]))
        assert row.limited_changed_share == pytest.approx(f["changed"] / f["tokens"])
        assert row.limited_moved_weight == pytest.approx(f["moved"] / f["tokens"], rel=1e-5)
        assert row.floor_remote_ranks <= row.remote_ranks_mean
        assert row.floor_remote_nodes <= row.remote_nodes_mean


def test_other_placements_are_measured_the_same_way(root):
    rank_node = np.array(NODES)
    setup = Wire(rank_node, "recorded")
    with Store(root) as store:
        coselected = coselection_placement(store, "t", Placement.contiguous(3), rank_node)
        balanced = eplb_placement(store, "t", 3, rank_node, redundant=3)  # 9 slots: three copies of hot experts
        frame = compare_placements(store, "t", {"default": Placement.contiguous(3), "co": coselected,
                                                "eplb": balanced}, setup)
    assert set(frame.placement) == {"default", "co", "eplb"} and len(frame) == 3 * LAYERS
    assert all(len(r) == 3 for r in balanced.rank_experts(0, EXPERTS))
    assert max(np.bincount([e for r in balanced.rank_experts(0, EXPERTS) for e in r])) > 1  # copies
    for name, placement in (("default", Placement.contiguous(3)), ("co", coselected), ("eplb", balanced)):
        for row in frame[frame.placement == name].itertuples():
            per_rank = [list(r) for r in placement.rank_experts(row.layer, EXPERTS)]
            f = brute_force(root, per_rank, "recorded", None, None)[(row.layer, None)]
            assert row.remote_ranks_mean == pytest.approx(f["rr"] / f["tokens"])
            np.testing.assert_array_equal(row.rank_matrix, f["matrix"])
    for layer in range(LAYERS):  # one slot per expert, as many per rank as the contiguous layout
        assert sorted(len(r) for r in coselected.rank_experts(layer, EXPERTS)) == [2, 2, 2]


def test_nodes_and_bad_input():
    assert node_layout(20, 8).tolist() == [0] * 8 + [1] * 8 + [2] * 4
    assert node_layout(5, nodes=[2, 3]).tolist() == [0, 0, 1, 1, 1]
    with pytest.raises(PlacementError, match="add up to 5"):
        node_layout(5, nodes=[2, 2])


def test_the_command_prints_the_figures(root, placement_file, capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 4096, "torch_dtype": "bfloat16"}))
    code = main(["traffic", root, "--placement", placement_file, "--nodes", "2,1", "--config", str(config),
                 "--max-nodes", "1", "--compare", "default,coselection,eplb", "--redundant", "3", "--matrix"])
    out = capsys.readouterr().out
    assert code == 0
    with Store(root) as store:
        report = traffic_report(store, "t", read_placement(placement_file),
                                Wire(np.array(NODES), "recorded", 4096, 2, 2, 1))
    row = report.layers.iloc[0]
    assert "3 ranks in 2 nodes" in out and "home ranks: recorded" in out
    assert f"remote ranks per token {row.remote_ranks_mean:.2f}" in out
    assert "node-limited routing" in out and "co-selection" in out and "default (contiguous)" in out
    assert "EPLB" in out
    assert f"{row.busiest_link_tokens:,} tokens" in out
    f = brute_force(root, LAYOUT, "recorded", None, None)[(0, None)]
    ranks_hist = " ".join(f"{n}:{c:,}" for n, c in sorted(f["rr_hist"].items()))
    nodes_hist = " ".join(f"{n}:{c:,}" for n, c in sorted(f["rn_hist"].items()))
    assert f"tokens by remote ranks  {ranks_hist}   by remote nodes  {nodes_hist}" in out, out
    node_rows = out.split("summed over nodes, from node (rows) to node (columns):\n")[1].splitlines()[:2]
    assert [[int(v.replace(",", "")) for v in line.split()] for line in node_rows] == row.node_matrix.tolist()
    assert main(["traffic", root, "--ranks", "3", "--nodes", "2,2"]) != 0
    assert "add up to 3" in capsys.readouterr().err


def histogram(counts: dict, size: int) -> list[int]:
    return [counts.get(n, 0) for n in range(size)]


@pytest.mark.parametrize("max_nodes,window", [(1, None), (1, 2), (2, None)])
def test_node_limited_routing_gives_every_figure(root, placement_file, max_nodes, window):
    """Under node-limited routing the same figures as without it, from a loop over the raw rows; a
    limit that changes no token (2 nodes here) moves 0 weight, not a blank, and changes no figure."""
    setup = Wire(np.array(NODES), "recorded", hidden_size=64, dispatch_bytes=1, combine_bytes=2,
                 max_nodes=max_nodes)
    with Store(root) as store:
        report = traffic_report(store, "t", read_placement(placement_file), setup, window)
    expected = brute_force(root, LAYOUT, "recorded", window, None, max_nodes=max_nodes)
    for row in report.layers.itertuples():
        f = expected[(row.layer, None if window is None else int(row.window_start))]
        lim, tokens, forwards = f["limited"], f["tokens"], len(f["steps"])
        sends = lim["matrix"] - np.diag(np.diag(lim["matrix"]))
        assert row.limited_rule == "kept-weights approximation (no router logits stored)"
        assert row.limited_remote_ranks_mean == pytest.approx(lim["rr"] / tokens)
        assert row.limited_remote_nodes_mean == pytest.approx(lim["rn"] / tokens)
        assert list(row.limited_remote_ranks_histogram) == histogram(lim["rr_hist"], 3)
        assert list(row.limited_remote_nodes_histogram) == histogram(lim["rn_hist"], 2)
        np.testing.assert_array_equal(row.limited_rank_matrix, lim["matrix"])
        assert row.limited_gpu_sends == sends.sum() and row.limited_rdma_sends == lim["rn"]
        assert row.limited_intra_node_share == pytest.approx((sends[0, 1] + sends[1, 0]) / sends.sum())
        assert row.limited_busiest_link_tokens == sends.max()
        assert sends[row.limited_busiest_link] == sends.max()
        assert row.limited_dispatch_bytes_per_forward == pytest.approx(sends.sum() * (64 + 4) / forwards)  # fp8 + scale
        assert row.limited_combine_bytes_per_forward == pytest.approx(sends.sum() * 64 * 2 / forwards)
        assert row.limited_rdma_combine_bytes_per_forward == pytest.approx(lim["rn"] * 64 * 2 / forwards)
        if max_nodes == 2:  # two nodes: nothing to limit
            assert row.limited_changed_share == 0 and row.limited_moved_weight_changed == 0.0
            assert row.limited_remote_ranks_mean == row.remote_ranks_mean
            np.testing.assert_array_equal(row.limited_rank_matrix, row.rank_matrix)
        else:
            assert row.limited_remote_nodes_mean < row.remote_nodes_mean


@pytest.mark.parametrize("window,phase", [(None, None), (2, "b")])
def test_node_limited_moved_weight_of_the_changed_tokens_is_over_those_tokens(root, placement_file, window, phase):
    """limited_moved_weight_changed (what the command prints as "moving N% of their top-k weight") is the
    weight moved off the tokens whose routing changes, over those tokens only; limited_moved_weight
    spreads the same weight over every token (issue 46 part 6)."""
    setup = Wire(np.array(NODES), "recorded", max_nodes=1)
    with Store(root) as store:
        report = traffic_report(store, "t", read_placement(placement_file), setup, window,
                                None if phase is None else {"phase": phase})
    expected = brute_force(root, LAYOUT, "recorded", window, phase, max_nodes=1)
    for row in report.layers.itertuples():
        f = expected[(row.layer, None if window is None else int(row.window_start))]
        assert 0 < f["changed"] < f["tokens"]  # per changed token and per token differ here
        assert row.limited_moved_weight_changed == pytest.approx(f["moved"] / f["changed"], rel=1e-5)
        assert row.limited_moved_weight == pytest.approx(f["moved"] / f["tokens"], rel=1e-5)


def test_the_command_prints_the_moved_weight_of_the_changed_tokens(root, placement_file, capsys):
    assert main(["traffic", root, "--placement", placement_file, "--nodes", "2,1", "--max-nodes", "1"]) == 0
    out = capsys.readouterr().out
    f = brute_force(root, LAYOUT, "recorded", None, None, max_nodes=1)[(0, None)]
    assert (f"{100 * f['changed'] / f['tokens']:.1f}% of tokens would change, moving "
            f"{100 * f['moved'] / f['changed']:.1f}% of their top-k weight; under it:") in out, out
    lim = f["limited"]
    under = out.split("under it:\n")[1].splitlines()
    assert under[0].startswith(f"    remote ranks per token {lim['rr'] / f['tokens']:.2f}   "
                               f"remote nodes per token {lim['rn'] / f['tokens']:.2f}"), under
    ranks_hist = " ".join(f"{n}:{c:,}" for n, c in sorted(lim["rr_hist"].items()))
    nodes_hist = " ".join(f"{n}:{c:,}" for n, c in sorted(lim["rn_hist"].items()))
    assert under[1] == f"    tokens by remote ranks  {ranks_hist}   by remote nodes  {nodes_hist}"
    assert "(kept-weights approximation (no router logits stored))" in out


def coselection_fit(root: str, layer: int, start: int, end: int) -> list[list[int]]:
    """The co-selection layout on 3 ranks fitted on the raw layer_steps rows of steps start..end-1."""
    from moescope.metrics.traffic import coselection_layout

    counts = np.zeros((EXPERTS, EXPERTS))
    for row in read_table(open_location(root), "layer_steps").to_pylist():
        if row["layer"] == layer and start <= row["step"] < end:
            counts += np.asarray(row["coselection"], dtype=float).reshape(EXPERTS, EXPERTS)
    return coselection_layout(counts, np.diag(counts), np.array([2, 2, 2]), np.array(NODES))


def test_the_coselection_placement_is_fitted_on_each_window_and_scored_on_the_next(root):
    setup = Wire(np.array(NODES), "recorded")
    with Store(root) as store:
        frame, latest = coselection_by_window(store, "t", Placement.contiguous(3), setup, 2)
    assert sorted(set(zip(frame.window_start, frame.fit_start))) == [(2, 0), (4, 2)]
    assert len(frame) == 2 * LAYERS
    for row in frame.itertuples():
        per_rank = coselection_fit(root, row.layer, row.fit_start, row.fit_start + 2)
        f = brute_force(root, per_rank, "recorded", 2, None)[(row.layer, row.window_start)]
        assert row.tokens == f["tokens"]
        assert row.remote_ranks_mean == pytest.approx(f["rr"] / f["tokens"])
        np.testing.assert_array_equal(row.rank_matrix, f["matrix"])
    for layer in range(LAYERS):  # the one to deploy next: fitted on the last window
        assert [sorted(r) for r in latest.rank_experts(layer, EXPERTS)] == \
            [sorted(r) for r in coselection_fit(root, layer, 4, 6)]


@pytest.mark.parametrize("name", ["coselection.yaml", "coselection.json"])
def test_the_exported_coselection_map_reads_back(root, tmp_path, capsys, name):
    path = str(tmp_path / name)
    assert main(["traffic", root, "--ranks", "3", "--nodes", "2,1", "--compare", "coselection", "--window", "2",
                 "--export", path]) == 0
    out = capsys.readouterr().out
    assert "co-selection placement fitted on each window, scored on the next" in out
    assert f"wrote the co-selection placement to {path}" in out
    exported = read_placement(path)
    for layer in range(LAYERS):
        assert [sorted(r) for r in exported.rank_experts(layer, EXPERTS)] == \
            [sorted(r) for r in coselection_fit(root, layer, 4, 6)]
    assert main(["placement", root, "--placement", path]) == 0  # the placement command reads it back
    assert f"3 ranks ({name})" in capsys.readouterr().out
    with Store(root) as store:  # and the traffic under it is the exported map's
        again = traffic_report(store, "t", read_placement(path), Wire(np.array(NODES), "recorded")).layers
    per_rank = coselection_fit(root, 0, 4, 6)
    assert again.remote_ranks_mean.iloc[0] == pytest.approx(
        brute_force(root, per_rank, "recorded", None, None)[(0, None)]["rr"] / again.tokens.iloc[0])


def test_an_fp8_dispatch_leaves_the_combine_in_bf16(root, placement_file, capsys):
    code = main(["traffic", root, "--placement", placement_file, "--nodes", "2,1", "--hidden-size", "4096",
                 "--dispatch-bytes", "1"])
    out = capsys.readouterr().out
    assert code == 0
    with Store(root) as store:
        row = traffic_report(store, "t", read_placement(placement_file),
                             Wire(np.array(NODES), "recorded")).layers.iloc[0]
    # DeepEP: 4096 fp8 bytes and 32 float32 scales a token out; 4096 bf16 elements back
    dispatch, combine = row.gpu_sends * (4096 + 32 * 4) / row.forwards, row.gpu_sends * 4096 * 2 / row.forwards
    assert f"per forward: dispatch {bytes_text(dispatch)}, combine {bytes_text(combine)}" in out


@pytest.mark.parametrize("window", [None, 2])
def test_low_latency_mode_sends_once_per_remote_slot(root, placement_file, window):
    # DeepEP's low-latency kernels (internode_ll.cu) put one message per top-k slot: two of a token's
    # experts on one remote GPU are two sends, and a slot on another node is an RDMA message of its own
    setup = Wire(np.array(NODES), "recorded", hidden_size=64, dispatch_bytes=2, combine_bytes=2, mode="low-latency")
    with Store(root) as store:
        report = traffic_report(store, "t", read_placement(placement_file), setup, window)
        normal = traffic_report(store, "t", read_placement(placement_file), Wire(np.array(NODES), "recorded"),
                                window)
    expected: dict = {}
    for row in read_table(open_location(root), "routes").to_pylist():
        key = (row["layer"], None if window is None else row["step"] // window * window)
        f = expected.setdefault(key, dict(matrix=np.zeros((3, 3), int), rdma=0, steps=set()))
        f["steps"].add(row["step"])
        for expert, kept in zip(row["expert_ids"], row["kept"]):
            if kept:
                dest = serving(LAYOUT, row["rank"], expert)
                f["matrix"][row["rank"], dest] += 1
                f["rdma"] += NODES[dest] != NODES[row["rank"]]
    assert report.mode == "low-latency" and len(report.layers) == len(expected)
    more = 0
    for row, plain in zip(report.layers.itertuples(), normal.layers.itertuples()):
        f = expected[(row.layer, None if window is None else int(row.window_start))]
        sends = f["matrix"] - np.diag(np.diag(f["matrix"]))
        np.testing.assert_array_equal(row.rank_matrix, f["matrix"])
        assert row.gpu_sends == sends.sum() and row.rdma_sends == f["rdma"]
        assert row.intra_node_share == pytest.approx((sends[0, 1] + sends[1, 0]) / sends.sum())
        assert row.dispatch_bytes_per_forward == pytest.approx(sends.sum() * 64 * 2 / len(f["steps"]))
        assert row.rdma_combine_bytes_per_forward == pytest.approx(f["rdma"] * 64 * 2 / len(f["steps"]))
        # the per-token fan-out is the mode's to leave alone
        assert row.remote_ranks_mean == plain.remote_ranks_mean and row.tokens == plain.tokens
        assert row.gpu_sends >= plain.gpu_sends and row.rdma_sends >= plain.rdma_sends
        more += row.gpu_sends > plain.gpu_sends
    assert more  # the routes put two slots of a token on one remote GPU somewhere


def test_the_command_counts_in_the_mode_asked(root, placement_file, capsys):
    assert main(["traffic", root, "--placement", placement_file, "--nodes", "2,1", "--mode", "low-latency"]) == 0
    out = capsys.readouterr().out
    with Store(root) as store:
        row = traffic_report(store, "t", read_placement(placement_file),
                             Wire(np.array(NODES), "recorded", mode="low-latency")).layers.iloc[0]
    assert "sends: DeepEP low-latency (one per remote top-k slot)" in out
    assert f"GPU sends {row.gpu_sends:,}, RDMA sends {row.rdma_sends:,}" in out
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        Wire(np.array(NODES), mode="fast")
