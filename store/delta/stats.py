"""A data file's Delta stats (numRecords, and per top-level primitive column its nullCount and
minValues / maxValues), what Delta readers prune on: from a Parquet footer when the file is written,
or rebuilt from the log's add actions when a snapshot is read.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["file_stats", "stat_value", "stats_of"]

# Columns whose min/max go into a file's stats (what Delta readers prune on). Floats are left out:
# Parquet's statistics skip NaN, which Spark orders above every number, so a min/max without it
# could prune a file that holds a matching NaN.
_STATS_TYPES = (pa.types.is_integer, pa.types.is_string, pa.types.is_large_string, pa.types.is_timestamp,
                pa.types.is_date)


def file_stats(footer: pq.FileMetaData) -> str:
    """The Delta stats of a Parquet file from its footer.

    Returns:
        JSON: numRecords, and per top-level primitive column its nullCount and (ints, strings,
        timestamps, dates) minValues / maxValues. A column whose statistics are missing in a row
        group is left out; one whose values lack bounds has no min/max.
    """
    schema = footer.schema.to_arrow_schema()
    index: dict[str, int] = {}
    if footer.num_row_groups:
        group = footer.row_group(0)
        index = {group.column(i).path_in_schema: i for i in range(group.num_columns)}
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for field in schema:
        if pa.types.is_nested(field.type) or field.name not in index:
            continue
        i = index[field.name]
        with_min_max = any(check(field.type) for check in _STATS_TYPES)
        low = high = None
        null_count = 0
        for g in range(footer.num_row_groups):
            st = footer.row_group(g).column(i).statistics
            if st is None or not st.has_null_count:
                null_count = -1
                break
            null_count += st.null_count
            if not with_min_max:
                continue
            if not st.has_min_max:
                if st.null_count < footer.row_group(g).num_rows:  # values without bounds: no min/max at all
                    with_min_max = False
                continue
            # a timestamp's bounds from their raw integers: pyarrow's own conversion of them (st.min) imports
            # pandas, most of a first attach's CPU in a process that records (store/columns.py)
            raw = pa.types.is_timestamp(field.type) and st.physical_type == "INT64"
            st_min, st_max = (_instant(st.min_raw, field.type.unit, floor=True),
                              _instant(st.max_raw, field.type.unit, floor=False)) if raw else (st.min, st.max)
            low = st_min if low is None else min(low, st_min)
            high = st_max if high is None else max(high, st_max)
        if null_count < 0:
            continue
        nulls[field.name] = null_count
        if with_min_max and low is not None:
            mins[field.name], maxs[field.name] = stat_value(low, floor=True), stat_value(high, floor=False)
    return json.dumps({"numRecords": footer.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls},
                      separators=(",", ":"))


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_TO_MICROSECONDS = {"s": (1_000_000, 1), "ms": (1000, 1), "us": (1, 1), "ns": (1, 1000)}  # (times, divided by)


def _instant(raw: int, unit: str, floor: bool) -> dt.datetime:
    """A timestamp statistic's raw integer as a UTC datetime, to the microsecond (rounded down for a
    minimum, up for a maximum, so that the bound still holds every row)."""
    times, per = _TO_MICROSECONDS[unit]
    micros = raw * times // per if floor else -(-raw * times // per)
    return _EPOCH + dt.timedelta(microseconds=micros)


def stat_value(value: Any, floor: bool) -> Any:
    """A Parquet statistic (or one of the log's flattened stats) as Delta writes it; timestamps in
    milliseconds (Delta's precision), the minimum rounded down and the maximum up, so the bounds
    still hold every row."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        value = value.astimezone(dt.timezone.utc)
        micro = value.microsecond % 1000
        if micro:
            value -= dt.timedelta(microseconds=micro)
            if not floor:
                value += dt.timedelta(milliseconds=1)
        return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def stats_of(actions: pa.Table) -> list[str | None]:
    """Each file's stats as JSON, rebuilt from the log's flattened add actions."""
    out: list[str | None] = []
    columns = {name: actions.column(name).to_pylist() for name in actions.column_names}
    for i in range(actions.num_rows):
        rows = columns.get("num_records", [None] * actions.num_rows)[i]
        if rows is None:
            out.append(None)
            continue
        found: dict[str, dict[str, Any]] = {"minValues": {}, "maxValues": {}, "nullCount": {}}
        for name, values in columns.items():
            kind, _, column = name.partition(".")
            target = {"min": "minValues", "max": "maxValues", "null_count": "nullCount"}.get(kind)
            if target and column and values[i] is not None:
                found[target][column] = stat_value(values[i], floor=kind == "min")
        out.append(json.dumps({"numRecords": rows, **found}, separators=(",", ":")))
    return out
