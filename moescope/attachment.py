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
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from moescope import probe
from moescope.core.exporters import Exporter
from moescope.core.records import StepRecord
from moescope.probe.options import TRUST_GATE_MODES, Pipeline
from moescope.probe.session import ProbeSession
from moescope.store.location import StoreLocation, open_location

if TYPE_CHECKING:  # imported when a policy is bound: a session without one never loads alerts
    from moescope.alerts.trust_policy import TrustPolicy


def attach(model: nn.Module, store: str | os.PathLike | StoreLocation | None = None, *,
           storage_options: Mapping[str, Any] | None = None, exporters: Sequence[Exporter[StepRecord]] = (),
           trust_gate: str | None = None, trust_policy: TrustPolicy | None = None,
           health: bool | probe.HealthSampling = False, **options: Any) -> ProbeSession:
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
        **options: the probe's (`probe.attach`: routes, router_logits, router_inputs, kv_cache, window,
            layers, specs, tags, run_id, policy, recording=, pipeline=, ...). The store's buffers are
            flushed every `flush_interval_s` (the pipeline's, default 5 s).

    Returns:
        The probe session (a context manager); `session.trust` is the bound policy (None without
            health or gate).

    Raises:
        ValueError: for an unknown trust_gate mode (`probe.TRUST_GATE_MODES`), or `storage_options`
            without a `store`.
        store.location.LocationError: (a ValueError) for a store URL or options that cannot be used.
        NoMoELayersError: for a model with no MoE layer; `probe.attach`'s other exceptions
            (ProbeAttachError, TypeError) pass through too.
    """
    if trust_gate not in TRUST_GATE_MODES:
        raise ValueError(f"trust_gate must be None, 'manual' or 'auto', not {trust_gate!r}")
    health = health or trust_gate == "auto"  # the auto policy judges by health scores
    exporters = list(exporters)
    location = None if store is None else open_location(store, storage_options)
    if location is None and storage_options:
        raise ValueError("storage_options without a store: give store= (a folder or a URL) too")
    if location is not None:
        from moescope.store.exporter import DeltaExporter

        pipeline = options.get("pipeline") or Pipeline()
        flush_interval_s = options.get("flush_interval_s", pipeline.flush_interval_s)
        exporters.append(DeltaExporter(location, max_age_s=flush_interval_s))
    session = probe.attach(model, exporters, health=health, gate=trust_gate is not None, **options)
    if health or trust_gate:
        from moescope.alerts.trust_policy import bind_policy

        try:
            session.bind_trust_policy(bind_policy(session, trust_policy, trust_gate, location))
        except BaseException:
            session.close()
            raise
    return session
