"""Where files live in a store, what they are called, and which of them are live.

    <root>/<table>/run_id=<id>/part-<rank>-<pid>-<seq>-<ns>.parquet     written by a probe
    <root>/<table>/run_id=<id>/part-compacted-<ns>-<uuid>.parquet      written by `compact`
    <root>/<table>/run_id=<id>/.tmp-<name>.inprogress                   a write in flight
    <root>/_quarantine/<table>/run_id=<id>/<name>                       a file moved aside as bad

Every file appears under its final name by one `os.replace`, so a name matching `part-*.parquet`
is always a complete file. A compacted file carries, in its Parquet footer (key-value metadata
`moescope.replaces`), the names of the files it replaces; from the instant it appears under its
final name, readers leave those files out, so a row is seen exactly once whether the sources are
still there or already deleted. This is the one rule that makes compaction safe under readers.
"""

from __future__ import annotations

import glob
import json
import os
import time
import uuid

TMP_PREFIX = ".tmp-"
# A temporary name does not end in .parquet either, so no engine's `*.parquet` glob reads a write in flight.
TMP_SUFFIX = ".inprogress"
QUARANTINE_DIR = "_quarantine"
REPLACES_KEY = b"moescope.replaces"
COMPACTED_PREFIX = "part-compacted-"

# Parquet writer settings per column kind. Dictionary encoding only where values repeat within a
# row group (ids, constants, tags, expert ids): on high-cardinality columns (token ids, gate
# weights) it costs a third of the write time and saves nothing. Gate weights are split by byte
# stream, which zstd compresses better and faster than plain floats.
DICTIONARY_COLUMNS = ["run_id", "tags", "step", "layer", "sequence", "position", "rank", "expert_ids", "table_name",
                      "reason", "module", "family", "model_class", "top1_expert", "ts"]
COMPRESSION = "zstd"
COLUMN_ENCODING = {"gate_weights": "BYTE_STREAM_SPLIT"}

# A writer's part holds up to 256 Ki rows per table (or one flush interval, whichever comes
# first) in row groups of 128 Ki rows: small enough that a crash loses at most one flush interval,
# large enough that a run does not become thousands of files per hour. `compact` merges them into
# files of up to 8 Mi rows (about 100 MB of routes) in row groups of 256 Ki rows sorted by
# (layer, step): a one-layer query reads one row group in eight, and two cores still get several
# row groups each to scan in parallel.
WRITER_ROW_GROUP_ROWS = 128 * 1024
COMPACT_FILE_ROWS = 8 * 1024 * 1024
COMPACT_ROW_GROUP_ROWS = 256 * 1024


def run_folder(root: str | os.PathLike, table: str, run_id: str) -> str:
    return os.path.join(os.fspath(root), table, f"run_id={run_id}")


def part_name(rank: int, seq: int) -> str:
    """A file name no other writer can choose: rank, pid, sequence and the clock's nanoseconds."""
    return f"part-{rank:05d}-{os.getpid()}-{seq:06d}-{time.time_ns() % 10**12:012d}.parquet"


def tmp_path(final: str) -> str:
    """The temporary name a file is written under before its rename to `final`."""
    return os.path.join(os.path.dirname(final), TMP_PREFIX + os.path.basename(final) + TMP_SUFFIX)


def compacted_name() -> str:
    return f"{COMPACTED_PREFIX}{time.time_ns()}-{uuid.uuid4().hex[:8]}.parquet"


def run_id_of(path: str) -> str:
    folder = os.path.basename(os.path.dirname(path))
    return folder[len("run_id="):] if folder.startswith("run_id=") else ""


def list_parts(root: str | os.PathLike, table: str, run_id: str | None = None) -> list[str]:
    """Complete Parquet files of a table, live or replaced (writes in flight are not matched)."""
    folder = f"run_id={glob.escape(run_id)}" if run_id is not None else "run_id=*"
    return sorted(glob.glob(os.path.join(glob.escape(os.fspath(root)), table, folder, "part-*.parquet")))


def list_runs(root: str | os.PathLike, table: str) -> list[str]:
    base = os.path.join(os.fspath(root), table)
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    return sorted(n[len("run_id="):] for n in names if n.startswith("run_id="))


def encode_replaces(names: list[str]) -> dict[bytes, bytes]:
    return {REPLACES_KEY: json.dumps(sorted(names)).encode()}


def decode_replaces(metadata: dict[bytes, bytes] | None) -> list[str]:
    if not metadata or REPLACES_KEY not in metadata:
        return []
    return list(json.loads(metadata[REPLACES_KEY]))


def tmp_files(root: str | os.PathLike) -> list[str]:
    """Temporary files of writes in flight, or left behind by a process that crashed."""
    return sorted(glob.glob(os.path.join(glob.escape(os.fspath(root)), "*", "run_id=*", TMP_PREFIX + "*")))


def clean_tmp(root: str | os.PathLike, older_than_s: float = 900.0) -> list[str]:
    """Delete temporary files older than `older_than_s`; returns their paths.

    Readers never match temporary names, so this is housekeeping, not a correctness step. The age
    bound keeps a write still in flight (a slow disk, a large flush) from being pulled away.
    """
    removed = []
    now = time.time()
    for path in tmp_files(root):
        try:
            if now - os.stat(path).st_mtime >= older_than_s:
                os.remove(path)
                removed.append(path)
        except FileNotFoundError:
            pass
    return removed
