"""Rank balance: how a placement spreads the experts' load over expert-parallel ranks.

Pure functions of a placement's slots (`moescope.metrics.placement.Placement.slots`) and of loads:
the share of each expert's load each rank serves (`replica_shares`), the slots per rank of a load
(`rank_load`), the distinct tokens and slots per rank of routed slots (`expected_rank_tokens`), and
the balancedness of a whole forward over layers (`balancedness_over_layers`). One rank's balance is
the load's `moescope.metrics.signals.balancedness` and `imbalance`, the same as an expert load's.
"""

from __future__ import annotations

import numpy as np

from moescope.metrics.signals import _as_load

REPLICA_SPLITS = ("even", "local")
HOME_CHUNK = 1 << 22  # (entry, home) cells held at once when averaging over unknown homes


def replica_shares(slot_rank: np.ndarray, slot_expert: np.ndarray, num_experts: int, ranks: int,
                   split: str = "even") -> np.ndarray:
    """Return the share of each logical expert's load that each rank serves: an (E, R) float array.

    A placement's physical slots each hold one logical expert on one rank (`slot_rank[s]`,
    `slot_expert[s]`); a logical expert with several slots (redundant copies) has its load split
    over them by `split`:

    - "even": evenly over its slots, so a rank serves (its slots of e) / (all slots of e) of expert
      e's load (a uniform choice of copy per slot, or a round robin, in the long run);
    - "local": a token is served on its own rank where that rank holds a copy, and by the copies in
      equal parts where it does not, with tokens coming evenly from all R ranks: a rank with n_r of
      the expert's n copies serves (1[n_r > 0] + (R - D) n_r / n) / R, D the ranks holding a copy.

    Every row sums to 1: a token's slot is counted once, on whichever rank serves it, never twice.
    Raises ValueError for a logical expert with no slot, an expert or rank outside 0..E-1 / 0..R-1,
    or an unknown split.
    """
    if split not in REPLICA_SPLITS:
        raise ValueError(f"unknown split {split!r}: one of {', '.join(REPLICA_SPLITS)}")
    slot_rank = np.asarray(slot_rank, dtype=np.int64)
    slot_expert = np.asarray(slot_expert, dtype=np.int64)
    if slot_rank.shape != slot_expert.shape or slot_rank.ndim != 1:
        raise ValueError("slot_rank and slot_expert must be 1-d arrays of the same length (one entry per slot)")
    outside = slot_expert[(slot_expert < 0) | (slot_expert >= num_experts)]
    if outside.size:
        raise ValueError(f"a slot holds expert {int(outside[0])}, outside 0..{num_experts - 1}")
    outside = slot_rank[(slot_rank < 0) | (slot_rank >= ranks)]
    if outside.size:
        raise ValueError(f"a slot is on rank {int(outside[0])}, outside 0..{ranks - 1}")
    counts = np.zeros((num_experts, ranks), dtype=np.float64)
    np.add.at(counts, (slot_expert, slot_rank), 1.0)
    replicas = counts.sum(axis=1, keepdims=True)
    if (replicas == 0).any():
        missing = np.flatnonzero(replicas[:, 0] == 0)
        raise ValueError(f"expert(s) {', '.join(map(str, missing[:8].tolist()))} have no slot: every logical "
                         "expert needs at least one")
    if split == "local":
        holding = counts > 0
        held = holding.sum(axis=1, keepdims=True)
        return (holding + (ranks - held) * counts / replicas) / ranks
    return counts / replicas


def expected_rank_tokens(row: np.ndarray, rank: np.ndarray, prob: np.ndarray, ranks: int,
                         row_group: np.ndarray | None = None, groups: int = 1,
                         unknown_home: tuple[np.ndarray, np.ndarray] | None = None,
                         row_count: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Return (tokens, slots), each a (groups, R) float array: per group of rows and rank, the distinct
    tokens the rank serves and the slots it serves.

    Each entry says that slot of token `row[i]` runs on `rank[i]` with probability `prob[i]` (1 where
    the engine's choice of copy is known, the copy's share where it is drawn at random). A token
    counts once on a rank however many of its slots land there: its expected count there is
    1 - prod(1 - p) over its entries on that rank. `row_group` (indexed by row) puts each token in a
    group 0..groups-1 (a window); None: one group. Entries with p = 0 count nowhere.

    `unknown_home` = (expert of each entry, holds: an (E, R) bool array, rank r holds a copy of e) is
    SGLang's static dispatch where the token's home rank is not known: the home is one of the R ranks
    alike, a home holding the slot's expert serves the slot itself, and any other home sends it to the
    copy on `rank` with probability `prob` (its share of the copies). The copy is a function of the
    home, so a token's slots are not independent draws: its count on a rank is the mean over homes h of
    1 - prod(1 - p) over its slots that h does not hold, and a slot's share there is
    (1[rank holds it] + (R - copies' ranks) p) / R.

    `row_count` (indexed by row) is the tokens each row stands for (rows grouped by routing,
    `moescope.store.queries.RouteGroups`): its entries count that many times; None: once.
    """
    row = np.asarray(row, dtype=np.int64)
    rank = np.asarray(rank, dtype=np.int64)
    prob = np.asarray(prob, dtype=np.float64)
    tokens = np.zeros((groups, ranks))
    slots = np.zeros((groups, ranks))
    if row.size == 0:
        return tokens, slots
    entry_group = np.zeros(row.size, dtype=np.int64) if row_group is None else np.asarray(row_group)[row]
    share = prob if unknown_home is None else _unknown_home_share(prob, unknown_home, ranks)
    if row_count is not None:
        share = share * np.asarray(row_count, dtype=np.float64)[row]
    slots += np.bincount(entry_group * ranks + rank, weights=share, minlength=groups * ranks).reshape(groups, ranks)
    key = row * ranks + rank
    if (int(row.max()) + 1) * ranks <= 4 * row.size:  # few (token, rank) cells: counted without a sort
        keys = np.arange((int(row.max()) + 1) * ranks)
        cell = key
    else:
        keys, cell = np.unique(key, return_inverse=True)
    cells = keys.size
    certain = np.bincount(cell, weights=(prob >= 1.0).astype(np.float64), minlength=cells) > 0
    missed = np.bincount(cell, weights=np.log1p(-np.minimum(prob, 1.0 - 1e-12)), minlength=cells)
    present = np.bincount(cell, minlength=cells) > 0
    token = np.where(certain, 1.0, np.where(present, -np.expm1(missed), 0.0))
    if unknown_home is not None:
        token = _unknown_home_tokens(cell, prob, certain, unknown_home, ranks, np.where(present, token, 0.0))
    cell_row, cell_rank = keys // ranks, keys % ranks
    cell_group = np.zeros(cells, dtype=np.int64) if row_group is None else np.asarray(row_group)[cell_row]
    if row_count is not None:
        token = token * np.asarray(row_count, dtype=np.float64)[cell_row]
    tokens += np.bincount(cell_group * ranks + cell_rank, weights=token,
                          minlength=groups * ranks).reshape(groups, ranks)
    return tokens, slots


def _unknown_home_share(prob: np.ndarray, unknown_home: tuple[np.ndarray, np.ndarray], ranks: int) -> np.ndarray:
    """Each entry's expected slot on its rank over homes alike: the rank's own tokens (the rank holds
    the expert), and its share of the tokens of the ranks that hold no copy."""
    expert, holds = np.asarray(unknown_home[0], dtype=np.int64), np.asarray(unknown_home[1], dtype=bool)
    return (1.0 + (ranks - holds.sum(axis=1)[expert]) * prob) / ranks


def _unknown_home_tokens(cell: np.ndarray, prob: np.ndarray, certain: np.ndarray,
                         unknown_home: tuple[np.ndarray, np.ndarray], ranks: int, token: np.ndarray) -> np.ndarray:
    """`token` with each (row, rank) cell that no certain entry fills replaced by the mean over homes h
    of 1 - prod(1 - p) over the cell's entries whose expert h does not hold (h = the cell's rank holds
    them all: 1). A cell with a certain entry (the expert's only copies are there) is 1 from every home."""
    expert, holds = np.asarray(unknown_home[0], dtype=np.int64), np.asarray(unknown_home[1], dtype=bool)
    token = np.where(certain, 1.0, token)
    todo = np.flatnonzero(~certain[cell])
    todo = todo[np.argsort(cell[todo], kind="stable")]
    todo_cell = cell[todo]
    log_miss = np.log1p(-np.minimum(prob, 1.0 - 1e-12))
    chunk = max(1, HOME_CHUNK // ranks)  # entries x ranks floats at a time
    start = 0
    while start < todo.size:
        end = int(np.searchsorted(todo_cell, todo_cell[min(start + chunk, todo.size) - 1], side="right"))
        part, part_cell = todo[start:end], todo_cell[start:end]
        firsts = np.flatnonzero(np.concatenate([[True], part_cell[1:] != part_cell[:-1]]))
        missed = np.add.reduceat(~holds[expert[part]] * log_miss[part, None], firsts, axis=0)  # [cells, homes]
        token[part_cell[firsts]] = (1.0 - np.expm1(missed).sum(axis=1)) / ranks
        start = end
    return token


def balancedness_over_layers(rank_loads: np.ndarray) -> float:
    """Return sum over layers of the mean rank load / sum over layers of the busiest rank's load.

    `rank_loads` is [layers, ranks]. Every layer waits for its busiest rank, so this is the share of
    an expert-parallel forward's MoE time that does useful work (vLLM's balancedness of the whole
    forward, layers weighted by their load); 1 is even. NaN when nothing was served. Given
    [steps, layers, ranks], the same per step: an np.ndarray of one figure per step.
    """
    arr = np.asarray(rank_loads, dtype=np.float64)
    if arr.ndim == 3:
        peaks = arr.max(axis=2).sum(axis=1) if arr.size else np.zeros(arr.shape[0])
        means = arr.mean(axis=2).sum(axis=1) if arr.size else np.zeros(arr.shape[0])
        return np.where(peaks > 0, means / np.where(peaks > 0, peaks, 1.0), np.nan)  # type: ignore[return-value]
    peak = arr.max(axis=1).sum() if arr.size else 0.0
    return float(arr.mean(axis=1).sum() / peak) if peak > 0 else float("nan")


def rank_load(load: np.ndarray | list[float], shares: np.ndarray) -> np.ndarray:
    """Return the slots each rank serves: a load of E experts times `replica_shares`' (E, R) shares.

    Raises ValueError when the load's experts and the shares' rows differ.
    """
    arr = _as_load(load)
    shares = np.asarray(shares, dtype=np.float64)
    if shares.ndim != 2 or shares.shape[0] != arr.size:
        raise ValueError(f"a load of {arr.size} experts needs (experts, ranks) shares, got shape {shares.shape}")
    return arr @ shares
