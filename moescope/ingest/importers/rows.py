"""The writing pass of an import: steps, in pieces, into the rows of the tables the probe writes.

`TableBuilder` takes the pieces of a stream in order. Routes go out in parts of about
`ROUTE_ROWS_PER_PART` rows as they come; a step's `steps` and `layer_steps` rows go out once its
last piece is in (loads and co-selection summed over its pieces). So memory holds one part of
routes and the sums of the step in progress, never a whole file.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa

from moescope.ingest.importers.source import LayerShape, RunSpec, SourceStep
from moescope.store.schema import (
    SCHEMAS,
    TAGS,
    LogprobPiece,
    RoutePiece,
    engine_logprobs_table,
    routes_table,
    table_from_columns,
)

# The probe's limit for co-selection (E x E counts per layer and step), kept for imports too.
COSELECTION_MAX_EXPERTS = 64
ROUTE_ROWS_PER_PART = 1 << 20
LAYER_ROWS_PER_PART = 4096


def coselection(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """(E, E) int64 tokens that chose both i and j (diagonal: tokens per expert), as the probe counts.

    Counts the k x k pairs of each token (top-k ids of a token are distinct), so the cost is
    tokens x k^2, not the tokens x E^2 of a one-hot product.
    """
    ids = ids.astype(np.int64, copy=False)
    pairs = (ids[:, :, None] * num_experts + ids[:, None, :]).reshape(-1)
    return np.bincount(pairs, minlength=num_experts * num_experts).reshape(num_experts, num_experts)


class _StepSums:
    """The step in progress: its loads, co-selection and tokens per layer, summed over its pieces."""

    def __init__(self, piece: SourceStep, tags: dict[str, str]):
        self.key = piece.key()
        self.step, self.rank, self.ts, self.tags = piece.step, piece.rank, piece.ts, tags
        self.load: dict[int, np.ndarray] = {}
        self.cosel: dict[int, np.ndarray | None] = {}
        self.tokens: dict[int, int] = {}
        self.sequences: set[int] = set()
        self.longest = 0
        self.routed = False

    def add(self, piece: SourceStep, shapes: dict[int, LayerShape]) -> None:
        self.ts = min(self.ts, piece.ts)
        for layer, routes in piece.routes.items():
            shape = shapes[layer]
            ids = routes.expert_ids
            self.routed = True
            self._sum(layer, np.bincount(ids.reshape(-1), minlength=shape.num_experts), len(ids))
            if shape.top_k > 1 and shape.num_experts <= COSELECTION_MAX_EXPERTS:
                cosel = coselection(ids, shape.num_experts)
                self.cosel[layer] = cosel if self.cosel.get(layer) is None else self.cosel[layer] + cosel
            else:
                self.cosel[layer] = None
            if len(ids):
                self.sequences.update(np.unique(routes.sequence).tolist())
                self.longest = max(self.longest, int(routes.position.max()) + 1)
        for layer, counts in piece.counts.items():
            if layer in shapes:  # counted layers zero throughout (dense) have no shape
                self._sum(layer, counts.astype(np.int64), None)
                self.cosel[layer] = None

    def _sum(self, layer: int, load: np.ndarray, tokens: int | None) -> None:
        load = load.astype(np.int64, copy=False)
        self.load[layer] = self.load[layer] + load if layer in self.load else load
        if tokens is not None:
            self.tokens[layer] = self.tokens.get(layer, 0) + tokens


class TableBuilder:
    """Pieces in, (table, rows) out: `add` each piece in stream order, then `finish`."""

    def __init__(self, spec: RunSpec, shapes: dict[int, LayerShape], route_rows: int | None = None,
                 layer_rows: int | None = None):
        self.spec, self.shapes = spec, shapes
        self.route_rows, self.layer_rows = route_rows or ROUTE_ROWS_PER_PART, layer_rows or LAYER_ROWS_PER_PART
        self._current: _StepSums | None = None
        self._pieces: list[RoutePiece] = []
        self._logprobs: list[LogprobPiece] = []
        self._pending_routes = 0
        self._steps: list[dict] = []
        self._layer_steps: list[dict] = []

    def add(self, piece: SourceStep) -> Iterator[tuple[str, pa.Table]]:
        """Take one piece; yield the parts that are full."""
        tags = {**self.spec.tags, **piece.tags}
        if self._current is None or self._current.key != piece.key():
            yield from self._close_step()
            self._current = _StepSums(piece, tags)
        self._current.add(piece, self.shapes)
        for layer, routes in piece.routes.items():
            if len(routes.expert_ids):
                self._pieces.append(RoutePiece(piece.step, layer, tags, routes, piece.rank))
                self._pending_routes += len(routes.expert_ids)
        for seq in piece.logprobs:
            self._logprobs.append(LogprobPiece(piece.step, seq.sequence, seq.first_position, seq.logprob,
                                               seq.token_ids, piece.rank))
            self._pending_routes += len(seq.logprob)
        if self._pending_routes >= self.route_rows:
            yield from self._flush_routes()

    def finish(self) -> Iterator[tuple[str, pa.Table]]:
        """Yield everything left."""
        yield from self._close_step()
        yield from self._flush_routes()
        yield from self._flush_steps()

    def _flush_routes(self) -> Iterator[tuple[str, pa.Table]]:
        if self._pieces:
            pieces, self._pieces, self._pending_routes = self._pieces, [], 0
            yield "routes", routes_table(self.spec.run_id, pieces)
        if self._logprobs:
            logprobs, self._logprobs, self._pending_routes = self._logprobs, [], 0
            yield "engine_logprobs", engine_logprobs_table(self.spec.run_id, logprobs)

    def _close_step(self) -> Iterator[tuple[str, pa.Table]]:
        step, self._current = self._current, None
        if step is None:
            return
        busiest = 0
        for layer in sorted(step.load):
            load = step.load[layer]
            tokens = step.tokens.get(layer)
            if tokens is None:  # counted: slots / top-k
                tokens = int(round(int(load.sum()) / self.shapes[layer].top_k))
            busiest = max(busiest, tokens)
            self._layer_steps.append({"step": step.step, "ts": step.ts, "layer": layer, "tokens": tokens,
                                      "expert_load": load, "coselection": step.cosel.get(layer),
                                      "tags": step.tags, "rank": step.rank})
        # every token runs every MoE layer, so the forward's tokens are its busiest layer's
        self._steps.append({"step": step.step, "ts": step.ts, "tokens": busiest,
                            "batch_size": len(step.sequences) if step.routed else None,
                            "seq_len": step.longest if step.routed else None, "tags": step.tags, "rank": step.rank})
        if len(self._layer_steps) >= self.layer_rows:
            yield from self._flush_steps()

    def _flush_steps(self) -> Iterator[tuple[str, pa.Table]]:
        steps, self._steps = self._steps, []
        layer_steps, self._layer_steps = self._layer_steps, []
        run = self.spec.run_id
        if steps:
            n = len(steps)
            yield "steps", table_from_columns("steps", {
                "run_id": pa.repeat(pa.scalar(run, pa.string()), n),
                "step": pa.array([s["step"] for s in steps], pa.int64()),
                "ts": pa.array([s["ts"] for s in steps], SCHEMAS["steps"].field("ts").type),
                "tokens": pa.array([s["tokens"] for s in steps], pa.int64()),
                "batch_size": pa.array([s["batch_size"] for s in steps], pa.int32()),
                "seq_len": pa.array([s["seq_len"] for s in steps], pa.int32()),
                "tags": tag_column([s["tags"] for s in steps]),
                "rank": pa.array([s["rank"] for s in steps], pa.int32()),
            }, n)
        if layer_steps:
            m = len(layer_steps)
            yield "layer_steps", table_from_columns("layer_steps", {
                "run_id": pa.repeat(pa.scalar(run, pa.string()), m),
                "step": pa.array([r["step"] for r in layer_steps], pa.int64()),
                "ts": pa.array([r["ts"] for r in layer_steps], SCHEMAS["layer_steps"].field("ts").type),
                "layer": pa.array([r["layer"] for r in layer_steps], pa.int32()),
                "tokens": pa.array([r["tokens"] for r in layer_steps], pa.int64()),
                "expert_load": _list_column([r["expert_load"] for r in layer_steps], pa.int64()),
                "coselection": _list_column([None if r["coselection"] is None else r["coselection"].reshape(-1)
                                             for r in layer_steps], pa.int64()),
                "tags": tag_column([r["tags"] for r in layer_steps]),
                "rank": pa.array([r["rank"] for r in layer_steps], pa.int32()),
            }, m)


def build_step_tables(steps: Iterable[SourceStep], spec: RunSpec, shapes: dict[int, LayerShape]) -> dict[str, pa.Table]:
    """The steps, layer_steps and routes rows of `steps` (checked first), as one table each."""
    builder = TableBuilder(spec, shapes, route_rows=1 << 62, layer_rows=1 << 62)
    parts: dict[str, list[pa.Table]] = {}
    for step in steps:
        for table, rows in builder.add(step):
            parts.setdefault(table, []).append(rows)
    for table, rows in builder.finish():
        parts.setdefault(table, []).append(rows)
    return {table: pa.concat_tables(tables) for table, tables in parts.items()}


def tag_column(tag_sets: list[dict[str, str]]) -> pa.Array:
    unique: dict[tuple, int] = {}
    index = [unique.setdefault(tuple(sorted(t.items())), len(unique)) for t in tag_sets]
    return pa.array([list(t) for t in unique], type=TAGS).take(pa.array(index, pa.int32()))


def _list_column(values: list[np.ndarray | None], type_: pa.DataType) -> pa.Array:
    return pa.array([None if v is None else v.tolist() for v in values], type=pa.list_(type_))
