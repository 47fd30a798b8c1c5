"""TensorRT-LLM's expert statistics (`EXPERT_STATISTIC_PATH`, with `EXPERT_STATISTIC_ITER_RANGE`).

The folder holds `meta_info.json` (`num_experts`, `num_experts_per_token`, written by rank 0) and
one `rank{r}.safetensors` per rank whose keys are `"{iter}_{layer}"`, each a bincount over the
experts of the slots that rank's tokens chose in that iteration and layer. Each (iteration, rank)
becomes a step of that rank (the store sums ranks); tokens are slots / num_experts_per_token.
Other files TensorRT-LLM may write next to them (`rank{r}_raw.safetensors`, co-occurrence,
token counts) are not read. A rank file is loaded whole (its size is iterations x layers x experts
counts).

Load balancer: TensorRT-LLM's MoE modules record `ExpertStatistic.maybe_add_info(num_slots,
token_selected_slots)` after routing tokens to slots, so with its load balancer on (online or
offline EPLB, redundant experts) the counts are per physical slot, and meta_info.json's
`num_experts` is the slot count, not the model's logical experts; slots cannot be mapped back to
experts from these files. Pass --num-experts (the model's routed experts): a count vector of
another length is then refused with this explanation. Without it, a run imported from a load-
balanced server shows slots as experts.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from moescope.ingest.importers.fields import INT32_MAX, INT64_MAX
from moescope.ingest.importers.tables import SourceData, SourceFormatError, SourceStep, StepStream, file_time

RANK_FILE = re.compile(r"rank(\d+)\.safetensors")
KEY = re.compile(r"(\d+)_(\d+)")


def files(paths: list[str]) -> list[str]:
    """The files an import of `paths` reads: meta_info.json and the rank{r}.safetensors files."""
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
    numbers = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= INT32_MAX]
    if len(numbers) != len(values):
        raise SourceFormatError(f"{path}: meta_info.json must hold positive integers num_experts and "
                                "num_experts_per_token")
    return numbers[0], numbers[1]


def read(paths: list[str], num_experts: int | None = None) -> SourceData:
    """Every (iteration, rank) step of the statistics, read lazily; raises SourceFormatError naming
    the file and the key. `num_experts` (the model's logical experts) detects slot counts."""
    found = files(paths)
    metas = [p for p in found if os.path.basename(p) == "meta_info.json"]
    if len(metas) != 1:
        raise SourceFormatError(f"expected one meta_info.json among {paths}, found {len(metas)}: pass the "
                                "EXPERT_STATISTIC_PATH folder")
    slots, top_k = _meta(metas[0])
    if num_experts is not None and slots != num_experts:
        raise SourceFormatError(f"{metas[0]}: num_experts is {slots} but the model has {num_experts} experts "
                                "(--num-experts): with TensorRT-LLM's load balancer on, these statistics count "
                                f"{slots} physical expert slots, which cannot be mapped back to experts; record "
                                "with the load balancer off")
    ranks = [p for p in found if p not in metas]
    if not ranks:
        raise SourceFormatError(f"no rank{{r}}.safetensors next to {metas[0]}")
    return SourceData(steps=StepStream(lambda: _steps(ranks, slots)), num_experts=slots, top_k=top_k)


def _steps(ranks: list[str], num_experts: int):
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    for path in ranks:
        match = RANK_FILE.fullmatch(os.path.basename(path))
        assert match is not None  # files() keeps meta_info.json and rank files only
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
            iteration, layer = int(match.group(1)), int(match.group(2))
            if iteration > INT64_MAX or layer > INT32_MAX or rank > INT32_MAX:
                raise SourceFormatError(f"{path}: key {key!r}: the iteration must be in 0..{INT64_MAX} and the layer "
                                        f"and rank in 0..{INT32_MAX}")
            if counts.dtype.kind not in "iu" or counts.shape != (num_experts,):
                raise SourceFormatError(f"{path}: {key} must be an integer bincount over {num_experts} experts, got "
                                        f"{counts.dtype} {counts.shape}")
            step = steps.setdefault(iteration, SourceStep(step=iteration, ts=file_time(path), rank=rank,
                                                          where=f"{path} iteration {iteration}"))
            step.counts[layer] = counts.astype(np.int64)
        yield from (steps[i] for i in sorted(steps))
