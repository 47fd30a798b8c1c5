"""moescope's probe: attach to a torch MoE model and record what every router decided.

    import probe
    with probe.attach(model, store="runs/", routes=True) as session:
        model(**batch)
"""

from __future__ import annotations

from probe.adapters import Choice, MoELayer, MoESpec, NoMoELayersError, find_moe_layers
from probe.records import KVCacheLayer, LayerInfo, LayerStep, Routes, RunInfo, StepRecord, TokenSample
from probe.session import ProbeAttachError, ProbeSession, attach

__all__ = [
    "Choice", "KVCacheLayer", "LayerInfo", "LayerStep", "MoELayer", "MoESpec", "NoMoELayersError",
    "ProbeAttachError", "ProbeSession", "Routes", "RunInfo", "StepRecord", "TokenSample", "attach",
    "find_moe_layers",
]
