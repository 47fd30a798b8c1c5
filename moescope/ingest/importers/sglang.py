"""SGLang's expert-distribution recorder dumps and per-request routed experts, read from files.

Recorder dumps come from `POST /start_expert_distribution_record` then
`POST /dump_expert_distribution_record`, as `expert_distribution_recorder_{time}[_{rank}].pt`
written with `torch.save`. They are loaded with `torch.load(weights_only=True)` only: a file that
needs anything beyond tensors, lists, dicts and numbers is refused, never unpickled.

- Mode `stat` / `stat_approx`: `{rank, logical_count, average_utilization_rate_over_window}`;
  `logical_count` is int32 `[buffered_passes, layers, logical_experts]`, a circular buffer. While
  it has unused (all-zero) rows, the used rows are the passes in time order: one step each. Once
  every row is used it may have wrapped, and its rows are no longer in time order: the whole buffer
  becomes one step (a window), unless `in_order` says the buffer was unbounded (buffer size -1).
- Modes `per_pass` / `per_token`: `{records, last_physical_to_logical_map [layers, physical]}`;
  a record per forward pass and rank (`forward_pass_id`, `rank`, `gatherer_key`,
  `global_physical_count [layers, physical]`). Physical expert slots are mapped to logical experts
  through the map. `per_token` records add `input_ids`, `positions`, `extend_seq_lens`,
  `forward_mode` and `topk_ids_of_layer [layers, tokens, 8]` (physical ids, padded with -1): routes.
- Legacy CSV `layer_id,expert_id,count`: one window per file, read line by line.
- JSON `/generate` output carrying `meta_info.routed_experts` (see `responses`: base64 of
  little-endian int32, shape (seq_len - 1, num_hidden_layers, top_k)): one step per request.

The map under EPLB: SGLang's recorder dumps the map in force when the dump is taken, and says so
("This may change during recording, so here we say it is the 'last' one"). With expert-parallel
load balancing rebalancing during a recording, passes recorded before a rebalance were routed
under an earlier map, and mapping their physical slots with the last one can credit their tokens
to the wrong logical experts; nothing in the dump tells which passes those are. Each step of a
per_pass / per_token dump is tagged `expert_map=<first 12 hex of the map's sha256>`, so dumps
taken under different maps are told apart (`moescope query` tag values, the compare page). To be
exact, dump after each rebalance (or record with rebalancing off): each dump's map then covers
its passes.

Layers whose counts are zero throughout (dense layers) are left out. Counts are slots (top-k
assignments); tokens are slots / top-k, so count-only dumps need `--top-k`. A .pt dump is loaded
whole (torch.load); CSV and JSON Lines files are read a piece at a time.
"""

from __future__ import annotations

import csv
import datetime as dt
import hashlib
import os
import re
from collections.abc import Iterator

import numpy as np

from moescope.ingest.importers.fields import DEFAULT_LIMIT, INT32_MAX, INT64_MAX, ExpertLimit, json_time
from moescope.ingest.importers.responses import is_sglang, sequence_pieces, sglang_sequences
from moescope.ingest.importers.tables import (
    LayerRoutes,
    SourceData,
    SourceFormatError,
    SourceStep,
    StepStream,
    file_time,
    split_routed_rows,
)
from moescope.ingest.importers.vllm import response_groups

DUMP_NAME = re.compile(r"expert_distribution_recorder_(\d+(?:\.\d+)?)(?:_(\d+))?\.pt$")
CSV_HEADER = ["layer_id", "expert_id", "count"]
WRAPPED = ("stat buffer full (rows may have wrapped around and lost time order): imported as one window step; "
           "pass --in-order if the buffer was unbounded")
NOT_COMPUTED = "token rows with every slot -1 left out"
MAP_TAG = "expert_map"


def files(paths: list[str]) -> list[str]:
    """The files an import of `paths` reads (SGLang takes files, not folders)."""
    return list(paths)


def dump_time(path: str) -> dt.datetime:
    """The time in a recorder dump's name, else the file's modification time. Raises
    SourceFormatError for a name whose time is not a Unix time."""
    match = DUMP_NAME.search(os.path.basename(path))
    if match:
        return json_time(float(match.group(1)), "the time in the file name (expert_distribution_recorder_{time})",
                         path)
    return file_time(path)


def map_hash(mapping: np.ndarray) -> str:
    """The first 12 hex of the sha256 of a physical-to-logical map (int64, C order)."""
    return hashlib.sha256(np.ascontiguousarray(mapping, dtype=np.int64).tobytes()).hexdigest()[:12]


def load_pt(path: str) -> dict:
    """A recorder dump via `torch.load(weights_only=True)`; raises SourceFormatError, never unpickles."""
    import torch

    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any refusal (pickle payload, truncated zip) is a bad file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SourceFormatError(
            f"{path}: torch.load(weights_only=True) refused the file ({first}). Only the recorder's tensor "
            "dicts are read; a truncated file or one holding other Python objects is not loaded") from e
    if not isinstance(payload, dict):
        raise SourceFormatError(f"{path}: holds a {type(payload).__name__}, not the recorder's dict")
    return payload


def _tensor(value, ndim: int, what: str, where: str) -> np.ndarray:
    import torch

    if not isinstance(value, torch.Tensor):
        raise SourceFormatError(f"{where}: {what} must be a tensor, not {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise SourceFormatError(f"{where}: {what} must hold integers, not {value.dtype}")
    if value.ndim != ndim:
        raise SourceFormatError(f"{where}: {what} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    return value.numpy().astype(np.int64)


def _int_list(value, what: str, where: str) -> np.ndarray:
    import torch

    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) for v in value):
        raise SourceFormatError(f"{where}: {what} must be a list of integers")
    return np.asarray(value, dtype=np.int64)


def _stat_steps(payload: dict, path: str, first_step: int, ts: dt.datetime, in_order: bool,
                data: SourceData) -> list[SourceStep]:
    counts = _tensor(payload["logical_count"], 3, "logical_count", path)
    if counts.size and counts.min() < 0:
        raise SourceFormatError(f"{path}: logical_count holds negative counts")
    rank = payload.get("rank", 0)
    if not isinstance(rank, int):
        raise SourceFormatError(f"{path}: rank must be an integer")
    used = counts.reshape(len(counts), -1).any(axis=1)
    if used.all() and not in_order and len(counts) > 1:
        data.notes[WRAPPED] += 1
        windows = [counts.sum(axis=0)]
    else:
        windows = list(counts[used])
    data.num_experts = counts.shape[2]
    return [SourceStep(step=first_step + i, ts=ts, rank=rank, where=path,
                       counts={layer: window[layer] for layer in range(window.shape[0])})
            for i, window in enumerate(windows)]


def _detail_steps(payload: dict, path: str, ts: dt.datetime, data: SourceData, limit: ExpertLimit,
                  ) -> list[SourceStep]:
    mapping = _tensor(payload["last_physical_to_logical_map"], 2, "last_physical_to_logical_map", path)
    layers, physical = mapping.shape
    if mapping.size and (mapping.min() < 0 or mapping.max() >= limit.value):
        bad = int(mapping.min()) if mapping.min() < 0 else int(mapping.max())
        raise SourceFormatError(f"{path}: last_physical_to_logical_map holds expert id {bad}, outside "
                                f"0..{limit.value - 1} ({limit.name})")
    tags = {MAP_TAG: map_hash(mapping)}
    experts = int(mapping.max()) + 1 if mapping.size else 0
    data.num_experts = max(data.num_experts or 0, experts)
    records = payload["records"]
    if not isinstance(records, list):
        raise SourceFormatError(f"{path}: records must be a list of dicts")
    steps: dict[tuple[int, int], SourceStep] = {}
    for number, record in enumerate(records):
        where = f"{path} record {number}"
        if not isinstance(record, dict) or not {"forward_pass_id", "rank", "global_physical_count"} <= set(record):
            raise SourceFormatError(f"{where}: a record needs forward_pass_id, rank and global_physical_count")
        step_id, rank = record["forward_pass_id"], record["rank"]
        if not isinstance(step_id, int) or not isinstance(rank, int):
            raise SourceFormatError(f"{where}: forward_pass_id and rank must be integers")
        physical_count = _tensor(record["global_physical_count"], 2, "global_physical_count", where)
        if physical_count.shape != (layers, physical):
            raise SourceFormatError(f"{where}: global_physical_count has shape {physical_count.shape}, but the map "
                                    f"is {layers} layers x {physical} physical experts")
        step = steps.setdefault((step_id, rank), SourceStep(step=step_id, ts=ts, rank=rank, tags=dict(tags),
                                                            where=where))
        if "topk_ids_of_layer" in record:
            _add_token_routes(step, record, mapping, physical_count, where, data)
            continue
        for layer in range(layers):
            logical = np.bincount(mapping[layer], weights=physical_count[layer], minlength=experts).astype(np.int64)
            step.counts[layer] = step.counts[layer] + logical if layer in step.counts else logical
    return list(steps.values())


def _add_token_routes(step: SourceStep, record: dict, mapping: np.ndarray, physical_count: np.ndarray,
                      where: str, data: SourceData) -> None:
    layers, physical = mapping.shape
    ids = _tensor(record["topk_ids_of_layer"], 3, "topk_ids_of_layer", where)
    if ids.shape[0] != layers:
        raise SourceFormatError(f"{where}: topk_ids_of_layer has {ids.shape[0]} layers, the map {layers}")
    tokens = ids.shape[1]
    input_ids = _int_list(record.get("input_ids"), "input_ids", where)
    positions = _int_list(record.get("positions"), "positions", where)
    if len(input_ids) != tokens or len(positions) != tokens:
        raise SourceFormatError(f"{where}: topk_ids_of_layer has {tokens} tokens but input_ids has "
                                f"{len(input_ids)} and positions {len(positions)}")
    if ids.size and (ids.max() >= physical or ids.min() < -1):
        raise SourceFormatError(f"{where}: topk_ids_of_layer holds ids outside -1..{physical - 1} (physical experts)")
    for layer in range(layers):
        row = ids[layer][ids[layer] >= 0]
        if not np.array_equal(np.bincount(row, minlength=physical), physical_count[layer]):
            raise SourceFormatError(f"{where}: global_physical_count of layer {layer} disagrees with the ids in "
                                    "topk_ids_of_layer; the record is damaged")
    lens = record.get("extend_seq_lens")
    if lens is None:  # decode: one new token per request
        sequence = np.arange(tokens, dtype=np.int32)
    else:
        lens = _int_list(lens, "extend_seq_lens", where)
        if lens.sum() != tokens or (lens < 0).any():
            raise SourceFormatError(f"{where}: extend_seq_lens sum to {int(lens.sum())}, not the {tokens} tokens")
        sequence = np.repeat(np.arange(len(lens), dtype=np.int32), lens)
    logical = np.where(ids >= 0, mapping[np.arange(layers)[:, None, None], np.clip(ids, 0, physical - 1)], -1)
    per_layer, skipped = split_routed_rows(logical.transpose(1, 0, 2), where)
    if skipped:
        data.notes[NOT_COMPUTED] += skipped
    if step.routes:
        raise SourceFormatError(f"{where}: forward pass {step.step} of rank {step.rank} has two per-token records")
    for layer, (rows, layer_ids) in per_layer.items():
        step.routes[layer] = LayerRoutes(expert_ids=layer_ids, token=rows.astype(np.int32), sequence=sequence[rows],
                                         position=positions[rows].astype(np.int32), token_ids=input_ids[rows])
    mode = record.get("forward_mode")
    if isinstance(mode, int):
        step.tags["forward_mode"] = str(mode)


def _csv_counts(path: str, limit: ExpertLimit) -> dict[int, dict[int, int]]:
    """Slots per (layer, expert) of a legacy CSV, summed over its lines, read line by line."""
    out: dict[int, dict[int, int]] = {}
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip() for h in header] != CSV_HEADER:
            raise SourceFormatError(f"{path}: a legacy SGLang CSV starts with the header {','.join(CSV_HEADER)}")
        for number, row in enumerate(reader, 2):
            if not row:
                continue
            try:
                layer, expert, count = (int(v) for v in row)
            except ValueError as e:
                raise SourceFormatError(f"{path}: line {number} is not three integers layer_id,expert_id,count") from e
            for field, value, high in (("layer_id", layer, INT32_MAX), ("expert_id", expert, limit.value - 1),
                                       ("count", count, INT64_MAX)):
                if not 0 <= value <= high:
                    raise SourceFormatError(f"{path}: line {number}: {field} {value} is outside 0..{high}")
            total = out.setdefault(layer, {}).get(expert, 0) + count
            if total > INT64_MAX:
                raise SourceFormatError(f"{path}: line {number}: the counts of layer {layer}, expert {expert} sum "
                                        f"past {INT64_MAX}")
            out[layer][expert] = total
    return out


def read(paths: list[str], num_layers: int | None = None, top_k: int | None = None,
         in_order: bool = False, num_experts: int | None = None, limit: ExpertLimit = DEFAULT_LIMIT) -> SourceData:
    """Every step in the files, read lazily (each pass reads them again); a bad file raises
    SourceFormatError naming the file and what was expected.

    `num_layers` and `top_k` unflatten per-request routed experts; `in_order` says a full stat
    buffer was unbounded, so its rows are in time order.
    """
    ordered = sorted(paths, key=dump_time)
    data = SourceData(steps=[])
    data.steps = StepStream(lambda: _steps(ordered, num_layers, top_k, in_order, num_experts, limit, data))
    return data


def _kind(path: str) -> str:
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":  # torch.save: a zip, or an old pickle stream
        return "dump"
    return "csv" if head.lstrip().startswith(b"layer_id") else "responses"


def _steps(paths: list[str], num_layers: int | None, top_k: int | None, in_order: bool, num_experts: int | None,
           limit: ExpertLimit, data: SourceData) -> Iterator[SourceStep]:
    data.notes.clear()
    data.checks.reset()
    kinds: set[str] = set()

    def found(kind: str) -> None:
        kinds.add(kind)
        if len(kinds) > 1:
            raise SourceFormatError(f"the files mix SGLang formats ({', '.join(sorted(kinds))}); import each kind as "
                                    "its own run")

    csv_files: list[tuple[str, dict]] = []
    number = 0
    for path in paths:
        kind = _kind(path)
        if kind == "csv":
            found("csv")
            csv_files.append((path, _csv_counts(path, limit)))
            continue
        if kind == "responses":
            found("responses")
            for step in _responses(path, num_layers, top_k, number, limit, data):
                number = step.step + 1
                yield step
            continue
        payload = load_pt(path)
        if "logical_count" in payload:
            steps = _stat_steps(payload, path, number, dump_time(path), in_order, data)
            found("stat")
        elif "records" in payload and "last_physical_to_logical_map" in payload:
            steps = _detail_steps(payload, path, dump_time(path), data, limit)
            found("detail")
        else:
            raise SourceFormatError(f"{path}: not an expert-distribution dump: expected the keys logical_count "
                                    f"(stat mode) or records and last_physical_to_logical_map, found "
                                    f"{sorted(map(str, payload))[:8]}")
        number += len(steps)
        yield from steps
    if csv_files:
        width = num_experts or 1 + max((e for _, c in csv_files for layer in c.values() for e in layer), default=0)
        for path, counts in csv_files:
            vectors = {}
            for layer, experts in counts.items():
                vector = np.zeros(width, dtype=np.int64)
                for expert, count in experts.items():
                    vector[expert] = count
                vectors[layer] = vector
            yield SourceStep(step=number, ts=file_time(path), counts=vectors, where=path)
            number += 1


def _responses(path: str, num_layers: int | None, top_k: int | None, first_step: int, limit: ExpertLimit,
               data: SourceData) -> Iterator[SourceStep]:
    def request_id(value):
        meta = value.get("meta_info") if isinstance(value, dict) else None
        return meta.get("id") if isinstance(meta, dict) else None

    number = first_step
    for where, bodies, batch in response_groups(path, request_id):
        if not any(is_sglang(b) for b in bodies):
            if any(isinstance(b, dict) and ("prompt_routed_experts" in b or "choices" in b) for b in bodies):
                raise SourceFormatError(f"{where}: this is an OpenAI-style (vLLM) response; import it with "
                                        "`moescope import vllm`")
            data.notes["response without meta_info.routed_experts skipped"] += 1
            continue
        sequences = sglang_sequences(bodies, num_layers, top_k, where, stream=not batch)
        produced = False
        for step, skipped in sequence_pieces(sequences, number, file_time(path), where, limit, checks=data.checks):
            if skipped:
                data.notes[NOT_COMPUTED] += skipped
            produced = True
            yield step
        if not produced:
            yield SourceStep(step=number, ts=file_time(path), where=where)
        number += 1
