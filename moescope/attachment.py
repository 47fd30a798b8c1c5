"""`moescope.attach`: the one call that wires a probe session to a store, a trust policy and alerts.

The composition root. The probe only produces records (`moescope.probe.attach(model, exporters)`);
the store writes them (`moescope.store.ParquetExporter`); alerts judge them
(`moescope.alerts.trust_policy.TrustPolicy`, `moescope.alerts.engine.EngineExporter`) and the
Prometheus exporter serves them (`moescope.prometheus.PrometheusExporter`). This module is the one
place that knows them all.

    import moescope
    with moescope.attach(model, store="runs/", routes=True) as session:
        model(**batch)

    # one bucket for a fleet (credentials from the environment: AWS_ACCESS_KEY_ID, a profile, a role)
    moescope.attach(model, store="s3://moe-runs/fleet", storage_options={"region": "eu-west-1"})

`moescope.replay(model, routes)` forces an engine's routing in the model (R3), from an array, a
`moescope mismatch --export` folder or a run in a store (`routes_array` reads them all).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from moescope import probe
from moescope.core.exporters import Exporter
from moescope.core.records import StepRecord
from moescope.probe.options import TRUST_GATE_MODES, Pipeline
from moescope.probe.replay import ReplayError, RoutingReplay
from moescope.probe.session import ProbeSession
from moescope.store.location import StoreLocation, open_location

if TYPE_CHECKING:  # imported when a policy is bound: a session without one never loads alerts
    from moescope.alerts.trust_policy import TrustPolicy


def attach(model: nn.Module, store: str | os.PathLike | StoreLocation | None = None, *,
           storage_options: Mapping[str, Any] | None = None, exporters: Sequence[Exporter[StepRecord]] = (),
           trust_gate: str | None = None, trust_policy: TrustPolicy | None = None,
           health: bool | probe.HealthSampling = False, replay: Any = None, **options: Any) -> ProbeSession:
    """Attach the probe to `model` and send its records to a store and any other exporters.

    The composition root: the session comes from `probe.attach`, the store's `ParquetExporter` is
    added when `store` is given, and a trust policy is bound when `health` or `trust_gate` asks for one.

    Args:
        model: the torch model to hook; every MoE layer the probe recognises is watched.
        store: where to write the tables (Reference, "Tables and columns"): a local folder, or a
            URL (`s3://bucket/prefix`, `gs://...`, `az://...`) that many processes and hosts may share.
            Default None: no store, the records go to `exporters` only.
        storage_options: how to reach a URL store, without secrets (`endpoint`, `region`, `allow_http`,
            ...; `store.location.parse_storage_options`); credentials come from the environment only.
            Needs `store`.
        exporters: more consumers of the records (the Prometheus exporter, an alerts engine, an
            `InMemoryExporter`).
        trust_gate: None (default: nothing in the model changes), "manual" (a `TrustGate` at
            `session.gate`, changed by `session.trust.override`) or "auto" (health on, and the policy
            gates unhealthy experts).
        trust_policy: an `alerts.trust_policy.TrustPolicy` (thresholds, alert sink, `accept_requests`);
            by default a default one. Used only when `health` or `trust_gate` is on.
        health: sample expert outputs and weight fingerprints and score expert health (True, or a
            `probe.HealthSampling`; docs/health.md). Default False; `trust_gate="auto"` turns it on.
        replay: a routing to force in every forward while the session is attached (what
            `moescope.replay` takes as `routes`); the records, routes included, show the forced experts
            and carry the tag `replay=<source>`. Default None. Not with `trust_gate`.
        **options: the probe's (`probe.attach`: routes, router_logits, router_inputs, kv_cache, window,
            layers, specs, tags, run_id, policy, recording=, pipeline=, ...). The store's buffers are
            flushed every `flush_interval_s` (the pipeline's, default 5 s).

    Returns:
        The probe session (a context manager); `session.trust` is the bound policy (None without
            health or gate).

    Raises:
        ValueError: for an unknown trust_gate mode (`probe.TRUST_GATE_MODES`), `storage_options`
            without a `store`, or `replay` with `trust_gate`.
        ReplayError: (a ValueError) for a routing that cannot be replayed in this model (`replay`).
        store.location.LocationError: (a ValueError) for a store URL or options that cannot be used.
        NoMoELayersError: for a model with no MoE layer; `probe.attach`'s other exceptions
            (ProbeAttachError, TypeError) pass through too.
    """
    if trust_gate not in TRUST_GATE_MODES:
        raise ValueError(f"trust_gate must be None, 'manual' or 'auto', not {trust_gate!r}")
    if replay is not None and trust_gate is not None:
        raise ValueError("a trust gate re-routes by the router's scores, a replay forces given experts: "
                         "give trust_gate or replay, not both")
    forced = None if replay is None else _routing_replay(model, replay, options.get("specs", ()))
    health = health or trust_gate == "auto"  # the auto policy judges by health scores
    exporters = list(exporters)
    location = None if store is None else open_location(store, storage_options)
    if location is None and storage_options:
        raise ValueError("storage_options without a store: give store= (a folder or a URL) too")
    if location is not None:
        pipeline = options.get("pipeline") or Pipeline()
        flush_interval_s = options.get("flush_interval_s", pipeline.flush_interval_s)
        if options.get("writer", pipeline.writer) == "process":
            from moescope.store.writer_process import ProcessExporter

            exporters.append(ProcessExporter(location, max_age_s=flush_interval_s))
        else:
            from moescope.store.exporter import DeltaExporter

            exporters.append(DeltaExporter(location, max_age_s=flush_interval_s))
    session = probe.attach(model, exporters, health=health, gate=trust_gate is not None, replay=forced, **options)
    if health or trust_gate:
        from moescope.alerts.trust_policy import bind_policy

        try:
            session.bind_trust_policy(bind_policy(session, trust_policy, trust_gate, location))
        except BaseException:
            session.close()
            raise
    return session


_NPY_NAME = re.compile(r"^(\d+)-(\d+)-(\d+)\.npy$")  # export_replay's <step>-<rank>-<sequence>.npy


def _stack(arrays: list[np.ndarray], where: str) -> np.ndarray:
    if not arrays:
        raise ReplayError(f"{where} holds no sequence to replay")
    lengths = sorted({a.shape[0] for a in arrays})
    if len(lengths) > 1 or len({a.shape[1:] for a in arrays}) > 1:
        raise ReplayError(f"{where} holds {len(arrays)} sequences of different shapes ({lengths} tokens): replay "
                          "them one at a time (moescope.replay(model, sequences[i:i + 1]) or one .npy array), or "
                          "pad them to one length with rows of -1 (the model's own choice)")
    return np.stack(arrays)


def _export_folder(folder: str) -> np.ndarray:
    import pyarrow.parquet as pq

    from moescope.analyses.mismatch_replay import PARQUET_NAME

    parquet = os.path.join(folder, PARQUET_NAME)
    if os.path.isfile(parquet):
        table = pq.read_table(parquet, columns=["tokens", "layers", "top_k", "expert_ids"]).to_pylist()
        return _stack([np.asarray(row["expert_ids"], dtype=np.int64).reshape(row["tokens"], row["layers"],
                                                                              row["top_k"]) for row in table],
                      parquet)
    names = sorted((tuple(int(v) for v in match.groups()), name) for name in os.listdir(folder)
                   if (match := _NPY_NAME.match(name)))
    if not names:
        raise ReplayError(f"{folder} holds neither {PARQUET_NAME} nor <step>-<rank>-<sequence>.npy files: give the "
                          "folder `moescope mismatch --export` wrote")
    return _stack([np.load(os.path.join(folder, name), allow_pickle=False) for _, name in names], folder)


def routes_array(routes: Any) -> tuple[np.ndarray, str]:
    """The expert ids of a routing to replay, (batch, tokens, layers, top_k) or (tokens, layers, top_k), and
    where they came from (the `replay=` tag).

    Args:
        routes: what `replay` takes (see there).

    Returns:
        (ids, label): the ids as an integer array; label "array", "sequences", the folder or file, or the run id.

    Raises:
        ReplayError: for a source that holds nothing to replay, or sequences of different lengths.
        moescope.analyses.mismatch_engine.MismatchError: for a run whose routing cannot be rebuilt.
        TypeError: for anything else.
    """
    if isinstance(routes, torch.Tensor):
        return routes.detach().cpu().numpy(), "array"
    if isinstance(routes, np.ndarray):
        return routes, "array"
    if isinstance(routes, (str, os.PathLike)):
        path = os.fspath(routes)
        if os.path.isdir(path):
            return _export_folder(path), path
        if os.path.isfile(path) and path.endswith(".npy"):
            return np.load(path, allow_pickle=False), path
        raise ReplayError(f"{path} is neither a replay export folder nor an .npy file")
    if isinstance(routes, (list, tuple)) and routes and all(hasattr(seq, "expert_ids") for seq in routes):
        return _stack([np.asarray(seq.expert_ids) for seq in routes], "the sequences given"), "sequences"
    if isinstance(routes, tuple) and len(routes) == 2 and isinstance(routes[1], str):
        from moescope.analyses.mismatch_replay import engine_replay

        store, run = routes
        sequences, _ = engine_replay(store, run)
        return _stack([seq.expert_ids for seq in sequences], f"run {run!r}"), run
    raise TypeError(f"routes must be an array of expert ids, a list of ReplaySequence, an export folder or a "
                    f"(store, run) pair, not {type(routes).__name__}")


def _routing_replay(model: nn.Module, routes: Any, specs: Any = ()) -> RoutingReplay:
    ids, label = routes_array(routes)
    return RoutingReplay(probe.find_moe_layers(model, specs=specs), ids, label)


@contextlib.contextmanager
def replay(model: nn.Module, routes: Any, *, session: ProbeSession | None = None) -> Iterator[RoutingReplay]:
    """Force a routing in `model`: inside the block every MoE layer sends each token to the given experts.

    R3's routing replay: the choice of experts is the given one (an inference engine's), the gate
    weights are the model's own, computed by the family's rule (`probe.trust_gate.RULES`: softmax or
    sigmoid, renormalisation, scaling) from the router's scores over the forced experts, so gradients
    flow through them. Replaying the model's own routing changes no bit of its output. Every forward
    inside must feed the (batch, tokens) the routing describes; the same routing applies to each.

        sequences, _ = engine_replay("runs/", "vllm-rollout")      # or an export folder, or an array
        with moescope.replay(model, sequences[:1]):
            loss = model(input_ids=ids, labels=ids).loss         # ids: that sequence, (1, tokens)
        loss.backward()

    Args:
        model: the transformers model (every MoE layer's family must have a rule: mixtral, qwen2_moe,
            qwen3_moe, olmoe, jamba, deepseek_v2, deepseek_v3, gpt_oss, granitemoe, phimoe, llama4, dbrx,
            switch_transformers).
        routes: expert ids, layers in the model's MoE-layer order (the probe's `session.layers`), one of:
            a numpy array or torch tensor `[tokens, layers, top_k]` (one sequence, batch 1) or
            `[batch, tokens, layers, top_k]`; a list of `analyses.mismatch.ReplaySequence` (what
            `analyses.mismatch_replay.engine_replay` and `moescope.mismatch` give), stacked as a batch;
            the folder `moescope mismatch --export` wrote (`replay.parquet`, else its `.npy` files, in
            step, rank, sequence order), or one `.npy` file of it; or a `(store, run)` pair: the routes
            table of that run, an engine run imported or recorded by the proxy, or a run moescope recorded
            itself (`moescope.attach(model, store, routes=True)`; its batch rows are its sequences), rebuilt
            as `engine_replay` does. Sequences must share one length (else replay them one at a time).
            -1: an engine's export has -1 where the engine routed nothing; a token whose every id in a
            layer is -1 is routed there by the model's own router (so pad a routing one token short with a
            row of -1); a row only partly -1 is refused.
        session: a probe session on `model`: the block is tagged `replay=<source>` there (its routes
            show the forced experts either way). Default None.

    Yields:
        The installed `probe.replay.RoutingReplay`.

    Raises:
        ReplayError: (a ValueError) before any forward: a family without a rule (named), a routing whose
            layer count or top-k differs from the model's, an id out of range, a repeated id within one
            token's top-k; at a forward, before it runs: inputs whose (batch, tokens) differ from the
            routing's.
        TypeError: for a `routes` of another kind.
    """
    forced = _routing_replay(model, routes)
    handles = forced.install(model)
    try:
        with session.tag(replay=forced.label) if session is not None else contextlib.nullcontext():
            yield forced
    finally:
        for handle in handles:
            handle.remove()
