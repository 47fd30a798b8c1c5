"""Compaction through S3: a store of tens of small files, then a compaction with nothing to merge.

    python bench/compact.py               # 24 flushes of one run (about 24 small files per table)
    python bench/compact.py --flushes 48

A moto S3 server (tests/support/s3server.py) in its own process, behind the counting proxy
(tests/support/s3faults.py): every request the compaction makes (data files and the Delta log) is
counted by method at the server's door. Prints the wall time, GETs, PUTs and the data bytes read
and written (`CompactResult.io`) of each compaction.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flushes", type=int, default=24, help="writer flushes (one small file per table each)")
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    from moescope.store.compact import CompactIO, compact
    from moescope.store.location import StoreLocation
    from tests.support.deltafiles import parts, write_run
    from tests.support.s3faults import FaultProxy
    from tests.support.s3server import S3Server

    server = S3Server(auth=False).start()
    try:
        loc = server.location(f"bench-{uuid.uuid4().hex[:8]}")
        write_run(loc, "r", steps=args.flushes, max_rows=48)  # a flush per step, as a fleet's writers leave them
        files = sum(len(parts(loc, t)) for t in ("routes", "layer_steps", "steps", "runs", "layers"))
        print(f"store: {files} data files in 5 tables, through S3 (moto at {server.endpoint})")
        with FaultProxy(loc.storage_options["AWS_ENDPOINT_URL"]) as proxy:
            through = StoreLocation(loc.url, {**loc.storage_options, "AWS_ENDPOINT_URL": proxy.url})
            for label in ("tens of small files", "nothing to merge"):
                proxy.reset_counts()
                started = time.perf_counter()
                results = compact(through, retention_hours=None)
                wall = time.perf_counter() - started
                requests = proxy.counts()["requests"]
                data_gets = sum(1 for m, path, _ in proxy.log() if m == "GET" and path.endswith(".parquet"))
                io = sum((r.io for r in results), CompactIO())
                merged = sum(r.merged_files for r in results)
                print(f"{label}: {wall:.2f} s, {merged} files merged; requests {dict(sorted(requests.items()))} "
                      f"({data_gets} GETs of data files); data files {io}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
