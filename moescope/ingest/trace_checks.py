"""Can an engine's routed-experts trace be trusted? The checks that need no model.

vLLM and SGLang return the experts each token was routed to as a `(rows, layers, top_k)` array per
sequence, filled from a zero-initialised buffer (vLLM's `RoutedExpertsCapturer`, SGLang's
`RoutedExpertsDeviceCache` / `RoutedExpertsHostCache`: `torch.zeros`, int32), so a layer the
capturer never wrote (a dense layer, a kernel path that skipped the capture) reads as expert 0 in
every slot; vLLM marks a row it did not compute in this request (a prefix-cache hit) with -1.
SGLang returns `req_to_token[...][: seqlen - 1]`: prompt + generated - 1 rows, the last generated
token never running a forward. These traces have gone wrong silently (vLLM PR 33013 and issue
54730: an all-zero buffer; PR 33013: physical ids; PR 39568: stale rows; verl PR 7075: the final
row zero-filled), so every trace an importer or the proxy reads is checked here, and each finding
names its check:

- `zero_rows`: token rows with expert 0 in every slot of every layer, a sequence's last row apart.
  An honest top-k router with k > 1 never gives one (a token's k ids are distinct); with k = 1 it
  gives about rows x the product over layers of expert 0's share, which `expected` says.
- `sentinel_rows`: token rows marked not computed (-1, and no expert above 0): prefix-cache hits
  in vLLM, which a replay cannot use.
- `repeated_ids`: (token row, layer) pairs naming one expert twice, the pair not all zero.
- `row_count`: sequences whose rows differ from the engines' convention (prompt rows, then
  generated tokens or one fewer); the count is the rows missing or extra.
- `final_row_zero`: sequences whose last row is all zero, the verl signature: it makes expert 0
  look hot by about E x these sequences / routed rows (E / mean length when every sequence has it).
- `physical_ids`: given an engine's physical-to-logical map (`EngineMap`: the placement sources of
  `moescope placement`), the slots a logical reading gets wrong (an id p whose physical slot holds
  another logical expert than p) in the layers whose ids are physical, post-EPLB ones where training
  needs logical ones. A layer's ids are physical when some pass the map's logical experts (only a
  physical slot, a redundant copy, has such an id), or, where the map comes with the load the
  engine recorded under it, when the ids' counts are likelier under "ids are physical slots" than
  under "ids are logical experts" by `load_evidence` (the odds in the module's `LOAD_ODDS`). A
  permutation map without a recorded load is not identifiable from a trace: any count per id is as
  likely logical as permuted.
- `out_of_range`: an id that cannot be stored (negative other than -1, past the column or
  `--num-experts`): the import is refused, its message naming this check.

The checks are sums over rows, so a sequence read in chunks gives the same findings as one read
whole; `TraceChecks.findings` turns the sums into `TraceFinding`s (`moescope.store.schema`'s, the
record of a `trace_findings` row, which the checks against the model give too).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from moescope.store.schema import TraceFinding as TraceFinding  # one record for every check's findings

CHECKS = ("zero_rows", "sentinel_rows", "repeated_ids", "row_count", "final_row_zero", "physical_ids",
          "out_of_range")
# what each finding's count counts, for messages
COUNTS = {"zero_rows": "token rows", "sentinel_rows": "token rows", "repeated_ids": "(token, layer) rows",
          "row_count": "rows missing or extra", "final_row_zero": "sequences", "physical_ids": "slots"}
# sequences and rows a finding names (the count says how many there are in all)
MAX_NAMED = 5
# a count of all-zero rows within this many standard deviations of an honest k = 1 router's is no finding
ZERO_ROWS_SIGMA = 3.0
# physical_ids by load: the odds (physical against logical) a trace's MoE layers must reach together; a
# layer needs LOAD_ODDS x layers (load_evidence)
LOAD_ODDS = 1000.0
SAMPLE_ROWS = 4 * MAX_NAMED  # rows kept per layer to name a layer found physical by its load

# the checks a trace is broken by (alerts/mismatch_rules.yaml's BrokenTrace), the model-based ones of
# `moescope mismatch` (moescope.analyses.trace_check) included; sentinel_rows is not one: vLLM marks
# prefix-cache hits -1 on purpose
BROKEN = ("zero_rows", "repeated_ids", "row_count", "final_row_zero", "physical_ids", "chance_agreement", "shifted",
          "large_margin_flips")

__all__ = ["BROKEN", "CHECKS", "LOAD_ODDS", "EngineMap", "TraceChecks", "TraceFinding", "broken_share", "finding_line",
           "load_evidence", "summary_line"]


class EngineMap(Protocol):
    """What the physical_ids check reads of an engine's map (`moescope.metrics.placement.RecordedMap`
    is one): where it came from, its logical experts, the most physical slots a layer has, and per
    MoE layer of a trace, (the logical expert of each physical slot, the load the engine recorded
    under it or None, what that load counts per: "physical" slot or "logical" expert)."""

    @property
    def source(self) -> str: ...

    @property
    def logical_experts(self) -> int: ...

    @property
    def physical_slots(self) -> int: ...

    def layer_maps(self, layer_ids: Sequence[int]) -> dict[int, tuple[np.ndarray, np.ndarray | None, str]]: ...


def load_evidence(counts: np.ndarray, physical_to_logical: np.ndarray, load: np.ndarray, load_per: str) -> float:
    """The log-likelihood ratio, in nats, of a layer's id counts under "ids are physical slots" against
    "ids are logical experts", given the load the engine recorded under its map.

    Under "logical", id e is drawn with the recorded share of logical expert e; under "physical", id
    p with the recorded share of physical slot p (a load per logical expert split evenly over its
    copies). Each recorded count gets half a token (Jeffreys' prior), so no id is impossible under
    either for lack of a record. Where the trace is drawn from the recorded load and its ids are
    logical, the likelihood ratio's expectation is 1, so it reaches odds O with probability at most
    1/O (Markov's inequality): the check calls a layer physical at `LOAD_ODDS` x layers. A trace from
    other traffic than the load's is judged by which of the two it is nearer (in Kullback-Leibler
    divergence: the ratio per slot is the difference of the two), so the load must be recorded over
    comparable traffic. -inf where an id has no physical slot.

    Args:
        counts: (ids,) how often the trace names each id in the layer.
        physical_to_logical: (physical slots,) the logical expert each slot holds.
        load: the recorded load per physical slot (`load_per` "physical") or logical expert ("logical").
        load_per: what `load` counts per.
    """
    p2l = np.asarray(physical_to_logical, dtype=np.int64)
    load = np.asarray(load, dtype=np.float64) + 0.5
    experts = max(int(p2l.max()) + 1, len(load) if load_per == "logical" else 0)
    if load_per == "physical":
        physical = load
        logical = np.bincount(p2l, weights=physical, minlength=experts)
    else:
        logical = np.concatenate([load, np.full(experts - len(load), 0.5)])
        physical = logical[p2l] / np.bincount(p2l, minlength=experts)[p2l]
    counts = np.asarray(counts, dtype=np.float64)
    ids = np.flatnonzero(counts)
    if not len(ids):
        return 0.0
    if ids[-1] >= len(physical):
        return -math.inf
    if ids[-1] >= len(logical):
        return math.inf
    q_physical = physical[ids] / physical.sum()
    q_logical = logical[ids] / logical.sum()
    return float(np.sum(counts[ids] * (np.log(q_physical) - np.log(q_logical))))


class _Tally:
    def __init__(self) -> None:
        self.count = 0
        self.sequences: list[str] = []
        self.rows: list[str] = []

    def add(self, label: str, rows: Iterable[int], n: int) -> None:
        if n <= 0:
            return
        self.count += n
        if label not in self.sequences and len(self.sequences) < MAX_NAMED:
            self.sequences.append(label)
        for row in rows:
            if len(self.rows) >= MAX_NAMED:
                break
            self.rows.append(f"{label} row {row}")


class TraceChecks:
    """Sums of the model-free checks over the sequences of a trace, fed a chunk at a time.

    Args:
        engine_map: the engine's physical-to-logical map, for `physical_ids` (None: not checked).
    """

    def __init__(self, engine_map: EngineMap | None = None):
        self.engine_map = engine_map
        self.logical_experts = None if engine_map is None else int(engine_map.logical_experts)
        # the MoE layers that have routed since the checks began, kept by `reset`: the map is placed on
        # all of them, so a chunk in which a layer routed nothing places its rows as the whole trace does
        self._layers_seen: set[int] = set()
        self.reset()

    def reset(self) -> None:
        """Forget every sum (a reader's second pass over its files starts again)."""
        self.rows = 0  # token rows seen
        self.layer_rows = 0  # (token row, layer) pairs seen, not all-zero or -1
        self.sequences = 0
        self.slots = 0
        self.top_k: int | None = None
        self.largest = -1  # the largest id seen: experts = largest + 1 where nothing says more
        self.tallies = {check: _Tally() for check in CHECKS}
        self._zero_share: dict[int, list[int]] = {}  # layer -> [rows choosing 0, rows] among routed rows
        self._counts: dict[int, np.ndarray] = {}  # layer -> how often each id was named (engine map given)
        self._sample: dict[int, list[tuple[str, int, np.ndarray]]] = {}  # layer -> its first routed rows
        self._physical: tuple[int, str] | None = None  # physical_ids' (count, detail), once judged

    def forget_map(self) -> None:
        """Stop checking physical_ids (a map that does not fit the trace's layers): `findings` then
        leaves it out."""
        self.engine_map = None
        self.logical_experts = None
        self._physical = None
        self._counts.clear()
        self._sample.clear()

    def add(self, ids: np.ndarray, label: str, first_row: int = 0, ends: bool = True,
            layer_numbers: Sequence[int] | None = None) -> None:
        """Check one sequence's rows `first_row ..` (a chunk of it, or all of it).

        Args:
            ids: (rows, layers, top_k) integer ids as the engine returned them (-1: not computed).
            label: names the sequence in findings (file, response, sequence).
            first_row: the row of `ids[0]` in the sequence.
            ends: whether the sequence's last row is in this chunk (its last row is `ids[-1]`).
            layer_numbers: the layer of each column of `ids` (default 0, 1, ...: the engines' arrays have
                a column per hidden layer).
        """
        ids = np.asarray(ids)
        self.sequences += bool(ends)  # each sequence ends once, whatever its chunks
        if ids.ndim != 3 or not len(ids):
            return
        n, layers, k = ids.shape
        self.top_k = k if self.top_k is None else self.top_k
        flat = ids.reshape(n, -1)
        signed = ids.dtype.kind == "i"
        zero = ~flat.any(axis=1)
        sentinel = ((flat == -1).any(axis=1) & (flat <= 0).all(axis=1)) if signed else np.zeros(n, dtype=bool)
        last = np.zeros(n, dtype=bool)
        if ends:
            last[-1] = True
        self.rows += n
        numbers = np.arange(first_row, first_row + n)
        self.tallies["zero_rows"].add(label, numbers[zero & ~last], int(np.count_nonzero(zero & ~last)))
        self.tallies["final_row_zero"].add(label, numbers[zero & last], int(np.count_nonzero(zero & last)))
        self.tallies["sentinel_rows"].add(label, numbers[sentinel], int(np.count_nonzero(sentinel)))
        routed = ~(zero | sentinel)
        layer_ids = ids[routed].astype(np.int64)  # (routed rows, layers, k)
        if not len(layer_ids):
            return
        self.largest = max(self.largest, int(layer_ids.max()))
        # (rows, layers): a layer-row routed (not all zero, no -1)
        live = np.asarray(layer_ids.any(axis=2) & ~(layer_ids < 0).any(axis=2), dtype=bool)
        self.layer_rows += int(np.count_nonzero(live))
        if k > 1:
            ordered = np.sort(layer_ids, axis=2)
            repeated = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2) & live
            which = numbers[routed][repeated.any(axis=1)]
            self.tallies["repeated_ids"].add(label, which, int(np.count_nonzero(repeated)))
        else:
            for layer in range(layers):
                share = self._zero_share.setdefault(layer, [0, 0])
                share[0] += int(np.count_nonzero(layer_ids[:, layer, 0] == 0))
                share[1] += len(layer_ids)
        self.slots += int(np.count_nonzero(live)) * k
        if self.logical_experts is not None:
            self._physical = None
            beyond = (layer_ids >= self.logical_experts) & live[:, :, None]
            which = numbers[routed][beyond.any(axis=(1, 2))]
            self.tallies["physical_ids"].add(label, which, len(which))  # names the rows; the count is judged
            for column, layer in enumerate(range(layers) if layer_numbers is None else layer_numbers):
                at = np.flatnonzero(live[:, column])
                if not len(at):
                    continue
                named = layer_ids[at, column].reshape(-1)
                counts = np.bincount(named[named >= 0], minlength=1)
                known = self._counts.get(int(layer), np.zeros(0, dtype=np.int64))
                if len(known) < len(counts):
                    known = np.concatenate([known, np.zeros(len(counts) - len(known), dtype=np.int64)])
                known[:len(counts)] += counts
                self._counts[int(layer)] = known
                self._layers_seen.add(int(layer))
                sample = self._sample.setdefault(int(layer), [])
                for row in at[:SAMPLE_ROWS - len(sample)]:
                    sample.append((label, int(numbers[routed][row]), layer_ids[row, column].copy()))

    def expect_rows(self, label: str, rows: int, allowed: tuple[int, ...]) -> None:
        """Check a sequence's row count against what its engine returns for its tokens (`allowed`)."""
        if not allowed or rows in allowed:
            return
        nearest = min(allowed, key=lambda a: abs(a - rows))
        self.tallies["row_count"].add(label, [], abs(rows - nearest))

    def zero_rows_expected(self) -> float:
        """All-zero token rows an honest router gives over the rows seen: 0 when k > 1 (a token's ids
        are distinct), else rows x the product over layers of expert 0's share of the routed rows."""
        if self.top_k is None or self.top_k > 1 or not self._zero_share:
            return 0.0
        product = 1.0
        for chose_zero, rows in self._zero_share.values():
            product *= chose_zero / rows if rows else 1.0
        return self.rows * product

    def findings(self, num_experts: int | None = None) -> list[TraceFinding]:
        """The checks that found something, in `CHECKS` order (`num_experts`: the model's E, for the
        final row's excess; default the largest id seen + 1)."""
        out = []
        expected_zero = self.zero_rows_expected()
        checked = {"zero_rows": self.rows, "sentinel_rows": self.rows, "repeated_ids": self.layer_rows,
                   "row_count": self.rows, "final_row_zero": self.sequences, "physical_ids": self.slots}
        for check, tally in self.tallies.items():
            if check == "physical_ids":  # its tally names rows past the logical experts; the layers are judged
                if self.engine_map is None:
                    continue
                count, detail = self._judge_physical()
                if count:
                    named = self.tallies[check]
                    out.append(TraceFinding(check, count, checked[check], 0.0, list(named.sequences),
                                            list(named.rows), detail))
                continue
            if not tally.count:
                continue
            expected = expected_zero if check == "zero_rows" else 0.0
            if check == "zero_rows" and tally.count <= expected + ZERO_ROWS_SIGMA * math.sqrt(expected):
                continue
            out.append(TraceFinding(check, tally.count, checked[check], expected, list(tally.sequences),
                                    list(tally.rows), self._detail(check, tally.count, expected, num_experts)))
        return out

    def _judge_physical(self) -> tuple[int, str]:
        """physical_ids' (count, detail): the layers whose ids are physical, by range or by load, and in
        them the slots whose id's physical slot holds another logical expert; the rows of the layers
        found by load are named from their first rows (`SAMPLE_ROWS`)."""
        if self._physical is not None or self.engine_map is None:
            return self._physical or (0, "")
        experts = int(self.logical_experts or 0)
        placed = self.engine_map.layer_maps(sorted(self._layers_seen)) if self._counts else {}
        maps = {layer: value for layer, value in placed.items() if layer in self._counts}
        threshold = math.log(LOAD_ODDS * max(len(maps), 1))
        count, by_range, by_load, loads = 0, [], [], 0
        named = self.tallies["physical_ids"]
        for layer, (p2l, load, per) in maps.items():
            counts = self._counts[layer]
            loads += load is not None
            if len(counts) > experts and counts[experts:].any():
                by_range.append(layer)
            elif load is not None and load_evidence(counts, p2l, load, per) >= threshold:
                by_load.append(layer)
            else:
                continue
            ids = np.arange(len(counts))
            moved = (ids >= len(p2l)) | (np.asarray(p2l)[np.minimum(ids, len(p2l) - 1)] != ids)
            count += int(counts[moved].sum())
            if layer in by_load:
                for label, row, chosen in self._sample.get(layer, []):
                    if moved[chosen[chosen >= 0]].any() and f"{label} row {row}" not in named.rows:
                        if len(named.rows) < MAX_NAMED:
                            named.rows.append(f"{label} row {row}")
                        if label not in named.sequences and len(named.sequences) < MAX_NAMED:
                            named.sequences.append(label)
        if not count:
            self._physical = (0, "")
            return self._physical
        parts = []
        if by_range:
            parts.append(f"{len(by_range)} layers name ids past the map's {experts} logical experts")
        if by_load:
            parts.append(f"the counts of {len(by_load)} layers are likelier under the map's physical slots than "
                         f"under its logical experts by odds over {LOAD_ODDS:g} x layers")
        self._physical = (count, f"{count} slots hold physical (post-EPLB) ids a logical reading gets wrong (vLLM "
                          f"PR 33013): {'; '.join(parts)} ({self.engine_map.source}; {loads} of {len(maps)} layers "
                          "with a recorded load)")
        return self._physical

    def _detail(self, check: str, count: int, expected: float, num_experts: int | None) -> str:
        if check == "zero_rows":
            return (f"{count} token rows route to expert 0 in every slot of every layer; an honest router gives "
                    f"{expected:.3g}: a capture that never wrote its buffer (vLLM PR 33013, issue 54730)")
        if check == "sentinel_rows":
            return (f"{count} token rows are -1 (not computed in this request: prefix-cache hits); a replay has "
                    "no routing for them")
        if check == "repeated_ids":
            return f"{count} (token, layer) rows name one expert twice; a top-k router's ids are distinct"
        if check == "row_count":
            return (f"{count} rows missing or extra against prompt + generated - 1 (the engines' convention): a "
                    "truncated or shifted trace")
        if check == "final_row_zero":
            excess = count * (num_experts or self.largest + 1 or 1) / max(self.rows, 1)
            return (f"{count} sequences end in an all-zero row (verl PR 7075): expert 0 looks hot by about "
                    f"E x {count} / {self.rows} rows = {excess:.3g} of a mean expert's load")
        return ""


def finding_line(finding: TraceFinding) -> str:
    """`check count of checked unit` (the unit: `COUNTS[check]`) for one-line summaries."""
    return f"{finding.check} {finding.count:,} of {finding.checked:,} {COUNTS.get(finding.check, 'rows')}"


def summary_line(findings: list[TraceFinding], rows: int) -> str:
    """One line: `trace checks: no finding in N token rows`, or the findings' checks and counts."""
    if not findings:
        return f"trace checks: no finding in {rows:,} token rows"
    return f"trace checks: {len(findings)} finding{'s' if len(findings) != 1 else ''}: " + \
        "; ".join(finding_line(f) for f in findings) + " (moescope check STORE --run RUN says more)"


def broken_share(findings: Iterable[tuple[str, int, int]]) -> float:
    """The largest share any check in `BROKEN` found broken, over (check, count, checked) triples:
    the `trace_broken_share` signal (0.0 when none found anything)."""
    return max((count / checked if checked else 1.0 for check, count, checked in findings
                if check in BROKEN and count > 0), default=0.0)

