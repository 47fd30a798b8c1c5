"""Megatron-core's router trace (`--moe-routing-trace-path DIR`): `router_trace_rank{r}.jsonl`.

One JSON line per router call (megatron/core/transformer/moe/router_tracer: one record per step,
block and layer): `step`, `stage`, `block`, `layer`, `rank`, `num_tokens`, `topk`, `top_indices`
(`num_tokens` lists of `topk` expert ids). A (step, stage, rank) is one step of that rank; several
calls of one layer in a step (micro-batches) are its sequences, in file order, positions counting
the rows of each call. Layers keep the number the trace gives (the module's index in its pipeline
stage). Records of multi-token-prediction heads (`block: "mtp"`, with `mtp_idx`) are left out and
counted: their layer numbers repeat the decoder's.

`stage` is the tracer's name for the point in the router where it recorded ("pre_dispatch": the
top-k before tokens are dispatched to experts), not a pipeline-parallel stage: steps are tagged
`trace_stage=<stage>`. The tracer writes a step's records together (it flushes at each step), so
records are read line by line and a step ends where the next begins; a step that appears again
after another is refused as the same records read twice. Expert ids must be in 0..E-1 (E from
--num-experts, else the --max-experts limit): the trace has no "not computed" marker.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import numpy as np

from moescope.ingest.importers.fields import DEFAULT_LIMIT, INT32_MAX, ExpertLimit, check_expert_ids, json_int
from moescope.ingest.importers.tables import (
    LayerRoutes,
    SourceData,
    SourceFormatError,
    SourceStep,
    StepStream,
    file_time,
)

TRACE_FILE = re.compile(r"router_trace_rank(\d+)\.jsonl")
FIELDS = ("step", "stage", "block", "layer", "rank", "num_tokens", "topk", "top_indices")
MTP = "records of multi-token-prediction heads (block 'mtp') left out"
STAGE_TAG = "trace_stage"


def files(paths: list[str]) -> list[str]:
    """The trace files an import of `paths` reads (a folder: its router_trace_rank*.jsonl)."""
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


def read(paths: list[str], limit: ExpertLimit = DEFAULT_LIMIT) -> SourceData:
    """Every (step, stage, rank) of the traces, read lazily, one router call at a time; a bad record
    raises SourceFormatError naming the file, the line and the field."""
    data = SourceData(steps=[])
    data.steps = StepStream(lambda: _steps(files(paths), limit, data))
    return data


def _steps(paths: list[str], limit: ExpertLimit, data: SourceData) -> Iterator[SourceStep]:
    data.notes.clear()
    for path in paths:
        ts = file_time(path)
        current = None
        calls: dict[int, int] = {}  # per layer of the step in progress: its calls so far (micro-batches)
        rows: dict[int, int] = {}  # and its token rows so far
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path} line {number}"
                record = _record(line, where)
                if record["block"] != "decoder" or "mtp_idx" in record:
                    data.notes[MTP] += 1
                    continue
                ids = _indices(record, where, limit)
                key = (record["step"], str(record["stage"]), record["rank"])
                if key != current:
                    current, calls, rows = key, {}, {}
                layer = record["layer"]
                call, first = calls.get(layer, 0), rows.get(layer, 0)
                calls[layer], rows[layer] = call + 1, first + len(ids)
                n = len(ids)
                routes = LayerRoutes(expert_ids=ids.astype(np.int32), token=np.arange(first, first + n, dtype=np.int32),
                                     sequence=np.full(n, call, dtype=np.int32), position=np.arange(n, dtype=np.int32))
                yield SourceStep(step=key[0], ts=ts, rank=key[2], tags={STAGE_TAG: key[1]}, routes={layer: routes},
                                 where=where)


def _record(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise SourceFormatError(f"{where}: not valid JSON ({e}); is the file truncated?") from e
    except RecursionError as e:
        raise SourceFormatError(f"{where}: JSON nested too deeply to be a trace record") from e
    if not isinstance(record, dict) or not set(FIELDS) <= set(record):
        raise SourceFormatError(f"{where}: a trace record needs the fields {', '.join(FIELDS)}")
    json_int(record["step"], "step", where)
    json_int(record["layer"], "layer", where, high=INT32_MAX)
    json_int(record["rank"], "rank", where, high=INT32_MAX)
    json_int(record["num_tokens"], "num_tokens", where)
    json_int(record["topk"], "topk", where, low=1, high=INT32_MAX)
    if not isinstance(record["stage"], str):
        raise SourceFormatError(f"{where}: stage must be a string (the tracer writes \"pre_dispatch\")")
    return record


def _indices(record: dict, where: str, limit: ExpertLimit) -> np.ndarray:
    tokens, topk, rows = record["num_tokens"], record["topk"], record["top_indices"]
    if not isinstance(rows, list) or len(rows) != tokens:
        raise SourceFormatError(f"{where}: top_indices must hold num_tokens={tokens} rows")
    if not tokens:
        return np.zeros((0, topk), dtype=np.int64)
    try:
        ids = np.asarray(rows)
    except (ValueError, RecursionError) as e:
        raise SourceFormatError(f"{where}: top_indices rows differ in length; expected {topk} ids each") from e
    if ids.shape != (tokens, topk) or ids.dtype.kind not in "iu":
        raise SourceFormatError(f"{where}: top_indices must be {tokens} x {topk} integer expert ids, got "
                                f"{ids.dtype} {ids.shape}")
    return check_expert_ids(ids, f"{where} top_indices", limit, ("token row", "slot"), not_computed=False)
