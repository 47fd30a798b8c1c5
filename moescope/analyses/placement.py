"""The load each expert-parallel rank serves in a recorded run, under a placement; and reading a placement file.

`read_placement` opens a placement file (JSON or YAML) and parses it with
`moescope.metrics.placement.parse_placement` (the formats: docs/placement.md). `placement_report`
reads the per-(layer, rank) slots through `store.Store.rank_loads` and the distinct tokens per rank
from the `routes` rows; a redundant expert's load is split over its copies as the engine that ran
it splits it (`moescope.metrics.dispatch.DISPATCH`, from each engine's source; docs/placement.md).
The what-if over other placements is `moescope.analyses.placement_whatif`.

The placement value and what computes from it alone live in the metrics room
(`moescope.metrics.placement`, `moescope.metrics.dispatch`, `moescope.metrics.eplb`), so the rules
engine and the Prometheus exporter read the same definition; the names that lived here before
(`Placement`, `parse_placement`, `DISPATCH`, `slot_ranks`, the what-if's) are still found here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from moescope.core.lazy import lazy_exports
from moescope.metrics import signals
from moescope.metrics.dispatch import (
    COPY_COUNTERS,
    DISPATCH,
    ENGINE_OF_SOURCE,
    TRTLLM_BLOCK_SLOTS,
    check_dispatch,
    slot_ranks,
)
from moescope.metrics.placement import (
    DEFAULT_KEY,  # noqa: F401  (here before issue 46, as are the two below)
    Placement,
    PlacementError,
    RankExperts,  # noqa: F401
    RecordedMap,
    contiguous_layout,  # noqa: F401
    parse_placement,  # noqa: F401
    parse_recorded_map,
)
from moescope.metrics.ranks import expected_rank_tokens
from moescope.store import Store
from moescope.store.queries import SlotCopies

_WHATIF = ("CANDIDATES", "WHATIF_COLUMNS", "WhatIfReport", "WhatIfSetup", "default_ranks", "placement_whatif",
           "why_placements_coincide", "write_whatif")

if TYPE_CHECKING:
    from moescope.analyses.placement_whatif import (  # noqa: F401
        CANDIDATES,
        WHATIF_COLUMNS,
        WhatIfReport,
        WhatIfSetup,
        default_ranks,
        placement_whatif,
        why_placements_coincide,
        write_whatif,
    )
else:  # the what-if's names, loaded on first use: its module imports this one
    __getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(_WHATIF, "moescope.analyses.placement_whatif"))

__all__ = ["REPORT_COLUMNS", "TOP_EXPERTS", "PlacementReport", "dispatch_of_run", "placement_for_run",
           "placement_report", "rank_tokens", "read_placement", "read_recorded_map"]

TOP_EXPERTS = 3


def read_placement(path: str, ranks: int | None = None) -> Placement:
    """A placement file: JSON (.json) or YAML (anything else), in one of `parse_placement`'s shapes
    (`ranks`: the expert-parallel size, for an engine's map that does not say it).
    Raises PlacementError for a file that cannot be read or parsed, or a bad placement."""
    return read_recorded_map(path, ranks).placement


def read_recorded_map(path: str, ranks: int | None = None) -> RecordedMap:
    """A placement file as `read_placement` reads it, with the load an engine's map carries beside it
    (`moescope.metrics.placement.ENGINE_LOADS`). Raises PlacementError as `read_placement` does."""
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
    recorded = parse_recorded_map(document, os.path.basename(path), ranks)
    if ranks is not None and ranks != recorded.placement.ranks:
        raise PlacementError(f"{path} places experts on {recorded.placement.ranks} ranks, but --ranks is {ranks}")
    return recorded


def placement_for_run(store: Store, run_id: str, placement: Placement) -> Placement:
    """`placement` on the run's MoE layers (`Placement.on_layers`: an engine map's rows, vLLM's one per
    MoE layer, go to the run's MoE layers in order): the layers of its `layers` rows, else those its
    steps recorded. Any other placement as it is. Raises PlacementError for a map of another row count."""
    if not placement.moe_rows:
        return placement
    layers = store.layers(run_id)
    ids = layers.layer if not layers.empty else store.layer_totals(run_id).layer
    return placement.on_layers([int(v) for v in ids])


def dispatch_of_run(store: Store, run_id: str) -> str:
    """The dispatch of the engine that recorded the run (`ENGINE_OF_SOURCE`), "even" for any other source."""
    info = store.run_info(run_id) or {}
    return ENGINE_OF_SOURCE.get(str(info.get("source") or ""), "even")




def _route_keys(placement: Placement, layer: int, num_experts: int, dispatch: str,
                homes_known: bool) -> dict[str, Any]:
    """What `slot_ranks` reads of a routes row besides its routing, as `Store.route_groups` keys: nothing
    where every expert has one copy (every rule sends a slot to it) or the copy is drawn apart from the
    token (even, SGLang dynamic, SGLang static of unknown homes); the recorded rank for SGLang static
    of known homes; each slot's copy number, counted in the store, for vLLM and TensorRT-LLM
    (`COPY_COUNTERS`)."""
    copies = np.bincount(placement.slots(layer, num_experts)[1], minlength=num_experts)
    if int(copies.max(initial=1)) <= 1 or dispatch in ("even", "sglang-dynamic"):
        return {}
    if dispatch == "sglang-static":
        return {"by_rank": True} if homes_known else {}
    counter, by_rank = COPY_COUNTERS[dispatch]
    return {"slot_copies": SlotCopies(tuple(int(c) for c in copies), counter, TRTLLM_BLOCK_SLOTS,
                                      placement.ranks if by_rank else None)}


def rank_tokens(store: Store, run_id: str, placement: Placement, experts_of: Mapping[int, int], dispatch: str,
                window_steps: int | None = None, tags: dict[str, str] | None = None,
                progress: bool = False) -> dict[int, dict]:
    """{layer: {window_start (None: the run): (tokens [R], slots [R])}} from the routes rows of the
    layers in `experts_of` ({layer: its routed experts}): the distinct tokens and the slots each rank
    serves (`moescope.metrics.ranks.expected_rank_tokens`). DuckDB counts the rows per window and
    routing (`Store.route_groups`, with the keys the dispatch reads: `_route_keys`, each slot's copy
    number for vLLM and TensorRT-LLM) and the figures are computed once per group. Empty without
    routes; `progress` shows a bar."""
    from tqdm import tqdm

    out: dict[int, dict] = {}
    ranks = placement.ranks
    # the rows' ranks are the expert-parallel ranks when as many ranks recorded the run
    homes_known = ranks > 1 and int(store.step_totals(run_id).get("ranks") or 0) == ranks
    for layer in tqdm(sorted(experts_of), desc="tokens per rank", unit="layer", disable=not progress,
                      leave=False):
        keys = _route_keys(placement, layer, experts_of[layer], dispatch, homes_known)
        sums: dict[int | None, tuple[np.ndarray, np.ndarray]] = {}
        for group in store.route_groups(run_id, layer, window_steps, tags=tags, **keys):
            found = slot_ranks(group.routes, placement, layer, experts_of[layer], dispatch, homes_known)
            starts, index = np.unique(group.window, return_inverse=True)
            tokens, slots = expected_rank_tokens(found.row, found.rank, found.prob, ranks, index, len(starts),
                                                 found.unknown_home, group.count)
            for i, start in enumerate(starts):
                key = None if window_steps is None else int(start) * window_steps
                before = sums.get(key, (0.0, 0.0))
                sums[key] = (before[0] + tokens[i], before[1] + slots[i])
        if sums:
            out[layer] = dict(sorted(sums.items(), key=lambda kv: -1 if kv[0] is None else kv[0]))
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
    dispatch = check_dispatch(dispatch or dispatch_of_run(store, run_id))
    split = DISPATCH[dispatch][0]
    placement = placement_for_run(store, run_id, placement)
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
