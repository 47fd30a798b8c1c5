"""What a reader hands over: an engine's routing as steps, before anything is checked or written.

A reader turns an engine's files into `SourceStep`s: per-token routes of each MoE layer where the
engine hands them out, slots per expert where it only counts. Steps come as a stream (`StepStream`):
each pass over it reads the files again, one chunk at a time, so an import checks every file in
one pass and writes in a second without holding a file's decoded routing in memory. Consecutive
pieces with the same (step, rank, tags) are parts of one step (a long sequence read in chunks, a
micro-batch of a training step); the same key after another step is the same step read twice.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from moescope.ingest.trace_checks import TraceChecks


class SourceFormatError(ValueError):
    """A file is not in the layout its engine documents. Raised before anything is written."""


@dataclass
class LayerRoutes:
    """Per-token routing of one MoE layer in one step, every slot set (no -1 left); the store's
    `routes_table` builds its rows (a `store.schema.RouteRows`: engines give no gate weights or drops)."""

    expert_ids: np.ndarray  # (tokens, k) int32 logical expert ids
    token: np.ndarray  # (tokens,) int32 row of the token in the step as the engine listed it
    sequence: np.ndarray  # (tokens,) int32 request / batch row
    position: np.ndarray  # (tokens,) int32 position in the sequence
    token_ids: np.ndarray | None = None  # (tokens,) int64 input ids where the engine gives them
    gate_weights: None = None  # not in any engine's routing output
    kept: None = None  # nor which slots a capacity limit dropped
    step: None = None  # every row is of its step


@dataclass
class SequenceLogprobs:
    """The engine's log-probs of one sequence's generated tokens (`logprobs` module): `logprob`
    (tokens,) float64, NaN where not measured, at positions from `first_position`; `token_ids` the
    sampled tokens where the response gives them."""

    sequence: int
    first_position: int
    logprob: np.ndarray
    token_ids: np.ndarray | None = None


@dataclass
class SourceStep:
    """One step of a source, or one piece of it: a forward pass, a request, a training iteration
    or a window of them.

    `routes` holds per-token routes per layer, `counts` slots per expert per layer (sources that
    only count; their tokens are slots / top-k); a layer is in one of the two. `where` names the
    file and the place in it, for messages.
    """

    step: int
    ts: dt.datetime
    rank: int = 0
    tags: dict[str, str] = field(default_factory=dict)
    routes: dict[int, LayerRoutes] = field(default_factory=dict)
    counts: dict[int, np.ndarray] = field(default_factory=dict)
    where: str = "the source"
    logprobs: list[SequenceLogprobs] = field(default_factory=list)  # where the engine returned them

    def key(self) -> tuple:
        return self.step, self.rank, tuple(sorted(self.tags.items()))


class StepStream:
    """Steps read lazily: iterating calls `read()` again, which reads the files from the start."""

    def __init__(self, read: Callable[[], Iterator[SourceStep]]):
        self._read = read

    def __iter__(self) -> Iterator[SourceStep]:
        return self._read()


@dataclass
class SourceData:
    """What a reader found: the steps (a list, or a `StepStream` read once per pass), and what the
    files say about the model (filled in as the steps are read)."""

    steps: Iterable[SourceStep]
    model: str | None = None
    num_experts: int | None = None  # where the files state it
    top_k: int | None = None  # where the files state it
    notes: Counter = field(default_factory=Counter)  # what was left out or changed, and how often
    # the model-free trace checks over the per-request routing read so far (moescope.ingest.trace_checks)
    checks: TraceChecks = field(default_factory=TraceChecks)


@dataclass(frozen=True)
class LayerShape:
    num_experts: int
    top_k: int


@dataclass(frozen=True)
class RunSpec:
    """The run an import or a proxy writes into."""

    run_id: str
    source: str
    model: str
    tags: dict[str, str]
    started_at: dt.datetime
    # the host that recorded the run (the proxy's); None: the writer's, where the import ran (an
    # engine's files do not say which host served them)
    host: str | None = None
