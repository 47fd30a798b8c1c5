"""The trace checks over a run already in a store: what `moescope check STORE --run RUN` runs.

The routes rows of every layer are put back together as the engines return them, one
`(positions, layers, top_k)` array per (step, rank, sequence), and fed to
`moescope.ingest.trace_checks.TraceChecks`. What the store no longer holds cannot be checked
again: rows not computed (-1) were left out on import, and a sequence's token count is not stored,
so `sentinel_rows` and `row_count` are the import's or the proxy's findings (`trace_findings`).
"""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa

from moescope.ingest.trace_checks import EngineMap, TraceChecks, TraceFinding
from moescope.store import Store
from moescope.store.schema import trace_findings_table

# the checks a stored run can be given again (the others need what an import leaves out)
RECHECKED = ("zero_rows", "repeated_ids", "final_row_zero", "physical_ids")

__all__ = ["RECHECKED", "check_stored_trace", "findings_table"]


def check_stored_trace(store: Store, run_id: str, engine_map: EngineMap | None = None,
                       page_rows: int = 262_144) -> TraceChecks:
    """Run the trace checks over a stored run's routes, a page of whole steps at a time.

    Args:
        store: the store, open.
        run_id: a run of it (`Store.check_run` names the runs when it is not one).
        engine_map: the engine's map (with the load it recorded, where it has one), for `physical_ids`.
        page_rows: routes rows read at a time (whole steps).

    Returns:
        The checks' sums: `.findings()` says what they found, `.rows` how many token rows were read.

    Raises:
        ValueError: an unknown run (from `Store.check_run`).
    """
    run_id = store.check_run(run_id)
    checks = TraceChecks(engine_map)
    for page in store.sequence_routes(run_id, page_rows):
        _add_page(checks, page)
    return checks


def _add_page(checks: TraceChecks, page: pa.Table) -> None:
    if not page.num_rows:
        return
    step = page.column("step").to_numpy().astype(np.int64)
    rank = page.column("rank").to_numpy(zero_copy_only=False)
    sequence = page.column("sequence").to_numpy().astype(np.int64)
    position = page.column("position").to_numpy(zero_copy_only=False).astype(np.int64)
    layer = page.column("layer").to_numpy().astype(np.int64)
    lists = page.column("expert_ids").combine_chunks()
    widths = lists.value_lengths().to_numpy(zero_copy_only=False)
    k = int(widths.max())
    ids = np.full((page.num_rows, k), -1, dtype=np.int64)
    values = lists.flatten().to_numpy(zero_copy_only=False)
    rows = np.repeat(np.arange(page.num_rows), widths)
    ids[rows, np.arange(values.size) - np.repeat(np.cumsum(widths) - widths, widths)] = values
    numbers = np.unique(layer)
    layers = {int(v): i for i, v in enumerate(numbers)}
    column = np.array([layers[int(v)] for v in layer]) if len(layers) > 1 else np.zeros(len(layer), dtype=np.int64)
    keys = np.stack([step, rank.astype(np.int64), sequence], axis=1)
    bounds = np.flatnonzero((keys[1:] != keys[:-1]).any(axis=1)) + 1
    for start, end in zip([0, *bounds.tolist()], [*bounds.tolist(), page.num_rows]):
        at = position[start:end]
        first = int(at.min())
        trace = np.full((int(at.max()) - first + 1, len(layers), k), -1, dtype=np.int64)
        trace[at - first, column[start:end]] = ids[start:end]
        kept = np.unique(at - first)  # positions the store holds (rows not computed were left out)
        label = f"step {int(step[start])} rank {int(rank[start])} sequence {int(sequence[start])}"
        checks.add(trace[kept], label, first_row=first, layer_numbers=numbers.tolist())


def findings_table(run_id: str, findings: list[TraceFinding]) -> pa.Table:
    """The findings of `moescope check --save` as `trace_findings` rows (origin "check")."""
    return trace_findings_table(run_id, dt.datetime.now(dt.timezone.utc), "check", findings)
