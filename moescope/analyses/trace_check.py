"""Checks of an engine's trace against the model itself: the part of `moescope mismatch` that says
whether the trace can be trusted at all, before it is called "mismatched".

The model-free checks (`moescope.ingest.trace_checks`) see what no router gives; these see what
this model's router would not give, on the tokens the engine routed:

- agreement at token offsets -2..+2: the mean share of the engine's k experts at position t that
  the reference chose at position t + d. A sound trace agrees best at d = 0; one that agrees best
  at +1 or -1 (by more than `SHIFT_SIGMA` standard errors) is shifted by a token, the engine's row t
  holding token t + d's routing.
- near chance: two unrelated top-k sets of E experts share k/E of their experts on average. A trace
  whose best agreement is within `BROKEN_FRACTION` of the way from chance to full agreement is
  broken (zeros, stale rows, another model's ids), not "mismatched": R3's mismatch (arXiv
  2510.11370: about 10% of (token, layer) decisions differ, most by one expert) keeps agreement
  above 0.9, a trace unrelated to the router sits at k/E, and a quarter of the way leaves room
  for a trace that is partly stale.
- large-margin flips: (token, layer) pairs whose expert set differs although the reference's
  top-k margin (its k-th largest router logit minus its (k+1)-th, `routing_compare.margins`) is
  at least `LARGE_MARGIN` logits. bfloat16 keeps 8 significant bits: one rounding moves a logit
  of magnitude 1..10 by at most about 0.02, and the hidden-state differences a bf16 engine
  accumulates flipped the shipped demo model's routing at margins of at most 0.14 logits (99th
  percentile 0.13, 27 flips of 6144 pairs, measured with the stand-in engine of the tests). A
  margin of 1 logit is seven times that, and a probability ratio of e = 2.7 between the k-th and
  the (k+1)-th expert, which rounding does not reverse: a flip there is a plumbing or placement
  bug (physical ids under a permutation map, a row from another token), not noise. The margin is
  the router's decision margin (`routing_compare.decision_margin`), taken where it decides: a
  grouped router (DeepSeek-V2's group-limited greedy, Mistral 4, DeepSeek-V3) chooses within its
  kept groups, so its margin is the smaller of its two decisions' (within the kept groups, and
  between a kept and a dropped group where exchanging them changes the choice). A DeepSeek-V3-style
  router chooses on sigmoid(logit) + correction bias, so its margin is in those biased scores, and
  its threshold is `LARGE_SCORE_MARGIN` = 0.25: a sigmoid's slope is at most 1/4, so closing a gap
  of 0.25 between two biased scores (the bias is a constant) takes the two logits moving by 1 logit
  together at least, the same evidence as `LARGE_MARGIN`.

Each check that finds something gives a finding of the engine run (`TraceFinding`, the record of a
`trace_findings` row, `moescope.store.schema`'s, which the model-free checks give too), written as its
`trace_findings` rows (origin "mismatch") beside the import's and the proxy's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moescope.analyses.routing_compare import MARGIN_KIND, RouterRule, decision_margin
from moescope.store.schema import TraceFinding

OFFSETS = (-2, -1, 0, 1, 2)
LARGE_MARGIN = 1.0  # logits; see the module doc
LARGE_SCORE_MARGIN = LARGE_MARGIN / 4  # biased scores: a sigmoid's slope is at most 1/4 (module doc)
BROKEN_FRACTION = 0.25  # of the way from chance (k/E) to full agreement
SHIFT_SIGMA = 3.0  # standard errors an offset's agreement must beat offset 0's by

__all__ = ["BROKEN_FRACTION", "LARGE_MARGIN", "LARGE_SCORE_MARGIN", "OFFSETS", "SHIFT_SIGMA",
           "TraceAgreement", "large_margin", "trace_agreement"]


def large_margin(kind: str) -> float:
    """The margin of a large-margin flip in a margin kind's unit: `LARGE_MARGIN` logits, or
    `LARGE_SCORE_MARGIN` for a biased router's scores."""
    return LARGE_MARGIN if kind == MARGIN_KIND else LARGE_SCORE_MARGIN


@dataclass
class TraceAgreement:
    """What the engine's trace and the reference's routing share.

    Attributes:
        agreement: per offset d, the mean share of the engine's k experts at t the reference chose at t + d.
        pairs: per offset, the (token, layer) pairs compared there.
        chance: k / E, the agreement of unrelated top-k sets.
        flips: pairs at offset 0 whose expert set differs.
        large_margin_flips: those whose reference decision margin is at least `threshold`.
        threshold: the margin of a large-margin flip, in `margin_kind`.
        margin_kind: "logit", or "biased score" for a DeepSeek-V3-style router.
    """

    agreement: dict[int, float]
    pairs: dict[int, int]
    chance: float
    flips: int
    large_margin_flips: int
    threshold: float = LARGE_MARGIN
    margin_kind: str = MARGIN_KIND

    @property
    def unit(self) -> str:
        """The margins' unit, as a line says it."""
        return "logits" if self.margin_kind == MARGIN_KIND else self.margin_kind

    @property
    def best_offset(self) -> int:
        """The offset the trace agrees best at (0 on a tie)."""
        return max(self.agreement, key=lambda d: (self.agreement[d], d == 0))

    @property
    def shifted(self) -> bool:
        """The trace agrees best at another offset than 0, beyond `SHIFT_SIGMA` standard errors."""
        best = self.best_offset
        if best == 0 or not self.pairs.get(0):
            return False
        p = self.agreement[0]
        error = math.sqrt(max(p * (1 - p), 1e-12) / self.pairs[0])
        return self.agreement[best] - p > SHIFT_SIGMA * error

    @property
    def broken(self) -> bool:
        """The best agreement is within `BROKEN_FRACTION` of the way from chance to 1."""
        return bool(self.agreement) and max(self.agreement.values()) < self.chance + BROKEN_FRACTION * (1 - self.chance)

    def verdict(self) -> str:
        """"broken", "shifted by d" or "sound"."""
        if self.broken:
            return "broken"
        if self.shifted:
            return f"shifted by {self.best_offset:+d}"
        return "sound"

    def line(self) -> str:
        """One line: the verdict, the agreement per offset, the large-margin flips."""
        shares = ", ".join(f"{d:+d}: {self.agreement[d]:.3f}" for d in sorted(self.agreement))
        return (f"trace {self.verdict()} (agreement by token offset {shares}; chance {self.chance:.3f}); "
                f"{self.large_margin_flips} of {self.flips} flips at a reference margin >= {self.threshold:g} "
                f"{self.unit}")

    def findings(self) -> list[TraceFinding]:
        """The findings of the engine run: chance_agreement, shifted, large_margin_flips."""
        out = []
        compared = self.pairs.get(0, 0)
        shares = ", ".join(f"{d:+d} {self.agreement[d]:.3f}" for d in sorted(self.agreement))
        if self.broken:
            out.append(TraceFinding("chance_agreement", compared, compared, 0.0, detail=(
                f"the trace agrees with the model's routing near chance (k/E = {self.chance:.3f}; by offset {shares}): "
                "broken, not mismatched (zeros, stale rows, another model's or physical ids)")))
        elif self.shifted:
            out.append(TraceFinding("shifted", compared, compared, 0.0, detail=(
                f"the trace agrees best at token offset {self.best_offset:+d} (by offset {shares}): row t holds "
                f"token t{self.best_offset:+d}'s routing")))
        if self.large_margin_flips and self.verdict() == "sound":  # a shift or a broken trace explains them
            out.append(TraceFinding("large_margin_flips", self.large_margin_flips, compared, 0.0, detail=(
                f"{self.large_margin_flips} (token, layer) pairs differ although the reference's top-k margin is at "
                f"least {self.threshold:g} {self.unit}: a plumbing or placement bug, not rounding")))
        return out


def trace_agreement(engine_ids: Sequence[np.ndarray], own_from: Sequence[int],
                    reference: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]], num_experts: int,
                    threshold: float = LARGE_MARGIN, margin_kind: str = MARGIN_KIND) -> TraceAgreement:
    """Agreement at each of `OFFSETS` and the large-margin flips, over every compared sequence.

    Args:
        engine_ids: per sequence, (tokens, layers, k) the engine's ids (-1: not routed).
        own_from: per sequence, its first own position (before it: a shared prompt, compared once).
        reference: per sequence, per layer (the engine's layer order), the reference's (ids (tokens,
            k), decision margins (tokens,), `routing_compare.decision_margin`).
        num_experts: E, for chance (k/E).
        threshold: the margin of a large-margin flip, in `margin_kind`.
        margin_kind: the margins' unit.

    Returns:
        A TraceAgreement.
    """
    overlap = {d: 0 for d in OFFSETS}
    pairs = {d: 0 for d in OFFSETS}
    flips = large = 0
    k = 1
    for ids, first, per_layer in zip(engine_ids, own_from, reference):
        tokens = len(ids)
        for layer, (ref_ids, margin) in enumerate(per_layer):
            k = ref_ids.shape[1]
            own = np.arange(first, tokens)
            engine = ids[own, layer]
            valid = (engine >= 0).all(axis=1)
            own, engine = own[valid], engine[valid]
            for d in OFFSETS:
                at = own + d
                inside = (at >= 0) & (at < tokens)
                shared = (engine[inside][:, :, None] == ref_ids[at[inside]][:, None, :]).any(axis=2).sum()
                overlap[d] += int(shared)
                pairs[d] += int(inside.sum())
            changed = ~(engine[:, :, None] == ref_ids[own][:, None, :]).any(axis=2).all(axis=1)
            flips += int(changed.sum())
            large += int((changed & (margin[own] >= threshold)).sum())
    agreement = {d: overlap[d] / (pairs[d] * k) for d in OFFSETS if pairs[d]}
    return TraceAgreement(agreement, {d: n for d, n in pairs.items() if n}, k / num_experts, flips, large, threshold,
                          margin_kind)


def reference_pairs(routed: Sequence[Sequence], positions: Sequence[int],
                    rules: Sequence[RouterRule]) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Per sequence, the reference's (ids, decision margins) of the layers at `positions` (its MoE-layer
    order), each layer's margins by its router's rule (`rules`, in the order of `positions`)."""
    return [[(per_layer[i].ids, decision_margin(per_layer[i].logits, per_layer[i].ids.shape[1], rule))
             for i, rule in zip(positions, rules)] for per_layer in routed]


def write_findings(store, engine_run: str, findings: Sequence[TraceFinding]) -> None:
    """Write `findings` as the engine run's `trace_findings` rows (origin "mismatch"); nothing when
    there are none. Raises OSError when the store refused them."""
    import datetime as dt

    from moescope.store.location import open_location
    from moescope.store.schema import trace_findings_table
    from moescope.store.writer import run_writer

    if not findings:
        return
    location = open_location(store)
    with run_writer(location, engine_run) as writer:
        table = trace_findings_table(engine_run, dt.datetime.now(dt.timezone.utc), "mismatch", findings)
        if not writer.write("trace_findings", table):
            raise OSError(f"the store {location.redacted!r} did not take the trace_findings rows "
                          f"({writer.last_error or 'see the log'})")
