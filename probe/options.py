"""The probe session's options: what it records (`Recording`), the queue to its exporters
(`Pipeline`), expert-health sampling (`HealthSampling`), and the trust gate's modes.

Frozen dataclasses; `probe.attach` also takes `Recording`'s and `Pipeline`'s fields one by one as
keyword options.
"""

from __future__ import annotations

from dataclasses import dataclass

from moescope.core.pipeline import DEFAULT_MAX_QUEUE_BYTES

# Who moves the trust gate's weights: None (no gate is installed), "manual" (an operator, through the
# bound policy's `override`), "auto" (the bound policy, from expert-health scores, and an operator).
# Here, with the session's options, so that `moescope.attach` checks a mode without loading alerts,
# and `alerts.trust_policy` checks the same modes.
TRUST_GATE_MODES: tuple[str | None, ...] = (None, "manual", "auto")
# Where `moescope.attach` runs the store's work: the pipeline's worker thread, or a writer process.
WRITERS = ("thread", "process")


@dataclass(frozen=True)
class Recording:
    """What a session records beyond the per-layer aggregates, and how forwards become records.

    Its fields may also be given one by one as keyword options of `probe.attach` or `moescope.attach`
    (`routes=True, window=1`).

    Args:
        routes: record per-token expert ids and gate weights (the `routes` table), kept in a device
            ring of `ring_tokens` tokens per group of like layers. Default False.
        router_logits: False (default), True for every token, or n for a sample of n tokens per layer
            and forward (chosen on the device from `sample_seed` and the forward counter).
        router_inputs: the router's input hidden states, sampled as `router_logits` is.
        kv_cache: record the KV-cache bytes per attention layer. Default False.
        coselection: record E x E co-selection counts; None (default) turns them on when k > 1 and
            E <= 64.
        compute_time: record the time spent in each MoE block and per expert (probe/timing.py: CUDA
            events read on the writer's thread, wall time on CPU). Opt-in (default False) because its
            hooks are host code, a graph break at each block under torch.compile, and record nothing
            under CUDA-graph replay.
        window: a record covers up to `window` forwards (default 32), all of one kind (prefill or
            decode steps); `window=1` records every forward.
        window_s: a record also ends after `window_s` seconds (default 1.0), whichever of the two
            comes first; None: no time limit.
        ring_tokens: tokens of the routes ring per group of like layers (default 16384).
        sample_seed: seed of the on-device token sampling for `router_logits` and `router_inputs`.

    Raises:
        ValueError: for `window` or `ring_tokens` below 1.
    """

    routes: bool = False
    router_logits: bool | int = False
    router_inputs: bool | int = False
    kv_cache: bool = False
    coselection: bool | None = None
    compute_time: bool = False
    window: int = 32
    window_s: float | None = 1.0
    ring_tokens: int = 16384
    sample_seed: int = 0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError("window counts forwards per record and must be at least 1 (1: a record per forward)")
        if self.ring_tokens < 1:
            raise ValueError("ring_tokens must be at least 1")


@dataclass(frozen=True)
class Pipeline:
    """The bounded queue between the model and the exporters (moescope/core/pipeline.py).

    Its fields may also be given one by one as keyword options of `probe.attach` (`policy="drop"`).

    Args:
        policy: "block" (default: lossless, the model waits if the exporters cannot keep up) or "drop"
            (the model never waits; drops are counted).
        max_queue: the most records waiting for the exporters (default 256).
        max_queue_bytes: the most host bytes of records waiting (default 256 MiB).
        flush_interval_s: how often exporters flush, in seconds (default 5.0); `moescope.attach` also
            gives it to the store's writer as the age at which its buffers are written.
        writer: where `moescope.attach` runs the store's work (Arrow tables, Parquet files, Delta
            commits): "thread" (default: the pipeline's worker thread, in the model's process) or
            "process" (a writer process fed through a pipe, `moescope.store.writer_process`: that
            work then holds no interpreter lock the model's thread needs).

    Raises:
        ValueError: for a `writer` other than "thread" or "process".
    """

    policy: str = "block"
    max_queue: int = 256
    max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES
    flush_interval_s: float = 5.0
    writer: str = "thread"

    def __post_init__(self) -> None:
        if self.writer not in WRITERS:
            raise ValueError(f"writer must be one of {WRITERS} (where the store's work runs), not {self.writer!r}")


@dataclass(frozen=True)
class HealthSampling:
    """Expert-health sampling (probe/health_sampling.py; `HealthSampler` does the sampling).

    Args:
        tokens_per_expert: tokens run through each sampled expert (default 4).
        experts_per_forward: experts sampled per watched layer at a sampled forward (default 1; None:
            every expert of every layer).
        weight_every: sampled forwards between two weight-fingerprint checks of a layer (default 32).
        sample_every: forwards between two health samples (default 4).
        seed: seed of the on-device token and expert choices.
    """

    tokens_per_expert: int = 4
    experts_per_forward: int | None = 1
    weight_every: int = 32
    sample_every: int = 4
    seed: int = 0
