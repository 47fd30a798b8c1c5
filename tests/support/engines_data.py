"""A run of at least 5 M route rows, written through the store's own writer, and the answers it must give.

`write_run(store)` generates a synthetic but self-consistent run (vectorised numpy, seeded: the same
rows on every call) and writes it through `store.writer.ParquetExporter`, the probe's exporter, as
`StepRecord`s: `runs`, `layers`, `steps`, `layer_steps`, `routes`, `run_ends` and `probe_stats`
rows, each part one Delta commit. Consistent means what a real probe guarantees:

- `layer_steps.expert_load` of a (step, layer, rank) is the bincount of its routes' kept slots;
  `dropped_tokens` counts its tokens whose every slot was dropped, `dropped_assignments` its dropped
  slots, `tokens` its routes rows;
- `steps.active_params` is the dense parameters plus, per token, the parameters of the experts its
  kept slots went to (every layer), so `active_param_fraction` follows from the routes too.

Tokens per forward vary (prefill-sized and decode-sized forwards), so a token-weighted mean and a
plain mean of per-step values differ, and an engine that weights wrongly is caught. A second, small
run (`OTHER_RUN`) shares the tables, so an engine that does not select the run's partition is caught
too.

`Truth` holds the answers computed here from the generated arrays (numpy, no store, no SQL): the
independent reference every engine and the Store are compared with.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import time
from collections.abc import Iterator

import numpy as np

from moescope.core.records import LayerInfo, LayerStep, Routes, RunInfo, StepRecord
from moescope.store.writer import ParquetExporter

RUN = "engines-5m"
OTHER_RUN = "engines-other"
LAYERS = 8
EXPERTS = 16
TOP_K = 2
RANKS = 2
ROUTE_ROWS = 5_000_000  # at least this many route rows in RUN
# tokens per forward, cycled: prefill-sized and decode-sized forwards
TOKENS_CYCLE = (4096, 4096, 2048, 512, 64)
DENSE_PARAMS = 50_000_000
PARAMS_PER_EXPERT = 1_000_000
TOTAL_PARAMS = DENSE_PARAMS + LAYERS * EXPERTS * PARAMS_PER_EXPERT
# A routes part per ~1 Mi rows: a handful of large parts per rank (one commit each), which `compact` merges.
PART_ROWS = 1 << 20
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


@dataclasses.dataclass
class Answers:
    """What each engine computes for a run, in one shape so they compare field by field.

    loads: (LAYERS, EXPERTS) int64, kept slots per (layer, expert); layer_tokens: (LAYERS,) tokens
    each layer routed; layer_dropped: (LAYERS,) tokens no expert processed; layer_entropy: (LAYERS,)
    token-weighted mean router entropy (nats); entropy: token-weighted over layers and steps;
    active_fraction: token-weighted over steps; drop_rate: dropped tokens / layer-tokens.
    """

    loads: np.ndarray
    layer_tokens: np.ndarray
    layer_dropped: np.ndarray
    layer_entropy: np.ndarray
    entropy: float
    active_fraction: float
    drop_rate: float

    @property
    def layer_drop_rate(self) -> np.ndarray:
        return self.layer_dropped / self.layer_tokens


def assert_same(got: Answers, want: Answers, who: str, rel: float = 1e-9) -> None:
    """Raise AssertionError naming `who` and the first field that differs (integers exactly, means to `rel`)."""
    for name in ("loads", "layer_tokens", "layer_dropped"):
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        assert a.shape == b.shape and np.array_equal(a, b), f"{who}: {name} differ:\n{a}\nvs\n{b}"
    assert np.allclose(got.layer_entropy, want.layer_entropy, rtol=rel, atol=0), \
        f"{who}: layer_entropy differ: {got.layer_entropy} vs {want.layer_entropy}"
    for name in ("entropy", "active_fraction", "drop_rate"):
        a, b = getattr(got, name), getattr(want, name)
        assert math.isclose(a, b, rel_tol=rel), f"{who}: {name} differ: {a!r} vs {b!r}"


@dataclasses.dataclass
class _Rank:
    """One rank's generated forwards, all layers at once."""

    step_tokens: np.ndarray  # (steps,)
    ids: np.ndarray  # (layers, tokens, k) int32
    kept: np.ndarray  # (layers, tokens, k) bool
    weights: np.ndarray  # (layers, tokens, k) float32
    token_ids: np.ndarray  # (tokens,) int64
    entropy: np.ndarray  # (steps, layers) float64, per-token mean router entropy of each row

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.step_tokens)])


def _steps_for(rows: int, ranks: int) -> int:
    per_cycle = sum(TOKENS_CYCLE) * LAYERS * ranks
    cycles = -(-rows // per_cycle)
    return cycles * len(TOKENS_CYCLE)


def _generate_rank(seed: int, steps: int) -> _Rank:
    rng = np.random.default_rng(seed)
    step_tokens = np.resize(np.array(TOKENS_CYCLE, dtype=np.int64), steps)
    tokens = int(step_tokens.sum())
    skews = np.random.default_rng(1234).dirichlet(np.full(EXPERTS, 0.5), size=LAYERS)  # the model's, every rank
    ids = np.empty((LAYERS, tokens, TOP_K), dtype=np.int32)
    kept = np.empty((LAYERS, tokens, TOP_K), dtype=bool)
    for layer in range(LAYERS):
        first = rng.choice(EXPERTS, size=tokens, p=skews[layer])
        ids[layer, :, 0] = first
        ids[layer, :, 1] = (first + 1 + rng.integers(0, EXPERTS - 1, tokens)) % EXPERTS  # a different expert
        # capacity drops, more in deeper layers (none in layers 0 and 4): single slots, and whole tokens
        level = layer % 4
        kept[layer] = rng.random((tokens, TOP_K)) >= 0.03 * level
        kept[layer, rng.random(tokens) < 0.01 * level] = False
    first_weight = rng.uniform(0.5, 1.0, (LAYERS, tokens)).astype(np.float32)
    weights = np.stack([first_weight, 1 - first_weight], axis=-1)
    entropy = rng.uniform(0.5, math.log(EXPERTS), (steps, LAYERS))
    return _Rank(step_tokens, ids, kept, weights, rng.integers(0, 32_000, tokens), entropy)


def _records(run_id: str, rank: int, data: _Rank) -> Iterator[StepRecord]:
    starts = data.starts
    for step, n in enumerate(data.step_tokens.tolist()):
        a, b = int(starts[step]), int(starts[step + 1])
        position = np.arange(n, dtype=np.int32)
        layers = []
        expert_params = 0.0
        for layer in range(LAYERS):
            ids, kept = data.ids[layer, a:b], data.kept[layer, a:b]
            load = np.bincount(ids[kept], minlength=EXPERTS).astype(np.int64)
            dropped_tokens = int(np.count_nonzero(~kept.any(axis=1)))
            capacity = math.ceil(1.25 * n * TOP_K / EXPERTS)
            per_token = PARAMS_PER_EXPERT * int(kept.sum()) / n
            expert_params += per_token
            weights = data.weights[layer, a:b]
            layers.append(LayerStep(
                layer=layer, tokens=n, expert_load=load,
                gate_weight_sum=np.bincount(ids[kept], weights=weights[kept], minlength=EXPERTS),
                router_entropy_mean=float(data.entropy[step, layer]),
                router_entropy_p95=float(data.entropy[step, layer]) + 0.25, top1_margin_mean=0.1,
                dropped_tokens=dropped_tokens, dropped_assignments=int(np.count_nonzero(~kept)),
                capacity=capacity, capacity_use=float(load.max() / capacity), active_params_per_token=per_token,
                router_prob_sum=np.full(EXPERTS, n / EXPERTS),
                routes=Routes(expert_ids=ids, gate_weights=weights[:, :], kept=kept,
                              token_ids=data.token_ids[a:b], sequence=position // 512, position=position % 512)))
        yield StepRecord(run_id=run_id, step=step, ts=T0 + dt.timedelta(seconds=step), duration_s=0.05,
                         tokens=n, batch_size=max(1, n // 512), seq_len=min(n, 512),
                         active_params=DENSE_PARAMS + expert_params, total_params=TOTAL_PARAMS,
                         tags={"split": "eval" if step % 10 == 0 else "train"}, layers=layers)


def truth(ranks: list[_Rank]) -> Answers:
    """The run's answers from the generated arrays: plain numpy over every rank's rows."""
    loads = np.zeros((LAYERS, EXPERTS), dtype=np.int64)
    layer_tokens = np.zeros(LAYERS, dtype=np.int64)
    layer_dropped = np.zeros(LAYERS, dtype=np.int64)
    entropy_sum = np.zeros(LAYERS)
    step_tokens, active = [], []
    for data in ranks:
        for layer in range(LAYERS):
            ids, kept = data.ids[layer], data.kept[layer]
            loads[layer] += np.bincount(ids[kept], minlength=EXPERTS)
            layer_tokens[layer] += len(ids)
            layer_dropped[layer] += np.count_nonzero(~kept.any(axis=1))
            entropy_sum[layer] += float(np.dot(data.entropy[:, layer], data.step_tokens))
        # the active fraction of each forward, from its routes: dense + experts of the kept slots
        kept_per_step = np.add.reduceat(data.kept.sum(axis=(0, 2)), data.starts[:-1])
        active.append((DENSE_PARAMS + PARAMS_PER_EXPERT * kept_per_step / data.step_tokens) / TOTAL_PARAMS)
        step_tokens.append(data.step_tokens)
    tokens, fractions = np.concatenate(step_tokens), np.concatenate(active)
    return Answers(loads=loads, layer_tokens=layer_tokens, layer_dropped=layer_dropped,
                   layer_entropy=entropy_sum / layer_tokens, entropy=float(entropy_sum.sum() / layer_tokens.sum()),
                   active_fraction=float(np.dot(fractions, tokens) / tokens.sum()),
                   drop_rate=float(layer_dropped.sum() / layer_tokens.sum()))


def _run_info(run_id: str, rank: int) -> RunInfo:
    return RunInfo(run_id=run_id, started_at=T0, model_class="EnginesSynthetic", total_params=TOTAL_PARAMS,
                   routed_expert_params=LAYERS * EXPERTS * PARAMS_PER_EXPERT, tags={"suite": "engines"},
                   rank=rank, world_size=RANKS,
                   layers=tuple(LayerInfo(i, f"model.layers.{i}.mlp", "synthetic", EXPERTS, TOP_K, PARAMS_PER_EXPERT)
                                for i in range(LAYERS)))


@dataclasses.dataclass
class WrittenRun:
    """What `write_run` wrote: the answers, route rows of RUN, and how long generating and writing took."""

    truth: Answers
    route_rows: int
    generate_s: float
    write_s: float


def write_run(store, rows: int = ROUTE_ROWS) -> WrittenRun:
    """Write RUN (>= `rows` route rows over RANKS ranks) and the small OTHER_RUN into `store` (a
    folder, URL or StoreLocation) through ParquetExporter, as a probe would; returns RUN's truth."""
    steps = _steps_for(rows, RANKS)
    generate_s = write_s = 0.0
    ranks = []
    for run_id, n_ranks, n_steps, seed in ((RUN, RANKS, steps, 0), (OTHER_RUN, 1, 3, 99)):
        for rank in range(n_ranks):
            started = time.perf_counter()
            data = _generate_rank(seed + rank, n_steps)
            generate_s += time.perf_counter() - started
            if run_id == RUN:
                ranks.append(data)
            started = time.perf_counter()
            exporter = ParquetExporter(store, _run_info(run_id, rank), max_rows=PART_ROWS, max_age_s=1e9,
                                       max_bytes=1 << 40)
            try:
                for record in _records(run_id, rank, data):
                    exporter.export([record])
            finally:
                exporter.shutdown()
            write_s += time.perf_counter() - started
    route_rows = sum(int(d.step_tokens.sum()) * LAYERS for d in ranks)
    return WrittenRun(truth(ranks), route_rows, generate_s, write_s)
