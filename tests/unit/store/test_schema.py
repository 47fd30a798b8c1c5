"""store.schema's one builder of route rows (`routes_table`), against a plain loop over the pieces' arrays."""

from __future__ import annotations

import dataclasses
import datetime as dt
from types import SimpleNamespace

import numpy as np
import pytest

from moescope.core.records import LayerInfo, RunInfo
from moescope.store.schema import SCHEMAS, LayerRow, RoutePiece, layers_table, routes_table, run_tables, runs_table


def _piece(rng: np.random.Generator, step: int, layer: int, tokens: int, k: int, *, window: bool = False,
           missing: tuple[str, ...] = (), tags: dict | None = None, rank: int = 0) -> RoutePiece:
    routes = SimpleNamespace(
        expert_ids=rng.integers(0, 64, (tokens, k)).astype(np.int64),
        gate_weights=rng.random((tokens, k)).astype(np.float32), kept=rng.random((tokens, k)) < 0.9,
        token_ids=rng.integers(0, 32_000, tokens), sequence=(np.arange(tokens) // 4).astype(np.int32),
        position=(np.arange(tokens) % 4).astype(np.int32),
        step=rng.integers(step, step + 3, tokens) if window else None,
        token=rng.permutation(tokens) if window else None)
    for name in missing:
        setattr(routes, name, None)
    return RoutePiece(step, layer, tags if tags is not None else {"split": "train"}, routes, rank)


def _rows_by_loop(run_id: str, pieces: list[RoutePiece]) -> list[dict]:
    rows = []
    for piece in pieces:
        r = piece.routes
        for i in range(len(r.expert_ids)):
            rows.append(dict(
                run_id=run_id, step=int(r.step[i]) if r.step is not None else piece.step, layer=piece.layer,
                token=int(r.token[i]) if r.token is not None else i, sequence=int(r.sequence[i]),
                position=int(r.position[i]), token_id=int(r.token_ids[i]) if r.token_ids is not None else None,
                expert_ids=[int(e) for e in r.expert_ids[i]],
                gate_weights=[float(w) for w in r.gate_weights[i]] if r.gate_weights is not None else None,
                kept=[bool(b) for b in r.kept[i]] if r.kept is not None else None,
                tags=sorted(piece.tags.items()), rank=piece.rank))
    return rows


@pytest.mark.parametrize("case", ["one forward per piece", "windows and gaps"])
def test_route_rows_are_the_pieces_rows_in_order(case):
    rng = np.random.default_rng(3)
    if case == "one forward per piece":  # the probe's flush: same k, every field, a tag set per step
        pieces = [_piece(rng, step, layer, 16, 2, tags={"split": "eval" if step % 2 else "train"})
                  for step in range(3) for layer in range(4)]
    else:  # windows (their own step and token numbers), another k, fields a source lacks, empty pieces, ranks
        pieces = [_piece(rng, 0, 0, 8, 2, window=True), _piece(rng, 1, 0, 0, 2),
                  _piece(rng, 1, 1, 5, 8, missing=("gate_weights", "token_ids"), tags={}),
                  _piece(rng, 2, 1, 7, 1, missing=("kept",), rank=3),
                  _piece(rng, 3, 0, 6, 2, window=True, tags={"b": "2", "a": "1"})]
    table = routes_table("run-1", pieces)
    assert table.schema == SCHEMAS["routes"]
    assert table.to_pylist() == _rows_by_loop("run-1", pieces)


# -- a run's own rows: one builder for every source ------------------------------------------------

STARTED = dt.datetime(2026, 12, 7, 9, 30, 0, 123_456, tzinfo=dt.timezone.utc)


def _run_row(rank: int, **values) -> dict:
    row = dict(run_id="r", started_at=STARTED, model_class="M", total_params=None, routed_expert_params=None,
               tags=[], rank=rank, world_size=1, source="probe", host=None)
    row.update(values)
    return row


def test_a_probe_run_is_its_runs_row_and_a_layers_row_per_layer():
    run = RunInfo(run_id="r", started_at=STARTED, model_class="M", total_params=1000, routed_expert_params=640,
                  tags={"job": "a", "step": "3"}, rank=1, world_size=4, host="node-7", layers=(
                      LayerInfo(layer=0, module="model.layers.0.mlp", family="mixtral", num_experts=8, top_k=2,
                                params_per_expert=40),
                      LayerInfo(layer=1, module="model.layers.1.mlp", family="mixtral", num_experts=8, top_k=2,
                                params_per_expert=40, zero_experts=2, expert_capacity=64)))
    tables = run_tables(run)
    assert tables["runs"].to_pylist() == [_run_row(1, total_params=1000, routed_expert_params=640,
                                                   tags=[("job", "a"), ("step", "3")], world_size=4, host="node-7")]
    assert tables["layers"].to_pylist() == [
        dict(run_id="r", layer=0, module="model.layers.0.mlp", family="mixtral", num_experts=8, zero_experts=0,
             top_k=2, params_per_expert=40, expert_capacity=None, rank=1),
        dict(run_id="r", layer=1, module="model.layers.1.mlp", family="mixtral", num_experts=8, zero_experts=2,
             top_k=2, params_per_expert=40, expert_capacity=64, rank=1)]
    assert run_tables(run, "jitter")["runs"].to_pylist()[0]["source"] == "jitter"
    assert set(run_tables(dataclasses.replace(run, layers=()))) == {"runs"}  # no layers: no layers rows


def test_an_imported_run_has_a_runs_row_per_rank_and_nulls_for_what_the_engine_does_not_say():
    runs = runs_table("r", STARTED, "M", "trtllm", tags={"pool": "a"}, ranks=[0, 2])
    assert runs.schema == SCHEMAS["runs"]
    assert runs.to_pylist() == [_run_row(rank, tags=[("pool", "a")], world_size=3, source="trtllm")
                                for rank in (0, 2)]
    layers = layers_table("r", [LayerRow(3, "trtllm layer 3", "trtllm", 16, 4), LayerRow(5, "x", "trtllm", 8, 1)],
                          ranks=[0, 2])
    assert layers.schema == SCHEMAS["layers"]
    assert [(row["rank"], row["layer"], row["num_experts"], row["top_k"], row["zero_experts"],
             row["params_per_expert"], row["expert_capacity"]) for row in layers.to_pylist()] == [
        (0, 3, 16, 4, 0, None, None), (0, 5, 8, 1, 0, None, None),
        (2, 3, 16, 4, 0, None, None), (2, 5, 8, 1, 0, None, None)]
