"""Where files live in a store, what they are called, and how they are written.

    <store>/<table>/_delta_log/                                              the table's Delta log
    <store>/<table>/run_id=<id>/part-<rank>-<host>-<pid>-<seq>-<ns>.parquet  written by a run's writer
    <store>/<table>/run_id=<id>/part-compacted-<ns>-<uuid>.parquet           written by `compact`
    <store>/_quarantine/<table>/run_id=<id>/<name>                           a file moved aside as bad

Each table is a Delta Lake table (`moescope.store.delta`): which files are live is what its log says, never
a folder listing. A file is written whole under its final name and then committed; a file no
commit added (a crashed writer's) is invisible and `vacuum` deletes it. This module owns the names
(a run id or table that may be part of a path, part names) and the Parquet settings every writer
uses. The previous release's layout (temporary names renamed into place, compaction footers) is
known only to `moescope.store.upgrade`, which converts such a store.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence

QUARANTINE_DIR = "_quarantine"

# Parquet writer settings per column kind. Dictionary encoding only where values repeat within a
# row group (ids, constants, expert ids): on high-cardinality columns (token ids, gate
# weights) it costs a third of the write time and saves nothing. Gate weights are split by byte
# stream, which zstd compresses better than plain floats; token numbers and token ids are delta
# encoded (as small as plain + zstd, in half the time). Parquet settings name a column's leaves:
# a list's is `<name>.list.element` (NESTED_LEAVES); a setting given the top-level name of a nested
# column does nothing. Tags (a map) stay plain: their repeated strings compress as well under zstd,
# and a dictionary on the key and value leaves costs more time than it saves.
DICTIONARY_COLUMNS = ["run_id", "step", "layer", "sequence", "position", "rank", "expert_ids", "table_name",
                      "reason", "module", "family", "model_class", "top1_expert", "ts"]
COMPRESSION = "zstd"
COLUMN_ENCODING = {"gate_weights": "BYTE_STREAM_SPLIT", "token": "DELTA_BINARY_PACKED",
                   "token_id": "DELTA_BINARY_PACKED"}
# Nested columns of the store's schemas that a setting above names, and the leaf it applies to.
NESTED_LEAVES = {"expert_ids": "expert_ids.list.element", "gate_weights": "gate_weights.list.element"}

# A writer's part holds up to 256 Ki rows per table (or one flush interval, whichever comes
# first) in row groups of 128 Ki rows: small enough that a crash loses at most one flush interval,
# large enough that a run does not become thousands of files per hour. `compact` merges them into
# files of up to 8 Mi rows (about 100 MB of routes) in row groups of 256 Ki rows sorted by
# (layer, step): a one-layer query reads one row group in eight, and two cores still get several
# row groups each to scan in parallel.
WRITER_ROW_GROUP_ROWS = 128 * 1024
COMPACT_FILE_ROWS = 8 * 1024 * 1024
COMPACT_ROW_GROUP_ROWS = 256 * 1024
# A row group is also cut at this size, so wide rows (router inputs of a large model) do not make
# a merge hold gigabytes in memory.
COMPACT_ROW_GROUP_BYTES = 128 * 1024 * 1024


def parquet_options(columns: Sequence[str]) -> dict:
    """Settings of `pyarrow.parquet` writers for a file with these columns (the writer's and compaction's).

    Every page carries a CRC-32 checksum, which readers verify (`moescope.store.quarantine.deep_check`): a
    flipped bit makes a file fail its check and go to quarantine instead of reading as other numbers.

    Min/max statistics are written for the top-level columns only: Parquet settings name leaves, and
    a nested column's leaves (`tags.key_value.key`, `expert_ids.list.element`) are not among these
    names. Nobody reads those: a file's Delta stats (`moescope.store.delta.file_stats`) cover top-level
    columns, and DuckDB prunes row groups on them too (not on list items or map entries); writing
    them took an eighth of a routes file's encoding time.
    """
    return dict(compression=COMPRESSION,
                use_dictionary=[NESTED_LEAVES.get(c, c) for c in DICTIONARY_COLUMNS if c in columns],
                column_encoding={NESTED_LEAVES.get(c, c): e for c, e in COLUMN_ENCODING.items() if c in columns},
                write_statistics=list(columns), write_page_index=False, write_page_checksum=True)


# Names that become parts of a path: a table, a run id. A run id can come from a data file (the
# alerts runner reads it from `layer_steps`) or a table's log (another hand may have written it), so
# it is never trusted: no separator, no `..`, no leading dot (hidden files), no `=` (hive
# partitioning), nothing a shell must quote. Names read from a store meet the same rule where a
# snapshot is read (`stored_name_problem`, in `moescope.store.delta.snapshot`).
NAME_FORM = "1 to 128 characters of A-Za-z0-9 . _ -, not starting with a dot"
_NAME = re.compile(r"(?!\.)[A-Za-z0-9._-]{1,128}")
# A table is a folder beside the store's own (`_quarantine`, `_locks`, `_trash`), which start with `_`.
TABLE_FORM = "1 to 64 characters of A-Za-z0-9 _ -, starting with a letter or digit"
_TABLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_PART = re.compile(r"part-[A-Za-z0-9_-][A-Za-z0-9._-]{0,200}\.parquet")


class InvalidNameError(ValueError):
    """A run id, table, rank or file name that cannot be used in a store path; says the allowed form."""


class InvalidNameWarning(UserWarning):
    """A file a store's log names was left out: a name in it (a run id, its path) fails the rule of
    `check_name`, so no command reads, moves or rewrites it (`moescope.store.delta.snapshot`)."""


def is_valid_name(value: object, kind: str = "run_id") -> bool:
    """Whether `value` may be a run id (kind "run_id") or a table name (kind "table") in a path."""
    pattern = _TABLE if kind == "table" else _NAME
    return isinstance(value, str) and pattern.fullmatch(value) is not None


def check_name(kind: str, value: object) -> str:
    """`value` if it may be a `kind` ("table" or "run_id") in a path; raises InvalidNameError otherwise."""
    if not is_valid_name(value, kind):
        form, example = (TABLE_FORM, "routes") if kind == "table" else (NAME_FORM, "20250101T120000-ab12cd34")
        raise InvalidNameError(f"{kind} {value!r} cannot be used in a store path: use {form} (e.g. {example})")
    return value  # type: ignore[return-value]


def check_rank(rank: object) -> int:
    """`rank` if it is a non-negative int; raises InvalidNameError otherwise."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise InvalidNameError(f"rank {rank!r} cannot be used in a file name: use a non-negative int")
    return rank


def check_part_name(name: object) -> str:
    """`name` if it is a part file's base name (`part-....parquet`); raises InvalidNameError otherwise."""
    if not isinstance(name, str) or _PART.fullmatch(name) is None:
        raise InvalidNameError(f"file name {name!r} is not a part of the store: use part-<letters, digits, "
                               f". _ ->.parquet, with no folder")
    return name


def stored_name_problem(run_id: object, path: object) -> str | None:
    """Why a data file a table's log names may not be used, or None when it may: the rule for names
    read from a store (the log's partition value `run_id` and its `path`, relative to the table) is
    the rule for names a user gives. The run id must be a valid run id (`check_name`), and the path
    exactly `run_id=<that run id>/<a part name>` (`check_part_name`): a store written by another
    hand may hold `..`, a separator, an absolute path or a NUL in either, and no path is built from
    such a value."""
    if run_id is None or run_id == "":
        return "it has no run id (its partition value is empty or null)"
    if not is_valid_name(run_id):
        return f"its run id {shown_name(run_id)} cannot be used in a store path ({NAME_FORM})"
    if not isinstance(path, str) or "/" not in path:
        return f"its path {shown_name(path)} is not run_id=<run id>/<file>"
    folder, name = path.split("/", 1)
    if folder != f"run_id={run_id}":
        return f"its path {shown_name(path)} is not in the folder of its run id {run_id!r}"
    if _PART.fullmatch(name) is None:
        return f"its path {shown_name(path)} does not end in a part file's name (part-<letters, digits, . _ ->.parquet)"
    return None


def shown_name(value: object, limit: int = 120) -> str:
    """`value` as a message shows a name read from a store: repr (a NUL or a newline stays visible),
    cut at `limit` characters with its length said."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(value) if isinstance(value, str) else len(text)} characters)"


def part_name(rank: int, seq: int, host: str) -> str:
    """A file name no other writer can choose: `part-<rank>-<host>-<pid>-<seq>-<ns>.parquet` (rank,
    host in `host_name_part` form, pid, the process's sequence and the clock's nanoseconds). The
    host may hold `-`: read the fields from the ends (rank first; pid, seq, ns last)."""
    return (f"part-{check_rank(rank):05d}-{host_name_part(host)}-{os.getpid()}-{seq:06d}-"
            f"{time.time_ns() % 10**12:012d}.parquet")


def host_name_part(host: str) -> str:
    """`host` as part of a file name: letters, digits, `.` and `-` kept, anything else `_`, at most
    63 characters, never empty."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", host)[:63].strip(".") or "host"
