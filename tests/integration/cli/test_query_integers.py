"""`moescope query` as a user runs it: integer results print as integers."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pandas as pd

from tests.support.deltafiles import snapshot_rows, write_run
from tests.support.paths import REPO


def _query(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moescope.cli", "query", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)


def test_integer_sums_print_as_integers_in_every_format(tmp_path):
    """DuckDB sums BIGINTs into a HUGEINT, which pandas turned into a float (175616.0)."""
    write_run(tmp_path, "r", steps=5, tokens=24)
    raw = snapshot_rows(tmp_path, "layer_steps").to_pylist()  # pyarrow over the Parquet files the log lists
    expected: dict[int, list[int]] = {}
    for row in raw:
        tokens, dropped = expected.setdefault(row["layer"], [0, 0])
        expected[row["layer"]] = [tokens + row["tokens"], dropped + row["dropped_assignments"]]
    sql = ("SELECT layer, sum(tokens) AS tokens, sum(dropped_assignments) AS dropped FROM layer_steps "
           "GROUP BY layer ORDER BY layer")

    csv = _query(str(tmp_path), sql, "--format", "csv")
    assert csv.returncode == 0, csv.stderr
    assert csv.stdout == "layer,tokens,dropped\n" + "".join(f"{layer},{t},{d}\n" for layer, (t, d)
                                                            in sorted(expected.items()))
    records = json.loads(_query(str(tmp_path), sql, "--format", "json").stdout)
    assert records == [{"layer": layer, "tokens": t, "dropped": d} for layer, (t, d) in sorted(expected.items())]
    assert all(type(r["tokens"]) is int and type(r["dropped"]) is int for r in records)
    table = _query(str(tmp_path), sql).stdout
    printed = pd.read_csv(io.StringIO(table), sep=r"\s+")
    assert printed.values.tolist() == [[layer, t, d] for layer, (t, d) in sorted(expected.items())]
    assert "." not in table
