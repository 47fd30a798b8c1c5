"""Arrow schemas of every table in a store, and the one builder of each table's rows.

This module is the contract: the Delta tables' Parquet files follow these schemas, `moescope.store.Store` reads them,
and any engine that reads Parquet can read them too. Columns are only ever added, never renamed.
Every producer builds rows here: a run's own rows, for every source (`runs_table`, `layers_table`;
`run_tables` for a run the probe describes, a `moescope.core.records.RunInfo`: the probe's, the jitter
and mismatch checks'), the probe's records (`step_tables`), routes of any source (`routes_table`: the
probe's and the importers'), columns a source has with the rest null (`table_from_columns`:
importers, benchmarks), and a writer's counts (`probe_stats_table`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import pyarrow as pa

from moescope.core.records import RunInfo, StepRecord, TokenSample
from moescope.core.runs import current_host
from moescope.store import columns

TAGS = pa.map_(pa.string(), pa.string())
TS = pa.timestamp("us", tz="UTC")

SCHEMAS: dict[str, pa.Schema] = {
    "runs": pa.schema([
        ("run_id", pa.string()), ("started_at", TS), ("model_class", pa.string()),
        ("total_params", pa.int64()), ("routed_expert_params", pa.int64()), ("tags", TAGS),
        ("rank", pa.int32()), ("world_size", pa.int32()),
        # what recorded the run: "probe", or the engine an importer read ("vllm", "sglang", ...);
        # null in stores written before the column existed, which only the probe wrote
        ("source", pa.string()),
        # the host the run's process ran on (moescope.core.runs.current_host: MOESCOPE_HOST or the
        # hostname); null in stores written before the column existed
        ("host", pa.string()),
    ]),
    "layers": pa.schema([
        ("run_id", pa.string()), ("layer", pa.int32()), ("module", pa.string()), ("family", pa.string()),
        ("num_experts", pa.int32()), ("zero_experts", pa.int32()), ("top_k", pa.int32()),
        ("params_per_expert", pa.int64()), ("expert_capacity", pa.int64()), ("rank", pa.int32()),
    ]),
    "steps": pa.schema([
        ("run_id", pa.string()), ("step", pa.int64()), ("ts", TS), ("duration_s", pa.float64()),
        ("tokens", pa.int64()), ("batch_size", pa.int32()), ("seq_len", pa.int32()),
        ("active_params", pa.float64()), ("total_params", pa.int64()),
        ("active_param_fraction", pa.float64()), ("tags", TAGS), ("rank", pa.int32()),
        # a row covers the forwards step..step_end (a window; one forward when forwards = 1)
        ("step_end", pa.int64()), ("forwards", pa.int64()),
    ]),
    "layer_steps": pa.schema([
        ("run_id", pa.string()), ("step", pa.int64()), ("ts", TS), ("layer", pa.int32()),
        ("tokens", pa.int64()), ("expert_load", pa.list_(pa.int64())),
        ("gate_weight_sum", pa.list_(pa.float64())), ("router_prob_sum", pa.list_(pa.float64())),
        ("router_entropy_mean", pa.float64()),
        ("router_entropy_p95", pa.float64()), ("top1_margin_mean", pa.float64()),
        ("dropped_tokens", pa.int64()), ("dropped_assignments", pa.int64()), ("capacity", pa.int64()),
        ("capacity_use", pa.float64()), ("active_params_per_token", pa.float64()),
        ("coselection", pa.list_(pa.int64())), ("tags", TAGS), ("rank", pa.int32()),
        ("step_end", pa.int64()), ("forwards", pa.int64()),
        # compute time (null unless recorded): seconds summed over the row's forwards; per expert
        # measured per expert module, or attributed by load (expert_compute_time_measured false)
        ("compute_time_s", pa.float64()), ("expert_compute_time_s", pa.list_(pa.float64())),
        ("expert_compute_time_measured", pa.bool_()),
        # what the auxiliary losses need (null in stores written before): per expert, the tokens
        # whose top-k router probabilities hold it (before bias correction or capacity drops), and
        # the sum over tokens of logsumexp(router logits)^2
        ("router_topk_load", pa.list_(pa.int64())), ("router_z_sum", pa.float64()),
    ]),
    "routes": pa.schema([
        ("run_id", pa.string()), ("step", pa.int64()), ("layer", pa.int32()), ("token", pa.int32()),
        ("sequence", pa.int32()), ("position", pa.int32()), ("token_id", pa.int64()),
        ("expert_ids", pa.list_(pa.int32())), ("gate_weights", pa.list_(pa.float32())),
        ("kept", pa.list_(pa.bool_())), ("tags", TAGS), ("rank", pa.int32()),
    ]),
    "router_logits": pa.schema([
        ("run_id", pa.string()), ("step", pa.int64()), ("layer", pa.int32()), ("token", pa.int32()),
        ("token_id", pa.int64()), ("top1_expert", pa.int32()), ("logits", pa.list_(pa.float32())),
        ("tags", TAGS), ("rank", pa.int32()),
    ]),
    "router_inputs": pa.schema([
        ("run_id", pa.string()), ("step", pa.int64()), ("layer", pa.int32()), ("token", pa.int32()),
        ("token_id", pa.int64()), ("top1_expert", pa.int32()), ("hidden", pa.list_(pa.float32())),
        ("tags", TAGS), ("rank", pa.int32()),
    ]),
    "kv_cache": pa.schema([
        ("run_id", pa.string()), ("step", pa.int64()), ("ts", TS), ("layer", pa.int32()),
        ("bytes", pa.int64()), ("seq_len", pa.int64()), ("rank", pa.int32()),
    ]),
    "probe_stats": pa.schema([
        ("run_id", pa.string()), ("ts", TS), ("table_name", pa.string()), ("written_rows", pa.int64()),
        ("dropped_rows", pa.int64()), ("dropped_records", pa.int64()), ("reason", pa.string()),
        ("rank", pa.int32()), ("pid", pa.int64()),
        # the writer's host: a writer is (host, rank, pid); null in stores written before the column existed
        ("host", pa.string()),
    ]),
    # One row per writer (rank, pid) whose session closed: the run has ended for that rank once it
    # is here. last_step is the last forward the writer recorded (null when it recorded none).
    "run_ends": pa.schema([
        ("run_id", pa.string()), ("rank", pa.int32()), ("pid", pa.int64()), ("ended_at", TS),
        ("last_step", pa.int64()),
    ]),
    # -- expert health and trust gate (alerts/health_score.py, alerts/trust_policy.py) --
    "expert_health": pa.schema([
        ("run_id", pa.string()), ("window", pa.int64()), ("step_start", pa.int64()), ("step_end", pa.int64()),
        ("ts", TS), ("layer", pa.int32()), ("expert", pa.int32()), ("score", pa.float64()),
        ("load", pa.float64()), ("confidence", pa.float64()), ("output", pa.float64()), ("weight", pa.float64()),
        ("grad", pa.float64()), ("load_share_ratio", pa.float64()), ("gate_weight_mean", pa.float64()),
        ("output_norm_mean", pa.float64()), ("output_nonfinite_fraction", pa.float64()),
        ("weight_cosine", pa.float64()), ("weight_norm_ratio", pa.float64()), ("grad_norm", pa.float64()),
        ("trust_weight", pa.float64()), ("reasons", pa.string()), ("rank", pa.int32()),
    ]),
    "trust_gate_events": pa.schema([
        ("run_id", pa.string()), ("ts", TS), ("step", pa.int64()), ("layer", pa.int32()), ("expert", pa.int32()),
        ("old_weight", pa.float64()), ("new_weight", pa.float64()), ("score", pa.float64()),
        ("reason", pa.string()), ("source", pa.string()), ("rank", pa.int32()),
    ]),
    # Manual gate requests from another process (the dashboard with --allow-writes); a trust
    # policy that accepts requests applies each request_id once.
    "trust_gate_requests": pa.schema([
        ("request_id", pa.string()), ("run_id", pa.string()), ("requested_at", TS), ("layer", pa.int32()),
        ("expert", pa.int32()), ("action", pa.string()), ("weight", pa.float64()), ("reason", pa.string()),
        ("requested_by", pa.string()),
    ]),
    # Routing cooldowns (alerts/cooldown_policy.py): one row per start, end, or start a guard rail
    # stopped ('blocked', the rail in `reason`). step: optimizer steps done; forward_step: the
    # probe's forward counter. lr_before / lr_after: the router's lr in force around the change
    # (for 'blocked' both the lr in force). router_entropy / capacity_use: the RoutingCooldown
    # rule's signals over its window at the latest record. period_steps: a start's planned length,
    # an end's actual length, in optimizer steps. source: "auto" (the policy) or "manual".
    "routing_cooldown_events": pa.schema([
        ("run_id", pa.string()), ("step", pa.int64()), ("forward_step", pa.int64()), ("ts", TS),
        ("layer", pa.int32()), ("action", pa.string()), ("lr_factor", pa.float64()), ("epsilon", pa.float64()),
        ("lr_before", pa.float64()), ("lr_after", pa.float64()), ("reason", pa.string()),
        ("router_entropy", pa.float64()), ("capacity_use", pa.float64()), ("source", pa.string()),
        ("period_steps", pa.int64()), ("rank", pa.int32()),
    ]),
    # moescope.training: per optimizer step and MoE layer, what the record of its forwards
    # (steps step..step_end of layer_steps) cannot tell: the learning rates the update used (the
    # first parameter group's, and the router's, a routing cooldown's factor included) and the L2
    # norm of each expert's weight gradients (null when the experts had no gradient)
    "train_steps": pa.schema([
        ("run_id", pa.string()), ("optimizer_step", pa.int64()), ("step", pa.int64()), ("step_end", pa.int64()),
        ("ts", TS), ("layer", pa.int32()), ("tokens", pa.int64()), ("lr", pa.float64()),
        ("router_lr", pa.float64()), ("expert_grad_norm", pa.list_(pa.float64())), ("rank", pa.int32()),
    ]),
    # -- routing jitter (moescope.analyses.jitter): the same inputs run under another condition --
    # One row per (condition, layer) of a jitter run. tokens: (token, layer) pairs compared with the
    # condition's `baseline` run; set_changed / top1_changed / kept_changed: how many changed their
    # chosen experts, their top-1 (the chosen expert of highest logit), the experts that processed
    # them; max_weight_change: largest |gate weight| change, dense over experts; the baseline's top-k
    # margin (margin_kind "logit": k-th minus (k+1)-th logit) counted per bin of margin_edges (lower
    # edges) for the tokens whose set changed and the rest; listed: rows of jitter_tokens; the
    # condition's batch_size, padding_side, dtype and attn_implementation as run.
    "jitter": pa.schema([
        ("run_id", pa.string()), ("ts", TS), ("condition", pa.string()), ("condition_order", pa.int32()),
        ("baseline", pa.string()), ("description", pa.string()), ("layer", pa.int32()), ("tokens", pa.int64()),
        ("set_changed", pa.int64()), ("top1_changed", pa.int64()), ("kept_changed", pa.int64()),
        ("max_weight_change", pa.float64()), ("margin_kind", pa.string()), ("margin_edges", pa.list_(pa.float64())),
        ("changed_by_margin", pa.list_(pa.int64())), ("unchanged_by_margin", pa.list_(pa.int64())),
        ("listed", pa.int64()), ("batch_size", pa.int32()), ("padding_side", pa.string()), ("dtype", pa.string()),
        ("attn_implementation", pa.string()), ("rank", pa.int32()),
    ]),
    # One row per token of a jitter run whose expert set or top-1 changed under a condition (at most
    # a bounded number per condition and layer; `jitter.listed` says how many): sequence is the
    # input's index, position the token's in it; margins from the baseline's logits; the experts and
    # gate weights of both runs in slot order; context_ids the input's tokens from context_start.
    "jitter_tokens": pa.schema([
        ("run_id", pa.string()), ("condition", pa.string()), ("layer", pa.int32()), ("sequence", pa.int32()),
        ("position", pa.int32()), ("token_id", pa.int64()), ("set_changed", pa.bool_()),
        ("top1_changed", pa.bool_()), ("topk_margin", pa.float64()), ("top1_margin", pa.float64()),
        ("baseline_ids", pa.list_(pa.int32())), ("condition_ids", pa.list_(pa.int32())),
        ("baseline_weights", pa.list_(pa.float32())), ("condition_weights", pa.list_(pa.float32())),
        ("context_ids", pa.list_(pa.int64())), ("context_start", pa.int32()), ("rank", pa.int32()),
    ]),
    # -- engine vs reference routing (moescope.analyses.mismatch): an engine run's tokens re-run --
    # One row per (group, layer) of a mismatch run: the engine run's (token, layer) routing compared
    # with a reference model's on the same token ids. grouping "all" (group_name "all"), "position"
    # (group_name a position bucket such as "64-127") or "tag" (group_name "key=value" of the engine's
    # steps); layer null: every layer together. pairs: (token, layer) pairs compared; tokens:
    # tokens compared; set_changed / top1_changed: pairs whose expert set / top-1 differ;
    # slots_changed: experts of the engine's k not among the reference's, summed over pairs;
    # tokens_set_changed / tokens_top1_changed: tokens that differ in at least one layer (R3's
    # figure); changed_by_count: pairs with 0..k experts differing; the reference's top-k margin
    # (margin_kind "logit") per bin of margin_edges for pairs whose set changed and the rest;
    # listed: rows of mismatch_tokens; engine_run, top_k, reference_dtype as run.
    "mismatch": pa.schema([
        ("run_id", pa.string()), ("ts", TS), ("engine_run", pa.string()), ("grouping", pa.string()),
        ("group_name", pa.string()), ("group_order", pa.int32()), ("layer", pa.int32()), ("pairs", pa.int64()),
        ("tokens", pa.int64()), ("set_changed", pa.int64()), ("top1_changed", pa.int64()),
        ("slots_changed", pa.int64()), ("tokens_set_changed", pa.int64()), ("tokens_top1_changed", pa.int64()),
        ("changed_by_count", pa.list_(pa.int64())), ("margin_kind", pa.string()),
        ("margin_edges", pa.list_(pa.float64())), ("changed_by_margin", pa.list_(pa.int64())),
        ("unchanged_by_margin", pa.list_(pa.int64())), ("listed", pa.int64()), ("top_k", pa.int32()),
        ("reference_dtype", pa.string()), ("rank", pa.int32()),
    ]),
    # One row per (token, layer) of a mismatch run whose expert set or top-1 differs between the
    # engine and the reference (at most a bounded number per layer; `mismatch.listed` says how
    # many): step, engine_rank and sequence name the engine's sequence, position the token's in it;
    # margins from the reference's logits; both expert lists in slot order (the reference's gate
    # weights beside its ids); context_ids the sequence's tokens from context_start.
    "mismatch_tokens": pa.schema([
        ("run_id", pa.string()), ("layer", pa.int32()), ("step", pa.int64()), ("engine_rank", pa.int32()),
        ("sequence", pa.int32()), ("position", pa.int32()), ("token_id", pa.int64()), ("set_changed", pa.bool_()),
        ("top1_changed", pa.bool_()), ("slots_changed", pa.int32()), ("topk_margin", pa.float64()),
        ("top1_margin", pa.float64()), ("reference_ids", pa.list_(pa.int32())), ("engine_ids", pa.list_(pa.int32())),
        ("reference_weights", pa.list_(pa.float32())), ("context_ids", pa.list_(pa.int64())),
        ("context_start", pa.int32()), ("rank", pa.int32()),
    ]),
    # -- the log-prob gap (moescope.analyses.logprob_gap): an engine's log-probs, and the reference's beside them --
    # One row per generated token whose log-prob the engine returned (vLLM's `logprobs`, SGLang's
    # `meta_info.output_token_logprobs`): step, rank and sequence as in routes, position the sampled
    # token's in its sequence (the prompt's tokens first), token_id the sampled token (null where the
    # response does not say), logprob the engine's log-prob of it (natural log).
    "engine_logprobs": pa.schema([
        ("run_id", pa.string()), ("step", pa.int64()), ("rank", pa.int32()), ("sequence", pa.int32()),
        ("position", pa.int32()), ("token_id", pa.int64()), ("logprob", pa.float64()),
    ]),
    # One row per (routing, group) of a mismatch run that measured log-probs: Δ = reference − engine
    # log-prob of each generated token, the reference run with its own routing ("reference"), the
    # engine's routing replayed in every layer ("replay"), or in every layer but `left_out_layer`
    # ("replay-but-layer", --per-layer). grouping "all", "flips" (group_name "0", "1", "2-3", "4+":
    # layers whose expert set differs at the token), "position" (a position bucket) or "tag";
    # tokens: generated tokens measured; AReaL's figures (moescope.metrics.logprob_gap): k3_mean,
    # abs_mean, sq_mean, extreme_2 / extreme_5 (shares with |Δ| > ln 2 / ln 5); engine_run as run.
    "mismatch_logprob_gap": pa.schema([
        ("run_id", pa.string()), ("ts", TS), ("engine_run", pa.string()), ("routing", pa.string()),
        ("left_out_layer", pa.int32()), ("grouping", pa.string()), ("group_name", pa.string()),
        ("group_order", pa.int32()), ("tokens", pa.int64()), ("k3_mean", pa.float64()), ("abs_mean", pa.float64()),
        ("sq_mean", pa.float64()), ("extreme_2", pa.float64()), ("extreme_5", pa.float64()), ("rank", pa.int32()),
    ]),
    # -- placement what-if (moescope.analyses.placement.placement_whatif, `moescope placement --whatif --save`) --
    # One row per (candidate placement, window, layer): the slots each rank would have served
    # (rank_load, a redundant expert's split by `dispatch`), their balancedness (mean / max) and
    # imbalance ((max - mean) / mean). candidate: "current" (the placement given), "default"
    # (contiguous), "eplb", "load-aware", "eplb-every-N" (EPLB refitted every N windows on the window
    # before); fit_start: the first step of the window its placement was fitted on (null: not
    # fitted); ts: when the what-if was written (a run can hold several; readers take the latest).
    "placement_whatif": pa.schema([
        ("run_id", pa.string()), ("ts", TS), ("candidate", pa.string()), ("window_start", pa.int64()),
        ("window_end", pa.int64()), ("layer", pa.int32()), ("fit_start", pa.int64()), ("ranks", pa.int32()),
        ("nodes", pa.int32()), ("groups", pa.int32()), ("redundant", pa.int32()), ("dispatch", pa.string()),
        ("rank_load", pa.list_(pa.float64())), ("balancedness", pa.float64()), ("imbalance", pa.float64()),
        ("rank", pa.int32()),
    ]),
    # -- trace checks (moescope.ingest.trace_checks: the importers, the proxy, `moescope check --save`) --
    # One row per (check that found something, writing) of an engine's routed-experts trace: check_name
    # one of the checks ("zero_rows", "sentinel_rows", "repeated_ids", "row_count", "final_row_zero",
    # "physical_ids"); count what it counts (token rows, (token, layer) rows, rows missing or extra,
    # sequences, slots) out of `checked`; expected what an honest router gives; sequences and rows the
    # first few where it was found; origin what checked it ("import", "proxy", "check"). The proxy
    # writes a row per flush: a check's figures are the sums over its rows.
    "trace_findings": pa.schema([
        ("run_id", pa.string()), ("ts", TS), ("origin", pa.string()), ("check_name", pa.string()),
        ("count", pa.int64()), ("checked", pa.int64()), ("expected", pa.float64()),
        ("sequences", pa.list_(pa.string())), ("rows", pa.list_(pa.string())), ("detail", pa.string()),
        ("rank", pa.int32()),
    ]),
    # -- alert transitions, from every source (alerts/storage.py writes them) --
    # One row per change of one alert's state: the rules engine's (source "rules"), the expert-
    # health policy's ExpertUnhealthy ("health") and the trust gate's TrustGateChanged ("trust_gate",
    # whoever changed the gate: the policy, an operator, a dashboard request). `ts` is the event time
    # of the step that caused it; `reason` says why a change was not the rule's own verdict (e.g.
    # "run ended"); window_steps / baseline_steps are the rule's window and baseline, where it has them.
    "alerts": pa.schema([
        ("run_id", pa.string()), ("fingerprint", pa.string()), ("alertname", pa.string()), ("state", pa.string()),
        ("previous_state", pa.string()), ("ts", TS), ("step", pa.int64()), ("layer", pa.int32()),
        ("severity", pa.string()), ("expr", pa.string()), ("labels", TAGS), ("annotations", TAGS),
        ("signal_values", pa.map_(pa.string(), pa.float64())), ("starts_at", TS), ("ends_at", TS),
        ("written_at", TS), ("source", pa.string()), ("expert", pa.int32()), ("reason", pa.string()),
        ("window_steps", pa.int64()), ("baseline_steps", pa.int64()),
    ]),
}

TABLES = tuple(SCHEMAS)

# What every view (the dashboard, `summary`) says of a figure a source does not record (a null column),
# instead of showing it as zero.
NOT_RECORDED = "not recorded by this source"


def table_from_columns(name: str, columns: Mapping[str, pa.Array], rows: int) -> pa.Table:
    """A table of schema `name` from the columns a source has; every column not given is null
    ("not recorded by this source", never zero). Raises KeyError for an unknown table."""
    schema = SCHEMAS[name]
    return pa.Table.from_arrays([columns[f.name] if f.name in columns else pa.nulls(rows, f.type)
                                 for f in schema], schema=schema)


def _tags(tags: dict[str, str], n: int) -> pa.Array:
    return columns.repeat(list(tags.items()), n, TAGS)


def _const(value, n: int, type_: pa.DataType) -> pa.Array:
    return columns.repeat(value, n, type_)


def _lists(matrix: np.ndarray, type_: pa.DataType) -> pa.Array:
    """A (rows, width) array as a list column without a Python loop."""
    rows, width = matrix.shape
    offsets = np.arange(0, (rows + 1) * width, width, dtype=np.int32) if rows else np.zeros(1, dtype=np.int32)
    offsets = columns.array(offsets, pa.int32())
    return pa.ListArray.from_arrays(offsets, columns.array(matrix.reshape(-1), type_))


class LayerFacts(Protocol):
    """One MoE layer as its `layers` row describes it. The probe's `moescope.core.records.LayerInfo`
    is one; a source that does not know every figure builds a `LayerRow`."""

    @property
    def layer(self) -> int: ...  # 0-based index of the MoE layer in module order
    @property
    def module(self) -> str: ...
    @property
    def family(self) -> str: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def zero_experts(self) -> int: ...
    @property
    def params_per_expert(self) -> int | None: ...  # None: not recorded by this source (null)
    @property
    def expert_capacity(self) -> int | None: ...  # None: no capacity, or not recorded


class LayerRow(NamedTuple):
    """A `LayerFacts` of a source that knows less than the probe (an importer, the proxy): what it
    does not know stays None, a null column, never zero."""

    layer: int
    module: str
    family: str
    num_experts: int
    top_k: int
    zero_experts: int = 0
    params_per_expert: int | None = None
    expert_capacity: int | None = None


def runs_table(run_id: str, started_at: dt.datetime, model_class: str, source: str, *,
               tags: Mapping[str, str] | None = None, ranks: Sequence[int] = (0,), world_size: int | None = None,
               total_params: int | None = None, routed_expert_params: int | None = None,
               host: str | None = None) -> pa.Table:
    """The `runs` rows of a run, one per rank (each rank of a probed run writes its own): the one
    builder of `runs`, for every source.

    Args:
        run_id: the run.
        started_at: when it started (UTC).
        model_class: the model's class name (an importer: the model the engine served).
        source: what recorded it: "probe", an engine an importer read ("vllm", ...), "proxy",
            "jitter", "mismatch".
        tags: key=value tags of the run.
        ranks: the ranks to write a row for (default: rank 0 alone).
        world_size: ranks in the job; None: the highest of `ranks` + 1.
        total_params: every parameter of the model; None where the source does not know (null).
        routed_expert_params: parameters of the routed experts; None likewise.
        host: the host that recorded the run; None: the writer's, filled in as the rows are written
            (`moescope.store.writer.RunWriter.write`).

    Returns:
        A table of the `runs` schema.
    """
    world = world_size if world_size is not None else max(ranks, default=0) + 1
    tag_items = list((tags or {}).items())
    return columns.rows_table([
        dict(run_id=run_id, started_at=started_at, model_class=model_class, total_params=total_params,
             routed_expert_params=routed_expert_params, tags=tag_items, rank=rank, world_size=world,
             source=source, host=host)
        for rank in ranks], SCHEMAS["runs"])


def layers_table(run_id: str, layers: Sequence[LayerFacts], ranks: Sequence[int] = (0,)) -> pa.Table:
    """The `layers` rows of a run, one per (rank, layer), rank by rank: the one builder of `layers`.

    Args:
        run_id: the run.
        layers: its MoE layers (the probe's `LayerInfo`s, or `LayerRow`s).
        ranks: the ranks to write the rows for (default: rank 0 alone).

    Returns:
        A table of the `layers` schema.
    """
    return columns.rows_table([
        dict(run_id=run_id, layer=info.layer, module=info.module, family=info.family,
             num_experts=info.num_experts, zero_experts=info.zero_experts, top_k=info.top_k,
             params_per_expert=info.params_per_expert, expert_capacity=info.expert_capacity, rank=rank)
        for rank in ranks for info in layers], SCHEMAS["layers"])


def run_tables(run: RunInfo, source: str = "probe") -> dict[str, pa.Table]:
    """A run as the probe describes it (`moescope.core.records.RunInfo`: one rank, its model's
    parameters, its hooked layers) as its `runs` row and, where it has layers, its `layers` rows.

    Args:
        run: the run.
        source: what recorded it ("probe"; the jitter and mismatch checks write runs of their own).

    Returns:
        {"runs": one row, "layers": a row per layer (left out when `run.layers` is empty)}.
    """
    out = {"runs": runs_table(run.run_id, run.started_at, run.model_class, source, tags=run.tags,
                              ranks=(run.rank,), world_size=run.world_size, total_params=run.total_params,
                              routed_expert_params=run.routed_expert_params, host=run.host)}
    if run.layers:
        out["layers"] = layers_table(run.run_id, run.layers, (run.rank,))
    return out


def step_tables(record: StepRecord, rank: int = 0) -> dict[str, pa.Table]:
    """The rows one forward adds to each table; tables with no rows are left out."""
    out: dict[str, pa.Table] = {}
    out["steps"] = columns.rows_table([dict(
        run_id=record.run_id, step=record.step, ts=record.ts, duration_s=record.duration_s,
        tokens=record.tokens, batch_size=record.batch_size, seq_len=record.seq_len,
        active_params=record.active_params, total_params=record.total_params,
        active_param_fraction=record.active_param_fraction, tags=list(record.tags.items()), rank=rank,
        step_end=record.step_end, forwards=record.forwards,
    )], SCHEMAS["steps"])
    if record.layers:
        out["layer_steps"] = columns.rows_table([dict(
            run_id=record.run_id, step=record.step, ts=record.ts, layer=ls.layer, tokens=ls.tokens,
            expert_load=ls.expert_load.tolist(), gate_weight_sum=ls.gate_weight_sum.tolist(),
            router_prob_sum=None if ls.router_prob_sum is None else ls.router_prob_sum.tolist(),
            router_entropy_mean=ls.router_entropy_mean, router_entropy_p95=ls.router_entropy_p95,
            top1_margin_mean=ls.top1_margin_mean, dropped_tokens=ls.dropped_tokens,
            dropped_assignments=ls.dropped_assignments, capacity=ls.capacity, capacity_use=ls.capacity_use,
            active_params_per_token=ls.active_params_per_token,
            coselection=None if ls.coselection is None else ls.coselection.reshape(-1).tolist(),
            tags=list(record.tags.items()), rank=rank, step_end=record.step_end, forwards=ls.forwards,
            compute_time_s=ls.compute_time_s, expert_compute_time_measured=ls.expert_compute_time_measured,
            expert_compute_time_s=None if ls.expert_compute_time_s is None else ls.expert_compute_time_s.tolist(),
            router_topk_load=None if ls.router_topk_load is None else ls.router_topk_load.tolist(),
            router_z_sum=ls.router_z_sum,
        ) for ls in record.layers], SCHEMAS["layer_steps"])
    routes = [RoutePiece(record.step, ls.layer, record.tags, ls.routes, rank)
              for ls in record.layers if ls.routes is not None]
    if routes:
        out["routes"] = routes_table(record.run_id, routes)
    for name, column, attr in (("router_logits", "logits", "router_logits"),
                               ("router_inputs", "hidden", "router_inputs")):
        samples = [_sample_table(record, ls.layer, getattr(ls, attr), name, column, rank)
                   for ls in record.layers if getattr(ls, attr) is not None]
        if samples:
            out[name] = pa.concat_tables(samples)
    if record.kv_cache:
        out["kv_cache"] = columns.rows_table([dict(
            run_id=record.run_id, step=record.step, ts=record.ts, layer=kv.layer, bytes=kv.bytes,
            seq_len=kv.seq_len, rank=rank) for kv in record.kv_cache], SCHEMAS["kv_cache"])
    return out


class RouteRows(Protocol):
    """Per-token routing of one layer, as the probe (`moescope.core.records.Routes`) and the importers
    (`moescope.ingest.importers.source.LayerRoutes`) hold it. Rows are tokens; `gate_weights` and `kept` are
    None where a source does not record them (their columns are then null), `step` and `token`
    None where every row is of the piece's step, numbered in order."""

    @property
    def expert_ids(self) -> np.ndarray: ...  # (tokens, k) int
    @property
    def gate_weights(self) -> np.ndarray | None: ...  # (tokens, k) float
    @property
    def kept(self) -> np.ndarray | None: ...  # (tokens, k) bool
    @property
    def token_ids(self) -> np.ndarray | None: ...  # (tokens,) int
    @property
    def sequence(self) -> np.ndarray: ...  # (tokens,) int
    @property
    def position(self) -> np.ndarray: ...  # (tokens,) int
    @property
    def step(self) -> np.ndarray | None: ...  # (tokens,) int: the forward of each row (a window's)
    @property
    def token(self) -> np.ndarray | None: ...  # (tokens,) int: the row in its forward's batch


class RoutePiece(NamedTuple):
    """One layer's routes in one step, with what every row of it shares."""

    step: int
    layer: int
    tags: Mapping[str, str]
    routes: RouteRows
    rank: int = 0


def routes_table(run_id: str, pieces: Sequence[RoutePiece]) -> pa.Table:
    """The routes rows of many pieces, built in one vectorised pass: the one builder of `routes`.

    The writer keeps the probe's numpy arrays until it flushes and converts them here all at once:
    per-piece Arrow tables and a concat would cost more than writing the Parquet file.
    """
    schema = SCHEMAS["routes"]
    if not pieces:
        return schema.empty_table()
    routes = [p.routes for p in pieces]
    sizes = [len(r.expert_ids) for r in routes]
    counts = np.array(sizes, dtype=np.int64)
    total = int(counts.sum())
    # a piece's rows are numbered from 0 unless it says otherwise (a window's pieces span several forwards)
    numbers = np.arange(max(sizes), dtype=np.int32)
    token = np.concatenate([numbers[:n] if r.token is None else r.token
                            for r, n in zip(routes, sizes)]).astype(np.int32, copy=False)
    widths = {r.expert_ids.shape[1] for r in routes}
    if len(widths) == 1:  # every piece has the same k: the offsets are a range
        width = widths.pop()
        offsets = columns.array(np.arange(0, (total + 1) * width, width, dtype=np.int32), pa.int32())
    else:
        ends = np.zeros(total + 1, dtype=np.int32)
        np.cumsum(np.repeat(np.array([r.expert_ids.shape[1] for r in routes], dtype=np.int32), counts),
                  out=ends[1:])
        offsets = columns.array(ends, pa.int32())

    def slots(name: str, dtype, type_: pa.DataType) -> pa.Array:
        """A (tokens, k) field of every piece as a list column; null rows where a piece lacks it."""
        present = [getattr(r, name) is not None for r in routes]
        if not any(present):
            return pa.nulls(total, pa.list_(type_))
        values = np.concatenate([getattr(r, name).reshape(-1) if has else np.zeros(r.expert_ids.size)
                                 for r, has in zip(routes, present)]).astype(dtype, copy=False)
        mask = None if all(present) else columns.array(np.repeat(~np.array(present), counts), pa.bool_())
        return pa.ListArray.from_arrays(offsets, columns.array(values, type_), mask=mask)

    if all(r.token_ids is not None for r in routes):
        token_ids = columns.array(np.concatenate([r.token_ids for r in routes]), pa.int64())
    else:
        values = np.concatenate([r.token_ids if r.token_ids is not None else np.zeros(n)
                                 for r, n in zip(routes, sizes)]).astype(np.int64)
        missing = np.concatenate([np.full(n, r.token_ids is None) for r, n in zip(routes, sizes)])
        token_ids = columns.array(values, pa.int64(), mask=missing)
    tag_sets: dict[tuple, int] = {}
    tag_index = np.repeat(np.array([tag_sets.setdefault(tuple(sorted(p.tags.items())), len(tag_sets))
                                    for p in pieces], dtype=np.int32), counts)
    tags = columns.array([list(t) for t in tag_sets], TAGS).take(columns.array(tag_index, pa.int32()))
    return pa.Table.from_arrays([
        _const(run_id, total, pa.string()),
        columns.array(np.repeat(np.array([p.step for p in pieces], dtype=np.int64), counts)
                      if all(r.step is None for r in routes) else
                      np.concatenate([r.step if r.step is not None else np.full(n, p.step)
                                      for p, r, n in zip(pieces, routes, sizes)]), pa.int64()),
        columns.array(np.repeat(np.array([p.layer for p in pieces], dtype=np.int32), counts), pa.int32()),
        columns.array(token, pa.int32()),
        columns.array(np.concatenate([r.sequence for r in routes]), pa.int32()),
        columns.array(np.concatenate([r.position for r in routes]), pa.int32()),
        token_ids,
        pa.ListArray.from_arrays(offsets, columns.array(
            np.concatenate([r.expert_ids.reshape(-1) for r in routes]), pa.int32())),
        slots("gate_weights", np.float32, pa.float32()),
        slots("kept", bool, pa.bool_()),
        tags, columns.array(np.repeat(np.array([p.rank for p in pieces], dtype=np.int32), counts), pa.int32()),
    ], schema=schema)


@dataclass(frozen=True)
class TraceFinding:
    """One check that found something in an engine's routed-experts trace, as its `trace_findings`
    row describes it: the model-free checks' (`moescope.ingest.trace_checks`) and those against the
    model (`moescope.analyses.trace_check`) alike.

    `count` is what the check counts out of `checked`; `expected` what an honest router gives (0
    where it gives none); `sequences` and `rows` name the first few where it was found (rows as
    "sequence row N"); `detail` says it in a sentence.
    """

    check: str
    count: int
    checked: int
    expected: float = 0.0
    sequences: list[str] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)
    detail: str = ""


def trace_findings_table(run_id: str, ts: dt.datetime, origin: str, findings: Sequence[TraceFinding],
                         rank: int = 0) -> pa.Table:
    """The `trace_findings` rows of one check of a trace: the one builder of `trace_findings`.

    Args:
        run_id: the run whose trace was checked.
        ts: when it was checked (UTC).
        origin: what checked it: "import", "proxy" or "check".
        findings: the checks that found something (none: an empty table).
        rank: the rank the trace came from.

    Returns:
        A table of the `trace_findings` schema, a row per finding.
    """
    return columns.rows_table([
        dict(run_id=run_id, ts=ts, origin=origin, check_name=f.check, count=int(f.count), checked=int(f.checked),
             expected=float(f.expected), sequences=list(f.sequences), rows=list(f.rows), detail=f.detail, rank=rank)
        for f in findings], SCHEMAS["trace_findings"])


def probe_stats_table(run_id: str, rank: int, pid: int, ts: dt.datetime, written: Mapping[str, int],
                      dropped: Mapping[tuple[str, str], int], dropped_records: Mapping[str, int],
                      host: str | None = None) -> pa.Table:
    """One writer's cumulative counts as `probe_stats` rows: per table a row of rows written (reason
    null), and a row per reason rows of it were dropped; records dropped per reason go on the
    `steps` rows (a record is one window, or one proxied response). Tables with neither are left out.
    `host` is the writer's (None: this process's, `moescope.core.runs.current_host`)."""
    host = host if host is not None else current_host()
    rows = []
    for table in SCHEMAS:
        if table == "probe_stats":
            continue
        reasons = sorted({reason for (t, reason) in dropped if t == table})
        if not reasons and not written.get(table):
            continue
        base = dict(run_id=run_id, ts=ts, table_name=table, rank=rank, pid=pid, host=host)
        rows.append(dict(base, written_rows=written.get(table, 0), dropped_rows=0, dropped_records=0, reason=None))
        rows += [dict(base, written_rows=0, dropped_rows=dropped[(table, reason)],
                      dropped_records=dropped_records.get(reason, 0) if table == "steps" else 0, reason=reason)
                 for reason in reasons]
    return columns.rows_table(rows, SCHEMAS["probe_stats"])


def _sample_table(record: StepRecord, layer: int, sample: TokenSample, name: str, column: str,
                  rank: int) -> pa.Table:
    n = len(sample.token)
    token_ids = (columns.array(np.asarray(sample.token_ids), pa.int64()) if sample.token_ids is not None
                 else pa.nulls(n, pa.int64()))
    arrays = {
        "run_id": _const(record.run_id, n, pa.string()),
        "step": (columns.array(np.asarray(sample.step), pa.int64()) if sample.step is not None
                 else _const(record.step, n, pa.int64())),
        "layer": _const(layer, n, pa.int32()), "token": columns.array(np.asarray(sample.token), pa.int32()),
        "token_id": token_ids, "top1_expert": columns.array(np.asarray(sample.top1_expert), pa.int32()),
        column: _lists(sample.values.astype(np.float32), pa.float32()),
        "tags": _tags(record.tags, n), "rank": _const(rank, n, pa.int32()),
    }
    return pa.Table.from_arrays([arrays[f.name] for f in SCHEMAS[name]], schema=SCHEMAS[name])


class LogprobPiece(NamedTuple):
    """The engine's log-probs of one sequence's generated tokens in one step: `logprob` (tokens,)
    at positions `first_position`.., `token_ids` (tokens,) the sampled tokens or None."""

    step: int
    sequence: int
    first_position: int
    logprob: np.ndarray
    token_ids: np.ndarray | None = None
    rank: int = 0


def engine_logprobs_table(run_id: str, pieces: Sequence[LogprobPiece]) -> pa.Table:
    """The `engine_logprobs` rows of many pieces: the one builder of the table."""
    schema = SCHEMAS["engine_logprobs"]
    pieces = [p for p in pieces if len(p.logprob)]
    if not pieces:
        return schema.empty_table()
    counts = np.array([len(p.logprob) for p in pieces], dtype=np.int64)
    total = int(counts.sum())
    ids = np.concatenate([np.zeros(len(p.logprob), dtype=np.int64) if p.token_ids is None else
                          np.asarray(p.token_ids, dtype=np.int64) for p in pieces])
    missing = np.concatenate([np.full(len(p.logprob), p.token_ids is None) for p in pieces])
    values = np.concatenate([np.asarray(p.logprob, dtype=np.float64) for p in pieces])
    return pa.Table.from_arrays([
        _const(run_id, total, pa.string()),
        columns.array(np.repeat(np.array([p.step for p in pieces], dtype=np.int64), counts), pa.int64()),
        columns.array(np.repeat(np.array([p.rank for p in pieces], dtype=np.int32), counts), pa.int32()),
        columns.array(np.repeat(np.array([p.sequence for p in pieces], dtype=np.int32), counts), pa.int32()),
        columns.array(np.concatenate([np.arange(p.first_position, p.first_position + len(p.logprob), dtype=np.int32)
                                      for p in pieces]), pa.int32()),
        columns.array(ids, pa.int64(), mask=missing),
        columns.array(values, pa.float64(), mask=np.isnan(values)),  # NaN: not measured, null in the table
    ], schema=schema)
