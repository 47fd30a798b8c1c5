"""Manual trust-gate requests from the dashboard: written into the store, applied by the model.

The dashboard runs in another process than the model, so it cannot call `TrustGate.set`. A
request is one row appended to the store's `trust_gate_requests` table, written atomically like
every other table, by the run's writer in this process (`store.writer.run_writer`, through its
pipeline); the model-side policy reads new requests through the store's query
(`Store.gate_requests`) and applies each once, through its API:
action "override" is `TrustPolicy.override(layer, expert, weight, reason)` (pin the weight),
action "release" is `TrustPolicy.release(layer, expert, reason)` (weight back to 1, the policy
judges the expert again). The gate records the change in `trust_gate_events`, which the Expert
health page shows, so the loop is closed in the store. Only a dashboard started with
`--allow-writes` writes anything.

Row format (`REQUESTS_SCHEMA`): request_id (uuid4 hex, lets the reader apply each once),
run_id, requested_at (UTC), layer, expert, action ("override" or "release"), weight in [0, 1]
(0 masks the expert; 1.0 for a release), reason (free text from the operator), requested_by
("dashboard@<host>").
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import uuid

from moescope.dashboard.settings import location_of
from moescope.store.location import StoreLocation
from moescope.store.schema import SCHEMAS
from moescope.store.writer import run_writer

REQUESTS_TABLE = "trust_gate_requests"
REQUESTS_SCHEMA = SCHEMAS[REQUESTS_TABLE]
ACTIONS = ("override", "release")


class GateRequestError(ValueError):
    """A gate request that cannot be written; the message says what to change."""


def write_request(root: str | os.PathLike | StoreLocation, run_id: str, layer: int, expert: int, weight: float,
                  reason: str, action: str = "override") -> dict:
    """Append one trust-gate request to the store (`root`: a page's `ctx.root`, a folder or a URL,
    reached with the dashboard's storage options); returns the row written.

    Raises GateRequestError for an unknown action, a weight outside [0, 1], a negative layer or
    expert, or an empty reason (every change of the gate must say why)."""
    if action not in ACTIONS:
        raise GateRequestError(f"action is one of {ACTIONS}, got {action!r}")
    if action == "release":
        weight = 1.0
    if not 0.0 <= float(weight) <= 1.0:
        raise GateRequestError(f"a trust weight lies in [0, 1] (0 masks the expert), got {weight}")
    if int(layer) < 0 or int(expert) < 0:
        raise GateRequestError("layer and expert are 0-based indices")
    if not reason.strip():
        raise GateRequestError("say why the expert's weight changes: the reason is kept with the change")
    row = {"request_id": uuid.uuid4().hex, "run_id": run_id, "requested_at": dt.datetime.now(dt.timezone.utc),
           "layer": int(layer), "expert": int(expert), "action": action, "weight": float(weight),
           "reason": reason.strip()[:500], "requested_by": f"dashboard@{socket.gethostname()}"}
    location = location_of(root)
    with run_writer(location, run_id) as writer:
        # The operator waits for the answer: the row is on disk (or refused) when this returns.
        before = writer.written_rows[REQUESTS_TABLE]
        writer.emit(REQUESTS_TABLE, [row])
        if not writer.flush() or writer.written_rows[REQUESTS_TABLE] == before:
            raise GateRequestError(f"the request could not be written to {location.redacted!r} "
                                   f"({writer.last_error or 'is the disk full?'}); nothing was changed")
    return row
