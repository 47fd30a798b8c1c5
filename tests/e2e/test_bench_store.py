"""The store benchmark runs end to end on a small store, locally and on the S3 server it starts itself
(the figures are for bench/store.py itself)."""

from __future__ import annotations

import importlib.util
import os

import pyarrow.parquet as pq

from moescope.store import delta
from tests.support.fixtures.store import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("bench_store", os.path.join(REPO, "bench", "store.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_smoke_local_and_s3_side_by_side(tmp_path):
    env_before = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    root = tmp_path / "bench"
    figures = _bench().main(["--rows", "300000", "--repeats", "1", "--layers", "4", "--tokens", "1024",
                             "--root", str(root), "--s3"])
    stores = figures["stores"]
    assert len(stores) == 2 and figures["store"] == str(root)
    assert any(f["store"].startswith("s3://") for f in stores.values())
    for f in stores.values():
        assert f["rows"] == 73 * 4 * 1024
        assert f["writer_rows_per_s"] > 0 and 0 < f["bytes_per_route_row"] < 64
        assert f["files_before"] == 2 and f["files_after"] == 1 and f["compact_s"] > 0 and f["compact_cpu_s"] > 0
        assert all(len(times) == 1 and times[0] > 0 for times in f["queries_ms"].values())
    # the local store holds every route row once, counted from the raw Parquet files of its snapshot
    snap = delta.snapshot(str(root), "routes")
    assert sum(pq.ParquetFile(root / "routes" / p.path).metadata.num_rows for p in snap.files) == 73 * 4 * 1024
    # the S3 server it started is stopped and its credentials are gone from the environment
    assert {k: v for k, v in os.environ.items() if k.startswith("AWS_")} == env_before
