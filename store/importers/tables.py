"""What every importer shares: an engine's routing, checked, as the tables the probe writes.

A reader turns an engine's files into `SourceStep`s: per-token routes of each MoE layer where the
engine hands them out, slots per expert where it only counts. `build_tables` checks them all and
derives what the probe derives (tokens per expert, co-selection); drift and switch statistics then
follow from those loads and routes exactly as for a probed run. What an engine cannot give (router
logits, entropy, gate weights, dropped tokens, parameter counts, forward time) is null, never zero,
so a view can say "not recorded by this source". The rows are built by the store's one builder
of each table (`store.schema`), and `write_run` hands them to the run's writer (`store.writer`),
the `runs` row last, so a run appears once all its rows are in place.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from moescope.pipeline import new_run_id
from moescope.store.layout import check_name
from moescope.store.location import StoreLocation, open_location
from moescope.store.schema import SCHEMAS, TAGS, RoutePiece, routes_table, table_from_columns
from moescope.store.text import control_characters
from moescope.store.writer import run_writer

# The probe's limit for co-selection (E x E counts per layer and step), kept for imports too.
COSELECTION_MAX_EXPERTS = 64
_TAG_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
MAX_TAG_VALUE = 256


class SourceFormatError(ValueError):
    """A file is not in the layout its engine documents. Raised before anything is written."""


@dataclass
class LayerRoutes:
    """Per-token routing of one MoE layer in one step, every slot set (no -1 left); the store's
    `routes_table` builds its rows (a `store.schema.RouteRows`: engines give no gate weights or drops)."""

    expert_ids: np.ndarray  # (tokens, k) int32 logical expert ids
    token: np.ndarray  # (tokens,) int32 row of the token in the step as the engine listed it
    sequence: np.ndarray  # (tokens,) int32 request / batch row
    position: np.ndarray  # (tokens,) int32 position in the sequence
    token_ids: np.ndarray | None = None  # (tokens,) int64 input ids where the engine gives them
    gate_weights: None = None  # not in any engine's routing output
    kept: None = None  # nor which slots a capacity limit dropped
    step: None = None  # every row is of its step


@dataclass
class SourceStep:
    """One step of a source: a forward pass, a request, a training iteration or a window of them.

    `routes` holds per-token routes per layer, `counts` slots per expert per layer (sources that
    only count; their tokens are slots / top-k); a layer is in one of the two.
    """

    step: int
    ts: dt.datetime
    rank: int = 0
    tags: dict[str, str] = field(default_factory=dict)
    routes: dict[int, LayerRoutes] = field(default_factory=dict)
    counts: dict[int, np.ndarray] = field(default_factory=dict)


@dataclass
class SourceData:
    """What a reader found: the steps, and what the files say about the model."""

    steps: list[SourceStep]
    model: str | None = None
    num_experts: int | None = None  # where the files state it
    top_k: int | None = None  # where the files state it
    notes: Counter = field(default_factory=Counter)  # what was left out or changed, and how often


@dataclass(frozen=True)
class LayerShape:
    num_experts: int
    top_k: int


@dataclass(frozen=True)
class RunSpec:
    """The run an import or a proxy writes into."""

    run_id: str
    source: str
    model: str
    tags: dict[str, str]
    started_at: dt.datetime
    # the host that recorded the run (the proxy's); None: the writer's, where the import ran (an
    # engine's files do not say which host served them)
    host: str | None = None


def check_tags(tags: dict[str, str]) -> dict[str, str]:
    """Return the tags if every key is a plain name and every value short printable text; raise
    ValueError otherwise (the importers' --tag options and the proxy's tag headers both come here)."""
    for key, value in tags.items():
        if not isinstance(key, str) or not _TAG_KEY.fullmatch(key):
            raise ValueError(f"tag key {key!r} is not allowed: use 1-64 letters, digits, '_', '.' or '-'")
        if not isinstance(value, str) or len(value) > MAX_TAG_VALUE:
            raise ValueError(f"tag {key}: the value must be a string of at most {MAX_TAG_VALUE} characters")
        if found := control_characters(value):
            raise ValueError(f"tag {key}: the value holds control characters ({', '.join(found)}): "
                             f"use printable text")
    return dict(tags)


def parse_tags(pairs: list[str] | None) -> dict[str, str]:
    """`["k=v", ...]` (the --tag options) as a dict; raises ValueError for a pair without '='."""
    tags = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--tag {pair!r}: write it as key=value")
        tags[key.strip()] = value.strip()
    return check_tags(tags)


def file_time(path: str) -> dt.datetime:
    return dt.datetime.fromtimestamp(os.stat(path).st_mtime, dt.timezone.utc)


def split_routed_rows(ids: np.ndarray, where: str) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], int]:
    """Per-layer computed rows of a `(rows, layers, slots)` routing array with -1 for "none".

    A slot that is -1 in every row of a layer is padding (a recorder padded to 8 slots) and goes;
    a layer with no slot set is a dense layer (or never ran) and goes; a row with every slot -1 was
    not computed (a prefix-cache hit) and goes. A row with only some slots set is not a documented
    layout. Returns ({layer: (row numbers, (n, k) int32 ids)}, rows not computed in any layer).
    Raises SourceFormatError for ids below -1 or a partly set row.
    """
    if ids.ndim != 3:
        raise SourceFormatError(f"{where}: routing must be (tokens, layers, top_k), got shape {ids.shape}")
    ids = ids.astype(np.int64, copy=False)
    if ids.size and ids.min() < -1:
        raise SourceFormatError(f"{where}: expert id {int(ids.min())} is negative (only -1 means 'none')")
    valid = ids >= 0
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    computed_any = np.zeros(ids.shape[0], dtype=bool)
    for layer in range(ids.shape[1]):
        used = valid[:, layer, :]
        slots = used.any(axis=0)
        if not slots.any():
            continue
        used = used[:, slots]
        rows = used.any(axis=1)
        partial = rows & ~used.all(axis=1)
        if partial.any():
            row = int(np.flatnonzero(partial)[0])
            raise SourceFormatError(
                f"{where}: token row {row} of layer {layer} has {int(used[row].sum())} of {used.shape[1]} "
                "expert slots set and -1 in the others; a token is either routed in every slot or not "
                "computed (all -1)")
        computed_any |= rows
        index = np.flatnonzero(rows)
        out[layer] = (index, ids[index][:, layer][:, slots].astype(np.int32))
    return out, int(np.count_nonzero(~computed_any))


# -- checking ------------------------------------------------------------------------------------

def layer_shapes(data: SourceData, num_experts: int | None = None, top_k: int | None = None,
                 where: str = "the source") -> dict[int, LayerShape]:
    """Experts and top-k of every layer the steps hold, checked against the ids and the options.

    Experts: `num_experts` if given, else what the files state, else the largest id seen + 1 (an
    expert never chosen above it would be missed; pass --num-experts to be exact). Raises
    SourceFormatError when an id is out of range, a count vector has the wrong length, top-k
    differs between steps of a layer, or counted layers have no top-k to turn slots into tokens.
    """
    stated = num_experts if num_experts is not None else data.num_experts
    if stated is not None and stated < 1:
        raise ValueError(f"the number of experts must be positive, not {stated}")
    k_stated = top_k if top_k is not None else data.top_k
    widths: dict[int, int] = {}
    largest: dict[int, int] = {}
    counted: dict[int, int] = {}
    for step in data.steps:
        for layer, routes in step.routes.items():
            k = routes.expert_ids.shape[1]
            if widths.setdefault(layer, k) != k:
                raise SourceFormatError(f"{where}: layer {layer} routes {widths[layer]} experts per token in one "
                                        f"step and {k} in step {step.step}; top-k must not change within a run")
            if len(routes.expert_ids):
                largest[layer] = max(largest.get(layer, -1), int(routes.expert_ids.max()))
                ordered = np.sort(routes.expert_ids, axis=1)
                if (ordered[:, 1:] == ordered[:, :-1]).any():
                    raise SourceFormatError(f"{where}: a token of layer {layer} in step {step.step} chose the same "
                                            "expert twice; top-k ids of a token are distinct")
        for layer, counts in step.counts.items():
            if counts.ndim != 1 or (counts.size and counts.min() < 0):
                raise SourceFormatError(f"{where}: the counts of layer {layer} in step {step.step} must be a "
                                        "vector of non-negative integers")
            if counted.setdefault(layer, len(counts)) != len(counts):
                raise SourceFormatError(f"{where}: layer {layer} counts {counted[layer]} experts in one step and "
                                        f"{len(counts)} in step {step.step}")
    if set(widths) & set(counted):
        raise SourceFormatError(f"{where}: layers {sorted(set(widths) & set(counted))} have both routes and "
                                "counts; one source gives one or the other")
    if counted and k_stated is None:
        raise ValueError(f"{where} counts expert slots but does not say how many experts each token chose: "
                         "pass --top-k (the model's num_experts_per_tok) so tokens can be counted")
    if k_stated is not None and k_stated < 1:
        raise ValueError(f"top-k must be positive, not {k_stated}")
    shapes: dict[int, LayerShape] = {}
    for layer in sorted(widths):
        if k_stated is not None and widths[layer] != k_stated:
            raise SourceFormatError(f"{where}: layer {layer} routes {widths[layer]} experts per token, but top-k "
                                    f"is {k_stated}")
        experts = stated if stated is not None else largest.get(layer, -1) + 1
        if largest.get(layer, -1) >= experts:
            raise SourceFormatError(f"{where}: layer {layer} routes to expert {largest[layer]}, but the model has "
                                    f"{experts} experts (ids 0..{experts - 1})")
        shapes[layer] = LayerShape(max(experts, 1), widths[layer])
    for layer in sorted(counted):
        assert k_stated is not None  # counted layers without a top-k were refused above
        experts = stated if stated is not None else counted[layer]
        if counted[layer] != experts:
            raise SourceFormatError(f"{where}: layer {layer} counts {counted[layer]} experts, but the model has "
                                    f"{experts}")
        shapes[layer] = LayerShape(experts, k_stated)
    if stated is None:  # one width for every layer, so the views compare like with like
        widest = max((s.num_experts for s in shapes.values()), default=0)
        shapes = {layer: LayerShape(widest, s.top_k) for layer, s in shapes.items()}
    return shapes


def check_unique_steps(steps: list[SourceStep], where: str) -> None:
    """Raise SourceFormatError when two steps share (step, rank, tags): the same forward read twice."""
    seen: set[tuple] = set()
    for step in steps:
        key = (step.step, step.rank, tuple(sorted(step.tags.items())))
        if key in seen:
            raise SourceFormatError(f"{where}: step {step.step} of rank {step.rank} appears twice (the same "
                                    "records in two files?); import each recording once")
        seen.add(key)


# -- tables --------------------------------------------------------------------------------------

def _tag_column(tag_sets: list[dict[str, str]]) -> pa.Array:
    unique: dict[tuple, int] = {}
    index = [unique.setdefault(tuple(sorted(t.items())), len(unique)) for t in tag_sets]
    return pa.array([list(t) for t in unique], type=TAGS).take(pa.array(index, pa.int32()))


def _list_column(values: list[np.ndarray | None], type_: pa.DataType) -> pa.Array:
    return pa.array([None if v is None else v.tolist() for v in values], type=pa.list_(type_))


def coselection(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """(E, E) int64 tokens that chose both i and j (diagonal: tokens per expert), as the probe counts."""
    onehot = np.zeros((len(ids), num_experts), dtype=np.int64)
    np.add.at(onehot, (np.repeat(np.arange(len(ids)), ids.shape[1]), ids.reshape(-1)), 1)
    return onehot.T @ onehot


def build_step_tables(steps: list[SourceStep], spec: RunSpec, shapes: dict[int, LayerShape]) -> dict[str, pa.Table]:
    """The steps, layer_steps and routes rows of `steps` (checked by `layer_shapes` first)."""
    step_rows: dict[str, list] = {k: [] for k in ("step", "ts", "tokens", "batch_size", "seq_len", "tags", "rank")}
    ls_rows: dict[str, list] = {k: [] for k in ("step", "ts", "layer", "tokens", "expert_load", "coselection",
                                               "tags", "rank")}
    pieces: list[RoutePiece] = []
    for step in steps:
        tags = {**spec.tags, **step.tags}
        layer_tokens = []
        sequences: set[int] = set()
        longest = 0
        for layer in sorted(set(step.routes) | set(step.counts)):
            shape = shapes[layer]
            if layer in step.routes:
                routes = step.routes[layer]
                tokens = len(routes.expert_ids)
                load = np.bincount(routes.expert_ids.reshape(-1), minlength=shape.num_experts).astype(np.int64)
                cosel = (coselection(routes.expert_ids, shape.num_experts)
                         if shape.top_k and shape.top_k > 1 and shape.num_experts <= COSELECTION_MAX_EXPERTS
                         else None)
                if tokens:
                    pieces.append(RoutePiece(step.step, layer, tags, routes, step.rank))
                    sequences.update(np.unique(routes.sequence).tolist())
                    longest = max(longest, int(routes.position.max()) + 1)
            else:
                load = step.counts[layer].astype(np.int64)
                tokens = int(round(int(load.sum()) / shape.top_k))
                cosel = None
            layer_tokens.append(tokens)
            for key, value in (("step", step.step), ("ts", step.ts), ("layer", layer), ("tokens", tokens),
                               ("expert_load", load), ("coselection", cosel), ("tags", tags),
                               ("rank", step.rank)):
                ls_rows[key].append(value)
        # every token runs every MoE layer, so the forward's tokens are its busiest layer's
        for key, value in (("step", step.step), ("ts", step.ts), ("tokens", max(layer_tokens, default=0)),
                           ("batch_size", len(sequences) if step.routes else None),
                           ("seq_len", longest if step.routes else None), ("tags", tags), ("rank", step.rank)):
            step_rows[key].append(value)
    out: dict[str, pa.Table] = {}
    n = len(steps)
    if n:
        out["steps"] = table_from_columns("steps", {
            "run_id": pa.repeat(pa.scalar(spec.run_id, pa.string()), n),
            "step": pa.array(step_rows["step"], pa.int64()),
            "ts": pa.array(step_rows["ts"], SCHEMAS["steps"].field("ts").type),
            "tokens": pa.array(step_rows["tokens"], pa.int64()),
            "batch_size": pa.array(step_rows["batch_size"], pa.int32()),
            "seq_len": pa.array(step_rows["seq_len"], pa.int32()),
            "tags": _tag_column(step_rows["tags"]), "rank": pa.array(step_rows["rank"], pa.int32()),
        }, n)
    m = len(ls_rows["step"])
    if m:
        out["layer_steps"] = table_from_columns("layer_steps", {
            "run_id": pa.repeat(pa.scalar(spec.run_id, pa.string()), m),
            "step": pa.array(ls_rows["step"], pa.int64()),
            "ts": pa.array(ls_rows["ts"], SCHEMAS["layer_steps"].field("ts").type),
            "layer": pa.array(ls_rows["layer"], pa.int32()), "tokens": pa.array(ls_rows["tokens"], pa.int64()),
            "expert_load": _list_column(ls_rows["expert_load"], pa.int64()),
            "coselection": _list_column([None if c is None else c.reshape(-1) for c in ls_rows["coselection"]],
                                        pa.int64()),
            "tags": _tag_column(ls_rows["tags"]), "rank": pa.array(ls_rows["rank"], pa.int32()),
        }, m)
    if pieces:
        out["routes"] = routes_table(spec.run_id, pieces)
    return out


def run_tables(spec: RunSpec, shapes: dict[int, LayerShape], ranks: list[int]) -> dict[str, pa.Table]:
    """The runs row (one per rank, as each probed rank writes one) and the layers rows of the run."""
    ranks = sorted(set(ranks)) or [0]
    world = max(ranks) + 1
    runs = table_from_columns("runs", {
        "run_id": pa.array([spec.run_id] * len(ranks), pa.string()),
        "started_at": pa.array([spec.started_at] * len(ranks), SCHEMAS["runs"].field("started_at").type),
        "model_class": pa.array([spec.model] * len(ranks), pa.string()),
        "tags": _tag_column([spec.tags] * len(ranks)), "rank": pa.array(ranks, pa.int32()),
        "world_size": pa.array([world] * len(ranks), pa.int32()),
        "source": pa.array([spec.source] * len(ranks), pa.string()),
        "host": pa.array([spec.host] * len(ranks), pa.string()),
    }, len(ranks))
    layers = sorted(shapes)
    rows = [(layer, rank) for rank in ranks for layer in layers]
    out = {"runs": runs}
    if rows:
        out["layers"] = table_from_columns("layers", {
            "run_id": pa.array([spec.run_id] * len(rows), pa.string()),
            "layer": pa.array([r[0] for r in rows], pa.int32()),
            "module": pa.array([f"{spec.source} layer {r[0]}" for r in rows], pa.string()),
            "family": pa.array([spec.source] * len(rows), pa.string()),
            "num_experts": pa.array([shapes[r[0]].num_experts for r in rows], pa.int32()),
            "zero_experts": pa.array([0] * len(rows), pa.int32()),
            "top_k": pa.array([shapes[r[0]].top_k for r in rows], pa.int32()),
            "rank": pa.array([r[1] for r in rows], pa.int32()),
        }, len(rows))
    return out


# -- writing -------------------------------------------------------------------------------------

def check_new_run(root: str | os.PathLike | StoreLocation, run_id: str) -> None:
    """Raise ValueError if `run_id` already has rows in the store (an import never appends): a data
    file of its partition in the current snapshot of any table."""
    from moescope.store.delta import snapshot

    location = open_location(root)
    for table in SCHEMAS:
        current = snapshot(location, table)
        if current is not None and any(f.run_id == run_id for f in current.files):
            raise ValueError(f"the store {location.redacted!r} already holds a run {run_id!r}: choose another "
                             "--run-id (an import never adds steps to an existing run)")


def write_run(root: str | os.PathLike | StoreLocation, run_id: str, tables: dict[str, pa.Table]) -> list[str]:
    """Hand the tables to the run's writer, `runs` last and only once every other table is on disk,
    so the run appears complete or not at all; returns the parts written.

    Raises OSError when the store refused rows (they are counted in `probe_stats` as write_failed;
    what was written before stays, without its `runs` row).
    """
    location = open_location(root)
    with run_writer(location, run_id) as writer:
        first = len(writer.files)
        for stage in ([t for t in tables if t != "runs"], [t for t in tables if t == "runs"]):
            before = writer.written_rows
            for table in stage:
                writer.emit(table, tables[table])
            writer.flush(timeout_s=None)
            written = writer.written_rows
            short = [t for t in stage if written[t] - before[t] < tables[t].num_rows]
            if short:
                raise OSError(f"the store {location.redacted!r} did not take the rows of {', '.join(short)} "
                              f"({writer.last_error or 'see the log'}); run {run_id!r} has no runs row: import "
                              "again under another --run-id (`moescope prune` removes the partial run once it is "
                              "old enough)")
        return writer.files[first:]


@dataclass
class ImportSummary:
    """What an import wrote: for the command's report and for tests."""

    run_id: str
    source: str
    steps: int
    layers: int
    ranks: int
    tokens: int  # layer-tokens summed over layers and steps
    routes: int  # per-token route rows written (0 for count-only sources)
    files: list[str]
    notes: Counter

    def report(self) -> str:
        lines = [f"imported {self.steps} steps of {self.layers} MoE layers ({self.ranks} rank"
                 f"{'s' if self.ranks != 1 else ''}, {self.tokens:,} layer-tokens, {self.routes:,} route rows) "
                 f"from {self.source} into run {self.run_id}"]
        lines += [f"  note: {note} ({count}x)" if count > 1 else f"  note: {note}"
                  for note, count in sorted(self.notes.items())]
        return "\n".join(lines)


def import_source(root: str | os.PathLike | StoreLocation, data: SourceData, source: str, run_id: str | None = None,
                  tags: dict[str, str] | None = None, num_experts: int | None = None, top_k: int | None = None,
                  model: str | None = None, where: str = "the source") -> ImportSummary:
    """Check everything a reader found, then write it as one new run; returns what was written.

    `root` is a folder or a URL (a `StoreLocation` carries its storage options).
    Raises SourceFormatError / ValueError (nothing written) when the data or options do not fit.
    """
    root = open_location(root)
    run_id = check_name("run_id", run_id) if run_id else new_run_id(source)
    tags = check_tags({**(tags or {})})
    if not data.steps:
        raise SourceFormatError(f"{where}: no routed step found, so there is nothing to import")
    for step in data.steps:
        check_tags(step.tags)
    check_unique_steps(data.steps, where)
    shapes = layer_shapes(data, num_experts, top_k, where)
    if not shapes:
        raise SourceFormatError(f"{where}: every layer is dense or uncomputed (-1 or zero throughout): no MoE "
                                "routing to import")
    check_new_run(root, run_id)
    spec = RunSpec(run_id=run_id, source=source, model=model or data.model or f"{source} model",
                   tags=tags, started_at=min(s.ts for s in data.steps))
    steps = sorted(data.steps, key=lambda s: (s.step, s.rank))
    tables = {**build_step_tables(steps, spec, shapes), **run_tables(spec, shapes, [s.rank for s in steps])}
    files = write_run(root, run_id, tables)
    layer_steps = tables.get("layer_steps")
    return ImportSummary(run_id=run_id, source=source, steps=len({s.step for s in steps}), layers=len(shapes),
                         ranks=len({s.rank for s in steps}),
                         tokens=int(pc.sum(layer_steps["tokens"]).as_py() or 0) if layer_steps else 0,
                         routes=tables["routes"].num_rows if "routes" in tables else 0, files=files,
                         notes=data.notes)
