"""The benchmark runs end to end on a small store (the figures are for bench/store.py itself)."""

from __future__ import annotations

import importlib.util
import os

from tests.store.conftest import REPO


def test_bench_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_store", os.path.join(REPO, "bench", "store.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    figures = bench.main(["--rows", "300000", "--repeats", "1", "--layers", "4", "--tokens", "1024",
                          "--root", str(tmp_path / "bench")])
    assert figures["writer_rows_per_s"] > 0 and 0 < figures["bytes_per_route_row"] < 64
