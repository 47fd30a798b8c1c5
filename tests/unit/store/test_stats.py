"""store.delta.stats reads a timestamp's bounds from their raw integers; the stats equal those of pyarrow's own
conversion of the bounds (`Statistics.min`, which imports pandas), for every unit, with and without a zone."""

from __future__ import annotations

import datetime as dt
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moescope.store.delta.stats import file_stats, stat_value


@pytest.mark.parametrize("type_", [pa.timestamp("us", tz="UTC"), pa.timestamp("ns", tz="UTC"), pa.timestamp("ms"),
                                   pa.timestamp("us")])
def test_timestamp_bounds_equal_pyarrows_conversion(tmp_path, type_: pa.DataType) -> None:
    base = dt.datetime(2026, 12, 7, 20, 0, 0, 123456, tzinfo=dt.timezone.utc)
    values = [base + dt.timedelta(microseconds=m) for m in (999, -1, 250_000_777, 0)] + [None]
    table = pa.table({"ts": pa.array(values, pa.timestamp("us", tz="UTC")).cast(type_, safe=False)})
    path = tmp_path / "part.parquet"
    pq.write_table(table, path, row_group_size=2)  # bounds over several row groups
    footer = pq.ParquetFile(path).metadata
    stats = json.loads(file_stats(footer))
    groups = [footer.row_group(g).column(0).statistics for g in range(footer.num_row_groups)]
    expected_min = stat_value(min(st.min for st in groups if st.has_min_max), floor=True)
    expected_max = stat_value(max(st.max for st in groups if st.has_min_max), floor=False)
    assert stats["minValues"]["ts"] == expected_min and stats["maxValues"]["ts"] == expected_max
    assert stats["nullCount"]["ts"] == 1
