"""The placement value: its layouts and shares against hand counts, each layer's shares computed once
and shared by every reader, and the per-layer view the rules engine and the exporter read (None and
one warning where a placement does not fit a layer)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from moescope.metrics import placement as placement_module
from moescope.metrics.placement import LayerPlacements, Placement, PlacementError, parse_placement, wire_layout
from moescope.metrics.traffic import default_rank_node


def test_sglang_map_slots_are_contiguous_per_rank():
    placement = Placement.from_physical_to_logical(np.array([[0, 1, 2, 3, 3, 0]]), 3, source="dump.pt")
    assert placement.rank_experts(0, 4) == ((0, 1), (2, 3), (3, 0))
    np.testing.assert_allclose(placement.shares(0, 4), [[.5, 0, .5], [1, 0, 0], [0, 1, 0], [0, .5, .5]])
    with pytest.raises(PlacementError, match="do not split evenly over 4 ranks"):
        Placement.from_physical_to_logical(np.zeros((1, 6), dtype=int), 4, source="dump.pt")


def test_the_default_layout_gives_the_first_ranks_one_expert_more():
    # vLLM's determine_expert_map: 10 experts on 4 ranks are 3, 3, 2, 2 contiguous experts
    placement = Placement.contiguous(4)
    assert placement.rank_experts(5, 10) == ((0, 1, 2), (3, 4, 5), (6, 7), (8, 9))
    slot_rank, slot_expert = placement.slots(5, 10)
    assert slot_rank.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3] and slot_expert.tolist() == list(range(10))


def test_a_document_in_an_engines_shape_is_parsed_per_rank():
    document = {"physical_to_logical_map": [[0, 1, 2, 3, 3, 0], [3, 2, 1, 0, 0, 1]], "ranks": 3}
    placement = parse_placement(document, "eplb_map.json").on_layers([0, 1])
    assert placement.rank_experts(1, 4) == ((3, 2), (1, 0), (0, 1))
    assert placement.document()["layers"]["1"] == [[3, 2], [1, 0], [0, 1]]
    with pytest.raises(PlacementError, match="give --ranks R"):
        parse_placement({"physical_to_logical_map": [[0, 1]]}, "map.json")


def test_a_vllm_map_has_a_row_per_moe_layer():
    # vLLM's EplbState.physical_to_logical_map is [num_moe_layers, physical]: on a model whose first
    # three layers are dense (DeepSeek-V3), row 0 is layer 3
    rows = [[0, 1, 2, 3], [3, 2, 1, 0], [1, 0, 3, 2]]
    unplaced = parse_placement({"physical_to_logical_map": rows, "ranks": 2}, "eplb_map.json")
    with pytest.raises(PlacementError, match="place them on a run's MoE layers first"):
        unplaced.rank_experts(0, 4)
    placed = unplaced.on_layers([5, 3, 4])
    assert {layer: placed.rank_experts(layer, 4) for layer in (3, 4, 5)} == {
        3: ((0, 1), (2, 3)), 4: ((3, 2), (1, 0)), 5: ((1, 0), (3, 2))}
    assert placed.rank_experts(0, 4) == ((0, 1), (2, 3))  # a layer not in the map: the contiguous layout
    # SGLang's map has a row for every layer, dense ones included: row i is layer i
    sglang = parse_placement({"physical_to_logical_map": [[0, 1, 2, 3]] * 3 + rows, "ranks": 2}, "map.json")
    assert sglang.on_layers([3, 4, 5]).rank_experts(4, 4) == ((3, 2), (1, 0))
    with pytest.raises(PlacementError, match="the map has 3 rows, but the run has 2 MoE layers"):
        unplaced.on_layers([3, 4])
    assert Placement.contiguous(2).on_layers([3]) == Placement.contiguous(2)


def test_each_layers_shares_are_computed_once_and_read_only(monkeypatch):
    calls = []
    real = placement_module.replica_shares

    def counting(*args, **kwargs):
        calls.append(args[:2])
        return real(*args, **kwargs)

    monkeypatch.setattr(placement_module, "replica_shares", counting)
    placement = Placement(2, default=((0, 1), (2, 3, 3)), source="p.yaml")
    first = placement.shares(0, 4)
    assert placement.shares(0, 4) is first and len(calls) == 1
    np.testing.assert_allclose(first, [[1, 0], [1, 0], [0, 1], [0, 1]])
    with pytest.raises(ValueError, match="read-only"):
        first[0, 0] = 0.5
    placement.shares(1, 4)
    placement.shares(0, 4, "local")
    assert len(calls) == 3  # another layer, another split: their own shares
    # a layer the placement does not fit raises each time, with the same message, computed once
    for _ in range(2):
        with pytest.raises(PlacementError, match=r"p\.yaml, layer 0 \(5 experts\).*expert\(s\) 4 have no slot"):
            placement.shares(0, 5)
    assert len(calls) == 4


def test_layer_placements_give_none_and_warn_once_where_the_placement_does_not_fit(caplog):
    placement = Placement(2, default=((0, 1), (2, 3)), source="p.yaml")
    layers = LayerPlacements(placement)
    assert layers.shares(3, 4) is placement.shares(3, 4)  # the value's own: one cache for every reader
    with caplog.at_level(logging.WARNING, logger="moescope.metrics.placement"):
        for _ in range(3):
            assert layers.shares(3, 6) is None and layers.wire(3, 6) is None
    assert len(caplog.records) == 1 and "layer 3" in caplog.text and "6 experts" in caplog.text


def test_the_wire_layout_is_the_placements_slots_in_its_nodes():
    placement = Placement(4, default=((0, 1), (2, 7), (3, 4), (5, 6, 7)), source="p.yaml")
    layout = LayerPlacements(placement, np.array([0, 0, 1, 1])).wire(2, 8)
    assert layout is not None
    assert layout.slot_rank.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 3]
    assert layout.slot_expert.tolist() == [0, 1, 2, 7, 3, 4, 5, 6, 7]
    assert layout.rank_node.tolist() == [0, 0, 1, 1]
    assert LayerPlacements(placement).rank_node.tolist() == default_rank_node(4).tolist()
    with pytest.raises(PlacementError, match="the nodes hold 3 ranks"):
        wire_layout(placement, 2, 8, np.array([0, 0, 1]))
