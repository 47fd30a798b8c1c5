"""A store whose Delta log another hand wrote cannot make moescope write outside it (issue 41).

Each table's log gets crafted add actions: run ids with `..`, `/`, `\\`, an absolute path, a NUL,
an empty value, 10 000 characters; paths out of the table; and files whose own `run_id` column is
not their run. Every command that writes (`compact`, `prune`, a quarantine, `upgrade`, `alerts run`)
and `Store(...)` then runs, on a local folder and on S3: nothing outside the store is created,
changed or removed (the folders above it, walked before and after; on S3 the bucket's other keys
too), every row of the genuine runs still reads (counted from their raw files beforehand), each
crafted file is named in a warning, and its rows are counted in probe_stats."""

from __future__ import annotations

import json
import os
import warnings

import pyarrow as pa
import pytest

from moescope.cli import main as moescope_main
from moescope.store import Store
from moescope.store.catalog import INVALID_NAME, INVALID_NAMES_RUN
from moescope.store.compact import compact, prune
from moescope.store.delta import snapshots
from moescope.store.naming import InvalidNameWarning
from moescope.store.upgrade import upgrade
from tests.support.deltafiles import parts, read_part, snapshot_rows, write_bytes, write_run
from tests.support.hostilelog import HOSTILE_RUN_IDS, craft_add, tree

GENUINE = ("victim", "other")
TABLES = ("layer_steps", "layers", "probe_stats", "routes", "run_ends", "runs", "steps")
HOSTILE_PATHS = ("../../../../outside.parquet", "/tmp/moescope-hostile-absolute.parquet",
                 "run_id=victim/../../../outside.parquet", "run_id=elsewhere/part-crafted-x.parquet")


@pytest.fixture(autouse=True)
def _each_warning_again(monkeypatch):
    """Each command warns afresh (a process names a skipped file once; here each command must)."""
    monkeypatch.setattr(snapshots, "_WARNED", set())


def _hostile_store(location) -> dict[str, int]:
    """Two genuine runs, then in every table crafted entries: each hostile run id twice (so a
    compaction would merge them), each hostile path once, and two files whose own run_id column is
    not their run. Returns the genuine rows per table, counted from the raw files before the crafting."""
    for i, run in enumerate(GENUINE):
        write_run(location, run, steps=3, seed=i)
    genuine = {table: snapshot_rows(location, table).num_rows for table in TABLES}
    for table in TABLES:
        source = parts(location, table)[0]
        for value in HOSTILE_RUN_IDS.values():
            craft_add(location, table, value, source=source)
            craft_add(location, table, value, source=source)
        for path in HOSTILE_PATHS:
            craft_add(location, table, "victim", source=source, path=path)
        rows = read_part(location, table, source)  # with a run_id column: the file's own says "victim"
        for own in ("victim", "../../escaped"):
            data = rows.set_column(rows.column_names.index("run_id"), "run_id",
                                   pa.array([own] * rows.num_rows, pa.string()))
            craft_add(location, table, "intruder", data=data)
    return genuine


def _outside(location, tmp_path) -> dict:
    """What lies outside the store: for a local store, every file and folder under the test's tmp
    folder (two levels above the store) but the store, and the absolute path a crafted entry names;
    on S3, the bucket's keys outside the store's prefix, and the test's tmp folder but the S3 store's
    state folder (`alerts run --state-dir`, its outbox's place)."""
    found = dict(tree(str(tmp_path), skip=location.url if location.is_local else str(tmp_path / "state")))
    found["absolute"] = os.path.exists("/tmp/moescope-hostile-absolute")
    if not location.is_local:
        from pyarrow import fs as pafs

        bucket = location.join().split("/", 1)[0]
        prefix = location.join() + "/"
        infos = location.filesystem().get_file_info(pafs.FileSelector(bucket, recursive=True))
        found.update({info.path: (info.size, 0) for info in infos if not info.path.startswith(prefix)})
    return found


def _store_at(location, tmp_path):
    """The store location: a local one two folders down, so `../..` from a run folder lands in tmp_path."""
    if location.is_local:
        from moescope.store.location import open_location

        return open_location(str(tmp_path / "fleet" / "bucket" / "store"))
    return location


def _options(location) -> list[str]:
    """The command line's storage options for the location (the S3 server's endpoint; credentials: the environment)."""
    return [arg for key, value in location.storage_options.items() for arg in ("--storage-option", f"{key}={value}")]


def _named(caught: list[warnings.WarningMessage]) -> str:
    return "\n".join(str(w.message) for w in caught if issubclass(w.category, InvalidNameWarning))


def _assert_each_value_named(text: str) -> None:
    for key, value in HOSTILE_RUN_IDS.items():
        shown = "no run id" if value == "" else repr(value)[:100]
        assert shown in text, f"the warning does not name the {key} run id"
    for path in HOSTILE_PATHS:
        assert repr(path) in text
    assert "own run_id column holds '../../escaped'" in text


def _genuine_rows_read(location, genuine: dict[str, int]) -> None:
    with Store(location) as store:
        for table in TABLES:
            frame = store.sql(f"SELECT run_id, count(*) AS n FROM {table} GROUP BY run_id")
            counts = dict(zip(frame.run_id, frame.n))
            extra = counts.pop(INVALID_NAMES_RUN, 0) if table == "probe_stats" else 0
            assert set(counts) <= set(GENUINE), f"{table} read rows of {set(counts) - set(GENUINE)}"
            if table == "probe_stats":  # the genuine writers' counters, and those of commands since (alerts run)
                assert sum(counts.values()) >= genuine[table] and extra
            else:
                assert sum(counts.values()) == genuine[table], table


def test_every_command_stays_inside_a_store_with_a_hostile_log(store_location, tmp_path, monkeypatch):
    location = _store_at(store_location, tmp_path)
    genuine = _hostile_store(location)
    snapshots._WARNED.clear()
    before = _outside(location, tmp_path)

    with warnings.catch_warnings(record=True) as caught:  # Store(...): the whole store reads
        warnings.simplefilter("always")
        _genuine_rows_read(location, genuine)
    _assert_each_value_named(_named(caught))
    with Store(location) as store:  # the crafted files' rows are counted once, where dropped rows are
        counted = store.sql("SELECT table_name, reason, count(*) AS n, sum(dropped_rows) AS rows FROM probe_stats "
                            "WHERE run_id = ? GROUP BY ALL", [INVALID_NAMES_RUN])
    assert set(counted.table_name) == set(TABLES) and set(counted.reason) == {INVALID_NAME}
    per_table = 2 * len(HOSTILE_RUN_IDS) + len(HOSTILE_PATHS) + 2
    assert counted.n.tolist() == [per_table] * len(TABLES)
    assert _outside(location, tmp_path) == before

    snapshots._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:  # compaction, with its vacuum
        warnings.simplefilter("always")
        code = moescope_main(["compact", location.url, *_options(location)])
    assert code == 0
    _assert_each_value_named(_named(caught))
    assert _outside(location, tmp_path) == before
    _genuine_rows_read(location, genuine)
    for table in TABLES:  # the crafted entries are all still there: never moved, rewritten or removed
        assert len(snapshots.snapshot(location, table).skipped) == 2 * len(HOSTILE_RUN_IDS) + len(HOSTILE_PATHS)

    state = ["--state-dir", str(tmp_path / "state")] if not location.is_local else []
    code = moescope_main(["alerts", "run", location.url, "--once", *state, *_options(location)])  # its state, its table
    assert code == 0 and _outside(location, tmp_path) == before
    _genuine_rows_read(location, genuine)

    # a quarantine: a genuine file damaged, in a store with such a log
    damaged = [p for p in parts(location, "routes") if p.run_id == "other"][-1]
    write_bytes(location, location.join("routes", *damaged.path.split("/")), b"not parquet" * 10)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with Store(location) as store:
            left = store.sql("SELECT count(*) AS n FROM routes").n[0]  # the query that reads routes checks them
            assert store.quarantined() and left < genuine["routes"]
    assert _outside(location, tmp_path) == before

    if location.is_local:  # upgrade (local stores only), with a plan in _upgrade/ that names paths outside
        os.makedirs(os.path.join(location.url, "_upgrade"), exist_ok=True)
        bait = tmp_path / "fleet" / "bait.txt"
        bait.write_text("keep me")
        before = _outside(location, tmp_path)
        with open(os.path.join(location.url, "_upgrade", "steps.json"), "w") as f:
            json.dump({"delete": ["../../bait.txt", "run_id=../../../bait.txt"],
                       "create": ["../../bait.txt", "/tmp/moescope-hostile-absolute"]}, f)
        steps = {p.path for p in parts(location, "steps")}
        upgrade(location.url)
        assert _outside(location, tmp_path) == before
        assert {p.path for p in parts(location, "steps")} == steps  # the Delta table is left as it was

    pruned = prune(location, older_than_s=0)  # every run with valid names (the intruder's too), nothing outside
    assert set(GENUINE) <= set(pruned) and not set(HOSTILE_RUN_IDS.values()) & set(pruned)
    assert _outside(location, tmp_path) == before
    for table in TABLES:
        assert not parts(location, table) or table == "probe_stats"


def test_compact_with_a_hostile_run_writes_nothing_outside(store_location, tmp_path):
    """The issue's case: `run_id = "crafted/../../../.."` in layer_steps, then `compact`: exit 0, the
    run named in the warning, no file two folders above the store, and the genuine run compacted."""
    location = _store_at(store_location, tmp_path)
    write_run(location, "victim", steps=6, max_rows=16)
    source = parts(location, "layer_steps")[0]
    for _ in range(2):
        craft_add(location, "layer_steps", "crafted/../../../..", source=source)
    before = _outside(location, tmp_path)
    with pytest.warns(InvalidNameWarning, match=r"crafted/\.\./\.\./\.\./\.\.") as caught:
        results = compact(location)
    assert "layer_steps" in str(caught[0].message)
    assert _outside(location, tmp_path) == before
    assert {r.run_id for r in results} == {"victim"} and any(r.merged_files for r in results)
