"""Megatron-core's router trace (`--moe-routing-trace-path DIR`): `router_trace_rank{r}.jsonl`.

One JSON line per router call: `step`, `stage`, `block`, `layer`, `rank`, `num_tokens`, `topk`,
`top_indices` (`num_tokens` lists of `topk` expert ids). A (step, stage, rank) is one step of that
rank, tagged `stage=<stage>`; several calls of one layer in a step (micro-batches) are its
sequences, in file order, positions counting the rows of each call. Layers keep the number the
trace gives (the module's index in its pipeline stage). Records of multi-token-prediction heads
(`block: "mtp"`) are left out and counted: their layer numbers repeat the decoder's.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re

import numpy as np

from moescope.store.importers.tables import LayerRoutes, SourceData, SourceFormatError, SourceStep, file_time

TRACE_FILE = re.compile(r"router_trace_rank(\d+)\.jsonl")
FIELDS = ("step", "stage", "block", "layer", "rank", "num_tokens", "topk", "top_indices")
MTP = "records of multi-token-prediction heads (block 'mtp') left out"


def _files(paths: list[str]) -> list[str]:
    out = []
    for path in paths:
        if os.path.isdir(path):
            found = [os.path.join(path, n) for n in sorted(os.listdir(path)) if TRACE_FILE.fullmatch(n)]
            if not found:
                raise SourceFormatError(f"{path}: no router_trace_rank{{r}}.jsonl in the folder")
            out += found
        else:
            out.append(path)
    return out


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read(paths: list[str]) -> SourceData:
    """Every (step, stage, rank) of the traces; raises SourceFormatError naming the file and line."""
    data = SourceData(steps=[])
    calls: dict[tuple, dict[int, list[np.ndarray]]] = {}
    times: dict[tuple, dt.datetime] = {}
    for path in _files(paths):
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path} line {number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SourceFormatError(f"{where}: not valid JSON ({e}); is the file truncated?") from e
                if not isinstance(record, dict) or not set(FIELDS) <= set(record):
                    raise SourceFormatError(f"{where}: a trace record needs the fields {', '.join(FIELDS)}")
                if not all(_is_int(record[k]) for k in ("step", "layer", "rank", "num_tokens", "topk")):
                    raise SourceFormatError(f"{where}: step, layer, rank, num_tokens and topk must be integers")
                if record["block"] != "decoder" or "mtp_idx" in record:
                    data.notes[MTP] += 1
                    continue
                ids = _indices(record, where)
                key = (record["step"], str(record["stage"]), record["rank"])
                calls.setdefault(key, {}).setdefault(record["layer"], []).append(ids)
                times.setdefault(key, file_time(path))
    for (step_id, stage, rank), layers in calls.items():
        step = SourceStep(step=step_id, ts=times[(step_id, stage, rank)], rank=rank, tags={"stage": stage})
        for layer, parts in layers.items():
            sizes = np.array([len(p) for p in parts])
            starts = np.repeat(np.cumsum(sizes) - sizes, sizes)
            total = int(sizes.sum())
            step.routes[layer] = LayerRoutes(
                expert_ids=np.concatenate(parts).astype(np.int32), token=np.arange(total, dtype=np.int32),
                sequence=np.repeat(np.arange(len(parts), dtype=np.int32), sizes),
                position=(np.arange(total) - starts).astype(np.int32))
        data.steps.append(step)
    return data


def _indices(record: dict, where: str) -> np.ndarray:
    tokens, topk, rows = record["num_tokens"], record["topk"], record["top_indices"]
    if not isinstance(rows, list) or len(rows) != tokens:
        raise SourceFormatError(f"{where}: top_indices must hold num_tokens={tokens} rows")
    if not tokens:
        return np.zeros((0, topk), dtype=np.int64)
    try:
        ids = np.asarray(rows)
    except ValueError as e:
        raise SourceFormatError(f"{where}: top_indices rows differ in length; expected {topk} ids each") from e
    if ids.shape != (tokens, topk) or ids.dtype.kind not in "iu":
        raise SourceFormatError(f"{where}: top_indices must be {tokens} x {topk} integer expert ids, got "
                                f"{ids.dtype} {ids.shape}")
    if ids.min() < 0:
        raise SourceFormatError(f"{where}: top_indices holds a negative expert id")
    return ids
