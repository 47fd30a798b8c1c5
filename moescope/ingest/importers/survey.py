"""The checking pass of an import: every step a reader yields, checked, before anything is written.

`survey` reads the stream once and keeps only what the writing pass needs (the experts and top-k
of each layer, the ranks, the first time), never the routing itself, so its memory is one chunk's.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from moescope.ingest.importers.fields import MAX_EXPERTS, check_step_numbers
from moescope.ingest.importers.source import LayerShape, SourceFormatError, SourceStep

DENSE = "{} dense layers (zero counts throughout) left out"


@dataclass
class Survey:
    """What the checking pass found: enough to write, nothing of the routing itself."""

    shapes: dict[int, LayerShape]
    ranks: set[int]
    step_numbers: set[int]
    started_at: dt.datetime
    rows: int  # route rows and count vectors, for the writing pass's progress
    dense: set[int] = field(default_factory=set)  # counted layers zero throughout, left out


def piece_rows(step: SourceStep) -> int:
    return sum(len(r.expert_ids) for r in step.routes.values()) + len(step.counts)


def survey(steps: Iterable[SourceStep], num_experts: int | None, top_k: int | None, files_state: Callable[[], tuple],
           where: str = "the source", max_experts: int = MAX_EXPERTS,
           progress: Callable[[int], None] = lambda rows: None) -> Survey:
    """Check every step; return the layers' shapes and what the writing pass needs.

    Experts: `num_experts` if given, else what the files state (`files_state()` -> (experts, top_k),
    read after the pass, as readers learn them while reading), else the largest id seen + 1 (an
    expert never chosen above it would be missed; pass --num-experts to be exact). Raises
    SourceFormatError when a step appears twice, an id or count vector does not fit the experts,
    top-k changes within a layer or a number does not fit the store (a token that chose an expert
    twice is kept: the trace checks report it, `moescope.ingest.trace_checks`);
    ValueError when counted layers have no top-k or the experts exceed `max_experts`.
    """
    from moescope.ingest.importers.tables import check_tags  # tables imports this module

    widths: dict[int, int] = {}
    largest: dict[int, int] = {}
    counted: dict[int, int] = {}
    routed_counts: set[int] = set()
    seen: set[tuple] = set()
    previous = None
    ranks: set[int] = set()
    numbers: set[int] = set()
    started: dt.datetime | None = None
    rows = 0
    for step in steps:
        check_step_numbers(step.step, step.rank, [*step.routes, *step.counts], step.where)
        try:
            check_tags(step.tags)
        except ValueError as e:
            raise SourceFormatError(f"{step.where}: {e}") from e
        key = step.key()
        if key != previous:
            if key in seen:
                raise SourceFormatError(f"{step.where}: step {step.step} of rank {step.rank} appears twice (the same "
                                        "records in two files?); import each recording once")
            seen.add(key)
            previous = key
        ranks.add(step.rank)
        numbers.add(step.step)
        started = step.ts if started is None else min(started, step.ts)
        for layer, routes in step.routes.items():
            _check_routes(step, layer, routes.expert_ids, routes.token, widths, largest, num_experts)
        for layer, counts in step.counts.items():
            if counts.ndim != 1 or (counts.size and counts.min() < 0):
                raise SourceFormatError(f"{step.where}: the counts of layer {layer} in step {step.step} must be a "
                                        "vector of non-negative integers")
            if counted.setdefault(layer, len(counts)) != len(counts):
                raise SourceFormatError(f"{step.where}: layer {layer} counts {counted[layer]} experts in one step "
                                        f"and {len(counts)} in step {step.step}")
            if counts.any():
                routed_counts.add(layer)
        n = piece_rows(step)
        rows += n
        progress(n)
    if started is None:
        raise SourceFormatError(f"{where}: no routed step found, so there is nothing to import")
    files_experts, files_k = files_state()
    stated = num_experts if num_experts is not None else files_experts
    k_stated = top_k if top_k is not None else files_k
    dense = set(counted) - routed_counts
    shapes = _shapes(widths, largest, {layer: n for layer, n in counted.items() if layer not in dense}, stated,
                     k_stated, where)
    widest = max((s.num_experts for s in shapes.values()), default=0)
    if widest > max_experts:
        raise ValueError(f"{where}: the model has {widest} experts per layer, more than the --max-experts limit "
                         f"{max_experts}; pass --max-experts {widest} if that is right")
    return Survey(shapes=shapes, ranks=ranks, step_numbers=numbers, started_at=started, rows=rows, dense=dense)


def _check_routes(step: SourceStep, layer: int, ids: np.ndarray, token: np.ndarray, widths: dict[int, int],
                  largest: dict[int, int], num_experts: int | None) -> None:
    k = ids.shape[1]
    if widths.setdefault(layer, k) != k:
        raise SourceFormatError(f"{step.where}: layer {layer} routes {widths[layer]} experts per token in one "
                                f"step and {k} in step {step.step}; top-k must not change within a run")
    if not len(ids):
        return
    top = int(ids.max())
    largest[layer] = max(largest.get(layer, -1), top)
    if num_experts is not None and top >= num_experts:
        row, slot = (int(i) for i in np.argwhere(ids >= num_experts)[0])
        raise SourceFormatError(f"{step.where}: expert id {int(ids[row, slot])} at token row {int(token[row])}, "
                                f"layer {layer}, slot {slot} is outside 0..{num_experts - 1} (--num-experts "
                                f"{num_experts}; check out_of_range)")


def _shapes(widths: dict[int, int], largest: dict[int, int], counted: dict[int, int], stated: int | None,
            k_stated: int | None, where: str) -> dict[int, LayerShape]:
    if stated is not None and stated < 1:
        raise ValueError(f"the number of experts must be positive, not {stated}")
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
                                    f"{experts} experts (ids 0..{experts - 1}; check out_of_range)")
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
