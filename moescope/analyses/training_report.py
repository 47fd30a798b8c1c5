"""A training run read back from a store: per optimizer step and MoE layer, the auxiliary losses,
router entropy, dead experts, learning rates, gradient norms and routing cooldowns that
`moescope.training` recorded (the dashboard's Training page).

Every figure comes from `moescope.metrics.signals` over the store's `training_steps` query, the same
definitions the training monitor logs live; the tests check them against the model's own
`aux_loss`, transformers' loss functions and the raw Parquet rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from moescope.metrics import signals
from moescope.store.store import Store

LAYER_COLUMNS = ["optimizer_step", "step", "step_end", "ts", "layer", "tokens", "lr", "router_lr", "aux_loss",
                 "z_loss", "router_entropy", "dead_expert_fraction", "expert_grad_norm", "num_experts"]
STEP_COLUMNS = ["optimizer_step", "step", "step_end", "ts", "layer_tokens", "lr", "aux_loss", "z_loss"]
COOLDOWN_COLUMNS = ["rank", "layer", "start_step", "end_step", "ended", "lr_before", "lr_cooled", "lr_factor",
                    "epsilon", "reason", "end_reason", "source"]


@dataclass(frozen=True)
class TrainingReport:
    """A training run's figures read back from a store (`training_report`).

    Attributes:
        layers: per optimizer step and MoE layer, columns optimizer_step, step, step_end (the
            forwards of the update), ts (UTC), layer, tokens (routed by the layer, all ranks), lr,
            router_lr (the lr the router was updated with, a cooldown's factor included), aux_loss (the
            layer's own load-balancing loss), z_loss (router z-loss), router_entropy (token-weighted
            mean per-token entropy / ln of the router's width, in [0, 1]), dead_expert_fraction (routed
            experts with no kept slot over the last `dead_window` optimizer steps), expert_grad_norm
            (np.ndarray per routed expert, or None), num_experts (routed).
        steps: per optimizer step, all layers pooled as transformers pools them (the model's own
            `aux_loss`): optimizer_step, step, step_end, ts, layer_tokens (tokens summed over layers,
            the pooled losses' denominator), lr, aux_loss, z_loss.
        events: `Store.routing_cooldown_events` rows.
        cooldowns: one row per cooldown, paired from the events per (rank, layer): rank, layer,
            start_step, end_step (optimizer steps done at its start and end: it cooled the updates
            start_step+1..end_step; the last step shown while it is still on, `ended` False), ended,
            lr_before, lr_cooled (the router's lr before and during), lr_factor, epsilon, reason (why it
            started), end_reason, source.
        dead_window: the optimizer steps the dead-expert fraction looks back over.
        optimizer_steps: how many the run recorded (0: not a training run).
        first_optimizer_step: the first in `layers` and `steps` (later than the run's first when
            `last_steps` cut the report).
    """

    layers: pd.DataFrame
    steps: pd.DataFrame
    events: pd.DataFrame
    cooldowns: pd.DataFrame
    dead_window: int
    optimizer_steps: int
    first_optimizer_step: int

    @property
    def recorded(self) -> bool:
        """Whether the run has training steps (it was recorded with `moescope.training`)."""
        return self.optimizer_steps > 0


def _vector_sum(vectors: Sequence[np.ndarray | None]) -> np.ndarray | None:
    """The element-wise sum of one step's per-layer vectors; None unless every layer has one of one width."""
    present = [v for v in vectors if v is not None]
    if not vectors or len(present) != len(vectors) or len({len(v) for v in present}) != 1:
        return None
    return np.sum(np.stack(present), axis=0)


def _cooldown_spans(events: pd.DataFrame, last_step: int) -> pd.DataFrame:
    spans, open_ = [], {}
    for event in events.itertuples(index=False):
        key = (int(event.rank), int(event.layer))
        if event.action == "start":
            open_[key] = dict(rank=key[0], layer=key[1], start_step=int(event.step), end_step=None, ended=False,
                              lr_before=event.lr_before, lr_cooled=event.lr_after, lr_factor=event.lr_factor,
                              epsilon=event.epsilon, reason=event.reason, end_reason=None, source=event.source)
            spans.append(open_[key])
        elif event.action == "end" and key in open_:
            span = open_.pop(key)
            span.update(end_step=int(event.step), ended=True, end_reason=event.reason)
    for span in open_.values():  # still cooling at the latest record
        span["end_step"] = max(int(last_step), span["start_step"])
    return pd.DataFrame(spans, columns=COOLDOWN_COLUMNS)


def training_report(store: Store, run_id: str, dead_window: int = 64, last_steps: int | None = None
                    ) -> TrainingReport:
    """The training figures of a run recorded with `moescope.training`, from the store alone.

    Every figure is a `moescope.metrics.signals` definition over `Store.training_steps` (the monitor computes
    the same from the records while it runs): aux_loss = `load_balancing_loss(router_topk_load,
    router_prob_sum, tokens)` per layer, and of the sums over layers for the pooled value (which
    equals the model's own `aux_loss`); z_loss = `router_z_loss(router_z_sum, tokens)`;
    dead_expert_fraction = `dead_expert_fraction` of the routed `expert_load` summed over the
    optimizer steps in (k - dead_window, k]; router_entropy = `normalized_entropy`. A figure whose
    inputs were not recorded (stores before the aux-loss columns) is NaN.

    Args:
        store: an open `Store`.
        run_id: the run.
        dead_window: optimizer steps over which an expert with no kept slot counts as dead.
        last_steps: only the latest this many optimizer steps (None: all); the dead-expert window
            still reaches back before the first one shown.

    Returns:
        A `TrainingReport`; for a run without training steps, one with `recorded` False and empty
            frames.

    Raises:
        ValueError: for dead_window or last_steps below 1.
    """
    if int(dead_window) < 1:
        raise ValueError(f"dead_window counts optimizer steps and must be at least 1, not {dead_window}")
    if last_steps is not None and int(last_steps) < 1:
        raise ValueError(f"last_steps must be at least 1 (or None for every step), not {last_steps}")
    dead_window = int(dead_window)
    span = store.training_span(run_id)
    if span["optimizer_steps"] == 0:
        empty = store.routing_cooldown_events(run_id)
        return TrainingReport(pd.DataFrame(columns=LAYER_COLUMNS), pd.DataFrame(columns=STEP_COLUMNS), empty,
                              _cooldown_spans(empty, 0), dead_window, 0, 0)
    first, last = span["first_optimizer_step"], span["last_optimizer_step"]
    shown = first if last_steps is None else max(first, last - int(last_steps) + 1)
    rows = store.training_steps(run_id, first_optimizer_step=shown - dead_window + 1, last_optimizer_step=last)
    layer_frame = pd.DataFrame(_layer_rows(rows, dead_window), columns=LAYER_COLUMNS)
    step_frame = pd.DataFrame(_step_rows(rows), columns=STEP_COLUMNS)
    events = store.routing_cooldown_events(run_id)
    return TrainingReport(
        layers=layer_frame[layer_frame.optimizer_step >= shown].sort_values(
            ["optimizer_step", "layer"], ignore_index=True),
        steps=step_frame[step_frame.optimizer_step >= shown].reset_index(drop=True),
        events=events, cooldowns=_cooldown_spans(events, last), dead_window=dead_window,
        optimizer_steps=span["optimizer_steps"], first_optimizer_step=shown)


def _layer_rows(rows: pd.DataFrame, dead_window: int) -> list[dict]:
    """One `TrainingReport.layers` row per optimizer step and MoE layer of `Store.training_steps` rows."""
    layers = []
    for layer, group in rows.groupby("layer", sort=True):
        group = group.sort_values("optimizer_step")
        experts = None if pd.isna(group.num_experts.iloc[0]) else int(group.num_experts.iloc[0])
        width = max((len(v) for v in group.expert_load if v is not None), default=0)
        routed = np.stack([signals.routed_load(v if v is not None else np.zeros(width), experts)
                           for v in group.expert_load]) if len(group) else np.zeros((0, 0))
        # Per step, the routed load summed over the optimizer steps (k - dead_window, k]: a prefix sum
        # over the rows, the window's first row found by optimizer-step number (a step whose record
        # was dropped is not in the window, as in the monitor's own count).
        prefix = np.vstack([np.zeros((1, routed.shape[1])), np.cumsum(routed, axis=0)])
        optimizer_steps = group.optimizer_step.to_numpy(np.int64)
        start = np.searchsorted(optimizer_steps, optimizer_steps - dead_window, side="right")
        window_load = prefix[1:] - prefix[start]
        for row, recent in zip(group.itertuples(index=False), window_load):
            choices = len(row.router_prob_sum) if row.router_prob_sum is not None else len(row.expert_load)
            layers.append(dict(
                optimizer_step=int(row.optimizer_step), step=int(row.step), step_end=int(row.step_end), ts=row.ts,
                layer=int(layer), tokens=int(row.tokens), lr=row.lr, router_lr=row.router_lr,
                aux_loss=(signals.load_balancing_loss(row.router_topk_load, row.router_prob_sum, row.tokens)
                          if row.router_topk_load is not None and row.router_prob_sum is not None else math.nan),
                z_loss=(math.nan if pd.isna(row.router_z_sum) else signals.router_z_loss(row.router_z_sum, row.tokens)),
                router_entropy=(math.nan if pd.isna(row.router_entropy_mean) or choices < 1
                                else signals.normalized_entropy(row.router_entropy_mean, choices)),
                dead_expert_fraction=signals.dead_expert_fraction(recent), expert_grad_norm=row.expert_grad_norm,
                num_experts=experts))
    return layers


def _step_rows(rows: pd.DataFrame) -> list[dict]:
    """One `TrainingReport.steps` row per optimizer step, the layers pooled, of `Store.training_steps` rows."""
    steps = []
    for optimizer_step, group in rows.groupby("optimizer_step", sort=True):
        topk, prob = _vector_sum(list(group.router_topk_load)), _vector_sum(list(group.router_prob_sum))
        tokens = int(group.tokens.sum())
        steps.append(dict(
            optimizer_step=int(optimizer_step), step=int(group.step.min()), step_end=int(group.step_end.max()),
            ts=group.ts.max(), layer_tokens=tokens, lr=group.lr.iloc[0],
            aux_loss=(signals.load_balancing_loss(topk, prob, tokens)
                      if topk is not None and prob is not None else math.nan),
            z_loss=(math.nan if group.router_z_sum.isna().any()
                    else signals.router_z_loss(float(group.router_z_sum.sum()), tokens))))
    return steps
