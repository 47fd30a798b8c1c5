"""A check that runs a model (the jitter check, the engine-vs-reference mismatch) written as a run
of the store.

A check's run is the model as the probe would describe it (`moescope.core.records.RunInfo`: rank 0
of 1, its parameters, its MoE layers), with the check's name as its source: its `runs` and `layers`
rows come from the store's one builder (`moescope.store.schema.run_tables`). The check's own rows
are written first and the run's rows last, so that the run appears complete or not at all.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from moescope.core.records import LayerInfo, RunInfo
from moescope.probe.adapters import MoELayer

if TYPE_CHECKING:
    from moescope.store.location import StoreLocation

__all__ = ["model_run", "write_check_run"]


def model_run(model: nn.Module, layers: Sequence[MoELayer], run_id: str, started_at: dt.datetime,
              tags: Mapping[str, str] | None = None) -> RunInfo:
    """`model` with its MoE `layers` as run `run_id` of one process (rank 0 of 1).

    Returns:
        A RunInfo: every parameter of the model, the routed experts' (each layer's experts times
            their parameters), and a `LayerInfo` per layer.
    """
    return RunInfo(
        run_id=run_id, started_at=started_at, model_class=type(model).__name__,
        total_params=sum(p.numel() for p in model.parameters()),
        routed_expert_params=sum(layer.params_per_expert * layer.num_experts for layer in layers),
        tags=dict(tags or {}), layers=tuple(LayerInfo(
            layer=layer.index, module=layer.name, family=layer.family, num_experts=layer.num_experts,
            top_k=layer.top_k, params_per_expert=layer.params_per_expert, zero_experts=layer.zero_experts,
            expert_capacity=layer.expert_capacity) for layer in layers))


def write_check_run(store: str | os.PathLike | StoreLocation, run: RunInfo, source: str,
                    rows: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], *, new_run: bool = True) -> None:
    """Write a check's `rows` (table, rows as dicts) into run `run.run_id`, then, with `new_run`, the
    run's `layers` rows and its `runs` row (source `source`) last.

    Args:
        store: a folder or a URL.
        run: the run (`model_run`).
        source: what the `runs` row says recorded it ("jitter", "mismatch").
        rows: the check's own tables, written in order; a table without rows is left out.
        new_run: False: the run is one the store holds already; only `rows` are added to it.

    Raises:
        OSError: when the store refused rows (what was written before stays, without a `runs` row).
    """
    import pyarrow as pa

    from moescope.store.location import open_location
    from moescope.store.schema import SCHEMAS, run_tables
    from moescope.store.writer import run_writer

    location = open_location(store)
    tables = [(table, pa.Table.from_pylist(list(data), schema=SCHEMAS[table])) for table, data in rows if data]
    if new_run:
        own = run_tables(run, source)
        tables += [(table, own[table]) for table in ("layers", "runs") if table in own]
    with run_writer(location, run.run_id) as writer:
        for table, data in tables:
            if not writer.write(table, data):
                raise OSError(f"the store {location.redacted!r} did not take the {table} rows "
                              f"({writer.last_error or 'see the log'})")
