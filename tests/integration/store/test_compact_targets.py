"""Issue 34, part 3: compaction packs the files below a target size and leaves the others alone,
reads only what it merges, and a compaction with nothing to merge reads no data file and commits
nothing. On a local folder and through S3 (`store_location`); rows counted from the raw Parquet files."""

from __future__ import annotations

import collections

from moescope.store import delta
from moescope.store.compact import compact
from moescope.store.location import StoreLocation
from tests.support.deltafiles import parts, read_table, write_run


def _rows(location) -> collections.Counter:
    data = read_table(location, "routes")
    columns = [c for c in data.column_names if c != "tags"]
    return collections.Counter(tuple(tuple(v) if isinstance(v, list) else v for v in row)
                               for row in zip(*(data.column(c).to_pylist() for c in columns)))


def _big_and_small(location) -> tuple[list[delta.PartFile], list[delta.PartFile]]:
    """Rank 0: two big routes files (1536 rows each); rank 1: four small ones (48 rows each)."""
    write_run(location, "r", steps=64, max_rows=48 * 32, seed=0, rank=0)
    big = parts(location, "routes")
    write_run(location, "r", steps=4, max_rows=48, seed=1, rank=1)
    small = [p for p in parts(location, "routes") if p.path not in {b.path for b in big}]
    assert len(big) == 2 and len(small) == 4
    return big, small


def test_files_at_the_target_are_left_alone_and_the_small_ones_merged(store_location):
    big, small = _big_and_small(store_location)
    target = min(p.size for p in big)  # "at or above the target": the big ones exactly reach it
    assert sum(p.size for p in small) < target  # so the four small ones make one merge
    want = _rows(store_location)
    assert sum(want.values()) == 2 * 1536 + 4 * 48

    [result] = compact(store_location, tables=("routes",), target_size=target)
    live = parts(store_location, "routes")
    assert {p.path for p in big} <= {p.path for p in live}  # untouched: the same files in the log
    assert not {p.path for p in small} & {p.path for p in live}  # merged away
    assert len(live) == 3 and result.merged_files == 4 and result.left_alone == 2
    assert result.rows == 4 * 48
    assert _rows(store_location) == want  # every row once
    # only the merge's sources were read: footers and files, none of the big ones
    assert (result.io.footer_reads, result.io.files_read, result.io.files_written) == (4, 4, 1)
    assert result.io.bytes_read == sum(p.size for p in small)
    assert result.io.bytes_written == sum(p.size for p in live if p.path not in {b.path for b in big})


def test_a_compaction_with_nothing_to_merge_reads_no_data_file_and_commits_nothing(store_location):
    _big_and_small(store_location)
    compact(store_location, retention_hours=None)
    versions = {t: delta.snapshot(store_location, t).version for t in ("routes", "steps", "layer_steps")}
    want = _rows(store_location)

    if store_location.is_local:
        results = compact(store_location, retention_hours=None)
        requests = None
    else:
        from tests.support.s3faults import FaultProxy

        with FaultProxy(store_location.storage_options["AWS_ENDPOINT_URL"]) as proxy:
            through = StoreLocation(store_location.url,
                                    {**store_location.storage_options, "AWS_ENDPOINT_URL": proxy.url})
            results = compact(through, retention_hours=None)
            requests = proxy.log()
    assert results and all(r.skipped == "nothing to merge" and not r.merged_files for r in results)
    assert all(r.io.footer_reads == r.io.files_read == r.io.files_written == 0 for r in results)
    assert {t: delta.snapshot(store_location, t).version for t in versions} == versions  # no new version
    assert _rows(store_location) == want
    if requests is not None:
        data_files = [(m, path) for m, path, _ in requests if "run_id=" in path and path.endswith(".parquet")]
        assert data_files == [], data_files  # the log said it all: no data file was asked for
        assert not [r for r in requests if r[0] in ("PUT", "POST", "DELETE")], requests
