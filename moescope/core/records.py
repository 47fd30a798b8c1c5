"""What the probe hands over: plain host-side records, one per forward pass.

The probe builds these after its single device-to-host transfer per forward; everything here is
numpy or Python scalars, so exporters (Parquet, Prometheus, in-memory) never touch torch or the
model's device. `store.schema` maps each record onto the Parquet tables.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

import numpy as np

from moescope.core.pipeline import array_bytes
from moescope.core.runs import current_host


@dataclass(frozen=True)
class LayerInfo:
    """A hooked MoE layer, as found at attach time (a row of the `layers` table).

    Attributes:
        layer: 0-based index of the MoE layer in module order.
        module: its qualified name in the model.
        family: the model family (the config's `model_type`, or a spec's).
        num_experts: routed experts with parameters.
        top_k: experts chosen per token.
        params_per_expert: parameters of one routed expert.
        zero_experts: identity ("zero") experts that the router may choose but that hold no parameters.
        expert_capacity: slots per expert where the router has a capacity, else None.
    """

    layer: int
    module: str
    family: str
    num_experts: int
    top_k: int
    params_per_expert: int
    zero_experts: int = 0
    expert_capacity: int | None = None


@dataclass(frozen=True)
class RunInfo:
    """One attach of the probe to one model in one process (a row of the `runs` table).

    Attributes:
        run_id: the run's id; every rank of a distributed job shares rank 0's.
        started_at: when the probe attached (UTC).
        model_class: the model's class name.
        total_params: every parameter of the model.
        routed_expert_params: parameters of the routed experts, over every MoE layer.
        tags: key=value tags given at attach.
        rank: the process's rank (torch.distributed, else `$RANK`, else 0).
        world_size: ranks in the job (else `$WORLD_SIZE`, else 1).
        layers: the hooked MoE layers.
        host: `$MOESCOPE_HOST`, else the machine's hostname.
    """

    run_id: str
    started_at: dt.datetime
    model_class: str
    total_params: int
    routed_expert_params: int
    tags: dict[str, str]
    rank: int = 0
    world_size: int = 1
    layers: tuple[LayerInfo, ...] = ()
    host: str = field(default_factory=current_host)  # MOESCOPE_HOST, else the hostname


@dataclass
class Routes:
    """Per-token routing of one layer in one forward; rows are the flattened batch (batch-major).

    Attributes:
        expert_ids: (tokens, k) int32 expert ids, in the model's order.
        gate_weights: (tokens, k) float32, as the experts received them.
        kept: (tokens, k) bool; False where a capacity limit dropped the slot.
        token_ids: (tokens,) int64 input ids where the layer saw the input ids, else None.
        sequence: (tokens,) int32 batch row.
        position: (tokens,) int32 position in the row.
        step: (tokens,) int64 the forward each row came from (windows span several), or None.
        token: (tokens,) int32 row in its forward's flattened batch, or None.
    """

    expert_ids: np.ndarray  # (tokens, k) int32, in the model's order
    gate_weights: np.ndarray  # (tokens, k) float32, as the experts received them
    kept: np.ndarray  # (tokens, k) bool; False where a capacity limit dropped the slot
    token_ids: np.ndarray | None  # (tokens,) int64 input ids where the layer saw the input ids
    sequence: np.ndarray  # (tokens,) int32 batch row
    position: np.ndarray  # (tokens,) int32 position in the row
    step: np.ndarray | None = None  # (tokens,) int64 the forward each row came from (windows span several)
    token: np.ndarray | None = None  # (tokens,) int32 row in its forward's flattened batch


@dataclass
class TokenSample:
    """A bounded sample of tokens of one layer: router logits or router inputs for those tokens.

    Attributes:
        token: (n,) int32 row in the flattened batch.
        token_ids: (n,) int64 input ids, or None.
        values: (n, width) float32: the logits (one per expert) or the router's input hidden states.
        top1_expert: (n,) int32, the expert each sampled token went to first.
        step: (n,) int64 the forward each row came from, or None.
    """

    token: np.ndarray  # (n,) int32 row in the flattened batch
    token_ids: np.ndarray | None  # (n,) int64
    values: np.ndarray  # (n, width) float32
    top1_expert: np.ndarray  # (n,) int32, the expert each sampled token went to first
    step: np.ndarray | None = None  # (n,) int64 the forward each row came from


@dataclass
class LayerStep:
    """Reductions of one MoE layer over one window of forwards; exact, computed on the model's device.

    Sums (loads, drops, co-selection) are over the window's tokens; means (entropy, margin,
    active parameters) are token-weighted; capacity use is the largest in any of its forwards.
    Per-expert arrays have E entries (routed experts) or E + Z (zero experts included), as noted.

    Attributes:
        layer: 0-based index of the MoE layer in module order.
        tokens: tokens the layer routed in the window.
        expert_load: (E + Z,) int64 tokens per expert (kept slots).
        gate_weight_sum: (E + Z,) float64 gate weights summed per expert.
        router_entropy_mean: token-weighted mean of each token's router entropy, in nats (0 to ln E).
        router_entropy_p95: 95th percentile of the router entropy (nats), from a histogram: within ln(E) / 256
            of the exact quantile.
        top1_margin_mean: token-weighted mean of top-1 minus top-2 router probability (1 with one expert).
        dropped_tokens: tokens that no expert processed (every slot dropped).
        dropped_assignments: (token, slot) pairs dropped at capacity.
        capacity: slots per expert in this forward, where the router has a capacity, else None.
        capacity_use: fullest expert's kept load / capacity, the largest over the window's forwards.
        active_params_per_token: routed-expert parameters used, averaged over tokens.
        router_prob_sum: (E,) float64 sum over tokens of softmax(logits).
        router_topk_load: (E,) int64 tokens whose top-k router probabilities hold each expert.
        router_z_sum: sum over tokens of logsumexp(router logits)².
        coselection: (E, E) int64 tokens choosing both i and j, or None when off.
        routes: per-token routing (`Recording.routes`), or None.
        router_logits: the sampled tokens' router logits, or None.
        router_inputs: the sampled tokens' router inputs, or None.
        expert_output_samples: (E,) int64 sampled token evaluations per expert. This and the fields
            down to `nonfinite_input_tokens` are None when health sampling / the trust gate is off.
        expert_output_norm_sum: (E,) float64 sum of L2 norms of finite sampled outputs.
        expert_output_nonfinite: (E,) int64 sampled outputs holding a NaN or inf.
        expert_weight_cosine: (E,) weight sketch vs the attach fingerprint; weight-check steps only.
        expert_weight_norm_ratio: (E,) weight norm / norm at attach; weight-check steps only.
        expert_grad_norm: (E,) gradient norm of the expert's weights, when gradients exist.
        trust_weight: (E,) trust-gate weight in force during this forward.
        nonfinite_input_tokens: tokens reaching the layer with a NaN/inf already in them.
        forwards: forwards of the window.
        compute_time_s: seconds in the whole MoE block (router, experts, shared experts), summed; None
            unless `Recording.compute_time`.
        expert_compute_time_s: (E + Z,) seconds per expert, summed over the forwards.
        expert_compute_time_measured: True: timed per expert module; False: attributed by load.
    """

    layer: int
    tokens: int
    expert_load: np.ndarray  # (num_experts + zero_experts,) int64 tokens per expert (kept slots)
    gate_weight_sum: np.ndarray  # (num_experts + zero_experts,) float64
    router_entropy_mean: float
    router_entropy_p95: float  # from a histogram: within ln(E) / 256 of the exact quantile
    top1_margin_mean: float
    dropped_tokens: int  # tokens that no expert processed (every slot dropped)
    dropped_assignments: int  # (token, slot) pairs dropped at capacity
    capacity: int | None  # slots per expert in this forward, where the router has a capacity
    capacity_use: float | None  # fullest expert's kept load / capacity
    active_params_per_token: float  # routed-expert parameters used, averaged over tokens
    router_prob_sum: np.ndarray | None = None  # (E,) float64 sum over tokens of softmax(logits)
    router_topk_load: np.ndarray | None = None  # (E,) int64 tokens whose top-k router probabilities hold e
    router_z_sum: float | None = None  # sum over tokens of logsumexp(router logits)^2
    coselection: np.ndarray | None = None  # (E, E) int64 tokens choosing both i and j
    routes: Routes | None = None
    router_logits: TokenSample | None = None
    router_inputs: TokenSample | None = None
    # -- expert health (probe/health_sampling.py, probe/trust_gate.py); None when health / the gate is off --
    expert_output_samples: np.ndarray | None = None  # (E,) int64 sampled token evaluations per expert
    expert_output_norm_sum: np.ndarray | None = None  # (E,) float64 sum of L2 norms of finite sampled outputs
    expert_output_nonfinite: np.ndarray | None = None  # (E,) int64 sampled outputs holding a NaN or inf
    expert_weight_cosine: np.ndarray | None = None  # (E,) weight sketch vs attach fingerprint; weight-check steps only
    expert_weight_norm_ratio: np.ndarray | None = None  # (E,) weight norm / norm at attach; weight-check steps only
    expert_grad_norm: np.ndarray | None = None  # (E,) gradient norm of the expert's weights, when grads exist
    trust_weight: np.ndarray | None = None  # (E,) trust-gate weight in force during this forward
    nonfinite_input_tokens: int | None = None  # tokens reaching the layer with a NaN/inf already in them
    forwards: int = 1  # forwards of the window
    # -- compute time (Recording.compute_time; probe/timing.py); None when off --
    compute_time_s: float | None = None  # seconds in the whole MoE block (router, experts, shared experts), summed
    expert_compute_time_s: np.ndarray | None = None  # (E + Z,) seconds per expert, summed over the forwards
    expert_compute_time_measured: bool | None = None  # True: timed per expert module; False: attributed by load


@dataclass
class KVCacheLayer:
    """KV-cache bytes of one attention layer after a forward (a row of the `kv_cache` table).

    Attributes:
        layer: the model's attention-layer index.
        bytes: bytes the layer's cache tensors hold (read from shapes and dtypes on the host).
        seq_len: tokens in the cache (0 when it cannot be told).
    """
    layer: int  # the model's attention-layer index
    bytes: int
    seq_len: int


@dataclass
class StepRecord:
    """Everything recorded about one window of forwards (one forward when `forwards == 1`).

    Attributes:
        run_id: the run the record belongs to.
        step: the window's first forward (0-based, counted on the device).
        ts: when the window closed (UTC).
        duration_s: host wall time of the window's forwards, hooks included (0 for CUDA-graph replays).
        tokens: tokens in the window's main input (the first MoE layer's tokens).
        batch_size: of the last forward.
        seq_len: of the last forward.
        active_params: parameters used per token, averaged over the window's tokens.
        total_params: every parameter of the model.
        tags: the tags in force (every record of a window carries the same).
        layers: one `LayerStep` per hooked MoE layer.
        kv_cache: KV-cache bytes per attention layer after the window's last forward, or None.
        forwards: forwards in the window.
        step_end: the window's last forward; None (default) sets it to `step + forwards - 1`.
    """

    run_id: str
    step: int
    ts: dt.datetime
    duration_s: float  # host wall time of the window's forwards, hooks included (0 for CUDA-graph replays)
    tokens: int  # tokens in the window's main input (the first MoE layer's tokens)
    batch_size: int  # of the last forward
    seq_len: int  # of the last forward
    active_params: float  # parameters used per token, averaged over the window's tokens
    total_params: int
    tags: dict[str, str] = field(default_factory=dict)
    layers: list[LayerStep] = field(default_factory=list)
    kv_cache: list[KVCacheLayer] | None = None  # after the window's last forward
    forwards: int = 1
    step_end: int | None = None

    def __post_init__(self) -> None:
        if self.step_end is None:
            self.step_end = self.step + self.forwards - 1

    @property
    def active_param_fraction(self) -> float:
        """Active parameters per token as a share of all the model's parameters (NaN when that is 0)."""
        return self.active_params / self.total_params if self.total_params else float("nan")

    @property
    def nbytes(self) -> int:
        """Host bytes of the record's arrays: what it holds while it waits in the write queue."""
        return array_bytes(self)

    def rows(self) -> dict[str, int]:
        """Rows the record adds to each table (what the pipeline counts when it is dropped).

        Returns:
            {table: rows} for `steps`, `layer_steps`, and `routes`, `router_logits`, `router_inputs`,
                `kv_cache` where the record holds them.
        """
        rows = {"steps": 1, "layer_steps": len(self.layers)}
        for layer in self.layers:
            if layer.routes is not None:
                rows["routes"] = rows.get("routes", 0) + len(layer.routes.expert_ids)
            for name in ("router_logits", "router_inputs"):
                sample = getattr(layer, name)
                if sample is not None:
                    rows[name] = rows.get(name, 0) + len(sample.token)
        if self.kv_cache:
            rows["kv_cache"] = len(self.kv_cache)
        return rows
