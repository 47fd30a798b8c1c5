"""TensorRT-LLM's expert statistics (`EXPERT_STATISTIC_PATH`, with `EXPERT_STATISTIC_ITER_RANGE`).

The folder holds `meta_info.json` (`num_experts`, `num_experts_per_token`, written by rank 0) and
one `rank{r}.safetensors` per rank whose keys are `"{iter}_{layer}"`, each a bincount over the
experts of the slots that rank's tokens chose in that iteration and layer. Each (iteration, rank)
becomes a step of that rank (the store sums ranks); tokens are slots / num_experts_per_token.
Other files TensorRT-LLM may write next to them (`rank{r}_raw.safetensors`, co-occurrence,
token counts) are not read.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from moescope.store.importers.tables import SourceData, SourceFormatError, SourceStep, file_time

RANK_FILE = re.compile(r"rank(\d+)\.safetensors")
KEY = re.compile(r"(\d+)_(\d+)")


def _files(paths: list[str]) -> list[str]:
    out = []
    for path in paths:
        if os.path.isdir(path):
            out += [os.path.join(path, n) for n in sorted(os.listdir(path))
                    if n == "meta_info.json" or RANK_FILE.fullmatch(n)]
        elif os.path.basename(path) == "meta_info.json" or RANK_FILE.fullmatch(os.path.basename(path)):
            out.append(path)
        else:
            raise SourceFormatError(f"{path}: expected the EXPERT_STATISTIC_PATH folder, its meta_info.json or a "
                                    "rank{r}.safetensors file")
    return out


def _meta(path: str) -> tuple[int, int]:
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SourceFormatError(f"{path}: not valid JSON ({e})") from e
    values = [meta.get(k) if isinstance(meta, dict) else None for k in ("num_experts", "num_experts_per_token")]
    numbers = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    if len(numbers) != len(values):
        raise SourceFormatError(f"{path}: meta_info.json must hold positive integers num_experts and "
                                "num_experts_per_token")
    return numbers[0], numbers[1]


def read(paths: list[str]) -> SourceData:
    """Every (iteration, rank) step of the statistics; raises SourceFormatError naming the file."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    files = _files(paths)
    metas = [p for p in files if os.path.basename(p) == "meta_info.json"]
    if len(metas) != 1:
        raise SourceFormatError(f"expected one meta_info.json among {paths}, found {len(metas)}: pass the "
                                "EXPERT_STATISTIC_PATH folder")
    num_experts, top_k = _meta(metas[0])
    ranks = [p for p in files if p not in metas]
    if not ranks:
        raise SourceFormatError(f"no rank{{r}}.safetensors next to {metas[0]}")
    data = SourceData(steps=[], num_experts=num_experts, top_k=top_k)
    for path in ranks:
        match = RANK_FILE.fullmatch(os.path.basename(path))
        assert match is not None  # _files keeps meta_info.json and rank files only
        rank = int(match.group(1))
        try:
            tensors = load_file(path)
        except (SafetensorError, OSError, ValueError) as e:
            raise SourceFormatError(f"{path}: not a readable safetensors file ({e}); is it truncated?") from e
        steps: dict[int, SourceStep] = {}
        for key, counts in tensors.items():
            match = KEY.fullmatch(key)
            if not match:
                raise SourceFormatError(f"{path}: key {key!r} is not \"{{iter}}_{{layer}}\"")
            if counts.dtype.kind not in "iu" or counts.shape != (num_experts,):
                raise SourceFormatError(f"{path}: {key} must be an integer bincount over {num_experts} experts, got "
                                        f"{counts.dtype} {counts.shape}")
            step = steps.setdefault(int(match.group(1)), SourceStep(step=int(match.group(1)), ts=file_time(path),
                                                                     rank=rank))
            step.counts[int(match.group(2))] = counts.astype(np.int64)
        data.steps += [steps[i] for i in sorted(steps)]
    return data
