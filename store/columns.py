"""Arrow arrays from Python values and numpy arrays, built from buffers: the store's write path never imports pandas.

`pa.array`, `pa.scalar` and `pa.Table.from_pylist` ask pandas whether their input is a pandas
object, and the first such call in a process imports pandas: 0.16-0.18 s of CPU on a quiet 2-core
machine, about 0.5 s on a loaded one, most of a first `moescope.attach`'s CPU, paid under the
interpreter lock of the model's process (docs/benchmarks.md, "Off the model's interpreter").
The probe's tables are built here instead (`pa.Array.from_buffers`), so a process that records
never loads pandas for the store; the arrays equal those `pa.array` gives for the same values
(tests/unit/store/test_columns.py checks every schema's types against it).

The types are the store's (`moescope.store.schema.SCHEMAS`): booleans, 32- and 64-bit integers,
32- and 64-bit floats, strings, UTC timestamps (from `datetime`s), lists of those and maps of
string keys. None is null at any level; NaN stays NaN.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["array", "repeat", "rows_table"]

_NUMPY = {pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64,
          pa.float32(): np.float32, pa.float64(): np.float64}
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_MICROSECOND = dt.timedelta(microseconds=1)


def _validity(missing: np.ndarray) -> pa.Buffer | None:
    """The validity bitmap of a column whose nulls are `missing` (None where none is)."""
    return pa.py_buffer(np.packbits(~missing, bitorder="little")) if missing.any() else None


def _micros(value: dt.datetime) -> int:
    # pyarrow reads a naive datetime as UTC wall time, an aware one in its own zone
    value = value if value.tzinfo is not None else value.replace(tzinfo=dt.timezone.utc)
    return (value - _EPOCH) // _MICROSECOND


def array(values: Sequence[Any] | np.ndarray, type_: pa.DataType, mask: np.ndarray | None = None) -> pa.Array:
    """An Arrow array of `type_` holding `values`, as `pa.array(values, type_, mask=mask)` gives it, without pandas.

    Args:
        values: Python values (None for a null) or a 1-d numpy array of a numeric or boolean type.
        type_: one of the store's types (module docstring).
        mask: with a numpy array, True where a row is null (default None: none is).

    Returns:
        The array.

    Raises:
        TypeError: for a type the store does not use (build it with `pa.array`).
    """
    n = len(values)
    if isinstance(values, np.ndarray):  # cast as pa.array(values, type_) would
        validity = None if mask is None else _validity(np.asarray(mask, dtype=bool))
        if pa.types.is_boolean(type_):
            bits = np.packbits(values.astype(bool), bitorder="little")
            return pa.Array.from_buffers(type_, n, [validity, pa.py_buffer(bits)])
        if type_ in _NUMPY:
            data = np.ascontiguousarray(values, dtype=_NUMPY[type_])
            return pa.Array.from_buffers(type_, n, [validity, pa.py_buffer(data)])
        if mask is not None:
            raise TypeError(f"moescope.store.columns takes a mask with a numeric array only, not for {type_}")
        values = values.tolist()
    missing = np.fromiter((v is None for v in values), dtype=bool, count=n)
    validity = _validity(missing)
    if type_ in _NUMPY:
        data = np.array([0 if v is None else v for v in values], dtype=_NUMPY[type_])
        return pa.Array.from_buffers(type_, n, [validity, pa.py_buffer(data)])
    if pa.types.is_boolean(type_):
        bits = np.packbits(np.fromiter((bool(v) for v in values), dtype=bool, count=n), bitorder="little")
        return pa.Array.from_buffers(type_, n, [validity, pa.py_buffer(bits)])
    if pa.types.is_string(type_):
        encoded = [b"" if v is None else v.encode() for v in values]
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(np.fromiter(map(len, encoded), dtype=np.int32, count=n), out=offsets[1:])
        return pa.Array.from_buffers(type_, n, [validity, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))])
    if pa.types.is_timestamp(type_) and type_.unit == "us":
        data = np.array([0 if v is None else _micros(v) for v in values], dtype=np.int64)
        return pa.Array.from_buffers(type_, n, [validity, pa.py_buffer(data)])
    if pa.types.is_list(type_) or pa.types.is_map(type_):
        items = [() if v is None else (v.items() if isinstance(v, Mapping) else v) for v in values]
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(np.fromiter(map(len, items), dtype=np.int32, count=n), out=offsets[1:])
        flat = [item for entry in items for item in entry]
        if pa.types.is_list(type_):
            child = array(flat, type_.value_type)
        else:
            keys = array([key for key, _ in flat], type_.key_type)
            child = pa.StructArray.from_arrays([keys, array([item for _, item in flat], type_.item_type)],
                                               fields=[type_.key_field, type_.item_field])
        return pa.Array.from_buffers(type_, n, [validity, pa.py_buffer(offsets)], children=[child])
    raise TypeError(f"moescope.store.columns builds no {type_} array: build it with pa.array")


def repeat(value: Any, n: int, type_: pa.DataType) -> pa.Array:
    """`value` `n` times, as `pa.repeat(pa.scalar(value, type_), n)` gives it, without pandas.

    Raises:
        TypeError: as `array`.
    """
    return array([value], type_).take(pa.Array.from_buffers(pa.int32(), n, [None, pa.py_buffer(
        np.zeros(n, dtype=np.int32))]))


def rows_table(rows: Sequence[Mapping[str, Any]], schema: pa.Schema) -> pa.Table:
    """A table of `schema` from rows (dicts; a missing key is null), as `pa.Table.from_pylist` gives it,
    without pandas.

    Raises:
        TypeError: for a field of a type `array` does not build.
    """
    return pa.Table.from_arrays([array([row.get(field.name) for row in rows], field.type) for field in schema],
                                schema=schema)
