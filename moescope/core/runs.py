"""Run ids, and the host a row records.

`new_run_id` is the one generator of run ids (the probe's sessions, the proxy, the importers, the
jitter check); `current_host` the one source of the host a row records (the probe's `runs` row, a
writer's `probe_stats` and part names, the importers'). Standard library only.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import uuid

__all__ = ["current_host", "new_run_id"]


def new_run_id(source: str | None = None) -> str:
    """A fresh run id: UTC time to the second, the source where one is given, and a random suffix.

    Args:
        source: what produced the run (an importer's engine, "proxy"), or None.

    Returns:
        e.g. `20250101T120000-ab12cd34`, or `20250101T120000-vllm-ab12cd34` with a source.
    """
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{source}-{uuid.uuid4().hex[:8]}" if source else f"{stamp}-{uuid.uuid4().hex[:8]}"


def current_host() -> str:
    """The host this process records in `runs` and `probe_stats`.

    Returns:
        MOESCOPE_HOST where set (a fleet names its hosts itself, e.g. a pod name, or several
        writers of one machine stand for hosts in a test), else the machine's hostname
        ("unknown" when it has none).
    """
    return os.environ.get("MOESCOPE_HOST", "").strip() or socket.gethostname() or "unknown"
