"""Run figures: what every view shows for a layer and a run, from the store's totals.

`layer_figures` turns one `store.Store.layer_totals` row into a layer's figures (`LayerFigures`: tokens,
slots, load spread, zero-expert share, router entropy, drops); `run_figures` aggregates a selection's
layers by the rules of `moescope.metrics.signals` (weighting by tokens, zero experts left out of
loads); `run_counts` states a run's forwards and tokens in one unit. `moescope summary`, the
dashboard's Overview and Compare pages and the store's reports read them from here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from moescope.metrics.signals import (
    LoadSpread,
    RouterEntropy,
    dropped_token_rate,
    load_spread,
    router_entropy,
    token_weighted_mean,
    zero_expert_share,
)


@dataclass(frozen=True)
class LayerFigures:
    """What every view shows for one MoE layer over a selection of rows (a run, a tag, a window)."""

    layer: int
    tokens: int  # tokens the layer routed
    slots: int  # kept top-k assignments (sum of the expert load)
    spread: LoadSpread  # over the routed experts
    zero_expert_share: float  # of the slots, to zero experts; NaN for a layer without them
    entropy: RouterEntropy
    dropped_tokens: int  # tokens no expert processed
    dropped_token_rate: float  # dropped_tokens / tokens; NaN where drops were not recorded


def _recorded(value: float | None) -> bool:
    """False for a value a source did not record: None, NaN, or pandas' NA (from a null column)."""
    try:
        return value is not None and not math.isnan(float(value))
    except TypeError:
        return False


def layer_figures(layer: int, expert_load: np.ndarray | list[float], num_experts: int | None, zero_experts: int,
                  tokens: int, router_entropy_nats: float, dropped_tokens: int | None) -> LayerFigures:
    """Return one layer's figures from its summed load and totals (a `Store.layer_totals` row).

    `num_experts` counts routed experts (None: every entry of the load is one); the router's width
    is num_experts + zero_experts. A NaN entropy or None drops mean "not recorded by this source".
    """
    load = np.asarray(expert_load, dtype=np.float64)
    routed = load.size if num_experts is None else int(num_experts)
    recorded = _recorded(dropped_tokens)
    dropped = int(dropped_tokens) if recorded and dropped_tokens is not None else 0
    return LayerFigures(
        layer=int(layer), tokens=int(tokens), slots=int(load.sum()),
        spread=load_spread(load, routed, tokens),
        zero_expert_share=zero_expert_share(load, routed) if zero_experts else float("nan"),
        entropy=router_entropy([router_entropy_nats], [tokens], routed + int(zero_experts or 0)),
        dropped_tokens=dropped,
        dropped_token_rate=dropped_token_rate(dropped, tokens) if tokens > 0 and recorded else float("nan"))


@dataclass(frozen=True)
class RunFigures:
    """The headline figures over every layer of a selection, aggregated by the rules above."""

    layer_tokens: int  # tokens summed over layers (a token counts once per layer it passed)
    load_cv: float  # token-weighted mean over layers of each layer's CV
    entropy: RouterEntropy  # token-weighted over layers (and, inside each layer, over its rows)
    dropped_tokens: int  # summed over layers
    dropped_token_rate: float  # dropped_tokens / layer_tokens of the layers that record drops; NaN if none does
    hottest: LayerFigures | None  # the layer whose busiest expert has the largest share of its slots


def run_figures(layers: list[LayerFigures]) -> RunFigures:
    """Return the headline figures of per-layer figures (NaN and None where there is no layer)."""
    tokens = np.array([f.tokens for f in layers], dtype=np.float64)
    total = int(tokens.sum())
    dropped = sum(f.dropped_tokens for f in layers)
    # tokens of the layers whose source records drops: an importer's layers (NaN rate) count as unknown, not 0
    dropping = sum(f.tokens for f in layers if not math.isnan(f.dropped_token_rate))
    entropy = RouterEntropy(token_weighted_mean([f.entropy.nats for f in layers], tokens),
                            token_weighted_mean([f.entropy.normalized for f in layers], tokens))
    shares = [f.spread.hottest_slot_share for f in layers]
    hottest = layers[int(np.nanargmax(shares))] if layers and not np.isnan(shares).all() else None
    return RunFigures(layer_tokens=total, load_cv=token_weighted_mean([f.spread.cv for f in layers], tokens),
                      entropy=entropy, dropped_tokens=dropped,
                      dropped_token_rate=dropped / dropping if dropping else float("nan"), hottest=hottest)


@dataclass(frozen=True)
class RunCounts:
    """A run's headline counts, both in one unit: summed over every rank that recorded the run.

    `forwards` counts forward passes (a windowed row counts the forwards it holds) and `tokens` the
    tokens those forwards routed, each over all `ranks`; `forwards_per_rank` is the per-rank figure
    (what a step count of a data-parallel job reads as), never shown beside a summed token count
    without its words."""

    forwards: int
    tokens: int
    ranks: int

    @property
    def forwards_per_rank(self) -> float:
        return self.forwards / self.ranks if self.ranks else 0.0

    @property
    def over_ranks(self) -> str:
        """The words that say the unit: '' for one rank, 'over 2 ranks' for more."""
        return f"over {self.ranks:,} ranks" if self.ranks > 1 else ""

    def headline(self) -> str:
        """'80 forwards and 10,240 tokens over 2 ranks (40 forwards per rank)'; for one rank
        '40 forwards, 5,120 tokens'."""
        if self.ranks <= 1:
            return f"{self.forwards:,} forwards, {self.tokens:,} tokens"
        text = f"{self.forwards:,} forwards and {self.tokens:,} tokens"
        return f"{text} {self.over_ranks} ({self.forwards_per_rank:,.0f} forwards per rank)"


def run_counts(totals: Mapping[str, object]) -> RunCounts:
    """The headline counts of a `store.Store.step_totals` answer (its `forwards`, `tokens` and
    `ranks`, all summed over ranks): what `moescope summary` and the dashboard's Overview show."""
    def count(key: str) -> int:
        value: Any = totals.get(key)
        return int(value) if _recorded(value) else 0

    return RunCounts(forwards=count("forwards"), tokens=count("tokens"), ranks=count("ranks"))


def _present(value: object) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def layer_figures_of(rows) -> list[LayerFigures]:
    """`layer_figures` of each row of `store.Store.layer_totals` (its `itertuples()`)."""
    return [layer_figures(r.layer, r.expert_load, int(r.num_experts) if _present(r.num_experts) else None,
                          int(r.zero_experts) if _present(r.zero_experts) else 0, int(r.tokens or 0),
                          float(r.router_entropy) if _present(r.router_entropy) else float("nan"),
                          r.dropped_tokens if _present(r.dropped_tokens) else None)
            for r in rows]
