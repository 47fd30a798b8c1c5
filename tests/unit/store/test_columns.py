"""store.columns builds the arrays pyarrow's own conversion (`pa.Table.from_pylist`, `pa.array`) builds, for
every table of the store, from random rows with nulls at every level, NaN, non-ASCII text and empty lists."""

from __future__ import annotations

import datetime as dt
import random

import numpy as np
import pyarrow as pa
import pytest

from moescope.store import columns
from moescope.store.schema import SCHEMAS


def _value(rng: random.Random, type_: pa.DataType, depth: int = 0):
    if rng.random() < 0.15:
        return None
    if pa.types.is_boolean(type_):
        return rng.random() < 0.5
    if pa.types.is_integer(type_):
        bits = type_.bit_width - 1
        return rng.choice([0, -1, 2 ** bits - 1, -(2 ** bits), rng.randrange(-1000, 1000)])
    if pa.types.is_floating(type_):
        return rng.choice([0.0, -1.5, float("nan"), float("inf"), rng.uniform(-1e6, 1e6), 1e-40])
    if pa.types.is_string(type_):
        return rng.choice(["", "layer.0.mlp", "héé ✓", "a" * rng.randrange(0, 40)])
    if pa.types.is_timestamp(type_):
        when = dt.datetime(2026, 12, 7, 20, 0, tzinfo=dt.timezone.utc) + dt.timedelta(
            microseconds=rng.randrange(-10 ** 12, 10 ** 12))
        return rng.choice([when, when.replace(tzinfo=None), when.astimezone(dt.timezone(dt.timedelta(hours=-5)))])
    if pa.types.is_list(type_):
        return [_value(rng, type_.value_type, depth + 1) for _ in range(rng.randrange(0, 5))]
    if pa.types.is_map(type_):
        return [(f"k{i}", _value(rng, type_.item_type, depth + 1)) for i in range(rng.randrange(0, 4))]
    raise AssertionError(f"no generator for {type_}")


def _nan_free(value):
    """`value` with NaN as a string, so that == compares it (NaN != NaN)."""
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, (list, tuple)):
        return type(value)(_nan_free(v) for v in value)
    return value


@pytest.mark.parametrize("table", sorted(SCHEMAS))
def test_rows_table_equals_pyarrows_conversion(table: str) -> None:
    rng = random.Random(table)
    schema = SCHEMAS[table]
    for n in (0, 1, 7):
        rows = [{f.name: _value(rng, f.type) for f in schema if rng.random() < 0.95} for _ in range(n)]
        built = columns.rows_table(rows, schema)
        built.validate(full=True)
        expected = pa.Table.from_pylist(rows, schema=schema)
        assert built.schema == expected.schema
        for name in schema.names:  # column by column, so that a failure names the column
            assert _nan_free(built.column(name).to_pylist()) == _nan_free(expected.column(name).to_pylist()), (
                table, name, rows)
            assert built.column(name).null_count == expected.column(name).null_count


@pytest.mark.parametrize("type_", [pa.int32(), pa.int64(), pa.float32(), pa.float64(), pa.bool_()])
def test_numpy_arrays_are_cast_as_pa_array_casts_them(type_: pa.DataType) -> None:
    values = np.array([0, 1, 3, 2, 1], dtype=np.int64)
    assert columns.array(values, type_).equals(pa.array(values, type_))
    assert columns.array(values[::2], type_).equals(pa.array(values[::2], type_))  # strided


def test_repeat_equals_pyarrows() -> None:
    tags = pa.map_(pa.string(), pa.string())
    for value, type_ in (([("split", "train"), ("é", "")], tags), ([], tags), (None, pa.string()), (7, pa.int64())):
        for n in (0, 1, 5):
            # pa.repeat of a map scalar refuses n=0 ("Must pass at least one array"); columns.repeat gives no rows
            expected = pa.repeat(pa.scalar(value, type=type_), n) if n else pa.array([], type_)
            assert columns.repeat(value, n, type_).equals(expected)


def test_an_unsupported_type_says_what_to_do() -> None:
    with pytest.raises(TypeError, match="pa.array"):
        columns.array([1], pa.decimal128(10, 2))


def test_a_mask_makes_nulls_as_pa_arrays_mask_does() -> None:
    values = np.array([1.5, np.nan, 3.0, 4.0], dtype=np.float64)
    mask = np.isnan(values)
    assert columns.array(values, pa.float64(), mask=mask).equals(pa.array(values, pa.float64(), mask=mask))
    kept = np.array([True, False, True, True])
    assert columns.array(kept, pa.bool_(), mask=~kept).equals(pa.array(kept, pa.bool_(), mask=~kept))
