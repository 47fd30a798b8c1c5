"""Where experts run: a placement of logical experts on expert-parallel ranks, as a value.

A placement maps each (MoE layer, physical slot) to a rank and a logical expert; a logical expert
may hold several slots (redundant copies, as EPLB makes them). It comes from one of:

- the default expert-parallel layout (`Placement.contiguous`, `--ranks R`): rank r holds the
  contiguous experts r*E/R .. (r+1)*E/R - 1; when R does not divide E the first E mod R ranks hold
  one expert more (vLLM's `determine_expert_map`);
- a document (`parse_placement`: moescope's format or an engine's map, docs/placement.md), which
  `moescope.analyses.placement.read_placement` reads from a JSON or YAML file; vLLM's map has a row
  per MoE layer, not per layer, and is placed on a run's layers by `Placement.on_layers`;
- SGLang's physical-to-logical map (`Placement.from_physical_to_logical`), which SGLang's recorder
  dumps carry: physical slots are contiguous per rank, P / R each;
- a fit to recorded loads (`moescope.metrics.eplb`: DeepSeek's EPLB and the seeds' load-aware mapping).

Everything here computes from the placement alone (no store, no file): its slots, the share of each
expert's load each rank serves (`Placement.shares`, computed once per layer and kept on the value),
the arrays the wire counts with (`wire_layout`), and `LayerPlacements`, the per-layer view the
rules engine and the Prometheus exporter read. How an engine picks the copy that serves a token is
`moescope.metrics.dispatch`; the reports over a run are `moescope.analyses.placement`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from moescope.metrics import traffic as wire
from moescope.metrics.ranks import replica_shares

log = logging.getLogger(__name__)

DEFAULT_KEY = "*"  # the file's entry for every layer not listed
# the loads an engine records beside its map, by the engine's own name, and what each counts: per
# physical slot (vLLM's EplbState `expert_load_window` [window, MoE layers, physical] and
# `expert_load_pass`; SGLang's recorder `global_physical_count`) or per logical expert (SGLang's
# `logical_count`, which `--init-expert-location` also reads)
ENGINE_LOADS = {"expert_load_window": "physical", "expert_load_pass": "physical",
                "global_physical_count": "physical", "logical_count": "logical"}

RankExperts = tuple[tuple[int, ...], ...]  # per rank, the logical expert of each of its slots

class PlacementError(ValueError):
    """A placement that cannot be used: the message names the file, layer and what to change."""


@dataclass(frozen=True)
class Placement:
    """Logical experts on ranks, per layer.

    Attributes:
        ranks: R, the expert-parallel ranks.
        layers: per layer listed, per rank the logical expert of each of its slots.
        default: the same for every layer not listed; None: the contiguous layout of that layer's
            experts (`contiguous_layout`).
        source: where it came from, as the report names it ("--ranks 4", a file name).
        moe_rows: an engine's map whose rows are the model's MoE layers in order (vLLM's), not yet
            placed on a run's layers: `on_layers` places them; until then no layer can be read.
    """

    ranks: int
    layers: Mapping[int, RankExperts] = field(default_factory=dict)
    default: RankExperts | None = None
    source: str = ""
    moe_rows: tuple[RankExperts, ...] = ()
    # (layer, experts, split) -> shares or the PlacementError they raised: computed once per layer, for
    # every reader of the value (the reports, the what-if, the rules engine, the exporter)
    _shares: dict[tuple[int, int, str], np.ndarray | PlacementError] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def contiguous(cls, ranks: int) -> Placement:
        """The default expert-parallel layout over `ranks` ranks. Raises PlacementError for ranks < 1."""
        if int(ranks) < 1:
            raise PlacementError(f"--ranks must be at least 1, not {ranks}")
        return cls(ranks=int(ranks), source=f"contiguous layout over {int(ranks)} ranks")

    @classmethod
    def from_physical_to_logical(cls, mapping: np.ndarray, ranks: int, source: str = "") -> Placement:
        """SGLang's `physical_to_logical_map` ([layers, physical slots]; slot s on rank s // (P / R)).
        Raises PlacementError when R does not divide the slots or an id is negative."""
        mapping = np.asarray(mapping)
        if mapping.ndim != 2:
            raise PlacementError(f"{source}: a physical-to-logical map is [layers, physical slots], "
                                 f"got shape {mapping.shape}")
        if int(ranks) < 1 or mapping.shape[1] % int(ranks):
            raise PlacementError(f"{source}: {mapping.shape[1]} physical slots do not split evenly over "
                                 f"{ranks} ranks; give the expert-parallel size the server ran with (--ranks)")
        if mapping.size and mapping.min() < 0:
            raise PlacementError(f"{source}: the map holds expert id {int(mapping.min())}")
        per_rank = mapping.shape[1] // int(ranks)
        layers = {layer: tuple(tuple(int(e) for e in row[r * per_rank:(r + 1) * per_rank]) for r in range(int(ranks)))
                  for layer, row in enumerate(mapping)}
        return cls(ranks=int(ranks), layers=layers, source=source)

    def on_layers(self, layer_ids: Sequence[int]) -> Placement:
        """This placement on a run whose MoE layers are `layer_ids`. An engine map's rows (`moe_rows`)
        go to them in order when there is one row per MoE layer (vLLM's `physical_to_logical_map`:
        `[num_moe_layers, physical]`, so on DeepSeek-V3, whose first 3 layers are dense, row 0 is layer
        3); a map with a row for every layer up to the last MoE one (SGLang's, dense layers included)
        keeps row i on layer i. Any other placement is returned as it is.
        Raises PlacementError for a map with another number of rows, naming both counts."""
        if not self.moe_rows:
            return self
        placed = {layer: self.moe_rows[row] for layer, row in moe_row_layers(len(self.moe_rows), layer_ids,
                                                                              self.source).items()}
        return Placement(self.ranks, placed, source=self.source)

    def rank_experts(self, layer: int, num_experts: int) -> RankExperts:
        """Per rank, the logical experts of its slots in `layer` (a layer of `num_experts` experts).
        Raises PlacementError for an engine's map not yet placed on a run's layers (`on_layers`)."""
        if self.moe_rows:
            raise PlacementError(f"{self.source}: the map's rows are the model's MoE layers in order; place "
                                 "them on a run's MoE layers first (Placement.on_layers)")
        if layer in self.layers:
            return self.layers[layer]
        if self.default is not None:
            return self.default
        return contiguous_layout(num_experts, self.ranks)

    def slots(self, layer: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        """(slot_rank, slot_expert): the rank and logical expert of each physical slot of `layer`, in
        slot order (rank by rank, each rank's slots as listed)."""
        per_rank = self.rank_experts(layer, num_experts)
        slot_rank = np.array([r for r, experts in enumerate(per_rank) for _ in experts], dtype=np.int64)
        slot_expert = np.array([e for experts in per_rank for e in experts], dtype=np.int64)
        return slot_rank, slot_expert

    def shares(self, layer: int, num_experts: int, split: str = "even") -> np.ndarray:
        """(E, R): the share of each expert's load each rank serves (`moescope.metrics.ranks.replica_shares`,
        `split` "even" or "local"), computed once per (layer, experts, split) and read-only.
        Raises PlacementError for an expert with no slot or a slot outside 0..E-1."""
        key = (int(layer), int(num_experts), split)
        known = self._shares.get(key)
        if known is None:
            slot_rank, slot_expert = self.slots(layer, num_experts)
            try:
                known = replica_shares(slot_rank, slot_expert, num_experts, self.ranks, split)
                known.setflags(write=False)
            except ValueError as e:
                known = PlacementError(f"{self.source}, layer {layer} ({num_experts} experts): {e}")
                known.__cause__ = e
            self._shares[key] = known
        if isinstance(known, PlacementError):
            raise PlacementError(*known.args) from known.__cause__  # a fresh one: a raised one keeps its frames
        return known

    def document(self, num_experts: int | None = None) -> dict:
        """This placement in `parse_placement`'s format (write it with json or yaml). Raises
        PlacementError for an engine's map not yet placed on a run's layers (`on_layers`)."""
        if self.moe_rows:
            raise PlacementError(f"{self.source}: place the map on a run's MoE layers first (Placement.on_layers)")
        doc: dict = {"ranks": self.ranks}
        if num_experts is not None:
            doc["num_experts"] = int(num_experts)
        layers: dict = {}
        if self.default is not None:
            layers[DEFAULT_KEY] = [list(r) for r in self.default]
        layers.update({str(layer): [list(r) for r in per_rank] for layer, per_rank in sorted(self.layers.items())})
        doc["layers"] = layers
        return doc


def contiguous_layout(num_experts: int, ranks: int) -> RankExperts:
    """Rank r holds E // R contiguous experts, one more for r < E mod R (vLLM's default expert map)."""
    base, extra = divmod(int(num_experts), int(ranks))
    out, start = [], 0
    for r in range(int(ranks)):
        size = base + (1 if r < extra else 0)
        out.append(tuple(range(start, start + size)))
        start += size
    return tuple(out)


def moe_row_layers(rows: int, layer_ids: Sequence[int], source: str = "the map") -> dict[int, int]:
    """The row of an engine's map that each of a run's MoE layers (`layer_ids`) reads: in order when
    the map has one row per MoE layer (vLLM's `[num_moe_layers, physical]`), row i for layer i when it
    has a row for every layer up to the last MoE one (SGLang's, dense layers included). Raises
    PlacementError for any other number of rows, naming both counts."""
    ids = sorted({int(v) for v in layer_ids})
    if rows == len(ids):
        return dict(zip(ids, range(rows)))
    if ids and rows == ids[-1] + 1:
        return {layer: layer for layer in ids}
    shown = f"{ids[0]}..{ids[-1]}" if ids else "none"
    raise PlacementError(f"{source}: the map has {rows} rows, but the run has {len(ids)} MoE layers "
                         f"(layers {shown}); a vLLM map has one row per MoE layer (an SGLang one a row "
                         f"per layer, {ids[-1] + 1 if ids else 0} here): give the map of the model this "
                         "run served")


def _rank_lists(value: object, ranks: int, where: str) -> RankExperts:
    if not isinstance(value, list) or not all(isinstance(r, list) for r in value):
        raise PlacementError(f"{where}: give a list with one list of logical expert ids per rank, "
                             "like [[0, 1], [2, 3]]")
    if len(value) != ranks:
        raise PlacementError(f"{where}: lists {len(value)} ranks, but ranks is {ranks}")
    for r, experts in enumerate(value):
        bad = [e for e in experts if isinstance(e, bool) or not isinstance(e, int) or e < 0]
        if bad:
            raise PlacementError(f"{where}, rank {r}: slot holds {bad[0]!r}; a slot holds a logical expert id "
                                 "(an integer from 0)")
    return tuple(tuple(int(e) for e in experts) for experts in value)


def _engine_map(document: dict, ranks: int | None, where: str) -> Placement:
    """vLLM's / SGLang's physical-to-logical map (its rows kept as `moe_rows`, placed on a run's layers
    by `Placement.on_layers`), or TensorRT-LLM's `initial_global_assignments` (keyed by layer)."""
    layer_ids: list[int] | None
    if "initial_global_assignments" in document:  # TensorRT-LLM's moe_load_balancer.yaml
        unknown = set(document) - {"initial_global_assignments", "num_slots", "layer_updates_per_iter", "ranks"}
        assignments = document["initial_global_assignments"]
        if not isinstance(assignments, dict) or not assignments:
            raise PlacementError(f"{where}: initial_global_assignments maps a layer to the expert of each slot")
        try:
            layer_ids = [int(str(k)) for k in assignments]
        except ValueError:
            raise PlacementError(f"{where}: initial_global_assignments has a key that is not a layer number") from None
        rows = list(assignments.values())
        slots = document.get("num_slots", len(rows[0]) if isinstance(rows[0], list) else None)
        if any(not isinstance(r, list) or len(r) != slots for r in rows):
            raise PlacementError(f"{where}: every layer of initial_global_assignments must list num_slots "
                                 f"({slots}) expert ids, one per slot")
    elif "physical_to_logical_map" in document:  # vLLM's EplbState / SGLang's ExpertLocationMetadata
        unknown = set(document) - {"physical_to_logical_map", "ranks", *ENGINE_LOADS}
        rows = document["physical_to_logical_map"]
        if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
            raise PlacementError(f"{where}: physical_to_logical_map is [layers][physical slots] of expert ids")
        layer_ids = None
    else:
        raise AssertionError("not an engine map")
    if unknown:
        raise PlacementError(f"{where}: unknown key(s) {', '.join(sorted(map(str, unknown)))}")
    ranks = document.get("ranks", ranks)
    if ranks is None:
        raise PlacementError(f"{where}: an engine's map does not say the expert-parallel size; give --ranks R "
                             "(or a `ranks:` key in the file)")
    if len({len(r) for r in rows}) != 1 or any(isinstance(e, bool) or not isinstance(e, int) for r in rows for e in r):
        raise PlacementError(f"{where}: every layer must list the same number of slots, each an expert id")
    placement = Placement.from_physical_to_logical(np.array(rows, dtype=np.int64), int(ranks), source=where)
    if layer_ids is None:  # rows are MoE layers in order: placed when the run is known
        return Placement(placement.ranks, source=where, moe_rows=tuple(placement.layers[i] for i in range(len(rows))))
    return Placement(placement.ranks, {layer: placement.layers[i] for i, layer in enumerate(layer_ids)},
                     source=where)


def parse_placement(document: object, where: str = "placement", ranks: int | None = None) -> Placement:
    """A placement from a parsed JSON or YAML document, in moescope's format:

        ranks: 4                        # the expert-parallel ranks (required)
        num_experts: 8                  # optional: checks every layer covers experts 0..7
        layers:
          "*": [[0, 1], [2, 3], [4, 5], [6, 7]]     # every layer not listed (optional)
          "3": [[0, 1, 7], [2, 3, 7], [4, 5], [6]]  # layer 3: expert 7 has two slots

    Each layer's value lists, per rank, the logical expert of each of its physical slots. Without
    "*", a layer not listed takes the contiguous layout. Or in an engine's shape, physical slots
    contiguous per rank (P / R each), `ranks` (the expert-parallel size) from the file or the argument:

        physical_to_logical_map: [[0, 1, 2, 3, 3, 0], ...]   # vLLM: [MoE layers][physical slots]
        initial_global_assignments: {3: [138, 81, ...], ...}  # TensorRT-LLM's moe_load_balancer.yaml
        num_slots: 288

    A `physical_to_logical_map` has a row per MoE layer (vLLM), or per layer (SGLang): its rows are
    kept as `Placement.moe_rows` and placed on a run's layers by `Placement.on_layers`, which the
    reports over a run call. TensorRT-LLM's keys are layer numbers.

    Raises PlacementError naming what is wrong: a layer listing another number of ranks, an expert id
    outside 0..num_experts-1, an expert with no slot (checked against num_experts here, and against
    the run's experts when read), an engine's map without the ranks.
    """
    if not isinstance(document, dict):
        raise PlacementError(f"{where}: expected a mapping with `ranks` and `layers`")
    if "physical_to_logical_map" in document or "initial_global_assignments" in document:
        return _engine_map(document, ranks, where)
    unknown = set(document) - {"ranks", "num_experts", "layers"}
    if unknown:
        raise PlacementError(f"{where}: unknown key(s) {', '.join(sorted(map(str, unknown)))}; "
                             "the keys are ranks, num_experts, layers")
    if "ranks" not in document and ranks is not None:
        document = {**document, "ranks": ranks}
    ranks = document.get("ranks")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise PlacementError(f"{where}: `ranks` must be a whole number of at least 1, not {ranks!r}")
    layers_doc = document.get("layers", {})
    if not isinstance(layers_doc, dict):
        raise PlacementError(f"{where}: `layers` maps a layer number (or \"*\") to per-rank expert lists")
    default, layers = None, {}
    for key, value in layers_doc.items():
        if str(key) == DEFAULT_KEY:
            default = _rank_lists(value, ranks, f"{where}, layers[\"*\"]")
            continue
        try:
            layer = int(str(key))
        except ValueError:
            raise PlacementError(f"{where}: layer key {key!r} is not a layer number or \"*\"") from None
        layers[layer] = _rank_lists(value, ranks, f"{where}, layer {layer}")
    placement = Placement(ranks=ranks, layers=layers, default=default, source=where)
    num_experts = document.get("num_experts")
    if num_experts is not None:
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise PlacementError(f"{where}: `num_experts` must be a whole number of at least 1")
        for layer in layers:
            placement.shares(layer, num_experts)
        if default is not None:
            Placement(ranks, {}, default, f"{where}, layers[\"*\"]").shares(0, num_experts)
    return placement


@dataclass(frozen=True)
class RecordedMap:
    """An engine's map with the load the engine recorded under it: what the trace checks' physical_ids
    check reads (`moescope.ingest.trace_checks.EngineMap`).

    Attributes:
        placement: the map.
        load: per row of the map, the load recorded per physical slot (`load_per` "physical") or per
            logical expert ("logical"); None where the map came without one.
        load_per: what `load` counts per.
    """

    placement: Placement
    load: np.ndarray | None = None
    load_per: str = "physical"

    @property
    def source(self) -> str:
        """Where the map came from."""
        return self.placement.source

    @property
    def logical_experts(self) -> int:
        """The largest logical id in any layer of the map + 1. Raises PlacementError for a map that
        lists no expert (the contiguous layout of `--ranks`)."""
        p = self.placement
        lists = [*p.layers.values(), *p.moe_rows] + ([p.default] if p.default else [])
        largest = max((int(e) for rank_lists in lists for slots in rank_lists for e in slots), default=-1)
        if largest < 0:
            raise PlacementError(f"{self.source}: the placement lists no expert, so it says nothing of the "
                                 "logical experts")
        return largest + 1

    @property
    def physical_slots(self) -> int:
        """The most physical slots any layer of the map has: a trace returned under it names ids below
        this (0 for the contiguous layout of `--ranks`, which lists none)."""
        p = self.placement
        lists = [*p.layers.values(), *p.moe_rows] + ([p.default] if p.default else [])
        return max((sum(len(slots) for slots in rank_lists) for rank_lists in lists), default=0)

    def layer_maps(self, layer_ids: Sequence[int]) -> dict[int, tuple[np.ndarray, np.ndarray | None, str]]:
        """Per MoE layer of a run (`layer_ids`): (the logical expert of each physical slot, the load
        recorded for that layer or None, `load_per`), the map's rows placed as `Placement.on_layers`
        places them. Raises PlacementError for a map of another row count."""
        ids = sorted({int(v) for v in layer_ids})
        placed = self.placement.on_layers(ids)
        experts = self.logical_experts
        if self.load is None:
            row_of: dict[int, int] = {}
        elif self.placement.moe_rows:
            row_of = moe_row_layers(len(self.placement.moe_rows), ids, self.source)
        else:  # a map keyed by layer (SGLang's dump): its load rows are its layers
            row_of = {layer: layer for layer in ids if layer < len(self.load)}
        return {layer: (placed.slots(layer, experts)[1],
                        None if self.load is None or layer not in row_of else self.load[row_of[layer]],
                        self.load_per) for layer in ids}


def recorded_load(document: dict, rows: int, slots: int, where: str) -> tuple[np.ndarray | None, str]:
    """The load an engine's map document carries (`ENGINE_LOADS`, at most one key) as (rows of the
    map, slots or logical experts), summed over a window axis; (None, "physical") when it has none.
    Raises PlacementError for a load that is not one count per row and slot (or logical expert)."""
    keys = [key for key in ENGINE_LOADS if key in document]
    if not keys:
        return None, "physical"
    if len(keys) > 1:
        raise PlacementError(f"{where}: give one recorded load, not {' and '.join(keys)}")
    key, per = keys[0], ENGINE_LOADS[keys[0]]
    shape = "[layers][physical slots]" if per == "physical" else "[layers][logical experts]"
    try:
        load = np.asarray(document[key], dtype=np.float64)
    except (TypeError, ValueError):
        raise PlacementError(f"{where}: {key} must be counts, {shape} or [window]{shape}") from None
    if load.ndim == 3:
        load = load.sum(axis=0)
    if load.ndim != 2 or not np.isfinite(load).all() or (load < 0).any():
        raise PlacementError(f"{where}: {key} must be counts (0 or more), {shape} or [window]{shape}")
    if len(load) != rows:
        raise PlacementError(f"{where}: {key} has {len(load)} rows, but the map has {rows}: give the load "
                             "recorded under this map")
    if per == "physical" and load.shape[1] != slots:
        raise PlacementError(f"{where}: {key} counts {load.shape[1]} physical slots, but the map has {slots}")
    return load, per


def parse_recorded_map(document: object, where: str = "placement", ranks: int | None = None) -> RecordedMap:
    """`parse_placement`'s placement and the load an engine's map carries beside it (`ENGINE_LOADS`:
    `physical_to_logical_map` documents only). Raises PlacementError as those two do, and for a
    logical load that does not cover the map's experts."""
    placement = parse_placement(document, where, ranks)
    if not isinstance(document, dict) or "physical_to_logical_map" not in document:
        return RecordedMap(placement)
    rows = document["physical_to_logical_map"]
    load, per = recorded_load(document, len(rows), len(rows[0]), where)
    recorded = RecordedMap(placement, load, per)
    if load is not None and per == "logical" and load.shape[1] < recorded.logical_experts:
        raise PlacementError(f"{where}: logical_count counts {load.shape[1]} experts, but the map places "
                             f"{recorded.logical_experts}")
    return recorded


def wire_layout(placement: Placement, layer: int, num_experts: int, rank_node: np.ndarray) -> wire.WireLayout:
    """One layer of `placement` as the arrays `moescope.metrics.traffic` counts with, the ranks in the
    nodes of `rank_node` ((R,) the node of each rank). Raises PlacementError where the placement does
    not fit the layer or the nodes."""
    if len(rank_node) != placement.ranks:
        raise PlacementError(f"the nodes hold {len(rank_node)} ranks, but {placement.source} has {placement.ranks}")
    placement.shares(layer, num_experts)  # every expert has a slot, every slot a known expert
    slot_rank, slot_expert = placement.slots(layer, num_experts)
    return wire.WireLayout(slot_rank, slot_expert, np.asarray(rank_node), num_experts)


class LayerPlacements:
    """A placement as the live readers take it, layer by layer: the rules engine's rank and traffic
    signals and the Prometheus exporter's rank and traffic series.

    `shares` and `wire` give None where the placement does not fit a layer (an expert with no slot, a
    slot outside its experts), with one warning per (layer, experts): those figures are then no data.
    The shares are the placement's own (`Placement.shares`, kept on the value); the wire layouts are
    kept here, built with `rank_node` ((R,) the node of each rank; None: nodes of
    `moescope.metrics.traffic.DEFAULT_RANKS_PER_NODE` consecutive ranks).
    """

    def __init__(self, placement: Placement, rank_node: np.ndarray | None = None):
        self.placement = placement
        self.rank_node = wire.default_rank_node(placement.ranks) if rank_node is None else np.asarray(rank_node)
        self._wire: dict[tuple[int, int], wire.WireLayout | None] = {}
        self._unfit: set[tuple[int, int]] = set()

    def shares(self, layer: int, num_experts: int) -> np.ndarray | None:
        """(E, R) of the layer (`Placement.shares`, split "even"); None where the placement does not fit."""
        if (layer, num_experts) in self._unfit:
            return None
        try:
            return self.placement.shares(layer, num_experts)
        except PlacementError as e:
            self._warn(layer, num_experts, e)
            return None

    def wire(self, layer: int, num_experts: int) -> wire.WireLayout | None:
        """The layer's `wire_layout`, built once; None where the placement does not fit it."""
        key = (int(layer), int(num_experts))
        if key not in self._wire:
            try:
                self._wire[key] = wire_layout(self.placement, layer, num_experts, self.rank_node)
            except ValueError as e:  # a PlacementError, or nodes the layout refuses
                self._warn(layer, num_experts, e)
                self._wire[key] = None
        return self._wire[key]

    def _warn(self, layer: int, num_experts: int, error: ValueError) -> None:
        if (layer, num_experts) not in self._unfit:
            self._unfit.add((layer, num_experts))
            log.warning("no rank or traffic figures for layer %d: the placement does not fit its %d experts (%s)",
                        layer, num_experts, error)
