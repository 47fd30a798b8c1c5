"""Routing from the engines people serve and train MoE models with, into a moescope store.

`import_files("vllm" | "sglang" | "trtllm" | "megatron", paths, store)` reads an engine's files
(one small strict reader per engine), checks all of them, and only then writes one new run with
the tables the probe writes, `source` recorded on the run. `moescope import` is its command line;
`moescope.ingest.proxy` records the same per-request routing live, in front of a vLLM or SGLang server.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

from moescope.ingest.importers.fields import MAX_EXPERTS, ExpertLimit, check_max_experts
from moescope.ingest.importers.tables import ImportSummary, SourceData, SourceFormatError, import_source
from moescope.ingest.trace_checks import EngineMap, TraceChecks
from moescope.store.location import StoreLocation, open_location

KINDS = ("vllm", "sglang", "trtllm", "megatron")


def _reader(kind: str):
    from moescope.ingest.importers import megatron, sglang, trtllm, vllm

    return {"vllm": vllm, "sglang": sglang, "trtllm": trtllm, "megatron": megatron}[kind]


def check_distinct(files: list[str]) -> None:
    """Raise ValueError when two of `files` are one file (the same resolved path) or hold the same
    bytes: importing both would count every step twice. Only files of equal size are hashed."""
    by_path: dict[str, str] = {}
    by_size: dict[int, list[str]] = {}
    for path in files:
        resolved = os.path.realpath(path)
        if resolved in by_path:
            raise ValueError(f"{by_path[resolved]} and {path} are the same file ({resolved}): importing it twice "
                             "would count its steps twice; give each file once")
        by_path[resolved] = path
        size = os.path.getsize(resolved)
        if size:
            by_size.setdefault(size, []).append(path)
    for same_size in (paths for paths in by_size.values() if len(paths) > 1):
        by_hash: dict[str, str] = {}
        for path in same_size:
            digest = _sha256(path)
            if digest in by_hash:
                raise ValueError(f"{by_hash[digest]} and {path} hold the same bytes (sha256 {digest[:16]}...): "
                                 "importing both would count every step twice; give one of them")
            by_hash[digest] = path


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_source(kind: str, paths: list[str], num_layers: int | None = None, top_k: int | None = None,
                in_order: bool = False, num_experts: int | None = None, max_experts: int = MAX_EXPERTS,
                engine_map: EngineMap | None = None) -> SourceData:
    """What the files of one engine hold, read lazily: each pass over `.steps` reads and checks them
    again, the trace checks (`SourceData.checks`; `engine_map`: the engine's map, for `physical_ids`)
    included. Raises SourceFormatError, ValueError (options, a file given twice) or
    FileNotFoundError."""
    data = _read_source(kind, paths, num_layers, top_k, in_order, num_experts, max_experts)
    data.checks = TraceChecks(engine_map)
    return data


def _read_source(kind: str, paths: list[str], num_layers: int | None, top_k: int | None, in_order: bool,
                 num_experts: int | None, max_experts: int) -> SourceData:
    if kind not in KINDS:
        raise ValueError(f"unknown source {kind!r}: choose one of {', '.join(KINDS)}")
    if not paths:
        raise ValueError("give at least one file or folder to import")
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such file or folder")
    max_experts = check_max_experts(max_experts)
    if num_experts is not None and not 1 <= num_experts <= max_experts:
        raise ValueError(f"--num-experts {num_experts} is outside 1..{max_experts} (the --max-experts limit; "
                         "raise it if the model really has that many experts)")
    reader = _reader(kind)
    check_distinct(reader.files(list(paths)))
    limit = ExpertLimit.of(num_experts, max_experts)
    if kind == "vllm":
        return reader.read(paths, limit)
    if kind == "sglang":
        return reader.read(paths, num_layers=num_layers, top_k=top_k, in_order=in_order, num_experts=num_experts,
                           limit=limit)
    if kind == "trtllm":
        return reader.read(paths, num_experts=num_experts)
    return reader.read(paths, limit)


def import_files(kind: str, paths: list[str], store: str | os.PathLike | StoreLocation, run_id: str | None = None,
                 tags: dict[str, str] | None = None, num_experts: int | None = None, top_k: int | None = None,
                 num_layers: int | None = None, model: str | None = None, in_order: bool = False,
                 storage_options: Mapping[str, Any] | None = None, max_experts: int = MAX_EXPERTS,
                 engine_map: EngineMap | None = None) -> ImportSummary:
    """Read every file, check everything, then write one new run into `store`; returns what was written.

    `store` is a folder or a URL (`s3://bucket/prefix`, ...; `storage_options` as `moescope.attach`
    takes them). `max_experts` bounds expert ids and counts (65 536 unless raised). The trace checks
    (`moescope.ingest.trace_checks`) run over per-request routing; their findings are written as the
    run's `trace_findings` rows and in the summary (`engine_map`: the engine's map, with the load it
    recorded where it has one, for the `physical_ids` check). Raises
    SourceFormatError (a file is not in its engine's layout), ValueError (options, run id, a file
    given twice, a store URL that cannot be used) or FileNotFoundError, in each case before anything
    is written.
    """
    location = open_location(store, storage_options)
    data = read_source(kind, list(paths), num_layers=num_layers, top_k=top_k, in_order=in_order,
                       num_experts=num_experts, max_experts=max_experts, engine_map=engine_map)
    where = paths[0] if len(paths) == 1 else f"the {len(paths)} {kind} files"
    return import_source(location, data, kind, run_id=run_id, tags=tags, num_experts=num_experts, top_k=top_k,
                         model=model, where=where, max_experts=max_experts)


__all__ = ["KINDS", "MAX_EXPERTS", "ImportSummary", "SourceFormatError", "check_distinct", "import_files",
           "read_source"]
