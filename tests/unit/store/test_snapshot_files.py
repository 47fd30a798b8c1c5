"""A snapshot's live files are read once each, even where the log replay lists a path twice.

delta-rs has listed one add action twice after an incremental update before (delta-io/delta-rs#127,
#398); a reader that took the list as given would count that file's rows twice. The stand-in below
is that replay's answer, named as such: a real table cannot be made to produce it on demand."""

from __future__ import annotations

import pyarrow as pa

from moescope.store.delta import snapshots


class ReplayListingAFileTwice:
    """Stand-in for a delta-rs table whose `get_add_actions` lists one path twice."""

    def get_add_actions(self, flatten: bool = True) -> pa.Table:
        paths = ["run_id=r/part-0.parquet", "run_id=r/part-1.parquet", "run_id=r/part-0.parquet"]
        return pa.table({"path": paths, "size_bytes": [10, 20, 10], "num_records": [3, 4, 3],
                         "partition.run_id": ["r", "r", "r"], "modification_time": [1, 2, 1]})


def test_a_path_listed_twice_is_one_live_file():
    files, skipped = snapshots._files(ReplayListingAFileTwice(), with_stats=False)
    assert [(f.path, f.rows) for f in files] == [("run_id=r/part-0.parquet", 3), ("run_id=r/part-1.parquet", 4)]
    assert sum(f.rows for f in files) == 7 and skipped == []
