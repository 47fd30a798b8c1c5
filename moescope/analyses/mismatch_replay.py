"""The engine's routing, exported for routing replay in training (R3: "rollout routing replay").

Replay feeds a trainer's forward the experts the inference engine chose, so the policy is trained
on the routing it sampled with. Per sequence, the engine's expert ids are an array
`[tokens, layers, top_k]` (int16 where every id fits, E < 32768; -1 where the engine routed
nothing), tokens in position order from 0 (a shared prompt's rows included), layers in the
reference model's MoE-layer order when a reference ran (`mismatch`), else as the engine numbered
them. `export_replay` writes, into a folder:

- `replay.parquet`: one row per sequence: step, rank, sequence (the engine run's), tokens, layers,
  top_k, layer_ids (the layer axis: MoE layer indices), token_ids (list<int64>), expert_ids
  (list<int16>, the array flattened in C order), set_changed (list<bool>, `[tokens, layers]`
  flattened: where the reference chose another set; null without a reference), own_from, npy_file;
- `<step>-<rank>-<sequence>.npy`: the same expert ids as an `.npy` array (with "npy"), named in
  the Parquet's `npy_file` column.

docs/mismatch.md shows a training loop loading them. The engine routes every token it fed: a
prompt and every generated token but the last, so a sequence's arrays hold one row fewer than the
tokens a trainer feeds when it feeds the last generated token too (that token's output predicts
past the end and takes no part in the loss: route it as the trainer likes).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from moescope.analyses.mismatch import ReplaySequence, narrow_ids
from moescope.analyses.mismatch_engine import MismatchError, TokenIds, engine_sequences

if TYPE_CHECKING:
    from moescope.store.location import StoreLocation

FORMATS = ("npy", "parquet")
PARQUET_NAME = "replay.parquet"


def npy_name(seq: ReplaySequence) -> str:
    """The `.npy` file of a sequence: `<step>-<rank>-<sequence>.npy` (integers only: no path from data)."""
    return f"{int(seq.step)}-{int(seq.rank)}-{int(seq.sequence)}.npy"


def engine_replay(store: str | os.PathLike | StoreLocation, run: str, token_ids: TokenIds | None = None,
                  max_sequences: int | None = None) -> tuple[list[ReplaySequence], list[int]]:
    """The engine run's routing per sequence, no reference run: (sequences, the engine's layer ids).
    Raises MismatchError for a run that cannot be rebuilt (`mismatch_engine.engine_sequences`)."""
    from moescope.store.store import Store

    with Store(store) as opened:
        engine = engine_sequences(opened, opened.check_run(run), token_ids, max_sequences)
    return ([ReplaySequence(s.step, s.rank, s.sequence, s.token_ids, narrow_ids(s.expert_ids), None, s.own_from)
             for s in engine.sequences], list(engine.layers))


def export_replay(replay: Sequence[ReplaySequence], folder: str | os.PathLike, formats: Sequence[str] = FORMATS,
                  layers: Sequence[int] = ()) -> str:
    """Write `replay` into `folder` (created if missing) as `replay.parquet` and/or one `.npy` per
    sequence (see the module docstring). Returns the folder.

    Raises:
        MismatchError: for an unknown format, or a folder path that is a file.
        OSError: when the files cannot be written.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise MismatchError(f"unknown export format {', '.join(unknown) or '(none)'}; choose from {', '.join(FORMATS)}")
    folder = os.fspath(folder)
    if os.path.isfile(folder):
        raise MismatchError(f"--export {folder!r} is a file: give a folder (it is created if missing)")
    os.makedirs(folder, exist_ok=True)
    if "npy" in formats:
        for seq in replay:
            np.save(os.path.join(folder, npy_name(seq)), seq.expert_ids, allow_pickle=False)
    if "parquet" in formats:
        int16 = all(seq.expert_ids.dtype == np.int16 for seq in replay)
        ids_type = pa.int16() if int16 else pa.int32()
        schema = pa.schema([
            ("step", pa.int64()), ("rank", pa.int32()), ("sequence", pa.int32()), ("tokens", pa.int32()),
            ("layers", pa.int32()), ("top_k", pa.int32()), ("layer_ids", pa.list_(pa.int32())),
            ("token_ids", pa.list_(pa.int64())), ("expert_ids", pa.list_(ids_type)),
            ("set_changed", pa.list_(pa.bool_())), ("own_from", pa.int32()), ("npy_file", pa.string())])
        rows = [dict(step=seq.step, rank=seq.rank, sequence=seq.sequence, tokens=seq.expert_ids.shape[0],
                     layers=seq.expert_ids.shape[1], top_k=seq.expert_ids.shape[2], layer_ids=[int(v) for v in layers],
                     token_ids=seq.token_ids.tolist(), expert_ids=seq.expert_ids.reshape(-1).tolist(),
                     set_changed=None if seq.set_changed is None else seq.set_changed.reshape(-1).tolist(),
                     own_from=seq.own_from, npy_file=npy_name(seq) if "npy" in formats else None)
                for seq in replay]
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), os.path.join(folder, PARQUET_NAME))
    return folder


def share_prompt_rows(replay: Sequence[ReplaySequence]) -> None:
    """Give a request's later choices the first choice's result on the prompt rows they copy: a shared
    prompt (vLLM's n > 1) is compared once, in the sequence that routes it (`own_from` 0), and a later
    choice's rows before its `own_from` are that prompt; their `set_changed` is set from it, in place."""
    first = {(seq.step, seq.rank): seq for seq in replay if seq.own_from == 0}
    for seq in replay:
        source = first.get((seq.step, seq.rank))
        if seq.own_from and source is not None and seq.set_changed is not None and source.set_changed is not None:
            rows = min(seq.own_from, len(source.set_changed))
            seq.set_changed[:rows] = source.set_changed[:rows]

