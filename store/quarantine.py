"""Bad files: detected, moved aside with the reason, listed; never deleted.

A Parquet file can be bad because it was copied in by hand half-way, written by a disk that
filled up, or damaged later. Readers check every new file's footer (cheap) when they list files,
and read a file through (expensive) only when a query over it failed. A bad file is moved to
`<root>/_quarantine/<table>/run_id=<id>/<name>` with a `<name>.reason.json` beside it, a warning
is logged with both paths, and the rest of the store stays queryable. The user decides what to do
with what is in quarantine; nothing here deletes it.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import warnings
from dataclasses import dataclass

import pyarrow.parquet as pq

from store.layout import QUARANTINE_DIR

log = logging.getLogger(__name__)


class BadFileWarning(UserWarning):
    """A Parquet file in the store was unreadable and has been moved to quarantine."""


@dataclass(frozen=True)
class QuarantinedFile:
    path: str  # where it is now, under <root>/_quarantine
    original_path: str  # where it was
    reason: str
    moved_at: str  # ISO time, UTC


def deep_check(path: str) -> str | None:
    """Read a file through (every row group, every column); the error text, or None if it reads."""
    try:
        file = pq.ParquetFile(path)
        for index in range(file.num_row_groups):
            file.read_row_group(index)
    except FileNotFoundError:
        return None  # gone (compacted or pruned meanwhile): not bad, just not there
    except Exception as e:  # pyarrow raises several types for a damaged file
        return f"{type(e).__name__}: {e}"
    return None


def quarantine(root: str | os.PathLike, path: str, reason: str) -> str | None:
    """Move `path` into the quarantine folder; returns the new path, None if it had vanished."""
    root = os.fspath(root)
    relative = os.path.relpath(path, root)
    target = os.path.join(root, QUARANTINE_DIR, relative)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.exists(target):
        stem, ext = os.path.splitext(target)
        target = f"{stem}-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S%f}{ext}"
    try:
        os.replace(path, target)
    except FileNotFoundError:
        return None  # another reader moved it first, or it was compacted away
    moved_at = dt.datetime.now(dt.timezone.utc).isoformat()
    with open(target + ".reason.json", "w") as f:
        json.dump({"original_path": path, "reason": reason, "moved_at": moved_at}, f)
    message = f"moescope store: unreadable file {path} moved to {target} ({reason})"
    log.warning(message)
    warnings.warn(message, BadFileWarning, stacklevel=3)
    return target


def quarantined(root: str | os.PathLike) -> list[QuarantinedFile]:
    """Every file in the store's quarantine folder, with why and when it was moved there."""
    base = os.path.join(os.fspath(root), QUARANTINE_DIR)
    found = []
    for folder, _, names in os.walk(base):
        for name in sorted(names):
            if name.endswith(".reason.json"):
                continue
            path = os.path.join(folder, name)
            try:
                with open(path + ".reason.json") as f:
                    info = json.load(f)
            except (OSError, ValueError):
                info = {"original_path": "", "reason": "unknown", "moved_at": ""}
            found.append(QuarantinedFile(path=path, original_path=info.get("original_path", ""),
                                         reason=info.get("reason", ""), moved_at=info.get("moved_at", "")))
    return sorted(found, key=lambda q: q.path)
