"""How an engine picks the copy of a redundant expert that serves a token's slot, and where each slot runs.

`DISPATCH` names each engine's rule (read from their sources; docs/placement.md cites them), and
`slot_ranks` applies it to a page of routes rows under a `moescope.metrics.placement.Placement`:
the rank (and the probability) of every kept slot, from which `moescope.metrics.ranks` counts
the slots and the distinct tokens each rank serves.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from moescope.metrics.placement import Placement, PlacementError

TRTLLM_BLOCK_SLOTS = 1024  # TensorRT-LLM's routing kernel: 256 threads x 4 (token, k) slots per block

# How each engine picks the copy of a redundant expert that serves a token's slot (read from their
# sources; docs/placement.md cites them). name -> (the split of slot counts without routes, how).
DISPATCH: dict[str, tuple[str, str]] = {
    "even": ("even", "a uniform choice of copy per slot (no engine named)"),
    "vllm": ("even", "vLLM EPLB: copy number (flat position of the slot in the forward's top-k ids) mod copies"),
    "sglang-static": ("local", "SGLang --ep-dispatch-algorithm static: the copy on the token's own rank, "
                               "else a fixed copy per rank drawn so that the copies share the ranks evenly"),
    "sglang-dynamic": ("even", "SGLang --ep-dispatch-algorithm dynamic: a copy drawn at random per slot"),
    "trtllm": ("even", "TensorRT-LLM load balancer with attention DP: per 1024-slot block, the expert's n-th "
                       "slot goes to copy (block + n + EP rank) mod copies"),
    "trtllm-tp": ("even", "TensorRT-LLM load balancer without attention DP (every rank routes the same tokens): "
                          "per 1024-slot block, the expert's n-th slot goes to copy (block + n) mod copies"),
}
ENGINE_OF_SOURCE = {"vllm": "vllm", "sglang": "sglang-static", "trtllm": "trtllm"}
# The engines whose copy is a counter mod the expert's copy count, numbered where the routes rows are
# (`moescope.store.queries.SlotCopies`): (the counter, whether the EP rank is added to it).
# vLLM (`eplb_map_to_physical_and_record`): the slot's flat position in the forward's top-k ids.
# TensorRT-LLM (`moeComputeRouteKernel`, moeLoadBalanceKernels.cu): per block of 1024 (token, slot)
# positions, the block's index plus the slot's place among the earlier slots of its expert in the block,
# plus the EP rank where `offsetByEpRank` (attention DP: `trtllm`; without it, `trtllm-tp`).
COPY_COUNTERS: dict[str, tuple[str, bool]] = {"vllm": ("position", False), "trtllm": ("block", True),
                                              "trtllm-tp": ("block", False)}


def check_dispatch(dispatch: str) -> str:
    """`dispatch` itself when `DISPATCH` names it; raises PlacementError naming the rules otherwise."""
    if dispatch not in DISPATCH:
        raise PlacementError(f"unknown dispatch {dispatch!r}: one of {', '.join(DISPATCH)}")
    return dispatch


def _copies(placement: Placement, layer: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(copy_rank [E, most copies], copies [E]): the rank of each copy of each expert, in slot order."""
    slot_rank, slot_expert = placement.slots(layer, num_experts)
    copies = np.bincount(slot_expert, minlength=num_experts)
    copy_rank = np.full((num_experts, max(int(copies.max(initial=0)), 1)), -1, dtype=np.int64)
    order = np.argsort(slot_expert, kind="stable")
    starts = np.concatenate([[0], np.cumsum(copies)[:-1]])
    nth = np.arange(order.size) - starts[slot_expert[order]]
    copy_rank[slot_expert[order], nth] = slot_rank[order]
    return copy_rank, copies


class SlotRanks(NamedTuple):
    """Where the kept slots of a page of routes rows run (`slot_ranks`): entry i says a slot of the
    page's row `row[i]` runs on `rank[i]` with probability `prob[i]`. `unknown_home` is None, or for
    SGLang's static dispatch of tokens whose home rank is unknown, (expert of each entry, holds: (E, R)
    bool, the ranks holding a copy of each expert): `prob` is then the share of the copy for a home
    without one, and `moescope.metrics.ranks.expected_rank_tokens` averages over the homes."""

    row: np.ndarray
    rank: np.ndarray
    prob: np.ndarray
    unknown_home: tuple[np.ndarray, np.ndarray] | None = None


def _expand(row: np.ndarray, expert: np.ndarray,
            shares: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Entries (row, rank, share, expert) for every rank that serves a part of each (row, expert) slot."""
    expert_of, rank_of = np.nonzero(shares > 0)
    width = np.bincount(expert_of, minlength=shares.shape[0])
    start = np.concatenate([[0], np.cumsum(width)[:-1]])
    per = width[expert]
    entry = np.repeat(np.arange(row.size), per)
    nth = np.arange(entry.size) - np.repeat(np.cumsum(per) - per, per)
    rank = rank_of[start[expert[entry]] + nth]
    return row[entry], rank, shares[expert[entry], rank], expert[entry]


def slot_ranks(page, placement: Placement, layer: int, num_experts: int, dispatch: str,
               homes_known: bool) -> SlotRanks:
    """Where each kept slot of a page of routes rows runs: entries (row of the page, rank, probability).

    `dispatch` names the engine's choice of copy (`DISPATCH`). The deterministic ones give each slot
    one rank with probability 1: vLLM and TensorRT-LLM (`COPY_COUNTERS`: the copy number of each slot,
    `page.copy`, counted where the rows are by `moescope.store.queries.SlotCopies`; a page without it
    raises ValueError) and SGLang static where
    the token's rank is known (`homes_known`: the rows' recorded rank is the expert-parallel rank):
    the copy on that rank, else the copies share it evenly (SGLang fixes one per rank by a seeded
    draw that spreads the ranks evenly over the copies). The random ones (SGLang dynamic, "even") give
    every rank holding a copy its share. SGLang static of unknown ranks gives the same entries and says
    so (`SlotRanks.unknown_home`): the copy is a function of the home, so a token's slots are not
    independent draws, and the tokens per rank are averaged over homes. Dropped slots, padding and
    zero experts run nowhere.
    """
    ids = np.asarray(page.expert_ids, dtype=np.int64)
    valid = np.asarray(page.kept, dtype=bool) & (ids >= 0) & (ids < num_experts)
    row, slot = np.nonzero(valid)
    expert = ids[row, slot]
    copy_rank, copies = _copies(placement, layer, num_experts)
    ones = np.ones(row.size)
    if dispatch in COPY_COUNTERS:
        if getattr(page, "copy", None) is None:
            raise ValueError(f"the {dispatch} dispatch reads each slot's copy number (RoutePage.copy), which "
                             "Store.route_groups counts with slot_copies")
        return SlotRanks(row, copy_rank[expert, np.asarray(page.copy, dtype=np.int64)[row, slot] % copies[expert]],
                         ones)
    home = np.asarray(page.rank, dtype=np.int64)[row] % placement.ranks
    if dispatch == "sglang-static":
        even = placement.shares(layer, num_experts, "even")
        holds = even > 0
        if not homes_known:
            far_row, far_rank, far_prob, far_expert = _expand(row, expert, even)
            return SlotRanks(far_row, far_rank, far_prob, (far_expert, holds))
        local = holds[expert, home]
        far = _expand(row[~local], expert[~local], even)
        return SlotRanks(np.concatenate([row[local], far[0]]), np.concatenate([home[local], far[1]]),
                         np.concatenate([ones[local], far[2]]))
    return SlotRanks(*_expand(row, expert, placement.shares(layer, num_experts, DISPATCH[dispatch][0]))[:3])
