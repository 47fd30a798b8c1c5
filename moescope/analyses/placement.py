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

`placement_report` reads the per-(layer, rank) slots through `store.Store.rank_loads` and the
distinct tokens per rank from the `routes` rows; a redundant expert's load is split over its copies
as the engine that ran it splits it (`DISPATCH`, from each engine's source; docs/placement.md).
`placement_whatif` evaluates other placements (the default layout, DeepSeek's EPLB and the seeds'
load-aware mapping, `moescope.analyses.eplb`) fitted on one window, on every later window.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from moescope.metrics import signals
from moescope.store import Store

if TYPE_CHECKING:
    from moescope.store.location import StoreLocation

DEFAULT_KEY = "*"  # the file's entry for every layer not listed
TOP_EXPERTS = 3
TRTLLM_BLOCK_SLOTS = 1024  # TensorRT-LLM's routing kernel: 256 threads x 4 (token, k) slots per block

# How each engine picks the copy of a redundant expert that serves a token's slot (read from their
# sources; docs/placement.md cites them). name -> (the split of slot counts without routes, how).
DISPATCH: dict[str, tuple[str, str]] = {
    "even": ("even", "a uniform choice of copy per slot (no engine named)"),
    "vllm": ("even", "vLLM EPLB: copy number (flat position of the slot in the forward's top-k ids) mod copies"),
    "sglang-static": ("local", "SGLang --ep-dispatch-algorithm static: the copy on the token's own rank, "
                               "else a fixed copy per rank drawn so that the copies share the ranks evenly"),
    "sglang-dynamic": ("even", "SGLang --ep-dispatch-algorithm dynamic: a copy drawn at random per slot"),
    "trtllm": ("even", "TensorRT-LLM load balancer: per 1024-slot block, the expert's n-th slot goes to copy "
                       "(block + n + EP rank) mod copies"),
}
ENGINE_OF_SOURCE = {"vllm": "vllm", "sglang": "sglang-static", "trtllm": "trtllm"}

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

    def slots(self, layer: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        """(slot_rank, slot_expert): the rank and logical expert of each physical slot of `layer`, in
        slot order (rank by rank, each rank's slots as listed)."""
        per_rank = self.rank_experts(layer, num_experts)
        slot_rank = np.array([r for r, experts in enumerate(per_rank) for _ in experts], dtype=np.int64)
        slot_expert = np.array([e for experts in per_rank for e in experts], dtype=np.int64)
        return slot_rank, slot_expert

    def shares(self, layer: int, num_experts: int, split: str = "even") -> np.ndarray:
        """(E, R): the share of each expert's load each rank serves (`signals.replica_shares`, `split`
        "even" or "local"). Raises PlacementError for an expert with no slot or a slot outside 0..E-1."""
        slot_rank, slot_expert = self.slots(layer, num_experts)
        try:
            return signals.replica_shares(slot_rank, slot_expert, num_experts, self.ranks, split)
        except ValueError as e:
            raise PlacementError(f"{self.source}, layer {layer} ({num_experts} experts): {e}") from e

    def document(self, num_experts: int | None = None) -> dict:
        """This placement in `parse_placement`'s format (write it with json or yaml)."""
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
    """vLLM's / SGLang's physical-to-logical map, or TensorRT-LLM's `initial_global_assignments`."""
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
        unknown = set(document) - {"physical_to_logical_map", "ranks"}
        rows = document["physical_to_logical_map"]
        if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
            raise PlacementError(f"{where}: physical_to_logical_map is [layers][physical slots] of expert ids")
        layer_ids = list(range(len(rows)))
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

        physical_to_logical_map: [[0, 1, 2, 3, 3, 0], ...]   # vLLM / SGLang: [layers][physical slots]
        initial_global_assignments: {3: [138, 81, ...], ...}  # TensorRT-LLM's moe_load_balancer.yaml
        num_slots: 288

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


def read_placement(path: str, ranks: int | None = None) -> Placement:
    """A placement file: JSON (.json) or YAML (anything else), in one of `parse_placement`'s shapes
    (`ranks`: the expert-parallel size, for an engine's map that does not say it).
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
    placement = parse_placement(document, os.path.basename(path), ranks)
    if ranks is not None and ranks != placement.ranks:
        raise PlacementError(f"{path} places experts on {placement.ranks} ranks, but --ranks is {ranks}")
    return placement


def dispatch_of_run(store: Store, run_id: str) -> str:
    """The dispatch of the engine that recorded the run (`ENGINE_OF_SOURCE`), "even" for any other source."""
    info = store.run_info(run_id) or {}
    return ENGINE_OF_SOURCE.get(str(info.get("source") or ""), "even")


def _check_dispatch(dispatch: str) -> str:
    if dispatch not in DISPATCH:
        raise PlacementError(f"unknown dispatch {dispatch!r}: one of {', '.join(DISPATCH)}")
    return dispatch


def _copies(placement: Placement, layer: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(copy_rank [E, most copies], copies [E]): the rank of each copy of each expert, in slot order."""
    slot_rank, slot_expert = placement.slots(layer, num_experts)
    copies = np.bincount(slot_expert, minlength=num_experts)
    copy_rank = np.full((num_experts, max(int(copies.max(initial=0)), 1)), -1, dtype=np.int64)
    order = np.argsort(slot_expert, kind="stable")
    starts = np.concatenate([[0], np.cumsum(copies)[:-1]])
    nth = np.arange(order.size) - starts[slot_expert[order]]
    copy_rank[slot_expert[order], nth] = slot_rank[order]
    return copy_rank, copies


def _expand(row: np.ndarray, expert: np.ndarray, shares: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Entries (row, rank, share) for every rank that serves a part of each (row, expert) slot."""
    expert_of, rank_of = np.nonzero(shares > 0)
    width = np.bincount(expert_of, minlength=shares.shape[0])
    start = np.concatenate([[0], np.cumsum(width)[:-1]])
    per = width[expert]
    entry = np.repeat(np.arange(row.size), per)
    nth = np.arange(entry.size) - np.repeat(np.cumsum(per) - per, per)
    rank = rank_of[start[expert[entry]] + nth]
    return row[entry], rank, shares[expert[entry], rank]


def slot_ranks(page, placement: Placement, layer: int, num_experts: int, dispatch: str,
               homes_known: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where each kept slot of a page of routes rows runs: entries (row of the page, rank, probability).

    `dispatch` names the engine's choice of copy (`DISPATCH`). The deterministic ones give each slot
    one rank with probability 1: vLLM (copy = (token * k + slot) mod copies, the token's place in its
    forward's batch), TensorRT-LLM (per block of 1024 (token, slot) positions of a forward and rank,
    the n-th slot of the expert goes to copy (block + n + rank) mod copies) and SGLang static where
    the token's rank is known (`homes_known`: the rows' recorded rank is the expert-parallel rank):
    the copy on that rank, else the copies share it evenly (SGLang fixes one per rank by a seeded
    draw that spreads the ranks evenly over the copies). The random ones (SGLang dynamic, "even",
    SGLang static of unknown ranks) give every rank holding a copy its share. Dropped slots, padding
    and zero experts run nowhere.
    """
    ids = np.asarray(page.expert_ids, dtype=np.int64)
    valid = np.asarray(page.kept, dtype=bool) & (ids >= 0) & (ids < num_experts)
    row, slot = np.nonzero(valid)
    expert = ids[row, slot]
    copy_rank, copies = _copies(placement, layer, num_experts)
    ones = np.ones(row.size)
    k = ids.shape[1] if ids.ndim == 2 else 1
    if dispatch == "vllm":
        position = np.asarray(page.token, dtype=np.int64)[row] * k + slot
        return row, copy_rank[expert, position % copies[expert]], ones
    home = np.asarray(page.rank, dtype=np.int64)[row] % placement.ranks
    if dispatch == "trtllm":
        position = np.asarray(page.token, dtype=np.int64)[row] * k + slot
        block = position // TRTLLM_BLOCK_SLOTS
        # the n-th slot of its expert within its (forward, rank, block): rows come in (step, rank, token)
        # order and slots in row order, so a stable sort by (forward and rank, block, expert) keeps positions
        step = np.asarray(page.step, dtype=np.int64)[row]
        forward = np.concatenate([[0], np.cumsum((step[1:] != step[:-1]) | (home[1:] != home[:-1]))])
        group = (forward * (int(block.max(initial=0)) + 1) + block) * num_experts + expert
        order = np.argsort(group, kind="stable")
        first = np.ones(order.size, dtype=bool)
        first[1:] = group[order][1:] != group[order][:-1]
        run_start = np.maximum.accumulate(np.where(first, np.arange(order.size), 0))
        nth = np.empty(order.size, dtype=np.int64)
        nth[order] = np.arange(order.size) - run_start
        return row, copy_rank[expert, (block + nth + home) % copies[expert]], ones
    split = DISPATCH[dispatch][0]
    if dispatch == "sglang-static" and homes_known:
        holds = placement.shares(layer, num_experts, "even") > 0
        local = holds[expert, home]
        far = _expand(row[~local], expert[~local], placement.shares(layer, num_experts, "even"))
        return (np.concatenate([row[local], far[0]]), np.concatenate([home[local], far[1]]),
                np.concatenate([ones[local], far[2]]))
    return _expand(row, expert, placement.shares(layer, num_experts, "even" if dispatch == "sglang-static" else split))


def rank_tokens(store: Store, run_id: str, placement: Placement, experts_of: Mapping[int, int], dispatch: str,
                window_steps: int | None = None, tags: dict[str, str] | None = None,
                progress: bool = False) -> dict[int, dict]:
    """{layer: {window_start (None: the run): (tokens [R], slots [R])}} from the routes rows of the
    layers in `experts_of` ({layer: its routed experts}): the distinct tokens and the slots each rank
    serves (`signals.expected_rank_tokens`). Empty without routes; `progress` shows a bar."""
    from tqdm import tqdm

    out: dict[int, dict] = {}
    ranks = placement.ranks
    # the rows' ranks are the expert-parallel ranks when as many ranks recorded the run
    homes_known = ranks > 1 and int(store.step_totals(run_id).get("ranks") or 0) == ranks
    bar = tqdm(total=len(experts_of), desc="tokens per rank", unit="layer", disable=not progress, leave=False)
    for layer, page in store.routes_by_layer(run_id, tags):
        bar.update()
        if layer not in experts_of:
            continue
        row, rank, prob = slot_ranks(page, placement, layer, experts_of[layer], dispatch, homes_known)
        windows = np.zeros(len(page.step), dtype=np.int64) if window_steps is None else page.step // window_steps
        starts, group = np.unique(windows, return_inverse=True)
        tokens, slots = signals.expected_rank_tokens(row, rank, prob, ranks, group, len(starts))
        out[layer] = {None if window_steps is None else int(start) * window_steps: (tokens[i], slots[i])
                      for i, start in enumerate(starts)}
    bar.close()
    return out


@dataclass(frozen=True)
class PlacementReport:
    """What `placement_report` found.

    `layers`: one row per (layer, window): layer, window_start, window_end (NULL for the whole run),
    steps, tokens (tokens the layer routed), slots (kept top-k assignments to routed experts),
    rank_slots (np.ndarray of R floats: slots each rank serves, a redundant expert's split as
    `dispatch` splits it), rank_tokens (np.ndarray of R floats: distinct tokens each rank serves,
    from the routes rows; None where the run kept no routes), balancedness (vLLM: mean / max of
    rank_slots), imbalance (TensorRT-LLM: (max - mean) / mean), hottest_rank, hottest_experts and
    hottest_expert_slots (its largest contributors). `dispatch`: the engine rule used (`DISPATCH`).
    """

    layers: pd.DataFrame
    ranks: int
    source: str
    dispatch: str = "even"


REPORT_COLUMNS = ["layer", "window_start", "window_end", "steps", "tokens", "slots", "rank_slots", "rank_tokens",
                  "balancedness", "imbalance", "hottest_rank", "hottest_experts", "hottest_expert_slots"]


def placement_report(store: Store, run_id: str, placement: Placement, window_steps: int | None = None,
                     tags: dict[str, str] | None = None, top_experts: int = TOP_EXPERTS,
                     dispatch: str | None = None, tokens: bool = True, progress: bool = False) -> PlacementReport:
    """Per layer (and window of `window_steps` steps; None: the whole run) of the run's rows carrying
    `tags`, the load each rank of `placement` serves, a redundant expert's split by `dispatch` (None:
    the engine that recorded the run, `dispatch_of_run`). With `tokens`, the distinct tokens per rank
    from the routes rows too (a pass over them, layer by layer: `progress` shows a bar). Raises
    PlacementError where the placement does not fit a layer of the run (an expert with no slot, a slot
    outside the layer's experts) or for an unknown dispatch."""
    dispatch = _check_dispatch(dispatch or dispatch_of_run(store, run_id))
    split = DISPATCH[dispatch][0]
    totals = store.layer_totals(run_id, tags=tags)
    layer, expert, rank, share = [], [], [], []
    experts_of: dict[int, int] = {}
    for row in totals.itertuples():
        experts = int(row.num_experts) if pd.notna(row.num_experts) else len(row.expert_load)
        experts_of[int(row.layer)] = experts
        shares = placement.shares(int(row.layer), experts, split)
        e, r = np.nonzero(shares)
        layer += [int(row.layer)] * len(e)
        expert += e.tolist()
        rank += r.tolist()
        share += shares[e, r].tolist()
    loads = store.rank_loads(run_id, layer, expert, rank, share, window_steps, tags, top_experts)
    routed = rank_tokens(store, run_id, placement, experts_of, dispatch, window_steps, tags,
                         progress) if tokens else {}
    rows = []
    for (lay, start), group in loads.groupby(["layer", "window_start"], sort=True, dropna=False):
        rank_slots = np.zeros(placement.ranks)
        rank_slots[group["rank"].to_numpy(dtype=np.int64)] = group.slots.to_numpy(dtype=np.float64)
        hottest = int(np.argmax(rank_slots))
        hot = group[group["rank"] == hottest]
        first = group.iloc[0]
        key = None if pd.isna(start) else int(start)
        by_route = routed.get(int(lay), {}).get(key)
        rows.append(dict(
            layer=int(lay), window_start=first.window_start, window_end=first.window_end, steps=int(first.steps),
            tokens=int(first.tokens), slots=int(first.layer_slots), rank_slots=rank_slots,
            rank_tokens=None if by_route is None else by_route[0],
            balancedness=signals.balancedness(rank_slots), imbalance=signals.imbalance(rank_slots),
            hottest_rank=hottest,
            hottest_experts=[int(e) for e in hot.experts.iloc[0]] if len(hot) else [],
            hottest_expert_slots=[float(s) for s in hot.expert_slots.iloc[0]] if len(hot) else []))
    return PlacementReport(pd.DataFrame(rows, columns=REPORT_COLUMNS), placement.ranks, placement.source, dispatch)


# -- the what-if: other placements on the same loads ----------------------------------------------

CANDIDATES = ("current", "default", "eplb", "load-aware")
WHATIF_COLUMNS = ["candidate", "window_start", "window_end", "layer", "fit_start", "rank_load", "balancedness",
                  "imbalance"]


@dataclass(frozen=True)
class WhatIfSetup:
    """The cluster a what-if places experts on, and when it fits.

    Attributes:
        ranks: expert-parallel ranks (GPUs).
        nodes: server nodes (EPLB's hierarchical policy packs expert groups onto them).
        groups: expert groups of the model (DeepSeek-V3: 8; 1 when it has none).
        redundant: extra physical slots EPLB may fill with copies of hot experts.
        fit_window: the window (0 = the first) whose loads the placements are fitted on.
        rebalance_every: refit EPLB every N windows on the window before (None: only the fit).
    """

    ranks: int
    nodes: int = 1
    groups: int = 1
    redundant: int = 0
    fit_window: int = 0
    rebalance_every: int | None = None


@dataclass(frozen=True)
class WhatIfReport:
    """What `placement_whatif` found.

    `rows`: one row per (candidate, window, layer): the WHATIF_COLUMNS (rank_load an np.ndarray of R
    slots). `summary`: one row per (candidate, window): candidate, window_start, window_end,
    balancedness (`signals.balancedness_over_layers`: the forward's useful share of MoE time),
    imbalance (its (max - mean) / mean counterpart, 1 / balancedness - 1), fitted (the window the
    placement was fitted on or a later one). `placements`: the fitted placements by candidate (the
    last fit for a rebalanced one).
    """

    rows: pd.DataFrame
    summary: pd.DataFrame
    placements: dict[str, Placement]
    setup: WhatIfSetup
    window_steps: int
    dispatch: str

    def figures(self) -> pd.DataFrame:
        """Per candidate: fit (balancedness on the fit window), later (mean over the later windows),
        last (the last window), decay (fit - later: what traffic shifts cost it), gain (later minus the
        default layout's later: what it buys), windows (later windows evaluated)."""
        fit_start = self.setup.fit_window
        out = []
        for candidate, group in self.summary.groupby("candidate", sort=False):
            group = group.sort_values("window_start")
            fit = group.iloc[fit_start].balancedness if len(group) > fit_start else float("nan")
            later = group.iloc[fit_start + 1:].balancedness
            out.append(dict(candidate=candidate, fit=fit, later=later.mean() if len(later) else float("nan"),
                            last=group.balancedness.iloc[-1], windows=len(later)))
        frame = pd.DataFrame(out, columns=["candidate", "fit", "later", "last", "windows"])
        frame["decay"] = frame.fit - frame.later
        default = frame.loc[frame.candidate == "default", "later"]
        frame["gain"] = frame.later - (default.iloc[0] if len(default) else float("nan"))
        return frame


def _layer_loads(frame: pd.DataFrame, experts_of: Mapping[int, int]) -> tuple[list[int], list[int], np.ndarray]:
    """(window starts, layers, loads [windows, layers, most experts]) from `Store.window_loads` rows."""
    starts = sorted({int(v) for v in frame.window_start})
    layers = sorted(experts_of)
    width = max(experts_of.values()) if experts_of else 0
    loads = np.zeros((len(starts), len(layers), width))
    w = np.searchsorted(starts, frame.window_start.to_numpy(dtype=np.int64))
    lay = np.searchsorted(layers, frame.layer.to_numpy(dtype=np.int64))
    expert = frame.expert.to_numpy(dtype=np.int64)
    routed = expert < np.array([experts_of[layers[i]] for i in lay]) if len(lay) else np.zeros(0, dtype=bool)
    np.add.at(loads, (w[routed], lay[routed], expert[routed]), frame.load.to_numpy(dtype=np.float64)[routed])
    return starts, layers, loads


def placement_whatif(store: Store, run_id: str, window_steps: int, setup: WhatIfSetup,
                     current: Placement | None = None, tags: dict[str, str] | None = None,
                     dispatch: str | None = None) -> WhatIfReport:
    """The balancedness other placements would have had over the run's windows of `window_steps` steps.

    Candidates: `current` (the placement given, if any), "default" (the contiguous layout), "eplb"
    (`eplb.eplb` fitted on window `setup.fit_window`), "load-aware" (`eplb.load_aware`, fitted alike)
    and, with `setup.rebalance_every` N, "eplb-every-N": EPLB refitted at every N-th window after the
    fit on the window just before it (what an engine that rebalances from its last statistics does).
    Every candidate is evaluated on every window from the per-step loads (`Store.window_loads`, kept
    slots), a redundant expert's split by `dispatch` (None: the run's engine).

    Raises PlacementError for a run without loads, a fit window past the last one, or a shape EPLB
    cannot place (experts + redundant not a multiple of the ranks, ...).
    """
    from moescope.analyses.eplb import eplb, load_aware

    dispatch = _check_dispatch(dispatch or dispatch_of_run(store, run_id))
    split = DISPATCH[dispatch][0]
    totals = store.layer_totals(run_id, tags=tags)
    experts_of = {int(r.layer): int(r.num_experts) if pd.notna(r.num_experts) else len(r.expert_load)
                  for r in totals.itertuples()}
    if len(set(experts_of.values())) > 1:
        raise PlacementError(f"the run's layers have different expert counts ({sorted(set(experts_of.values()))}); "
                             "the what-if places one expert count")
    starts, layers, loads = _layer_loads(store.window_loads(run_id, window_steps, tags), experts_of)
    if not starts:
        raise PlacementError(f"run {run_id} recorded no expert load (under these tags)")
    fit = setup.fit_window
    if not 0 <= fit < len(starts):
        raise PlacementError(f"--fit-window {fit} is past the run's {len(starts)} windows of {window_steps} steps")

    def fitted(kind: str, window: int) -> Placement:
        if kind == "eplb":
            return eplb(loads[window], setup.ranks, setup.nodes, setup.groups, setup.redundant, layers)
        return load_aware(loads[window], setup.ranks, layers)

    schedules: dict[str, list[tuple[Placement, int | None]]] = {}
    if current is not None:
        schedules["current"] = [(current, None)] * len(starts)
    schedules["default"] = [(Placement.contiguous(setup.ranks), None)] * len(starts)
    for kind in ("eplb", "load-aware"):
        once: list[tuple[Placement, int | None]] = [(fitted(kind, fit), fit)]
        schedules[kind] = once * len(starts)
    if setup.rebalance_every:
        n = int(setup.rebalance_every)
        plan: list[tuple[Placement, int | None]] = []
        refits = {fit: schedules["eplb"][0][0]}
        for t in range(len(starts)):
            source = fit if t <= fit else fit + n * ((t - fit - 1) // n)
            if source not in refits:
                refits[source] = fitted("eplb", source)
            plan.append((refits[source], source))
        schedules[f"eplb-every-{n}"] = plan
    rows, summary = [], []
    shares_of: dict[tuple[int, int], np.ndarray] = {}
    for candidate, plan in schedules.items():
        for t, (placement, fitted_on) in enumerate(plan):
            per_layer = []
            for i, layer in enumerate(layers):
                key = (id(placement), layer)
                if key not in shares_of:
                    shares_of[key] = placement.shares(layer, experts_of[layer], split)
                rank_load = signals.rank_load(loads[t, i, :experts_of[layer]], shares_of[key])
                per_layer.append(rank_load)
                rows.append(dict(candidate=candidate, window_start=starts[t], window_end=starts[t] + window_steps,
                                 layer=layer, fit_start=None if fitted_on is None else starts[fitted_on],
                                 rank_load=rank_load, balancedness=signals.balancedness(rank_load),
                                 imbalance=signals.imbalance(rank_load)))
            whole = signals.balancedness_over_layers(np.array(per_layer))
            summary.append(dict(candidate=candidate, window_start=starts[t], window_end=starts[t] + window_steps,
                                balancedness=whole, imbalance=1.0 / whole - 1.0 if whole > 0 else float("nan"),
                                fitted=fitted_on is not None and t >= fitted_on))
    placements = {c: plan[-1][0] for c, plan in schedules.items()}
    return WhatIfReport(pd.DataFrame(rows, columns=WHATIF_COLUMNS), pd.DataFrame(summary), placements, setup,
                        int(window_steps), dispatch)


def write_whatif(store_location: str | StoreLocation, run_id: str, report: WhatIfReport) -> int:
    """Append `report`'s rows to the run's `placement_whatif` table (one `ts` for all of them).
    Returns the rows written; raises OSError when the store refused them."""
    import datetime as dt

    import pyarrow as pa

    from moescope.store.location import open_location
    from moescope.store.schema import SCHEMAS
    from moescope.store.writer import run_writer

    location = open_location(store_location)
    now = dt.datetime.now(dt.timezone.utc)
    setup = report.setup
    rows = [dict(run_id=run_id, ts=now, candidate=r.candidate, window_start=int(r.window_start),
                 window_end=int(r.window_end), layer=int(r.layer),
                 fit_start=None if pd.isna(r.fit_start) else int(r.fit_start), ranks=setup.ranks, nodes=setup.nodes,
                 groups=setup.groups, redundant=setup.redundant, dispatch=report.dispatch,
                 rank_load=[float(v) for v in r.rank_load], balancedness=float(r.balancedness),
                 imbalance=float(r.imbalance), rank=0)
            for r in report.rows.itertuples()]
    with run_writer(location, run_id) as writer:
        table = pa.Table.from_pylist(rows, schema=SCHEMAS["placement_whatif"])
        if rows and not writer.write("placement_whatif", table):
            raise OSError(f"the store {location.redacted!r} did not take the placement_whatif rows "
                          f"({writer.last_error or 'see the log'})")
    return len(rows)
