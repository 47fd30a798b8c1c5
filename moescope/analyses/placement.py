"""Where experts run: a placement of logical experts on expert-parallel ranks, and the load per rank.

A placement maps each (MoE layer, physical slot) to a rank and a logical expert; a logical expert
may hold several slots (redundant copies, as EPLB makes them). It comes from one of:

- the default expert-parallel layout (`Placement.contiguous`, `--ranks R`): rank r holds the
  contiguous experts r*E/R .. (r+1)*E/R - 1; when R does not divide E the first E mod R ranks hold
  one expert more (vLLM's `determine_expert_map`);
- a file (`read_placement`, `--placement FILE`, JSON or YAML; see `parse_placement` and
  docs/placement.md);
- SGLang's physical-to-logical map (`Placement.from_physical_to_logical`), which SGLang's recorder
  dumps carry: physical slots are contiguous per rank, P / R each.

`placement_report` reads the per-(layer, rank) load through `store.Store.rank_loads`; the split
of a redundant expert's load over its slots is `metrics.signals.replica_shares` (evenly).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from moescope.metrics import signals
from moescope.store import Store

DEFAULT_KEY = "*"  # the file's entry for every layer not listed
TOP_EXPERTS = 3

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
    """

    ranks: int
    layers: Mapping[int, RankExperts] = field(default_factory=dict)
    default: RankExperts | None = None
    source: str = ""

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

    def rank_experts(self, layer: int, num_experts: int) -> RankExperts:
        """Per rank, the logical experts of its slots in `layer` (a layer of `num_experts` experts)."""
        if layer in self.layers:
            return self.layers[layer]
        if self.default is not None:
            return self.default
        return contiguous_layout(num_experts, self.ranks)

    def shares(self, layer: int, num_experts: int) -> np.ndarray:
        """(E, R): the share of each expert's load each rank serves (`signals.replica_shares`).
        Raises PlacementError for an expert with no slot or a slot outside 0..E-1."""
        per_rank = self.rank_experts(layer, num_experts)
        slot_rank = np.array([r for r, experts in enumerate(per_rank) for _ in experts], dtype=np.int64)
        slot_expert = np.array([e for experts in per_rank for e in experts], dtype=np.int64)
        try:
            return signals.replica_shares(slot_rank, slot_expert, num_experts, self.ranks)
        except ValueError as e:
            raise PlacementError(f"{self.source}, layer {layer} ({num_experts} experts): {e}") from e


def contiguous_layout(num_experts: int, ranks: int) -> RankExperts:
    """Rank r holds E // R contiguous experts, one more for r < E mod R (vLLM's default expert map)."""
    base, extra = divmod(int(num_experts), int(ranks))
    out, start = [], 0
    for r in range(int(ranks)):
        size = base + (1 if r < extra else 0)
        out.append(tuple(range(start, start + size)))
        start += size
    return tuple(out)


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


def parse_placement(document: object, where: str = "placement") -> Placement:
    """A placement from a parsed JSON or YAML document:

        ranks: 4                        # the expert-parallel ranks (required)
        num_experts: 8                  # optional: checks every layer covers experts 0..7
        layers:
          "*": [[0, 1], [2, 3], [4, 5], [6, 7]]     # every layer not listed (optional)
          "3": [[0, 1, 7], [2, 3, 7], [4, 5], [6]]  # layer 3: expert 7 has two slots

    Each layer's value lists, per rank, the logical expert of each of its physical slots. Without
    "*", a layer not listed takes the contiguous layout. Raises PlacementError naming what is wrong:
    a layer listing another number of ranks, an expert id outside 0..num_experts-1, an expert with
    no slot (checked against num_experts here, and against the run's experts when read).
    """
    if not isinstance(document, dict):
        raise PlacementError(f"{where}: expected a mapping with `ranks` and `layers`")
    unknown = set(document) - {"ranks", "num_experts", "layers"}
    if unknown:
        raise PlacementError(f"{where}: unknown key(s) {', '.join(sorted(map(str, unknown)))}; "
                             "the keys are ranks, num_experts, layers")
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


def read_placement(path: str) -> Placement:
    """A placement file: JSON (.json) or YAML (anything else), in `parse_placement`'s format.
    Raises PlacementError for a file that cannot be read or parsed, or a bad placement."""
    import yaml  # JSON is YAML too, but a JSON error reads better from json

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise PlacementError(f"{path}: cannot read the placement file ({e.strerror})") from e
    try:
        document = json.loads(text) if path.lower().endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise PlacementError(f"{path}: not valid {'JSON' if path.lower().endswith('.json') else 'YAML'}: "
                             f"{str(e).splitlines()[0]}") from e
    return parse_placement(document, os.path.basename(path))


@dataclass(frozen=True)
class PlacementReport:
    """What `placement_report` found.

    `layers`: one row per (layer, window): layer, window_start, window_end (NULL for the whole run),
    steps, tokens (tokens the layer routed), slots (kept top-k assignments to routed experts),
    rank_slots (np.ndarray of R floats: slots each rank serves, redundant experts split evenly),
    balancedness (vLLM: mean / max over ranks), imbalance (TensorRT-LLM: (max - mean) / mean),
    hottest_rank, hottest_experts and hottest_expert_slots (its largest contributors).
    """

    layers: pd.DataFrame
    ranks: int
    source: str


def placement_report(store: Store, run_id: str, placement: Placement, window_steps: int | None = None,
                     tags: dict[str, str] | None = None, top_experts: int = TOP_EXPERTS) -> PlacementReport:
    """Per layer (and window of `window_steps` steps; None: the whole run) of the run's rows carrying
    `tags`, the load each rank of `placement` serves. Raises PlacementError where the placement does
    not fit a layer of the run (an expert with no slot, a slot outside the layer's experts)."""
    totals = store.layer_totals(run_id, tags=tags)
    layer, expert, rank, share = [], [], [], []
    for row in totals.itertuples():
        experts = int(row.num_experts) if pd.notna(row.num_experts) else len(row.expert_load)
        shares = placement.shares(int(row.layer), experts)
        e, r = np.nonzero(shares)
        layer += [int(row.layer)] * len(e)
        expert += e.tolist()
        rank += r.tolist()
        share += shares[e, r].tolist()
    loads = store.rank_loads(run_id, layer, expert, rank, share, window_steps, tags, top_experts)
    rows = []
    for (lay, start), group in loads.groupby(["layer", "window_start"], sort=True, dropna=False):
        rank_slots = np.zeros(placement.ranks)
        rank_slots[group["rank"].to_numpy(dtype=np.int64)] = group.slots.to_numpy(dtype=np.float64)
        hottest = int(np.argmax(rank_slots))
        hot = group[group["rank"] == hottest]
        first = group.iloc[0]
        rows.append(dict(
            layer=int(lay), window_start=first.window_start, window_end=first.window_end, steps=int(first.steps),
            tokens=int(first.tokens), slots=int(first.layer_slots), rank_slots=rank_slots,
            balancedness=signals.balancedness(rank_slots), imbalance=signals.imbalance(rank_slots),
            hottest_rank=hottest,
            hottest_experts=[int(e) for e in hot.experts.iloc[0]] if len(hot) else [],
            hottest_expert_slots=[float(s) for s in hot.expert_slots.iloc[0]] if len(hot) else []))
    frame = pd.DataFrame(rows, columns=["layer", "window_start", "window_end", "steps", "tokens", "slots",
                                        "rank_slots", "balancedness", "imbalance", "hottest_rank",
                                        "hottest_experts", "hottest_expert_slots"])
    return PlacementReport(frame, placement.ranks, placement.source)

