"""Other engines' routing into a moescope store: importers of their dumps and a live proxy.

`import_files` (`moescope import`) reads the files of vLLM, SGLang, TensorRT-LLM or Megatron, checks
all of them, and only then writes one new run (`moescope.ingest.importers`); `RoutingProxy`
(`moescope proxy`) sits in front of a vLLM or SGLang server and records the routed experts of every
response, live (`moescope.ingest.proxy`). Both write through the one write pipeline into the tables
the probe writes. The names below are imported on first use: the proxy does not load the importers,
nor the importers the proxy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moescope.core.lazy import lazy_exports

# name -> the module that defines it
_EXPORTS = {
    "KINDS": "moescope.ingest.importers",
    "ImportSummary": "moescope.ingest.importers",
    "SourceFormatError": "moescope.ingest.importers",
    "import_files": "moescope.ingest.importers",
    "read_source": "moescope.ingest.importers",
    "ProxyLimits": "moescope.ingest.proxy",
    "RoutingProxy": "moescope.ingest.proxy",
    "RoutingRecorder": "moescope.ingest.proxy",
}

__all__ = ["KINDS", "ImportSummary", "ProxyLimits", "RoutingProxy", "RoutingRecorder", "SourceFormatError",
           "import_files", "read_source"]

if TYPE_CHECKING:
    from moescope.ingest.importers import KINDS, ImportSummary, SourceFormatError, import_files, read_source
    from moescope.ingest.proxy import ProxyLimits, RoutingProxy, RoutingRecorder
else:
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
