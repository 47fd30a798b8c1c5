"""The rebalance what-if: other placements fitted on one window of a run's loads, evaluated on every window.

`placement_whatif` evaluates the default layout, DeepSeek's EPLB and the seeds' load-aware mapping
(`moescope.metrics.eplb`), and with a rebalance period EPLB refitted as an engine would, on the
per-step loads of every window (`store.Store.window_loads`); `write_whatif` keeps the result in the
run's `placement_whatif` table (`moescope placement --whatif --save`). The report of the placement a
run ran with is `moescope.analyses.placement`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from moescope.analyses.placement import dispatch_of_run, placement_for_run
from moescope.metrics import signals
from moescope.metrics.dispatch import DISPATCH, check_dispatch
from moescope.metrics.eplb import eplb, load_aware
from moescope.metrics.placement import Placement, PlacementError
from moescope.metrics.ranks import balancedness_over_layers, rank_load
from moescope.store import Store

if TYPE_CHECKING:
    from moescope.store.location import StoreLocation

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
    balancedness (`moescope.metrics.ranks.balancedness_over_layers`: the forward's useful share of MoE time),
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


def default_ranks(experts: int, most: int = 8) -> int:
    """The expert-parallel size a what-if is shown at before the user picks one: the most ranks, up to
    `most`, that divide the experts and still hold two or more each, so that placements can differ
    (with one expert per rank every placement only renames the ranks). The demo model's 8 experts: 4
    ranks; 64 experts: 8; fewer than 4 experts: 1."""
    return max((r for r in range(1, max(1, most) + 1) if experts % r == 0 and experts // r >= 2), default=1)


def why_placements_coincide(experts: int, ranks: int, redundant: int) -> str | None:
    """Why every placement of `experts` experts on `ranks` ranks with `redundant` extra slots must give
    the same balancedness, whatever the loads (None when they can differ): one rank holds them all, or
    each rank holds exactly one expert and no expert can be copied."""
    if ranks == 1:
        return "one rank holds every expert, so there is nothing to place"
    if redundant == 0 and experts == ranks:
        return (f"each of the {ranks} ranks holds exactly one of the {experts} experts and there is no redundant "
                "slot, so every placement only renames the ranks")
    return None


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
    (`moescope.metrics.eplb.eplb` fitted on window `setup.fit_window`), "load-aware"
    (`moescope.metrics.eplb.load_aware`, fitted alike)
    and, with `setup.rebalance_every` N, "eplb-every-N": EPLB refitted at every N-th window after the
    fit on the window just before it (what an engine that rebalances from its last statistics does).
    Every candidate is evaluated on every window from the per-step loads (`Store.window_loads`, kept
    slots), a redundant expert's split by `dispatch` (None: the run's engine).

    Raises PlacementError for a run without loads, a fit window past the last one, or a shape EPLB
    cannot place (experts + redundant not a multiple of the ranks, ...).
    """
    dispatch = check_dispatch(dispatch or dispatch_of_run(store, run_id))
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
        schedules["current"] = [(placement_for_run(store, run_id, current), None)] * len(starts)
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
    for candidate, plan in schedules.items():
        for t, (placement, fitted_on) in enumerate(plan):
            per_layer = []
            for i, layer in enumerate(layers):
                ranks = rank_load(loads[t, i, :experts_of[layer]], placement.shares(layer, experts_of[layer], split))
                per_layer.append(ranks)
                rows.append(dict(candidate=candidate, window_start=starts[t], window_end=starts[t] + window_steps,
                                 layer=layer, fit_start=None if fitted_on is None else starts[fitted_on],
                                 rank_load=ranks, balancedness=signals.balancedness(ranks),
                                 imbalance=signals.imbalance(ranks)))
            whole = balancedness_over_layers(np.array(per_layer))
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
