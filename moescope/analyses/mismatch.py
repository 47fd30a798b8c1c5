"""Engine vs reference: does the trainer route an engine's tokens the way the engine did?

Reinforcement learning on an MoE model samples with an inference engine (vLLM, SGLang) and trains
with another stack, and the two route the same tokens differently (the R3 paper, "rollout routing
replay", arXiv 2510.11370, measured about 10% of router decisions and 94% of tokens differing in
at least one layer on Qwen3-30B-A3B). `mismatch(model, store=..., run=...)` takes an engine run's
sequences and routing (`moescope import vllm|sglang`, `moescope proxy`; `mismatch_engine` says
how sequences are rebuilt and what is assumed where a format does not tell), runs `model` (the
reference: the trainer's model) on the same token ids with the same position ids, and compares
every (token, layer) the engine routed:

- set changed: the k experts differ as sets;
- top-1 changed: the engine's top-1 is not the reference's chosen expert of highest router logit
  (`moescope.analyses.routing_compare.top1_expert`). The engine's top-1 is its slot 0 where its
  router returns a sorted top-k (Mixtral, Qwen); for a grouped or biased router (DeepSeek-V2/V3
  style), whose engines return the top-k in the kernel's order, it is the engine's chosen expert of
  highest reference logit (`routing_compare.engine_top1`, `RouterRule.ranked`);
- slots changed: how many of the engine's k experts the reference did not choose (0..k);
- the reference's top-k decision margin (`moescope.analyses.routing_compare.decision_margin`): the
  k-th largest router logit minus the (k+1)-th; for a grouped router (DeepSeek-V2's group-limited
  greedy, Mistral 4, DeepSeek-V3) the smaller of its margins within its kept groups and between a
  kept and a dropped group, on its logits or, DeepSeek-V3-style, its sigmoid scores plus correction
  bias (`MismatchReport.margin_kind`), histogrammed for the pairs whose set changed and for the rest.

Figures come per MoE layer and for every layer together, overall, per position bucket
(`POSITION_EDGES`) and per tag of the engine's steps (`key=value`, at most `MAX_TAG_GROUPS`
values a key); beside the pair shares, the share of tokens that differ in at least one layer
(R3's figure). A shared prompt (vLLM's n > 1) is compared once, in sequence 0.

The reference runs the sequences `batch_size` at a time, right-padded, with an attention mask and
position ids from `moescope.analyses.routing_compare.generate_position_ids` (the rule
transformers' `generate` uses; a real token's position is its position in the sequence, as the
engine numbered it), in the model's dtype and attention, no cache, eval mode (the model is left in
the mode it came in).

Results land in a store as a run of their own (source "mismatch", tag `engine_run`): `mismatch`
rows per (group, layer), `mismatch_tokens` rows for the pairs that differ (at most `max_listed`
per layer, with their neighbours' ids), and the reference model's `layers` rows. The replay
arrays (`MismatchReport.replay`, `mismatch_replay.export_replay`) hold the engine's expert ids
per sequence as `[tokens, layers, top_k]`, ready for routing replay in training.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from moescope.analyses.check_runs import model_run, write_check_run
from moescope.analyses.mismatch_engine import EngineRun, EngineSequence, MismatchError, TokenIds, engine_sequences
from moescope.analyses.routing_compare import (
    CONTEXT_AFTER,
    CONTEXT_BEFORE,
    MARGIN_EDGES,
    MARGIN_KIND,
    RouterRule,
    decision_margin,
    engine_top1,
    forward_routing,
    margin_histogram,
    margins,
    pad_id,
    router_rule,
    top1_expert,
)
from moescope.analyses.trace_check import (
    TraceAgreement,
    large_margin,
    reference_pairs,
    trace_agreement,
    write_findings,
)
from moescope.probe.adapters import MoELayer, MoESpec, find_moe_layers
from moescope.probe.capture import LayerRouting, RoutingCapture

if TYPE_CHECKING:
    from moescope.analyses.logprob_gap import LogprobGapReport, LogprobsGiven
    from moescope.store.location import StoreLocation

__all__ = ["GROUPINGS", "LAYER_AXES", "POSITION_EDGES", "MismatchError", "MismatchReport", "ReplaySequence",
           "layer_map", "mismatch", "position_bucket", "write_report"]

# Lower edges of the position buckets (the last is open): short prompts apart, then doubling.
POSITION_EDGES: tuple[int, ...] = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MAX_TAG_GROUPS = 32  # values of one tag key kept as groups of their own; the rest pooled as "key=(other)"
GROUPINGS = ("all", "position", "tag")
LAYER_AXES = ("auto", "moe", "hidden")
EVERY_LAYER = None  # the layer of a group's every-layer row


@dataclass
class ReplaySequence:
    """One engine sequence ready for routing replay.

    Attributes:
        step, rank, sequence: the engine run's sequence.
        token_ids: (tokens,) int64, positions 0..tokens-1 (a shared prompt's included).
        expert_ids: (tokens, layers, top_k) the engine's expert ids, int16 where every id fits (E <
            32768), else int32; layers in the reference model's MoE-layer order (`MismatchReport.layers`),
            or the engine's own layer axis when no reference ran; -1 where the engine routed nothing.
        set_changed: (tokens, layers) bool, the reference chose another expert set; None without a
            reference.
        own_from: the first position routed for this sequence itself (before it: a shared prompt).
    """

    step: int
    rank: int
    sequence: int
    token_ids: np.ndarray
    expert_ids: np.ndarray
    set_changed: np.ndarray | None
    own_from: int = 0


@dataclass
class MismatchReport:
    """What `mismatch` measured.

    groups: one row per (group, layer): grouping ("all", "position", "tag"), group_name,
        group_order, layer (None: every layer together), pairs, tokens, set_changed, top1_changed,
        slots_changed, tokens_set_changed, tokens_top1_changed, changed_by_count (pairs with 0..k
        experts differing), changed_by_margin / unchanged_by_margin (pairs per bin of
        MARGIN_EDGES), listed, and the fractions set_changed_fraction, top1_changed_fraction (of
        pairs), slots_changed_fraction (of pairs x k), tokens_set_changed_fraction,
        tokens_top1_changed_fraction (of tokens).
    tokens: one row per listed pair that differs: layer, step, engine_rank, sequence, position,
        token_id, set_changed, top1_changed, slots_changed, topk_margin (the reference's decision
        margin, in `margin_kind`), top1_margin (reference logits), reference_ids, engine_ids,
        reference_weights, context_ids, context_start.
    replay: the engine's routing per sequence (`ReplaySequence`).
    layers: the reference MoE layers compared, in order (the replay arrays' layer axis).
    skipped: sequences not compared, per reason.
    gap: the log-prob gap, with and without the engine's routing replayed, where the engine returned
        log-probs (`moescope.analyses.logprob_gap`); else None.
    """

    groups: pd.DataFrame
    tokens: pd.DataFrame
    replay: list[ReplaySequence]
    engine_run: str
    top_k: int
    layers: list[int]
    reference_dtype: str = ""
    model_class: str = ""
    skipped: dict[str, int] = field(default_factory=dict)
    run_id: str | None = None
    # the engine's trace against the reference (offsets, chance, large-margin flips: `trace_check`)
    trace: TraceAgreement | None = None
    # the log-prob gap with and without the engine's routing replayed (`logprob_gap`), with engine log-probs
    gap: LogprobGapReport | None = None
    margin_kind: str = MARGIN_KIND  # the unit of the top-k margins: "logit" or "biased score"

    def overall(self) -> pd.Series:
        """The every-layer row of the whole run (grouping "all", layer None)."""
        rows = self.groups[(self.groups.grouping == "all") & self.groups.layer.isna()]
        if rows.empty:
            raise MismatchError("nothing was compared")
        return rows.iloc[0]

    @property
    def decision_share(self) -> float:
        """Share of the (token, layer) pairs whose expert set differs (R3: about 10%)."""
        return float(self.overall().set_changed_fraction)

    @property
    def token_share(self) -> float:
        """Share of the tokens whose expert set differs in at least one layer (R3: 94%)."""
        return float(self.overall().tokens_set_changed_fraction)

    def line(self) -> str:
        """One line for a person: both shares, the top-1 share, and where the flips sit."""
        row = self.overall()
        flipped = self.tokens[self.tokens.set_changed] if not self.tokens.empty else self.tokens
        unit = "logits" if self.margin_kind == MARGIN_KIND else self.margin_kind
        where = (f"; median reference top-k margin of the listed flips {flipped.topk_margin.median():.3g} {unit}"
                 if len(flipped) else "")
        if self.trace is not None and self.trace.broken:  # not a mismatch: the trace is not the router's
            return f"Engine vs reference ({self.engine_run}): {self.trace.line()}"
        return (f"Engine vs reference ({self.engine_run}): expert set differs for {row.set_changed_fraction:.2%} "
                f"of {int(row.pairs):,} (token, layer) pairs, top-1 for {row.top1_changed_fraction:.2%}; "
                f"{row.tokens_set_changed_fraction:.2%} of {int(row.tokens):,} tokens differ in at least one layer"
                + where + (f"; {self.trace.line()}" if self.trace is not None else ""))


# -- groups ------------------------------------------------------------------------------------

def position_bucket(position: int | np.ndarray) -> np.ndarray:
    """The bucket (index into POSITION_EDGES) of each position."""
    return np.searchsorted(np.asarray(POSITION_EDGES), np.asarray(position), side="right") - 1


def bucket_name(index: int) -> str:
    """A position bucket as `16-31` (the last as `16384+`)."""
    low = POSITION_EDGES[index]
    return f"{low}+" if index == len(POSITION_EDGES) - 1 else f"{low}-{POSITION_EDGES[index + 1] - 1}"


def _tag_groups(sequences: Sequence[EngineSequence]) -> dict[tuple[int, int, int], list[str]]:
    """Per sequence, the tag groups it belongs to: `key=value`, a key's values past MAX_TAG_GROUPS
    pooled as `key=(other)`."""
    values: dict[str, dict[str, int]] = {}
    for seq in sequences:
        for key, value in seq.tags.items():
            values.setdefault(key, {}).setdefault(value, 0)
            values[key][value] += 1
    kept = {key: set(sorted(counts, key=lambda v: (-counts[v], v))[:MAX_TAG_GROUPS]) for key, counts in values.items()}
    return {seq.key: [f"{k}={v}" if v in kept[k] else f"{k}=(other)" for k, v in sorted(seq.tags.items())]
            for seq in sequences}


class _Counts:
    """Running sums of one (group, layer)."""

    def __init__(self, top_k: int):
        self.pairs = self.tokens = self.set_changed = self.top1_changed = self.slots_changed = 0
        self.tokens_set_changed = self.tokens_top1_changed = 0
        self.by_count = np.zeros(top_k + 1, dtype=np.int64)
        self.changed_margin = np.zeros(len(MARGIN_EDGES), dtype=np.int64)
        self.unchanged_margin = np.zeros(len(MARGIN_EDGES), dtype=np.int64)
        self.listed = 0

    def add_pairs(self, set_changed: np.ndarray, top1_changed: np.ndarray, slots: np.ndarray,
                  margin: np.ndarray) -> None:
        self.pairs += len(set_changed)
        self.set_changed += int(set_changed.sum())
        self.top1_changed += int(top1_changed.sum())
        self.slots_changed += int(slots.sum())
        self.by_count += np.bincount(slots, minlength=len(self.by_count))[:len(self.by_count)]
        self.changed_margin += margin_histogram(margin[set_changed])
        self.unchanged_margin += margin_histogram(margin[~set_changed])

    def add_tokens(self, tokens: int, set_changed: int, top1_changed: int) -> None:
        self.tokens += tokens
        self.tokens_set_changed += set_changed
        self.tokens_top1_changed += top1_changed


# -- layers ------------------------------------------------------------------------------------

def _hidden_index(layer: MoELayer) -> int | None:
    """The hidden (decoder) layer an MoE block sits in: the first number in its module name."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", layer.name)
    return int(match.group(1)) if match else None


def layer_map(engine_layers: Sequence[int], layers: Sequence[MoELayer], num_hidden_layers: int | None = None,
              axis: str = "auto") -> dict[int, int]:
    """Which engine layer each reference MoE layer is: {reference MoE layer index: position on the
    engine's layer axis (`EngineRun.layers`)}; a reference layer the engine did not record is left out.

    The engine numbers layers either among its MoE layers only ("moe": the i-th MoE layer, as the
    probe numbers them) or among every hidden layer, dense ones included ("hidden": SGLang's routed
    experts do so). "auto" takes "moe" when every hidden layer is an MoE layer or the engine's
    layers fit no other way, else "hidden".

    Raises:
        MismatchError: for an unknown axis, or engine layers the reference model does not have.
    """
    if axis not in LAYER_AXES:
        raise MismatchError(f"unknown layer axis {axis!r}; choose from {', '.join(LAYER_AXES)}")
    engine = {int(v): i for i, v in enumerate(engine_layers)}
    by_moe = {layer.index: layer.index for layer in layers}
    hidden = {layer.index: _hidden_index(layer) for layer in layers}
    by_hidden = {index: h for index, h in hidden.items() if h is not None}
    all_moe = num_hidden_layers is not None and num_hidden_layers == len(layers)
    fits_moe = set(engine) <= set(by_moe.values())
    fits_hidden = len(by_hidden) == len(layers) and set(engine) <= set(by_hidden.values())
    if axis == "auto":
        axis = "moe" if all_moe or (fits_moe and not fits_hidden) else "hidden"
    chosen, fits = (by_moe, fits_moe) if axis == "moe" else (by_hidden, fits_hidden)
    if not fits:
        raise MismatchError(f"the engine recorded layers {sorted(engine)} but the reference model's MoE layers are "
                            f"{sorted(by_moe.values())} (hidden layers {sorted(by_hidden.values())}): is it the "
                            "engine's model? (layer_axis='moe' or 'hidden' says how the engine numbers layers)")
    return {index: engine[value] for index, value in chosen.items() if value in engine}


# -- the check ---------------------------------------------------------------------------------

def mismatch(model: nn.Module, *, store: str | os.PathLike | StoreLocation, run: str,
             token_ids: TokenIds | None = None, batch_size: int = 8, max_sequences: int | None = None,
             max_listed: int = 1000, layer_axis: str = "auto", specs: Sequence[MoESpec] = (),
             write: bool = True, run_id: str | None = None, tags: dict[str, str] | None = None,
             progress: bool = False, logprobs: LogprobsGiven | None = None, per_layer: bool = False) -> MismatchReport:
    """Run `model` on engine run `run`'s token ids and compare its routing with the engine's, token by token.

    Args:
        model: the reference (the trainer's model): a decoder-only MoE model, in the dtype and
            attention implementation to compare (it is run as it is, in eval mode).
        store: the store holding the engine run (a folder or a URL); the results are written there.
        run: the engine run's id.
        token_ids: token ids the routes do not carry (SGLang responses): (step, sequence) or (step,
            rank, sequence) -> ids from position 0, the prompt's and the generated ones.
        batch_size: sequences per reference forward (right-padded; position ids as `generate`'s).
        max_sequences: compare the first this many sequences; None: all.
        max_listed: the most differing pairs listed per layer (`mismatch_tokens` rows).
        layer_axis: how the engine numbers layers: "moe", "hidden" or "auto" (`layer_map`).
        specs: `MoESpec`s for custom MoE modules.
        write: write the results to `store` as a run of their own.
        run_id: the results' run id (None: a new one).
        tags: key=value tags of the results' run (`engine_run` is added).
        progress: show a progress bar over the reference's forwards.
        logprobs: the engine's log-probs of the generated tokens where the run's `engine_logprobs`
            rows do not hold them: (step, sequence) or (step, rank, sequence) -> (position of the
            first generated token, log-probs). With either, the log-prob gap is measured
            (`moescope.analyses.logprob_gap`: the reference's own routing, then the engine's replayed).
        per_layer: with log-probs, also replay every layer but one, in turn (L + 1 more forwards).

    Returns:
        A MismatchReport (`run_id` set when written).

    Raises:
        MismatchError: for an engine run that cannot be re-run (no routes, no token ids, layers or
            top-k the model does not have), an encoder-decoder model, or options out of range; the
            message says what to do.
        probe.NoMoELayersError: for a model without MoE layers.
        StoreError: for a store or run that cannot be read. OSError: when the store refused the rows.
    """
    from moescope.store.store import Store

    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise MismatchError(f"{type(model).__name__} is an encoder-decoder model; the mismatch check re-runs a "
                            "decoder-only model on the engine's tokens")
    if batch_size < 1 or max_listed < 0 or (max_sequences is not None and max_sequences < 1):
        raise MismatchError(f"batch_size and max_sequences must be at least 1 and max_listed 0 or more, got "
                            f"{batch_size}, {max_sequences} and {max_listed}")
    layers = find_moe_layers(model, specs)
    with Store(store) as opened:
        run = opened.check_run(run)
        engine = engine_sequences(opened, run, token_ids, max_sequences)
        engine_logprobs = opened.engine_logprobs(run) if logprobs is None else logprobs
    mapping = layer_map(engine.layers, layers, getattr(config, "num_hidden_layers", None), layer_axis)
    compared = [layer for layer in layers if layer.index in mapping]
    wrong_k = [layer.name for layer in compared if layer.top_k != engine.top_k]
    if wrong_k:
        raise MismatchError(f"the engine routed top-{engine.top_k} but {', '.join(wrong_k)} of the reference route "
                            f"top-{compared[0].top_k if compared else '?'}: is it the engine's model?")
    routed = _reference(model, layers, engine.sequences, batch_size, progress)
    rules = {layer.index: router_rule(layer.router) for layer in compared}
    report = _compare(engine, layers, compared, mapping, routed, max_listed, rules)
    report.trace = _trace(report, layers, compared, routed, rules)
    from moescope.analyses.mismatch_replay import share_prompt_rows  # it imports this module

    share_prompt_rows(report.replay)
    report.model_class = type(model).__name__
    report.reference_dtype = str(next((p.dtype for p in model.parameters()), torch.float32)).removeprefix("torch.")
    report.gap = _gap(model, layers, report, engine, engine_logprobs, batch_size, per_layer, progress)
    if write:
        report.run_id = write_report(store, report, model, layers, run_id, tags)
        write_findings(store, report.engine_run, report.trace.findings() if report.trace is not None else [])
    return report


def _trace(report: MismatchReport, layers: Sequence[MoELayer], compared: Sequence[MoELayer],
           routed: list[list[LayerRouting]], rules: dict[int, RouterRule]) -> TraceAgreement | None:
    """The engine's trace against the reference (`trace_check.trace_agreement`), None when nothing ran."""
    if not routed or not compared:
        return None
    position = {layer.index: i for i, layer in enumerate(layers)}
    reference = reference_pairs(routed, [position[layer.index] for layer in compared],
                                [rules[layer.index] for layer in compared])
    return trace_agreement([r.expert_ids for r in report.replay], [r.own_from for r in report.replay], reference,
                           int(routed[0][position[compared[0].index]].logits.shape[1]),
                           large_margin(report.margin_kind), report.margin_kind)


def _reference(model: nn.Module, layers: Sequence[MoELayer], sequences: Sequence[EngineSequence], batch_size: int,
               progress: bool) -> list[list[LayerRouting]]:
    """Per sequence, per reference MoE layer, the reference's routing of its tokens."""
    from tqdm.auto import tqdm

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    pad = pad_id(model)
    ids = [seq.token_ids.tolist() for seq in sequences]
    out: list[list[LayerRouting]] = []
    was_training = model.training
    bar = tqdm(total=len(ids), desc="mismatch", unit="seq", disable=not progress, leave=False)
    try:
        model.eval()
        with RoutingCapture(layers) as capture, torch.no_grad():
            for first in range(0, len(ids), batch_size):
                try:
                    out += forward_routing(model, capture, ids[first:first + batch_size], "right", pad, device)
                except Exception as e:
                    if "index out of range" in str(e):
                        raise MismatchError(f"the reference cannot embed the engine's tokens ({e}): is it the "
                                            "engine's model, with its vocabulary?") from e
                    raise
                bar.update(len(ids[first:first + batch_size]))
    finally:
        model.train(was_training)
        bar.close()
    return out


def _gap(model: nn.Module, layers: Sequence[MoELayer], report: MismatchReport, engine: EngineRun, logprobs: Any,
         batch_size: int, per_layer: bool, progress: bool) -> LogprobGapReport | None:
    """The log-prob gap of the sequences compared (`moescope.analyses.logprob_gap`), None without log-probs."""
    from moescope.analyses.logprob_gap import logprob_gap

    compared = {(r.step, r.rank, r.sequence) for r in report.replay}
    return logprob_gap(model, layers, report.layers, EngineRun(engine.run_id, [s for s in engine.sequences
                                                                               if s.key in compared],
                                                                engine.layers, engine.top_k),
                       report.replay, logprobs, _tag_groups(engine.sequences), batch_size=batch_size,
                       per_layer=per_layer, progress=progress)


def _compare(engine: EngineRun, layers: Sequence[MoELayer], compared: Sequence[MoELayer], mapping: dict[int, int],
             routed: list[list[LayerRouting]], max_listed: int, rules: dict[int, RouterRule]) -> MismatchReport:
    k = engine.top_k
    tag_groups = _tag_groups(engine.sequences)
    counts: dict[tuple[str, str, int, int | None], _Counts] = {}
    listed: list[dict[str, Any]] = []
    listed_per_layer: dict[int, int] = {}
    replay: list[ReplaySequence] = []
    position = {layer.index: i for i, layer in enumerate(layers)}

    def group(kind: str, name: str, order: int, layer: int | None) -> _Counts:
        key = (kind, name, order, layer)
        if key not in counts:
            counts[key] = _Counts(k)
        return counts[key]

    for seq, per_layer in zip(engine.sequences, routed):
        tokens = len(seq.token_ids)
        own = np.arange(seq.own_from, tokens)
        buckets = position_bucket(own)
        groups = [("all", "all", 0, None)] + [("tag", name, 0, None) for name in tag_groups[seq.key]]
        any_set = np.zeros(len(own), dtype=bool)
        any_top1 = np.zeros(len(own), dtype=bool)
        any_pair = np.zeros(len(own), dtype=bool)
        set_matrix = np.zeros((tokens, len(compared)), dtype=bool)
        for column, layer in enumerate(compared):
            ref = per_layer[position[layer.index]]
            engine_ids = seq.expert_ids[own, mapping[layer.index]]
            valid = (engine_ids >= 0).all(axis=1)
            rows = own[valid]
            if not len(rows):
                continue
            e_ids, r_ids, logits = engine_ids[valid], ref.ids[rows], ref.logits[rows]
            same = (e_ids[:, :, None] == r_ids[:, None, :]).any(axis=2)
            slots = (k - same.sum(axis=1)).astype(np.int64)
            set_changed = slots > 0
            rule = rules[layer.index]
            top1_changed = engine_top1(e_ids, logits, rule) != top1_expert(logits, r_ids)
            topk_margin, top1_margin = decision_margin(logits, k, rule), margins(logits, k)[1]
            set_matrix[rows, column] = set_changed
            any_set[valid] |= set_changed
            any_top1[valid] |= top1_changed
            any_pair |= valid
            differ = np.flatnonzero(set_changed | top1_changed)
            chosen = differ[:max(max_listed - listed_per_layer.get(layer.index, 0), 0)]
            listed_per_layer[layer.index] = listed_per_layer.get(layer.index, 0) + len(chosen)
            pair_groups = [(g, np.ones(len(rows), dtype=bool)) for g in groups]
            pair_groups += [(("position", bucket_name(b), int(b), None), buckets[valid] == b)
                            for b in np.unique(buckets[valid])]
            for (kind, name, order, _), mask in pair_groups:
                for lay in (layer.index, EVERY_LAYER):
                    counted = group(kind, name, order, lay)
                    counted.add_pairs(set_changed[mask], top1_changed[mask], slots[mask], topk_margin[mask])
                    counted.listed += int(mask[chosen].sum())
                group(kind, name, order, layer.index).add_tokens(int(mask.sum()), int(set_changed[mask].sum()),
                                                                 int(top1_changed[mask].sum()))
            for i in chosen.tolist():
                at = int(rows[i])
                start = max(0, at - CONTEXT_BEFORE)
                listed.append(dict(
                    layer=layer.index, step=seq.step, engine_rank=seq.rank, sequence=seq.sequence, position=at,
                    token_id=int(seq.token_ids[at]), set_changed=bool(set_changed[i]),
                    top1_changed=bool(top1_changed[i]), slots_changed=int(slots[i]),
                    topk_margin=float(topk_margin[i]), top1_margin=float(top1_margin[i]),
                    reference_ids=r_ids[i].tolist(), engine_ids=e_ids[i].tolist(),
                    reference_weights=ref.weights[at].tolist(),
                    context_ids=seq.token_ids[start:at + CONTEXT_AFTER + 1].tolist(), context_start=start))
        token_groups = [(g, any_pair) for g in groups]
        token_groups += [(("position", bucket_name(b), int(b), None), any_pair & (buckets == b))
                         for b in np.unique(buckets[any_pair])]
        for (kind, name, order, _), mask in token_groups:
            group(kind, name, order, EVERY_LAYER).add_tokens(int(mask.sum()), int((any_set & mask).sum()),
                                                             int((any_top1 & mask).sum()))
        ids = seq.expert_ids[:, [mapping[layer.index] for layer in compared]]
        replay.append(ReplaySequence(seq.step, seq.rank, seq.sequence, seq.token_ids, narrow_ids(ids), set_matrix,
                                     seq.own_from))
    frame = pd.DataFrame([dict(grouping=kind, group_name=name, group_order=order, layer=layer, pairs=c.pairs,
                               tokens=c.tokens, set_changed=c.set_changed, top1_changed=c.top1_changed,
                               slots_changed=c.slots_changed, tokens_set_changed=c.tokens_set_changed,
                               tokens_top1_changed=c.tokens_top1_changed, changed_by_count=c.by_count.tolist(),
                               changed_by_margin=c.changed_margin.tolist(),
                               unchanged_by_margin=c.unchanged_margin.tolist(), listed=c.listed)
                          for (kind, name, order, layer), c in counts.items()], columns=list(GROUP_COLUMNS))
    if not frame.empty:
        frame["layer"] = frame.layer.astype("Int64")
        frame = frame.sort_values(["grouping", "group_order", "group_name", "layer"], key=_group_sort,
                                  na_position="last", kind="stable").reset_index(drop=True)
    frame["set_changed_fraction"] = frame.set_changed / frame.pairs.where(frame.pairs > 0)
    frame["top1_changed_fraction"] = frame.top1_changed / frame.pairs.where(frame.pairs > 0)
    frame["slots_changed_fraction"] = frame.slots_changed / (frame.pairs * k).where(frame.pairs > 0)
    frame["tokens_set_changed_fraction"] = frame.tokens_set_changed / frame.tokens.where(frame.tokens > 0)
    frame["tokens_top1_changed_fraction"] = frame.tokens_top1_changed / frame.tokens.where(frame.tokens > 0)
    kinds = {rule.margin_kind for rule in rules.values()} or {MARGIN_KIND}
    if len(kinds) > 1:
        raise MismatchError(f"the reference's MoE layers decide on different scores ({', '.join(sorted(kinds))}); "
                            "a run's margins share one unit, and the check does not support a model that mixes them")
    return MismatchReport(frame, pd.DataFrame(listed, columns=list(TOKEN_COLUMNS)), replay, engine.run_id, k,
                          [layer.index for layer in compared], skipped=dict(engine.skipped), margin_kind=kinds.pop())


def _group_sort(column: pd.Series) -> pd.Series:
    if column.name == "grouping":
        return column.map({name: i for i, name in enumerate(GROUPINGS)})
    return column


def narrow_ids(ids: np.ndarray) -> np.ndarray:
    """Expert ids as int16 where every id fits (E < 32768, -1 for "not routed"), else int32."""
    return ids.astype(np.int16 if ids.size == 0 or int(ids.max()) < 32768 else np.int32)


GROUP_COLUMNS = ("grouping", "group_name", "group_order", "layer", "pairs", "tokens", "set_changed", "top1_changed",
                 "slots_changed", "tokens_set_changed", "tokens_top1_changed", "changed_by_count",
                 "changed_by_margin", "unchanged_by_margin", "listed")
TOKEN_COLUMNS = ("layer", "step", "engine_rank", "sequence", "position", "token_id", "set_changed", "top1_changed",
                 "slots_changed", "topk_margin", "top1_margin", "reference_ids", "engine_ids", "reference_weights",
                 "context_ids", "context_start")


# -- the store ---------------------------------------------------------------------------------

def write_report(store: str | os.PathLike | StoreLocation, report: MismatchReport, model: nn.Module,
                 layers: Sequence[MoELayer], run_id: str | None = None, tags: dict[str, str] | None = None) -> str:
    """Write `report` as run `run_id` (a new id when None): its `mismatch` and `mismatch_tokens` rows,
    then the reference's `layers` rows and the `runs` row (source "mismatch", tag engine_run) last,
    so that the run appears complete or not at all (`moescope.analyses.check_runs.write_check_run`).
    Returns the run id; raises OSError when the store refused rows."""
    from moescope.core.runs import new_run_id

    run = model_run(model, layers, run_id or new_run_id(), dt.datetime.now(dt.timezone.utc),
                    {**(tags or {}), "engine_run": report.engine_run})
    group_rows = [dict(row, run_id=run.run_id, ts=run.started_at, engine_run=report.engine_run,
                       layer=None if pd.isna(row["layer"]) else int(row["layer"]), margin_kind=report.margin_kind,
                       margin_edges=list(MARGIN_EDGES), top_k=report.top_k, reference_dtype=report.reference_dtype,
                       rank=0)
                  for row in report.groups[list(GROUP_COLUMNS)].to_dict("records")]
    token_rows = [dict(row, run_id=run.run_id, rank=0) for row in report.tokens.to_dict("records")]
    gap_rows = [] if report.gap is None else [
        dict(row, run_id=run.run_id, ts=run.started_at, engine_run=report.engine_run, rank=0,
             left_out_layer=None if pd.isna(row["left_out_layer"]) else int(row["left_out_layer"]))
        for row in report.gap.rows.to_dict("records")]
    write_check_run(store, run, "mismatch", [("mismatch", group_rows), ("mismatch_tokens", token_rows),
                                             ("mismatch_logprob_gap", gap_rows)])
    return run.run_id
