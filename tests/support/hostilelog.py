"""Delta log entries as someone with write access to one store's log could craft them: an add action
whose partition value (the run id) or path is any string, committed as the table's next version by
writing the log's JSON by hand, as a hostile or broken writer would, not through delta-rs.

Also what a test needs to prove nothing escaped: every file under the folders above a store, with its
size and mtime, before and after (`tree`)."""

from __future__ import annotations

import json
import os
import time
import uuid
import warnings

import pyarrow as pa
import pyarrow.parquet as pq

from moescope.store import delta
from moescope.store.location import StoreLocation, open_location

# The partition values (run ids) a crafted entry carries: each must be left out by every command.
HOSTILE_RUN_IDS = {
    "dotdot-slashes": "crafted/../../../..",
    "dotdot-named": "x/../../../escaped",
    "dotdot-only": "../../..",
    "slash": "a/b",
    "backslash": "a\\..\\..\\b",
    "absolute": "/tmp/moescope-hostile-absolute",
    "nul": "run\x00id",
    "empty": "",
    "long": "r" * 10_000,
}


def craft_add(store, table: str, run_id: str | None, *, source: delta.PartFile | None = None,
              path: str | None = None, data: pa.Table | None = None) -> str:
    """Commit, by hand, a version of `table` that adds one file with the partition value `run_id`.

    The file is a copy of `source` (a live file of the table) or `data` written with pyarrow, put
    at `run_id=<source's run>/part-crafted-<uuid>.parquet` unless `path` says where the log should
    point (then nothing is written: the path may lead anywhere). Returns the add action's path.
    """
    location = open_location(store)
    fs = location.filesystem()
    if path is None:
        folder_run = source.run_id if source is not None else run_id
        path = f"run_id={folder_run}/part-crafted-{uuid.uuid4().hex[:12]}.parquet"
        target = location.join(table, *path.split("/"))
        if location.is_local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
        if source is not None:
            fs.copy_file(location.join(table, *source.path.split("/")), target)
            rows = source.rows
        else:
            assert data is not None, "give a source file or the data to write"
            with fs.open_output_stream(target) as stream:
                pq.write_table(data, stream)
            rows = data.num_rows
        size = fs.get_file_info(target).size
    else:
        rows, size = (source.rows, source.size) if source is not None else (1, 1)
    now = int(time.time() * 1000)
    action = {"add": {"path": path, "partitionValues": {"run_id": run_id}, "size": size, "modificationTime": now,
                      "dataChange": True, "stats": json.dumps({"numRecords": rows})}}
    info = {"commitInfo": {"timestamp": now, "operation": "WRITE", "engineInfo": "tests/support/hostilelog.py"}}
    _commit(location, table, [info, action])
    return path


def _commit(location: StoreLocation, table: str, actions: list[dict]) -> None:
    with warnings.catch_warnings():  # the entries crafted so far: the test wants its own command's warnings
        warnings.simplefilter("ignore")
        snap = delta.snapshot(location, table)
    assert snap is not None, f"{table} has no log to add to"
    name = location.join(table, "_delta_log", f"{snap.version + 1:020d}.json")
    body = "\n".join(json.dumps(a) for a in actions).encode() + b"\n"
    if location.is_local:
        with open(name, "xb") as f:  # never over another version
            f.write(body)
    else:
        with location.filesystem().open_output_stream(name) as f:
            f.write(body)


def tree(folder: str, skip: str | None = None) -> dict[str, tuple[int, int]]:
    """Every file under `folder` (recursively), but none under `skip`: path -> (size, mtime_ns).
    Folders count too, as (-1, 0), so a folder created outside the store shows."""
    found: dict[str, tuple[int, int]] = {}
    skip = os.path.abspath(skip) if skip else None
    for root, dirs, files in os.walk(folder):
        if skip is not None:
            dirs[:] = [d for d in dirs if os.path.abspath(os.path.join(root, d)) != skip]
        for d in dirs:
            found[os.path.join(root, d)] = (-1, 0)
        for f in files:
            path = os.path.join(root, f)
            try:
                stat = os.lstat(path)
            except FileNotFoundError:
                continue
            found[path] = (stat.st_size, stat.st_mtime_ns)
    return found
