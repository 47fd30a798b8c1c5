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
- `physical_ids`: given the logical experts of an engine's physical-to-logical map (the placement
  files of `moescope placement`), slots holding an id past them: a physical, post-EPLB id where
  training needs a logical one. A map without redundant slots (a permutation) gives no such id and
  is not found here: the model-based checks of `moescope mismatch` are the ones that see it.
- `out_of_range`: an id that cannot be stored (negative other than -1, past the column or
  `--num-experts`): the import is refused, its message naming this check.

The checks are sums over rows, so a sequence read in chunks gives the same findings as one read
whole; `TraceChecks.findings` turns the sums into `TraceFinding`s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

CHECKS = ("zero_rows", "sentinel_rows", "repeated_ids", "row_count", "final_row_zero", "physical_ids",
          "out_of_range")
# what each finding's count counts, for messages
COUNTS = {"zero_rows": "token rows", "sentinel_rows": "token rows", "repeated_ids": "(token, layer) rows",
          "row_count": "rows missing or extra", "final_row_zero": "sequences", "physical_ids": "slots"}
# sequences and rows a finding names (the count says how many there are in all)
MAX_NAMED = 5
# a count of all-zero rows within this many standard deviations of an honest k = 1 router's is no finding
ZERO_ROWS_SIGMA = 3.0

# the checks a trace is broken by (alerts/mismatch_rules.yaml's BrokenTrace), the model-based ones of
# `moescope mismatch` (moescope.analyses.trace_check) included; sentinel_rows is not one: vLLM marks
# prefix-cache hits -1 on purpose
BROKEN = ("zero_rows", "repeated_ids", "row_count", "final_row_zero", "physical_ids", "chance_agreement", "shifted",
          "large_margin_flips")

__all__ = ["BROKEN", "CHECKS", "TraceChecks", "TraceFinding", "broken_share", "summary_line"]


@dataclass
class TraceFinding:
    """One check that found something in a trace.

    `count` is what the check counts (`COUNTS[check]`) out of `checked`; `expected` what an honest
    router gives (0 where it gives none); `sequences` and `rows` name the first few where it was
    found (rows as "sequence row N"); `detail` says it in a sentence.
    """

    check: str
    count: int
    checked: int
    expected: float = 0.0
    sequences: list[str] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)
    detail: str = ""

    def line(self) -> str:
        """`check count of checked unit` for one-line summaries."""
        return f"{self.check} {self.count:,} of {self.checked:,} {COUNTS.get(self.check, 'rows')}"


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
        logical_experts: the logical experts of the engine's placement map, for `physical_ids`
            (None: not checked).
    """

    def __init__(self, logical_experts: int | None = None):
        if logical_experts is not None and logical_experts < 1:
            raise ValueError(f"logical experts must be positive, not {logical_experts}")
        self.logical_experts = logical_experts
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

    def add(self, ids: np.ndarray, label: str, first_row: int = 0, ends: bool = True) -> None:
        """Check one sequence's rows `first_row ..` (a chunk of it, or all of it).

        Args:
            ids: (rows, layers, top_k) integer ids as the engine returned them (-1: not computed).
            label: names the sequence in findings (file, response, sequence).
            first_row: the row of `ids[0]` in the sequence.
            ends: whether the sequence's last row is in this chunk (its last row is `ids[-1]`).
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
            beyond = (layer_ids >= self.logical_experts) & live[:, :, None]
            which = numbers[routed][beyond.any(axis=(1, 2))]
            self.tallies["physical_ids"].add(label, which, int(np.count_nonzero(beyond)))

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
            if not tally.count:
                continue
            expected = expected_zero if check == "zero_rows" else 0.0
            if check == "zero_rows" and tally.count <= expected + ZERO_ROWS_SIGMA * math.sqrt(expected):
                continue
            out.append(TraceFinding(check, tally.count, checked[check], expected, list(tally.sequences),
                                    list(tally.rows), self._detail(check, tally.count, expected, num_experts)))
        return out

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
        if check == "physical_ids":
            return (f"{count} slots hold ids past the {self.logical_experts} logical experts of the placement map: "
                    "physical (post-EPLB) ids where training needs logical ones (vLLM PR 33013)")
        return ""


def summary_line(findings: list[TraceFinding], rows: int) -> str:
    """One line: `trace checks: no finding in N token rows`, or the findings' checks and counts."""
    if not findings:
        return f"trace checks: no finding in {rows:,} token rows"
    return f"trace checks: {len(findings)} finding{'s' if len(findings) != 1 else ''}: " + \
        "; ".join(f.line() for f in findings) + " (moescope check STORE --run RUN says more)"


def broken_share(findings: Iterable[tuple[str, int, int]]) -> float:
    """The largest share any check in `BROKEN` found broken, over (check, count, checked) triples:
    the `trace_broken_share` signal (0.0 when none found anything)."""
    return max((count / checked if checked else 1.0 for check, count, checked in findings
                if check in BROKEN and count > 0), default=0.0)

