"""An engine run's sequences, rebuilt from its `routes` rows for the mismatch check to re-run.

An engine (vLLM, SGLang: `moescope import`, `moescope proxy`) records one routes row per (token,
layer) it routed, with the sequence, the position and, where the format carries it, the token id.
`engine_sequences` turns those rows back into whole sequences: the token ids from position 0 and
the engine's expert ids as `[tokens, layers, top_k]`.

What is assumed where a format does not tell:

- Positions: the engine fed position i to the token at position i of its sequence, counted from
  the first prompt token (vLLM and SGLang number a request's tokens from 0 and neither pads); the
  reference is fed the same.
- A shared prompt: vLLM routes a prompt once, for every choice; its rows are recorded in sequence
  0 of the response's step and choice i's generated rows in sequence i, from the prompt's length
  on. A sequence whose first routed position is p > 0 takes its tokens (and, for replay, its
  routing) at positions 0..p-1 from sequence 0 of the same step and rank.
- Token ids: read from `routes.token_id`. vLLM's responses carry them (`prompt_token_ids`,
  `choices[].token_ids`), the proxy keeps them with `--record-token-ids`; SGLang's `/generate`
  response does not carry the prompt's ids, so they are given beside the run (`token_ids=`:
  (step, sequence) -> ids, what the client sent and received).
- The engine's top-1 is its slot 0: vLLM's and SGLang's top-k kernels return a token's experts in
  descending router weight.
- A sequence with a position whose token is unknown (a prefix-cache hit vLLM did not compute,
  marked -1 and left out of the routes, with no id given) cannot be re-run and is skipped, counted
  by reason.
- A step is a request: runs whose steps are forward passes (SGLang's per-token recorder dumps,
  Megatron) spread a request over many steps and are not rebuilt (their sequences are skipped).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from moescope.store.store import Store

# (step, sequence) -> token ids, or (step, rank, sequence) -> token ids
TokenIds = Mapping[tuple[int, ...], Sequence[int]]

NO_TOKEN_IDS = ("its routes carry no token ids. vLLM responses carry them (prompt_token_ids and "
                "choices[].token_ids: request them with return_token_ids, or record through `moescope proxy "
                "--record-token-ids`); SGLang's /generate response does not carry the prompt's ids: give them "
                "with --token-ids FILE (JSON Lines of {\"step\": S, \"sequence\": N, \"token_ids\": [...]}) or "
                "token_ids= in Python")


class MismatchError(ValueError):
    """The mismatch check cannot run as asked; the message says what to do."""


@dataclass
class EngineSequence:
    """One sequence as the engine ran it.

    Attributes:
        step: the engine run's step (a response, for the importers and the proxy).
        rank: the rank that recorded it.
        sequence: the sequence in the step (vLLM: the choice).
        token_ids: (tokens,) int64 token ids from position 0.
        expert_ids: (tokens, layers, top_k) the engine's expert ids on its own layer axis
            (`EngineRun.layers`), -1 where it routed nothing (a layer it left out, a row not computed).
        own_from: the first position whose routing is this sequence's own (rows before are a shared
            prompt's, copied from sequence 0: compared once, there).
        tags: the step's tags.
    """

    step: int
    rank: int
    sequence: int
    token_ids: np.ndarray
    expert_ids: np.ndarray
    own_from: int
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.step, self.rank, self.sequence)


@dataclass
class EngineRun:
    """An engine run's sequences, its layer axis (the `routes.layer` values, in order), top-k, and
    the sequences that could not be rebuilt, counted per reason."""

    run_id: str
    sequences: list[EngineSequence]
    layers: list[int]
    top_k: int
    skipped: dict[str, int] = field(default_factory=dict)


def _given_ids(token_ids: TokenIds | None) -> dict[tuple[int, int, int], np.ndarray]:
    """Given token ids keyed (step, rank, sequence); a (step, sequence) key means rank 0."""
    out: dict[tuple[int, int, int], np.ndarray] = {}
    for key, ids in (token_ids or {}).items():
        if len(key) == 2:
            full = (int(key[0]), 0, int(key[1]))
        elif len(key) == 3:
            full = (int(key[0]), int(key[1]), int(key[2]))
        else:
            raise MismatchError(f"token_ids keys are (step, sequence) or (step, rank, sequence), got {key!r}")
        out[full] = np.asarray(list(ids), dtype=np.int64)
    return out


def engine_sequences(store: Store, run_id: str, token_ids: TokenIds | None = None,
                     max_sequences: int | None = None) -> EngineRun:
    """The sequences of engine run `run_id`, rebuilt from its routes (see the module docstring).

    Args:
        store: an open store.
        run_id: the engine's run.
        token_ids: ids the routes do not carry, (step, sequence) or (step, rank, sequence) -> ids
            from position 0 (they must agree with any id the routes carry).
        max_sequences: keep the first this many sequences (step order); None: all.

    Returns:
        An EngineRun.

    Raises:
        MismatchError: for a run without routes, routes of mixed top-k, ids that disagree, or a run
            none of whose sequences can be rebuilt (the message says what is missing).
    """
    table = store.engine_routes(run_id)
    if table.num_rows == 0:
        raise MismatchError(f"run {run_id!r} has no routes (per-token routing): the mismatch check needs an engine "
                            "run imported with `moescope import vllm|sglang` from responses carrying routed experts, "
                            "or recorded with `moescope proxy`")
    column = {name: table.column(name) for name in table.column_names}
    step = column["step"].to_numpy().astype(np.int64)
    rank = column["rank"].to_numpy().astype(np.int64)
    seq = column["sequence"].to_numpy().astype(np.int64)
    pos = column["position"].to_numpy().astype(np.int64)
    layer = column["layer"].to_numpy().astype(np.int64)
    ids_column = column["token_id"].combine_chunks()
    has_id = ~np.asarray(ids_column.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    tok = ids_column.fill_null(0).to_numpy().astype(np.int64)
    experts = column["expert_ids"].combine_chunks()
    widths = np.diff(np.asarray(experts.offsets.to_numpy(), dtype=np.int64))
    if len(np.unique(widths)) != 1:
        raise MismatchError(f"run {run_id!r} routes {sorted(set(widths.tolist()))} experts per token in different "
                            "rows: the check compares one top-k")
    top_k = int(widths[0])
    flat = np.asarray(experts.flatten().to_numpy(zero_copy_only=False), dtype=np.int64).reshape(-1, top_k)
    layers = sorted(int(v) for v in np.unique(layer))
    layer_index = np.searchsorted(np.asarray(layers), layer)
    given = _given_ids(token_ids)
    if not has_id.any() and not given:
        raise MismatchError(f"run {run_id!r}: {NO_TOKEN_IDS}")
    tags_column = column["tags"]

    # rows are ordered by (step, rank, sequence, position, layer): a sequence is a run of rows
    change = np.flatnonzero((np.diff(step) != 0) | (np.diff(rank) != 0) | (np.diff(seq) != 0)) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [len(step)]])
    built: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray, np.ndarray, int, dict[str, str]]] = {}
    skipped: dict[str, int] = {}

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    for start, end in zip(starts.tolist(), ends.tolist()):
        key = (int(step[start]), int(rank[start]), int(seq[start]))
        p = pos[start:end]
        first, last = int(p.min()), int(p.max())
        length = last + 1
        known = np.zeros(length, dtype=bool)
        ids = np.zeros(length, dtype=np.int64)
        with_id = has_id[start:end]
        for position, token in zip(p[with_id].tolist(), tok[start:end][with_id].tolist()):
            if known[position] and ids[position] != token:
                raise MismatchError(f"run {run_id!r} step {key[0]} sequence {key[2]}: position {position} has token "
                                    f"ids {ids[position]} and {token} in different layers")
            ids[position], known[position] = token, True
        if key in given:
            supplied = given[key]
            if len(supplied) < length:
                raise MismatchError(f"token_ids for step {key[0]} sequence {key[2]} hold {len(supplied)} ids; the "
                                    f"engine routed positions up to {last}: give the prompt's and generated ids")
            clash = known & (ids != supplied[:length])
            if clash.any():
                at = int(np.flatnonzero(clash)[0])
                raise MismatchError(f"token_ids for step {key[0]} sequence {key[2]} give {supplied[at]} at position "
                                    f"{at}, the routes {ids[at]}: are they this run's?")
            ids, known = supplied[:length].copy(), np.ones(length, dtype=bool)
        routing = np.full((length, len(layers), top_k), -1, dtype=np.int64)
        routing[p, layer_index[start:end]] = flat[start:end]
        tags = dict(tags_column[start].as_py() or [])
        built[key] = (ids, known, routing, first, tags)

    sequences: list[EngineSequence] = []
    for key, (ids, known, routing, first, tags) in built.items():
        if first > 0 and key[2] != 0:  # a choice's generated rows: the prompt is sequence 0's
            prompt = built.get((key[0], key[1], 0))
            if prompt is None:
                skip("its positions before the first routed one are in no sequence 0 of its step")
                continue
            shared = min(first, len(prompt[0]))
            ids[:shared], known[:shared] = prompt[0][:shared], prompt[1][:shared]
            routing[:shared] = prompt[2][:shared]
        if not known.all():
            skip("a position without a token id (a row the engine did not compute, e.g. a vLLM prefix-cache hit: "
                 "give the sequence's ids with --token-ids / token_ids=)")
            continue
        sequences.append(EngineSequence(key[0], key[1], key[2], ids, routing, first, tags))
        if max_sequences is not None and len(sequences) >= max_sequences:
            break
    if not sequences:
        reasons = "; ".join(f"{n} skipped: {why}" for why, n in skipped.items())
        raise MismatchError(f"run {run_id!r}: no sequence could be rebuilt ({reasons}); "
                            + (NO_TOKEN_IDS if not has_id.all() else "give token_ids for the missing positions"))
    return EngineRun(run_id, sequences, layers, top_k, skipped)

