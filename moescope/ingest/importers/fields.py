"""What a value read from an engine's file must be, checked where it is read.

Every check raises SourceFormatError with one line: the file and the place in it, the field, what
was expected. Numbers are checked before they are narrowed to the store's column types, so an id
of 2**32 + 1 is refused instead of wrapping to expert 1, and a uint32 2**32 - 1 is refused instead
of becoming -1 ("not computed").
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any, NamedTuple

import numpy as np

from moescope.ingest.importers.source import SourceFormatError

# Experts per layer an import accepts unless told otherwise (--max-experts): the largest routed
# expert counts in use are in the hundreds; an id far above that is a corrupt or wrapped value,
# and loads, co-selection and what-if grow with the expert count.
MAX_EXPERTS = 65_536
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
LATEST_TIME = dt.datetime(9999, 12, 31, tzinfo=dt.timezone.utc).timestamp()


class ExpertLimit(NamedTuple):
    """Expert ids must be below `value`; `name` says where that bound came from, for messages."""

    value: int
    name: str

    @classmethod
    def of(cls, num_experts: int | None, max_experts: int = MAX_EXPERTS) -> ExpertLimit:
        if num_experts is not None:
            return cls(num_experts, f"--num-experts {num_experts}")
        return cls(max_experts, f"the --max-experts limit {max_experts}")


DEFAULT_LIMIT = ExpertLimit.of(None)


def check_max_experts(max_experts: int) -> int:
    """Return `max_experts` if it can bound expert ids (1 .. 2**31 - 1); raise ValueError otherwise."""
    if isinstance(max_experts, bool) or not isinstance(max_experts, int) or not 1 <= max_experts <= INT32_MAX:
        raise ValueError(f"--max-experts must be an integer in 1..{INT32_MAX}, not {max_experts!r}")
    return max_experts


def check_expert_ids(ids: np.ndarray, where: str, limit: ExpertLimit, axes: tuple[str, ...],
                     not_computed: bool, first_row: int = 0) -> np.ndarray:
    """`ids` as int64 once every id is in 0..limit-1 (or -1 where `not_computed` says the format
    marks a row not computed that way); raise SourceFormatError naming the first id that is not,
    its position (one name per axis, the first counted from `first_row`: a chunk of a longer
    array) and its value. Unsigned ids are compared as they are, so a large unsigned value never
    passes as -1."""
    if ids.dtype.kind not in "iu":
        raise SourceFormatError(f"{where}: expert ids must be integers, got {ids.dtype}")
    low = -1 if not_computed else 0
    bad = ids >= limit.value
    if ids.dtype.kind == "i":
        bad |= ids < low
    if bad.any():
        index = np.unravel_index(int(np.argmax(bad.reshape(-1))), ids.shape)
        position = ", ".join(f"{axis} {int(i) + (first_row if n == 0 else 0)}"
                             for n, (axis, i) in enumerate(zip(axes, index)))
        allowed = f"0..{limit.value - 1}" + (", or -1 for a row not computed" if not_computed else "")
        raise SourceFormatError(f"{where}: expert id {ids[index].item()} at {position} is outside {allowed} "
                                f"({limit.name}; check out_of_range): the id cannot be stored; the file is damaged, "
                                "written for another model, or holds physical (post-EPLB) ids")
    return ids.astype(np.int64, copy=False)


def json_int(value: Any, field: str, where: str, low: int = 0, high: int = INT64_MAX) -> int:
    """An integer field of a JSON record in low..high; raises SourceFormatError (bools, floats,
    strings and null are not integers)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SourceFormatError(f"{where}: {field} must be an integer in {low}..{high}, got {_show(value)}")
    return value


def json_object(value: Any, field: str, where: str) -> dict:
    """A JSON object field (absent or null: empty); raises SourceFormatError for anything else."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SourceFormatError(f"{where}: {field} must be an object, got {_show(value)}")
    return value


def json_time(value: Any, field: str, where: str) -> dt.datetime:
    """A Unix time in seconds (an integer or a finite number up to year 9999) as a UTC datetime."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0 <= value <= LATEST_TIME):
        raise SourceFormatError(f"{where}: {field} must be a Unix time in seconds (0..{int(LATEST_TIME)}), "
                                f"got {_show(value)}")
    return dt.datetime.fromtimestamp(float(value), dt.timezone.utc)


def json_token_ids(value: Any, field: str, where: str) -> np.ndarray | None:
    """A list of token ids (integers, 0..2**63-1) as int64, or None where the field is absent."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= INT64_MAX for v in value):
        first = next((v for v in value if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= INT64_MAX),
                     value) if isinstance(value, list) else value
        raise SourceFormatError(f"{where}: {field} must be a list of integer token ids in 0..{INT64_MAX}, "
                                f"got {_show(first)}")
    return np.asarray(value, dtype=np.int64)


def check_step_numbers(step: int, rank: int, layers: list[int], where: str) -> None:
    """Step, rank and layer numbers fit the store's columns (int64 steps, int32 ranks and layers)."""
    for name, value, low, high in (("step", step, INT64_MIN, INT64_MAX), ("rank", rank, 0, INT32_MAX),
                                   *(("layer", layer, 0, INT32_MAX) for layer in layers)):
        if not low <= value <= high:
            raise SourceFormatError(f"{where}: {name} {value} is outside {low}..{high}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
