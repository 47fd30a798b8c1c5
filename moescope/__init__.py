"""moescope: observability and routing diagnostics for Mixture-of-Experts models.

`moescope.attach(model, store="runs/", ...)` is the one call: the probe, the store and (when
asked) the trust policy wired together. The command line is `moescope.cli`.

Everything installs under this one namespace: `moescope.probe` (instrumentation),
`moescope.store` (data at rest), `moescope.alerts` (judgement), `moescope.dashboard` (views). The
names users need most are re-exported here and imported on first use, so `import moescope.probe`
inside a serving process does not pull in DuckDB or Streamlit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moescope.core.lazy import lazy_exports

# name -> the module that defines it
_EXPORTS = {
    "attach": "moescope.attachment",
    "replay": "moescope.attachment",
    "jitter": "moescope.analyses.jitter",
    "mismatch": "moescope.analyses.mismatch",
    "HealthSampling": "moescope.probe",
    "MoESpec": "moescope.probe",
    "NoMoELayersError": "moescope.probe",
    "Pipeline": "moescope.probe",
    "ProbeAttachError": "moescope.probe",
    "ProbeSession": "moescope.probe",
    "Recording": "moescope.probe",
    "ReplayError": "moescope.probe.replay",
    "Store": "moescope.store",
    "StoreError": "moescope.store",
}

__all__ = ["HealthSampling", "MoESpec", "NoMoELayersError", "Pipeline", "ProbeAttachError", "ProbeSession", "Recording",
           "ReplayError", "Store", "StoreError", "attach", "jitter", "mismatch", "replay"]

if TYPE_CHECKING:
    from moescope.analyses.jitter import jitter
    from moescope.analyses.mismatch import mismatch
    from moescope.attachment import attach, replay
    from moescope.probe import (
        HealthSampling,
        MoESpec,
        NoMoELayersError,
        Pipeline,
        ProbeAttachError,
        ProbeSession,
        Recording,
    )
    from moescope.probe.replay import ReplayError
    from moescope.store import Store, StoreError
else:
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
