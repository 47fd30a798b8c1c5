"""moescope's probe: attach to a torch MoE model and record what every router decided.

The probe is a pure producer: it hands records to exporters and imports nothing from the store or
alerts. `moescope.attach` wires it to a store, a trust policy and alerts in one call.

    from moescope import probe
    from moescope.core.exporters import InMemoryExporter
    memory = InMemoryExporter[probe.StepRecord]()
    with probe.attach(model, [memory], routes=True) as session:
        model(**batch)
"""

from __future__ import annotations

from moescope.core.records import KVCacheLayer, LayerInfo, LayerStep, Routes, RunInfo, StepRecord, TokenSample
from moescope.probe.adapters import (
    CapacityDispatch,
    CapacityPerSequence,
    Choice,
    MoELayer,
    MoESpec,
    NoMoELayersError,
    find_moe_layers,
)
from moescope.probe.options import TRUST_GATE_MODES, HealthSampling, Pipeline, Recording
from moescope.probe.session import ProbeAttachError, ProbeSession, TrustPolicyExporter, attach

__all__ = [
    "TRUST_GATE_MODES", "CapacityDispatch", "CapacityPerSequence", "Choice", "HealthSampling", "KVCacheLayer",
    "LayerInfo", "LayerStep", "MoELayer", "MoESpec", "NoMoELayersError", "Pipeline", "ProbeAttachError",
    "ProbeSession", "Recording", "Routes", "RunInfo", "StepRecord", "TokenSample", "TrustPolicyExporter", "attach",
    "find_moe_layers",
]
