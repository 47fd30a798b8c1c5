"""The per-window placement queries return every row their figure needs: on a store whose
(layer, window, rank) rows pass the row limit `rank_loads` used to end in (320 000), every layer and
every rank of every window is there, checked against a loop over the raw layer_steps rows."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest

from moescope.analyses.placement import placement_report
from moescope.core.records import LayerStep, StepRecord
from moescope.metrics.placement import Placement
from moescope.store import Store
from moescope.store.location import open_location
from moescope.store.writer import ParquetExporter
from tests.support.deltafiles import read_table
from tests.support.store_records import run_info

LAYERS, RANKS, STEPS = 6, 64, 900  # 6 x 64 x 900 = 345 600 (layer, window, rank) rows: past 320 000
OLD_LIMIT = 320_000


def _record(step: int, rng: np.random.Generator) -> StepRecord:
    layers = []
    for layer in range(LAYERS):
        load = rng.integers(1, 40, RANKS).astype(np.int64)  # every expert, so every rank, serves in every window
        layers.append(LayerStep(layer=layer, tokens=int(load.sum()) // 2, expert_load=load,
                                gate_weight_sum=np.zeros(RANKS), router_entropy_mean=1.0, router_entropy_p95=1.0,
                                top1_margin_mean=0.1, dropped_tokens=0, dropped_assignments=0, capacity=None,
                                capacity_use=None, active_params_per_token=1.0))
    return StepRecord(run_id="big", step=step, ts=dt.datetime.now(dt.timezone.utc), duration_s=0.01,
                      tokens=layers[0].tokens, batch_size=1, seq_len=1, active_params=1.0, total_params=1000,
                      layers=layers)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("placement_rows") / "store")
    exporter = ParquetExporter(root, run_info("big", LAYERS, RANKS, top_k=2))
    rng = np.random.default_rng(47)
    exporter.export([_record(step, rng) for step in range(STEPS)])
    exporter.shutdown()
    return root


def raw_loads(root: str) -> dict:
    """{(layer, step): expert loads} from the raw layer_steps rows, read without DuckDB."""
    return {(row["layer"], row["step"]): list(row["expert_load"])
            for row in read_table(open_location(root), "layer_steps").to_pylist()}


def test_rank_loads_keep_every_layer_and_rank_past_the_old_limit(root):
    raw = raw_loads(root)
    assert LAYERS * RANKS * STEPS > OLD_LIMIT and len(raw) == LAYERS * STEPS
    with Store(root) as store:
        report = placement_report(store, "big", Placement.contiguous(RANKS), window_steps=1, tokens=False)
    layers = report.layers
    assert len(layers) == LAYERS * STEPS  # every (layer, window), the highest layers included
    for row in layers.itertuples():
        loads = raw[(row.layer, row.window_start)]
        rank_slots = [0.0] * RANKS  # one expert per rank: rank r serves expert r
        for expert, load in enumerate(loads):
            rank_slots[expert] += load
        np.testing.assert_allclose(row.rank_slots, rank_slots)
        assert row.balancedness == pytest.approx(sum(rank_slots) / RANKS / max(rank_slots))
        assert row.slots == sum(loads)


def test_window_loads_keep_every_layer_window_and_expert(root):
    raw = raw_loads(root)
    window = 3
    expected: dict = {}
    for (layer, step), loads in raw.items():
        for expert, load in enumerate(loads):
            key = (layer, step // window * window, expert)
            expected[key] = expected.get(key, 0) + load
    with Store(root) as store:
        frame = store.window_loads("big", window)
    got = {(int(r.layer), int(r.window_start), int(r.expert)): int(r.load) for r in frame.itertuples()}
    assert got == expected
