"""Bad files: detected, moved aside with the reason, listed; never deleted.

A Parquet file can be bad because it was copied in by hand half-way, written by a disk that
filled up, or damaged later (bit rot). Readers check every new file when they first list it: its
footer, then every page against the CRC-32 checksum the writer stored (a read through the file,
about as costly as one query over all its columns, once per file per reader). A file that still
makes a query fail is read through again, by DuckDB too. A bad file is moved to
`<root>/_quarantine/<table>/run_id=<id>/<name>` with a `<name>.reason.json` beside it, a warning
is logged with both paths, and the rest of the store stays queryable. On a full or read-only disk
a bad file that cannot be moved stays where it is, with a warning, and readers skip it. The user
decides what to do with what is in quarantine; nothing here deletes it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import warnings
from dataclasses import dataclass

import pyarrow.parquet as pq

from moescope.store.layout import QUARANTINE_DIR

log = logging.getLogger(__name__)
REASON_SUFFIX = ".reason.json"


class BadFileWarning(UserWarning):
    """A Parquet file in the store was unreadable and has been moved to quarantine."""


@dataclass(frozen=True)
class QuarantinedFile:
    path: str  # where it is now, under <root>/_quarantine
    original_path: str  # where it was
    reason: str
    moved_at: str  # ISO time, UTC


def deep_check(path: str) -> str | None:
    """Read a file through, every page checked against its checksum; the error text, or None if it reads.

    Each column of each row group must also read back as many rows as the footer says: the
    checksum covers a page's data, not its header, and a damaged value count in a header can make
    a reader return fewer values without an error. Pages written without a checksum (files from
    before checksums, other writers) are read but cannot be checked. Reads column by column in
    batches, so a wide row group is never held whole.
    """
    try:
        file = pq.ParquetFile(path, page_checksum_verification=True)
        for group in range(file.metadata.num_row_groups):
            expected = file.metadata.row_group(group).num_rows
            for column in file.schema_arrow.names:
                batches = file.iter_batches(batch_size=64 * 1024, row_groups=[group], columns=[column])
                rows = sum(batch.num_rows for batch in batches)
                if rows != expected:
                    return f"column {column!r} of row group {group} holds {rows} rows, its footer says {expected}"
    except FileNotFoundError:
        return None  # gone (compacted or pruned meanwhile): not bad, just not there
    except Exception as e:  # pyarrow raises several types for a damaged file
        return f"{type(e).__name__}: {e}"
    return None


def quarantine(root: str | os.PathLike, path: str, reason: str) -> str | None:
    """Move `path` into the quarantine folder; returns the new path, or None if it was not moved.

    Never raises for the disk: a file that vanished meanwhile is left alone (another reader moved
    it, or it was compacted away); one that cannot be moved (full or read-only disk) stays in place
    with a warning, and the caller skips it. A reason that cannot be saved beside a moved file is
    in the warning only; no partial reason file is left behind.
    """
    root = os.fspath(root)
    target = os.path.join(root, QUARANTINE_DIR, os.path.relpath(path, root))
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.exists(target):
            stem, ext = os.path.splitext(target)
            target = f"{stem}-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S%f}{ext}"
        os.replace(path, target)
    except OSError as e:
        if not os.path.exists(path):
            return None
        _warn(f"moescope store: unreadable file {path} could not be moved to quarantine ({e}); it stays "
              f"where it is and readers skip it ({reason}). Free space on the disk (or make the store writable) "
              f"and open the store again to move it.")
        return None
    moved_at = dt.datetime.now(dt.timezone.utc).isoformat()
    saved = _write_reason(target, {"original_path": path, "reason": reason, "moved_at": moved_at})
    _warn(f"moescope store: unreadable file {path} moved to {target} ({reason})"
          + ("" if saved is None else f"; the reason could not be saved beside it: {saved}"))
    return target


def _write_reason(target: str, reason: dict) -> OSError | None:
    """Write `<target>.reason.json` through a temporary name; the error, or None when it was written."""
    final = target + REASON_SUFFIX
    tmp = os.path.join(os.path.dirname(target), "." + os.path.basename(final) + ".inprogress")
    try:
        with open(tmp, "w") as f:
            json.dump(reason, f)
        os.replace(tmp, final)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        return e
    return None


def _warn(message: str) -> None:
    log.warning(message)
    warnings.warn(message, BadFileWarning, stacklevel=4)


def quarantined(root: str | os.PathLike) -> list[QuarantinedFile]:
    """Every file in the store's quarantine folder, with why and when it was moved there."""
    base = os.path.join(os.fspath(root), QUARANTINE_DIR)
    found = []
    for folder, _, names in os.walk(base):
        for name in sorted(names):
            if name.endswith(REASON_SUFFIX) or name.startswith("."):
                continue
            path = os.path.join(folder, name)
            try:
                with open(path + REASON_SUFFIX) as f:
                    info = json.load(f)
            except (OSError, ValueError):
                info = {"original_path": "", "reason": "unknown (not saved: the disk may have been full)",
                        "moved_at": ""}
            found.append(QuarantinedFile(path=path, original_path=info.get("original_path", ""),
                                         reason=info.get("reason", ""), moved_at=info.get("moved_at", "")))
    return sorted(found, key=lambda q: q.path)
