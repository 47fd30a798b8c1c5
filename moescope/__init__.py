"""moescope: observability and routing diagnostics for Mixture-of-Experts models.

`moescope.attach(model, store="runs/", ...)` is the one call: the probe, the store and (when
asked) the trust policy wired together. The command line is `moescope.cli`.
"""

from __future__ import annotations

from moescope.attach import attach

__all__ = ["attach"]
