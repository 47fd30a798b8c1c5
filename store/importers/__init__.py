"""Routing from the engines people serve and train MoE models with, into a moescope store.

`import_files("vllm" | "sglang" | "trtllm" | "megatron", paths, store)` reads an engine's files
(one small strict reader per engine), checks all of them, and only then writes one new run with
the tables the probe writes, `source` recorded on the run. `moescope import` is its command line;
`store.proxy` records the same per-request routing live, in front of a vLLM or SGLang server.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from moescope.store.importers.tables import ImportSummary, SourceData, SourceFormatError, import_source
from moescope.store.location import StoreLocation, open_location

KINDS = ("vllm", "sglang", "trtllm", "megatron")


def read_source(kind: str, paths: list[str], num_layers: int | None = None, top_k: int | None = None,
                in_order: bool = False, num_experts: int | None = None) -> SourceData:
    """What the files of one engine hold, checked. Raises SourceFormatError or FileNotFoundError."""
    from moescope.store.importers import megatron, sglang, trtllm, vllm

    if kind not in KINDS:
        raise ValueError(f"unknown source {kind!r}: choose one of {', '.join(KINDS)}")
    if not paths:
        raise ValueError("give at least one file or folder to import")
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such file or folder")
    if kind == "vllm":
        return vllm.read(paths)
    if kind == "sglang":
        return sglang.read(paths, num_layers=num_layers, top_k=top_k, in_order=in_order, num_experts=num_experts)
    if kind == "trtllm":
        return trtllm.read(paths)
    return megatron.read(paths)


def import_files(kind: str, paths: list[str], store: str | os.PathLike | StoreLocation, run_id: str | None = None,
                 tags: dict[str, str] | None = None, num_experts: int | None = None, top_k: int | None = None,
                 num_layers: int | None = None, model: str | None = None, in_order: bool = False,
                 storage_options: Mapping[str, Any] | None = None) -> ImportSummary:
    """Read every file, check everything, then write one new run into `store`; returns what was written.

    `store` is a folder or a URL (`s3://bucket/prefix`, ...; `storage_options` as `moescope.attach`
    takes them). Raises SourceFormatError (a file is not in its engine's layout), ValueError (options,
    run id, a store URL that cannot be used) or FileNotFoundError, in each case before anything is written.
    """
    location = open_location(store, storage_options)
    data = read_source(kind, list(paths), num_layers=num_layers, top_k=top_k, in_order=in_order,
                       num_experts=num_experts)
    where = paths[0] if len(paths) == 1 else f"the {len(paths)} {kind} files"
    return import_source(location, data, kind, run_id=run_id, tags=tags, num_experts=num_experts, top_k=top_k,
                         model=model, where=where)


__all__ = ["KINDS", "ImportSummary", "SourceFormatError", "import_files", "read_source"]
