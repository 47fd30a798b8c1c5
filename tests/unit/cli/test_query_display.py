"""How `moescope query` displays a result: integers as integers whatever DuckDB widened them to."""

from __future__ import annotations

import duckdb
import pandas as pd

from moescope.cli.store import _displayed

INT64_MAX = 2**63 - 1


def _displayed_sql(sql: str) -> pd.DataFrame:
    return _displayed(duckdb.sql(sql).to_arrow_table())


def test_sums_of_integers_are_integers_even_past_int64():
    frame = _displayed_sql(f"SELECT sum(x) AS wide, sum(x % 7) AS small, sum(x) FILTER (WHERE false) AS nothing "
                           f"FROM (VALUES ({INT64_MAX}), ({INT64_MAX}), ({INT64_MAX})) t(x)")
    assert str(duckdb.sql("SELECT sum(1::BIGINT)").types[0]) == "HUGEINT"  # why: DuckDB widens every integer sum
    assert frame["wide"].tolist() == [3 * INT64_MAX] and type(frame["wide"][0]) is int  # past uint64 too
    assert frame["small"].dtype == pd.Int64Dtype() and frame["small"].tolist() == [3 * (INT64_MAX % 7)]
    assert frame["nothing"].dtype == pd.Int64Dtype() and frame["nothing"].isna().all()
    assert frame.to_csv(index=False) == f"wide,small,nothing\n{3 * INT64_MAX},{3 * (INT64_MAX % 7)},\n"


def test_other_types_display_as_in_duckdbs_own_frames():
    frame = _displayed_sql("SELECT 1.25::DECIMAL(10, 2) AS d, 0.5::DOUBLE AS f, [1, 2] AS l, MAP {'k': 1} AS m, "
                           "NULL::BIGINT AS n, 7::BIGINT AS i")
    assert frame["d"].dtype == "float64" and frame["d"][0] == 1.25
    assert frame["f"][0] == 0.5 and list(frame["l"][0]) == [1, 2] and frame["m"][0] == {"k": 1}
    assert frame["n"].dtype == pd.Int64Dtype() and frame["n"].isna().all() and frame["i"].tolist() == [7]


def test_repeated_column_names_get_a_suffix():
    assert list(_displayed_sql("SELECT 1 AS a, 2 AS a, 3 AS a_1").columns) == ["a", "a_1", "a_1_1"]
