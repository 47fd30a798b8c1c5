"""Is it the routing? The rollout/training log-prob gap of an engine run, attributed to routing.

An RL trainer compares its own log-prob of each sampled token (the reference: the trainer's model)
with the inference engine's (vLLM's `logprobs`, SGLang's `output_token_logprobs`: the
`engine_logprobs` rows `moescope import` and `moescope proxy` write, or a file of them). For every
generated token, Δ = reference log-prob − engine log-prob, measured twice:

- "reference": the reference routes the tokens itself (what a trainer without replay sees);
- "replay": the engine's routing is replayed in every MoE layer (`moescope.replay`: the engine's
  experts, their weights from the reference's own router scores by the family's rule, as R3 does).

What replay removes is the share of the gap routing causes; what is left comes from everything
else (kernels, precision, batch shape). With `per_layer`, the engine's routing is replayed in every
layer but one, in turn ("replay-but-layer", one forward each: L + 1 forwards with the reference's
own): the gap that comes back when layer l routes itself is the gap layer l carries.

The figures are AReaL's (`moescope.metrics.logprob_gap`: mean k3 KL, mean |Δ|, mean Δ², shares with
|Δ| > ln 2 and > ln 5), overall, per count of layers whose expert set differs at the token
(`FLIP_BUCKETS`: 0, 1, 2-3, 4+, counted at the position whose output predicts the token), per
position bucket and per tag of the engine's steps. A generated token at position p is predicted by
the forward's output at p - 1: its log-prob is log_softmax(logits[p - 1])[token], in float32 as the
reference computes its logits, and the flips that count for it are those of position p - 1.

Tokens left out, counted by reason: a log-prob the engine did not measure (null, or a clamp:
`moescope.ingest.importers.logprobs.CLAMPED_LOGPROB`), a position past the tokens the engine fed
whose id the engine did not return, a sequence with positions the engine did not route (it cannot
be replayed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from moescope.analyses.mismatch_engine import EngineRun, MismatchError
from moescope.metrics.logprob_gap import gap_figures, removed_share
from moescope.probe.adapters import MoELayer

__all__ = ["FLIP_BUCKETS", "GAP_COLUMNS", "ROUTINGS", "LogprobGapReport", "logprob_gap", "read_logprobs_file"]

# (lowest, highest or None, name): layers whose expert set differs at the predicting position
FLIP_BUCKETS: tuple[tuple[int, int | None, str], ...] = ((0, 0, "0"), (1, 1, "1"), (2, 3, "2-3"), (4, None, "4+"))
ROUTINGS = ("reference", "replay", "replay-but-layer")
GAP_COLUMNS = ("routing", "left_out_layer", "grouping", "group_name", "group_order", "tokens", "k3_mean",
               "abs_mean", "sq_mean", "extreme_2", "extreme_5")
# (step, sequence) or (step, rank, sequence) -> (position of the first generated token, its log-probs...)
LogprobsGiven = Mapping[tuple[int, ...], tuple[int, Sequence[float]]]


@dataclass
class LogprobGapReport:
    """What `logprob_gap` measured.

    rows: one row per (routing, left_out_layer, group), the `GAP_COLUMNS` (`mismatch_logprob_gap`).
    tokens: per measured token: step, rank, sequence, position, token_id, flips (layers whose set
        differs at p - 1), engine, reference, replay (log-probs), and with `per_layer` a column
        `but_<layer>` per compared layer.
    layers: the reference MoE layers the engine's routing was replayed in.
    skipped: tokens (or sequences) left out, per reason.
    """

    rows: pd.DataFrame
    tokens: pd.DataFrame
    layers: list[int]
    skipped: dict[str, int] = field(default_factory=dict)

    def figures(self, routing: str = "reference", grouping: str = "all", group_name: str = "all",
                left_out_layer: int | None = None) -> pd.Series | None:
        """One row of `rows`, or None where it has none."""
        rows = self.rows[(self.rows.routing == routing) & (self.rows.grouping == grouping)
                         & (self.rows.group_name == group_name)]
        rows = rows[rows.left_out_layer.isna()] if left_out_layer is None else \
            rows[rows.left_out_layer == left_out_layer]
        return None if rows.empty else rows.iloc[0]

    @property
    def removed_share(self) -> float:
        """The share of the k3 KL (reference's own routing) that replaying the engine's routing removes."""
        before, after = self.figures("reference"), self.figures("replay")
        if before is None or after is None:
            return float("nan")
        return removed_share(float(before.k3_mean), float(after.k3_mean))

    def carried(self) -> pd.DataFrame:
        """With --per-layer: per compared layer, the k3 KL with every layer but it replayed, what it
        adds to full replay's (`carried_k3`), and that as a share of the gap replay removes
        (`carried_share`), largest first. Empty without per-layer rows."""
        rows = self.rows[(self.rows.routing == "replay-but-layer") & (self.rows.grouping == "all")]
        full, own = self.figures("replay"), self.figures("reference")
        if rows.empty or full is None or own is None:
            return pd.DataFrame(columns=["layer", "k3_mean", "carried_k3", "carried_share"])
        removed = float(own.k3_mean) - float(full.k3_mean)
        out = pd.DataFrame({"layer": rows.left_out_layer.astype(int).to_numpy(), "k3_mean": rows.k3_mean.to_numpy()})
        out["carried_k3"] = out.k3_mean - float(full.k3_mean)
        out["carried_share"] = out.carried_k3 / removed if removed > 0 else np.nan
        return out.sort_values("carried_k3", ascending=False, kind="stable").reset_index(drop=True)

    def line(self) -> str:
        """One line for a person: k3 KL with the reference's routing and with replay, what replay removes."""
        own, replay = self.figures("reference"), self.figures("replay")
        if own is None:
            return "Log-prob gap: no generated token with an engine log-prob was measured"
        text = (f"Log-prob gap over {int(own.tokens):,} generated tokens: k3 KL {own.k3_mean:.3g} with the "
                f"reference's own routing (|Δ| > ln 2: {own.extreme_2:.2%})")
        if replay is not None:
            text += (f", {replay.k3_mean:.3g} with the engine's routing replayed (|Δ| > ln 2: {replay.extreme_2:.2%}): "
                     f"replay removes {self.removed_share:.1%} of it")
        carried = self.carried()
        named = carried[carried.carried_share >= 0.1] if not carried.empty else carried
        if len(named):
            text += "; carried by layer " + ", ".join(f"{int(r.layer)} ({r.carried_share:.0%})"
                                                      for r in named.itertuples())
        return text


def read_logprobs_file(path: str) -> dict[tuple[int, int, int], tuple[int, list[float]]]:
    """--logprobs FILE: JSON Lines of {"step": S, "sequence": N, "position": P, "logprobs": [...]}
    ("rank" optional, 0): the engine's log-probs of a sequence's generated tokens from position P (its
    prompt's length). Raises ValueError naming the line for anything else."""
    import math

    from moescope.core.sequence_file import read_sequence_file

    def value_of(record: dict) -> tuple[int, list[float]]:
        first = int(record["position"])
        values = [math.nan if v is None else float(v) for v in record["logprobs"]]
        if first < 1 or any(v > 0 for v in values):
            raise ValueError("position must be at least 1 and log-probs at most 0")
        return first, values

    return read_sequence_file(path, "--logprobs", '{"step": S, "sequence": N, "position": P, "logprobs": [...]}',
                              value_of)


def _given_frame(given: LogprobsGiven) -> pd.DataFrame:
    rows = []
    for key, (first, values) in given.items():
        full = (int(key[0]), 0, int(key[1])) if len(key) == 2 else tuple(int(v) for v in key)
        if len(full) != 3:
            raise MismatchError(f"logprobs keys are (step, sequence) or (step, rank, sequence), got {key!r}")
        rows += [dict(step=full[0], rank=full[1], sequence=full[2], position=int(first) + j, token_id=None,
                      logprob=float(v)) for j, v in enumerate(values)]
    return pd.DataFrame(rows, columns=["step", "rank", "sequence", "position", "token_id", "logprob"])


def _flip_bucket(flips: np.ndarray) -> np.ndarray:
    out = np.zeros(len(flips), dtype=np.int64)
    for index, (low, _, _) in enumerate(FLIP_BUCKETS):
        out[flips >= low] = index
    return out


@contextlib.contextmanager
def _replayed(model: nn.Module, layers: Sequence[MoELayer], routes: np.ndarray | None) -> Iterator[None]:
    """Routing replay of `routes` while the block runs (`moescope.probe.replay.RoutingReplay`, what
    `moescope.replay` installs: the given experts, their weights by the family's rule from the
    model's own router scores; a row of -1 routed by the model itself); nothing when None."""
    if routes is None:
        yield
        return
    from moescope.probe.replay import RoutingReplay

    handles = RoutingReplay(list(layers), routes, label="mismatch").install(model)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _log_probs(model: nn.Module, layers: Sequence[MoELayer], batch: list[np.ndarray],
               targets: list[tuple[np.ndarray, np.ndarray]], pad: int, device: torch.device,
               routes: np.ndarray | None) -> list[np.ndarray]:
    """One right-padded forward (attention mask, `generate`'s position ids, no cache), with the
    routing `routes` replayed ([batch, tokens, layers, top_k], -1: the model routes itself) when
    given; per sequence, log_softmax(logits[p - 1])[token] of its (positions, tokens) targets."""
    from moescope.analyses.routing_compare import generate_position_ids

    length = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), length), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, :len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        mask[row, :len(ids)] = 1
    kwargs: dict[str, Any] = dict(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                                  position_ids=generate_position_ids(mask).to(device), use_cache=False)
    with _replayed(model, layers, routes):
        logits = model(**kwargs).logits
    out = []
    for row, (positions, tokens) in enumerate(targets):
        rows = logits[row, torch.as_tensor(positions - 1, dtype=torch.long, device=logits.device)].float()
        picked = torch.log_softmax(rows, dim=-1).gather(-1, torch.as_tensor(tokens, device=logits.device)[:, None])
        out.append(picked[:, 0].double().cpu().numpy())
    return out


def logprob_gap(model: nn.Module, layers: Sequence[MoELayer], compared: Sequence[int], engine: EngineRun,
                replay: Sequence[Any], logprobs: pd.DataFrame | LogprobsGiven, tag_groups: Mapping[tuple, list[str]],
                *, batch_size: int = 8, per_layer: bool = False, progress: bool = False) -> LogprobGapReport | None:
    """Measure the log-prob gap of the engine run's generated tokens (see the module docstring).

    Args:
        model: the reference (as `moescope.analyses.mismatch.mismatch` ran it).
        layers: the reference's MoE layers, in order (replay's layer axis).
        compared: the reference MoE layer indices the engine recorded (the replay arrays' layer axis).
        engine: the engine run's sequences.
        replay: the mismatch check's `ReplaySequence`s, one per engine sequence in order.
        logprobs: the engine's log-probs: the store's `engine_logprobs` rows, or (step, sequence) /
            (step, rank, sequence) -> (first generated position, log-probs).
        tag_groups: per sequence key, its tag groups (`key=value` of its steps, as the mismatch check groups them).
        batch_size: sequences per forward.
        per_layer: also replay every layer but one, in turn (one more forward per compared layer).
        progress: show a progress bar.

    Returns:
        A LogprobGapReport, or None when the engine returned no log-prob for any sequence compared.

    Raises:
        MismatchError: for log-probs whose token ids disagree with the routes'.
    """
    from tqdm.auto import tqdm

    from moescope.analyses.mismatch import bucket_name, position_bucket
    from moescope.analyses.routing_compare import pad_id

    frame = _given_frame(logprobs) if not isinstance(logprobs, pd.DataFrame) else logprobs
    if frame.empty:
        return None
    skipped: dict[str, int] = {}

    def skip(reason: str, n: int = 1) -> None:
        if n:
            skipped[reason] = skipped.get(reason, 0) + n

    by_key = {key: part for key, part in frame.groupby(["step", "rank", "sequence"], sort=False)}
    replay_by_key = {(r.step, r.rank, r.sequence): r for r in replay}
    column = {index: i for i, index in enumerate(compared)}
    all_layers = [layer.index for layer in layers]
    work = []  # (sequence, replay sequence, positions, tokens, engine log-probs, flips)
    for seq, routed in zip(engine.sequences, replay):
        part = by_key.get(seq.key)
        if part is None:
            continue
        n = len(seq.token_ids)
        positions = part.position.to_numpy(dtype=np.int64)
        values = part.logprob.to_numpy(dtype=np.float64)
        ids_given = part.token_id.to_numpy(dtype=object)
        keep = np.isfinite(values)
        skip("no engine log-prob (null, or clamped by the engine)", int((~keep).sum()))
        keep &= positions >= 1
        tokens = np.zeros(len(positions), dtype=np.int64)
        inside = positions < n
        tokens[inside & keep] = seq.token_ids[positions[inside & keep]]
        for i in np.flatnonzero(keep):
            given = ids_given[i]
            if given is None or pd.isna(given):
                if not inside[i]:
                    keep[i] = False
                    skip("the last generated token, whose id the engine's log-probs do not give")
                continue
            if inside[i] and int(given) != tokens[i]:
                raise MismatchError(f"engine run {engine.run_id!r} step {seq.step} sequence {seq.sequence}: the "
                                    f"log-prob at position {positions[i]} is of token {int(given)}, the routes "
                                    f"have {tokens[i]}: are they the same run?")
            tokens[i] = int(given)
        keep &= positions <= n
        if not keep.any():
            continue
        if (np.asarray(routed.expert_ids) < 0).any():
            skip("tokens of sequences with positions the engine did not route (they cannot be replayed)",
                 int(keep.sum()))
            continue
        before = positions[keep] - 1
        flips = np.zeros(len(before), dtype=np.int64)
        own = before >= routed.own_from
        if routed.set_changed is not None:
            flips[own] = routed.set_changed[before[own]].sum(axis=1)
            shared = replay_by_key.get((seq.step, seq.rank, 0))
            if (~own).any() and shared is not None and shared.set_changed is not None:
                flips[~own] = shared.set_changed[before[~own]].sum(axis=1)
        work.append((seq, routed, positions[keep], tokens[keep], values[keep], flips))
    if not work:
        return None

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    pad = pad_id(model)
    top_k = int(np.asarray(work[0][1].expert_ids).shape[2])
    variants: list[tuple[str, int | None]] = [("reference", None), ("replay", None)]
    if per_layer:
        variants += [("replay-but-layer", index) for index in compared]
    results: dict[tuple[str, int | None], list[np.ndarray]] = {v: [] for v in variants}
    was_training = model.training
    bar = tqdm(total=len(variants) * len(work), desc="log-prob gap", unit="seq", disable=not progress, leave=False)
    try:
        model.eval()
        with torch.no_grad():
            for first in range(0, len(work), batch_size):
                chunk = work[first:first + batch_size]
                batch = [item[0].token_ids for item in chunk]
                targets = [(item[2], item[3]) for item in chunk]
                length = max(len(ids) for ids in batch)
                routes = np.full((len(chunk), length, len(all_layers), top_k), -1, dtype=np.int64)
                for row, item in enumerate(chunk):
                    ids = np.asarray(item[1].expert_ids, dtype=np.int64)
                    for index, col in column.items():
                        routes[row, :len(ids), all_layers.index(index)] = ids[:, col]
                for routing, left_out in variants:
                    forced = None
                    if routing != "reference":
                        forced = routes.copy()
                        if left_out is not None:
                            forced[:, :, all_layers.index(left_out)] = -1
                    results[(routing, left_out)] += _log_probs(model, layers, batch, targets, pad, device, forced)
                    bar.update(len(chunk))
    finally:
        model.train(was_training)
        bar.close()

    engine_values = np.concatenate([item[4] for item in work])
    flips = np.concatenate([item[5] for item in work])
    positions = np.concatenate([item[2] for item in work])
    sequence_of = np.concatenate([np.full(len(item[2]), i) for i, item in enumerate(work)])
    groups: list[tuple[str, str, int, np.ndarray]] = [("all", "all", 0, np.ones(len(flips), dtype=bool))]
    bucket = _flip_bucket(flips)
    groups += [("flips", name, i, bucket == i) for i, (_, _, name) in enumerate(FLIP_BUCKETS) if (bucket == i).any()]
    position = position_bucket(positions)
    groups += [("position", bucket_name(int(b)), int(b), position == b) for b in np.unique(position)]
    tags = sorted({name for item in work for name in tag_groups.get(item[0].key, [])})
    for name in tags:
        members = np.array([name in tag_groups.get(item[0].key, []) for item in work])
        groups.append(("tag", name, 0, members[sequence_of]))
    rows = []
    deltas = {}
    for variant in variants:
        delta = np.concatenate(results[variant]) - engine_values
        deltas[variant] = delta
        for grouping, name, order, mask in groups:
            f = gap_figures(delta[mask])
            rows.append(dict(routing=variant[0], left_out_layer=variant[1], grouping=grouping, group_name=name,
                             group_order=order, tokens=f.tokens, k3_mean=f.k3_mean, abs_mean=f.abs_mean,
                             sq_mean=f.sq_mean, extreme_2=f.extreme_2, extreme_5=f.extreme_5))
    table = pd.DataFrame(rows, columns=list(GAP_COLUMNS))
    table["left_out_layer"] = table.left_out_layer.astype("Int64")
    tokens = pd.DataFrame(dict(
        step=np.concatenate([np.full(len(item[2]), item[0].step) for item in work]),
        rank=np.concatenate([np.full(len(item[2]), item[0].rank) for item in work]),
        sequence=np.concatenate([np.full(len(item[2]), item[0].sequence) for item in work]),
        position=positions, token_id=np.concatenate([item[3] for item in work]), flips=flips, engine=engine_values,
        reference=np.concatenate(results[("reference", None)]), replay=np.concatenate(results[("replay", None)])))
    for routing, left_out in variants[2:]:
        tokens[f"but_{left_out}"] = np.concatenate(results[(routing, left_out)])
    return LogprobGapReport(table, tokens, list(compared), skipped)
