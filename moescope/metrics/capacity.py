"""The capacity what-if: the drops a capacity limit per expert would have caused on observed routes.

GShard / Switch capacity (`expert_capacity`) and its admission order (`whatif_capacity`): what the
demo's capacity block and `moescope whatif` report for capacity factors the model did not run with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

CAPACITY_FACTORS = (1.0, 1.25, 1.5, 2.0)


@dataclass(frozen=True)
class WhatIfCapacity:
    """Drops that a capacity limit of `capacity` slots per expert would have caused."""

    capacity_factor: float
    capacity: int
    dropped_tokens: int  # tokens whose every slot would be dropped
    dropped_assignments: int  # (token, slot) pairs over capacity
    tokens: int

    @property
    def dropped_token_rate(self) -> float:
        return self.dropped_tokens / self.tokens if self.tokens else float("nan")


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Return ceil(capacity_factor * tokens * top_k / num_experts), the GShard/Switch capacity."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def whatif_capacity(
    expert_ids: np.ndarray, num_experts: int, capacity_factors: tuple[float, ...] = CAPACITY_FACTORS
) -> dict[float, WhatIfCapacity]:
    """Return, per capacity factor, the drops the observed routes of one forward would have had.

    `expert_ids` is the (tokens, k) choice of one forward. Slots are admitted in priority order
    as GShard does it: every token's first choice before any second choice, tokens in batch
    order within a slot; an expert admits `expert_capacity(...)` slots and drops the rest.
    """
    ids = np.asarray(expert_ids)
    if ids.ndim != 2:
        raise ValueError(f"expert_ids must be (tokens, k), got shape {ids.shape}")
    tokens, top_k = ids.shape
    flat = ids.T.reshape(-1).astype(np.int64)  # slot-major priority order
    # rank of each assignment among the earlier assignments to the same expert
    order = np.argsort(flat, kind="stable")
    sorted_ids = flat[order]
    starts = np.searchsorted(sorted_ids, sorted_ids, side="left")
    rank = np.empty_like(flat)
    rank[order] = np.arange(flat.size) - starts
    out: dict[float, WhatIfCapacity] = {}
    for cf in capacity_factors:
        cap = expert_capacity(tokens, top_k, num_experts, cf)
        kept = (rank < cap).reshape(top_k, tokens).T
        out[cf] = WhatIfCapacity(
            capacity_factor=cf,
            capacity=cap,
            dropped_tokens=int(np.count_nonzero(~kept.any(axis=1))),
            dropped_assignments=int(np.count_nonzero(~kept)),
            tokens=tokens,
        )
    return out
