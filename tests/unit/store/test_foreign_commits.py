"""A file another Delta writer committed without stats is read whole, never quarantined.

Delta's `stats` (and its `numRecords`) is optional in an add action: Spark with stats collection off,
or any writer that does not collect them, commits files without it. The table below holds one file
from moescope's writer and one committed by hand as such a writer would (the Parquet file written
with pyarrow, the log's JSON written directly, its add action without `stats`). The expected rows
are the two raw files read with pyarrow (issue 46 part 6)."""

from __future__ import annotations

import json
import os
import time
import uuid
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from moescope.store import Store, delta
from moescope.store.location import open_location
from moescope.store.writer import ParquetExporter
from tests.support.store_records import make_record, run_info

LAYERS, EXPERTS, STEPS = 3, 6, 4


def commit_without_stats(root: str, table: str, run_id: str, data: pa.Table) -> str:
    """Write `data` as a new file of `table` in `run_id`'s partition and commit it as the table's next
    version by hand: an add action with no `stats`. Returns the file's path in the table."""
    location = open_location(root)
    path = f"run_id={run_id}/part-foreign-{uuid.uuid4().hex[:12]}.parquet"
    target = os.path.join(root, table, *path.split("/"))
    pq.write_table(data, target)
    version = delta.snapshot(location, table).version + 1
    now = int(time.time() * 1000)
    actions = [{"commitInfo": {"timestamp": now, "operation": "WRITE", "engineInfo": "another writer, no stats"}},
               {"add": {"path": path, "partitionValues": {"run_id": run_id}, "size": os.path.getsize(target),
                        "modificationTime": now, "dataChange": True}}]
    with open(os.path.join(root, table, "_delta_log", f"{version:020d}.json"), "x") as f:
        f.write("\n".join(json.dumps(a) for a in actions) + "\n")
    return path


def test_a_file_committed_without_num_records_is_read_whole(tmp_path):
    root = str(tmp_path / "store")
    rng = np.random.default_rng(5)
    exporter = ParquetExporter(root, run_info("r", LAYERS, EXPERTS))
    exporter.export([make_record("r", step, rng, LAYERS, EXPERTS, skew=1.0) for step in range(STEPS)])
    exporter.shutdown()
    location = open_location(root)
    (ours,) = delta.snapshot(location, "layer_steps").files
    with open(os.path.join(root, "layer_steps", *ours.path.split("/")), "rb") as f:
        written = pq.ParquetFile(f).read()
    # the other writer's rows: the same layers at later steps, each expert's load reversed
    theirs = written.set_column(written.schema.get_field_index("step"), "step",
                                pc.add(written.column("step"), STEPS))
    loads = [row[::-1] for row in theirs.column("expert_load").to_pylist()]
    theirs = theirs.set_column(theirs.schema.get_field_index("expert_load"), "expert_load",
                               pa.array(loads, theirs.schema.field("expert_load").type))
    path = commit_without_stats(root, "layer_steps", "r", theirs)

    expected: dict[tuple[int, int], int] = {}
    for rows in (written, theirs):
        for row in rows.select(["step", "layer", "expert_load"]).to_pylist():
            if row["layer"] == 1:
                for expert, load in enumerate(row["expert_load"]):
                    expected[(row["step"], expert)] = expected.get((row["step"], expert), 0) + load
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Store(root) as store:
            got = store.load_per_step("r", 1)
    got = {(int(r.step), int(r.expert)): int(r.load) for r in got.itertuples() if r.load}
    assert {s for s, _ in got} == set(range(2 * STEPS))  # both writers' steps
    assert got == {key: value for key, value in expected.items() if value}
    assert [str(w.message) for w in caught] == []  # a quarantined or skipped file warns
    assert path in {p.path for p in delta.snapshot(location, "layer_steps").files}  # still live
    assert not os.path.exists(os.path.join(root, "_quarantine"))
    (foreign,) = [p for p in delta.snapshot(location, "layer_steps").files if p.path == path]
    assert foreign.rows < 0  # the log does not say how many rows: unknown, not 0
