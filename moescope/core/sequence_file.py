"""JSON Lines of per-sequence values that a user hands a command beside a store (`moescope mismatch
--logprobs FILE`, `--token-ids FILE`): one object a line, keyed by "step", "rank" (optional, 0) and
"sequence" (optional, 0). One reader, so every such file names a bad line the same way."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["read_sequence_file"]

T = TypeVar("T")


def read_sequence_file(path: str, option: str, shape: str,
                       value_of: Callable[[dict[str, Any]], T]) -> dict[tuple[int, int, int], T]:
    """{(step, rank, sequence): value_of(line's object)} from the file at `path`, blank lines skipped.

    `option` (e.g. "--logprobs") and `shape` (the object a line holds, e.g. '{"step": S, ...}') are
    for the messages. Raises ValueError naming the file and line for a line that is not such an
    object (value_of raising ValueError, KeyError, TypeError or AttributeError) and for a key given
    twice, and naming the option for a file that cannot be read."""
    out: dict[tuple[int, int, int], T] = {}
    try:
        with open(path, encoding="utf-8") as fh:
            lines = list(fh)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {option} {path!r}: {e}") from e
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            key = (int(record["step"]), int(record.get("rank", 0)), int(record.get("sequence", 0)))
            value = value_of(record)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}:{number}: expected {shape} ({type(e).__name__}: {e})") from e
        if key in out:
            raise ValueError(f"{path}:{number}: step {key[0]} sequence {key[2]} is given twice")
        out[key] = value
    return out
