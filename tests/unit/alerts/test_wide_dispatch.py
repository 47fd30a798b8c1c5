"""WideExpertDispatch: the default rule on remote ranks per token under a placement, its value (and
the nodes' and intra-node figures) against a plain loop over the window's routes, silent on a
layer whose tokens stay near home and without a placement."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moescope.alerts.engine import AlertEngine
from moescope.alerts.observations import compute_signals, observations_from_record
from moescope.alerts.rules import default_rules
from moescope.core.records import Routes
from moescope.metrics.placement import Placement
from tests.support.alert_records import layer_step, step_record

EXPERTS, RANKS, PER_NODE, TOKENS = 16, 8, 4, 64
WIDE = [0, 2, 4, 6, 8, 10]  # one expert on each of ranks 0..5 (expert e on rank e // 2)
NARROW = [0, 1, 2, 3, 4, 5]  # ranks 0..2


def _layer(layer: int, experts: list[int], rng) -> object:
    ids = np.array([rng.permutation(experts) for _ in range(TOKENS)], dtype=np.int32)
    kept = np.ones(ids.shape, dtype=bool)
    kept[::5, 0] = False  # a few dropped slots run nowhere
    step = layer_step(layer, np.bincount(ids[kept], minlength=EXPERTS))
    routes = Routes(expert_ids=ids, gate_weights=np.full(ids.shape, 1 / 6, dtype=np.float32), kept=kept,
                    token_ids=None, sequence=(np.arange(TOKENS) // 4).astype(np.int32),
                    position=(np.arange(TOKENS) % 4).astype(np.int32))
    return dataclasses.replace(step, tokens=TOKENS, routes=routes)


def _records(steps: int = 40):
    rng = np.random.default_rng(0)
    return [step_record(s, [_layer(0, WIDE, rng), _layer(1, NARROW, rng)]) for s in range(steps)]


def _pack():
    pack = default_rules()
    rule = next(r for r in pack.rules if r.name == "WideExpertDispatch")
    return dataclasses.replace(pack, rules=(dataclasses.replace(rule, for_s=0.0),))


def loop(records, layer: int, steps: int) -> tuple[float, float, float]:
    """Mean remote ranks, remote nodes and the intra-node share of GPU sends over the last `steps`."""
    tokens = ranks = nodes = sends = intra = 0
    for record in records[-steps:]:
        routes = next(ls for ls in record.layers if ls.layer == layer).routes
        for token, (row, keep) in enumerate(zip(routes.expert_ids, routes.kept)):
            home = token % RANKS  # one process recorded it: a row's home is its place in the batch mod R
            dests = {int(e) // 2 for e, k in zip(row, keep) if k} - {home}
            tokens += 1
            ranks += len(dests)
            nodes += len({d // PER_NODE for d in dests} - {home // PER_NODE})
            sends += len(dests)
            intra += sum(d // PER_NODE == home // PER_NODE for d in dests)
    return ranks / tokens, nodes / tokens, intra / sends


def test_wide_dispatch_fires_on_the_layer_whose_tokens_reach_far():
    engine = AlertEngine(_pack(), placement=Placement.contiguous(RANKS))
    engine.rank_node = np.repeat(np.arange(RANKS // PER_NODE), PER_NODE)
    records = _records()
    transitions = [t for r in records for t in engine.ingest(observations_from_record(r))]
    firing = [t for t in transitions if t.state == "firing"]
    assert {t.labels["layer"] for t in firing} == {"0"}
    rule = engine.pack.rules[0]
    for layer in (0, 1):
        window = engine._runs["run-a"].history[layer].window(rule.window)
        values = compute_signals(window, ["remote_ranks_per_token", "remote_nodes_per_token", "intra_node_share"],
                                 wire_layout=engine.wire_layout(layer, window))
        ranks, nodes, intra = loop(records, layer, 32)
        assert values["remote_ranks_per_token"] == pytest.approx(ranks)
        assert values["remote_nodes_per_token"] == pytest.approx(nodes)
        assert values["intra_node_share"] == pytest.approx(intra)
    assert engine.signals(rule, "run-a", 0)["remote_ranks_per_token"] == pytest.approx(loop(records, 0, 32)[0])
    assert loop(records, 1, 32)[0] < 4 < loop(records, 0, 32)[0]


def test_no_placement_is_no_data():
    engine = AlertEngine(_pack())
    assert [t for r in _records(10) for t in engine.ingest(observations_from_record(r))] == []
    assert np.isnan(engine.signals(engine.pack.rules[0], "run-a", 0)["remote_ranks_per_token"])
