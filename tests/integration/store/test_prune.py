"""prune: old runs leave every table in one commit per table; their files stay for the retention, so a
reader holding the version before keeps answering, and vacuum deletes them after it; a run still
written is never pruned; a compaction made from the version before a prune cannot bring a run back."""

from __future__ import annotations

import time

import pytest

from moescope.store import Store, delta
from moescope.store import compact as compaction
from moescope.store.compact import compact, prune
from moescope.store.schema import TABLES
from tests.support.deltafiles import exists, file_path, parts, read_table, write_run


def _runs(location) -> dict[str, set[str]]:
    """table -> run ids in its latest version, from the log."""
    return {table: {p.run_id for p in parts(location, table)} for table in TABLES if parts(location, table)}


def test_prune_removes_old_runs_from_every_table_and_vacuum_deletes_them_after_the_retention(store_location):
    write_run(store_location, "old", steps=3)
    old_files = [(t, p) for t in TABLES for p in parts(store_location, t)]
    time.sleep(0.05)
    between = time.time()  # "now" for the prunes below: old was committed before it, new after
    time.sleep(0.05)
    write_run(store_location, "new", steps=3)
    reader = Store(store_location)

    before = _runs(store_location)
    assert prune(store_location, older_than_s=0.0, now=between, dry_run=True) == ["old"]
    assert _runs(store_location) == before and before["routes"] == {"old", "new"}
    assert prune(store_location, older_than_s=0.0, now=between) == ["old"]
    assert {run for runs in _runs(store_location).values() for run in runs} == {"new"}
    routes = read_table(store_location, "routes")
    assert set(routes.column("run_id").to_pylist()) == {"new"} and routes.num_rows == 3 * 48
    assert all(exists(store_location, file_path(store_location, t, p)) for t, p in old_files)  # the retention
    query = "SELECT run_id, count(*) AS n FROM routes GROUP BY run_id ORDER BY run_id"
    assert reader.sql(query).values.tolist() == [["new", 3 * 48], ["old", 3 * 48]]  # its pinned version
    reader.refresh()
    assert reader.sql(query).values.tolist() == [["new", 3 * 48]]

    assert prune(store_location, older_than_s=3600, retention_hours=0) == []
    assert not any(exists(store_location, file_path(store_location, t, p)) for t, p in old_files)
    assert Store(store_location).sql(query).values.tolist() == [["new", 3 * 48]]


def test_a_run_still_written_is_never_pruned(tmp_path):
    write_run(tmp_path, "live", steps=2)
    assert prune(tmp_path, older_than_s=3600) == []
    assert prune(tmp_path, older_than_s=3600, now=time.time() + 7200, dry_run=True) == ["live"]
    write_run(tmp_path, "live", steps=1, rank=1)  # it commits again: its newest file is new
    assert prune(tmp_path, older_than_s=3600, now=time.time() + 1800) == []


def test_a_compaction_made_before_a_prune_cannot_bring_the_run_back(tmp_path, monkeypatch):
    """The compaction read the version before the prune and commits after it: the prune's commit
    carries the same app transaction version, so the compaction's is not made and nothing returns."""
    write_run(tmp_path, "old", steps=6)
    real_commit = delta.commit
    pruned = []

    def prune_first(loc, table, adds=(), removes=(), **kwargs):
        if table == "routes" and adds and not pruned:
            monkeypatch.setattr(compaction.delta, "commit", real_commit)
            pruned.extend(prune(tmp_path, older_than_s=0.0, retention_hours=1))
        return real_commit(loc, table, adds, removes, **kwargs)

    monkeypatch.setattr(compaction.delta, "commit", prune_first)
    [result] = compact(tmp_path, tables=("routes",))
    assert pruned == ["old"]
    assert result.version is None and result.skipped == "nothing to merge"
    assert parts(tmp_path, "routes") == []
    assert int(Store(tmp_path).sql("SELECT count(*) AS n FROM routes").n[0]) == 0


def test_prune_refuses_a_negative_retention(tmp_path):
    write_run(tmp_path, "r", steps=1)
    with pytest.raises(ValueError, match="retention"):
        prune(tmp_path, older_than_s=0, retention_hours=-1)
