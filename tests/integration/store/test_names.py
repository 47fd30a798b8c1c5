"""Run ids, ranks, table and file names become paths: every one is checked before anything is
written, and readers never take a folder of the wrong name for a table or a run."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moescope.store import Store
from moescope.store.compact import compact
from moescope.store.delta import legacy_tables, snapshot, write_part
from moescope.store.exporter import DeltaExporter
from moescope.store.naming import InvalidNameError
from moescope.store.writer import run_writer
from tests.support.fixtures.store import REPO
from tests.support.store_records import make_record, run_info

ESCAPES = ["x/../../../escaped", "../escaped", "..", ".", ".hidden", "a/b", "", "a" * 129, "run id", "a\x00b",
           "/abs", "run=1"]
PART = "part-00000-h-1-000001-000000000001.parquet"


def _files_under(path) -> set[str]:
    return {os.path.join(folder, name) for folder, folders, names in os.walk(path) for name in names + folders}


@pytest.mark.parametrize("run_id", ESCAPES)
def test_a_hostile_run_id_never_becomes_a_path(tmp_path, run_id):
    root = tmp_path / "store"
    root.mkdir()
    before = _files_under(tmp_path)
    with pytest.raises(InvalidNameError, match="run_id") as error:
        write_part(root, "alerts", run_id, pa.table({"alertname": ["x"]}), PART)
    assert repr(run_id) in str(error.value) and "A-Za-z0-9" in str(error.value)
    with pytest.raises(InvalidNameError, match="run_id"):
        run_writer(root, run_id)
    with pytest.raises(InvalidNameError):
        DeltaExporter(root, run_info(run_id))
    with pytest.raises(InvalidNameError):
        compact(root, run_id=run_id)
    assert _files_under(tmp_path) == before


def test_an_attach_refused_for_its_run_id_logs_no_second_failure(tmp_path, caplog):
    # The session shuts its processor down, which flushes and shuts the exporter that never
    # attached: it has nothing to write (it used to log two tracebacks of AttributeError).
    import moescope
    from tests.support.zoo import tiny_model

    with pytest.raises(InvalidNameError, match="run_id"):
        moescope.attach(tiny_model("mixtral"), store=tmp_path / "store", run_id="a/b")
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


def test_moescope_alerts_writes_no_file_outside_the_store(tmp_path):
    """The issue's escape: a run id read from a data file, handed to the alerts table writer."""
    from moescope.alerts.engine import AlertTransition
    from moescope.alerts.storage import AlertTableWriter

    root = tmp_path / "a" / "b" / "store"
    root.mkdir(parents=True)
    now = dt.datetime.now(dt.timezone.utc)
    transition = AlertTransition(
        run_id="x/../../../escaped", fingerprint="f", alertname="hot", state="firing", previous_state="pending",
        at=now, step=1, layer=0, severity="warning", expr="1 > 0", labels={}, annotations={}, values={},
        starts_at=now, ends_at=None)
    with pytest.raises(InvalidNameError, match="escaped"):
        AlertTableWriter(str(root)).handle([transition])
    assert not [p for p in tmp_path.rglob("*.parquet")]
    assert not (tmp_path / "a" / "escaped").exists()


@pytest.mark.parametrize("table", ["../x", "_quarantine", ".x", "a/b", "", "bad table"])
def test_table_names_are_checked(tmp_path, table):
    with pytest.raises(InvalidNameError, match="table"):
        write_part(tmp_path, table, "r", pa.table({"step": [1]}), PART)
    with pytest.raises(InvalidNameError, match="table"):
        snapshot(tmp_path, table)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("rank", [-1, 1.5, "0", True, None])
def test_ranks_are_checked(tmp_path, rank):
    with pytest.raises(InvalidNameError, match="rank"):
        run_writer(tmp_path, "r", rank=rank)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["../part-1.parquet", "part-1.parquet/..", "x.parquet", "part-1.csv",
                                  ".tmp-part-1.parquet", "sub/part-1.parquet"])
def test_file_names_given_to_the_writer_are_checked(tmp_path, name):
    with pytest.raises(InvalidNameError, match="file name"):
        write_part(tmp_path, "steps", "r", pa.table({"step": [1]}), name)
    assert os.listdir(tmp_path) == []


def test_readers_skip_folders_whose_names_are_not_valid(tmp_path):
    rng = np.random.default_rng(0)
    exporter = DeltaExporter(tmp_path, run_info("good"))
    exporter.export([make_record("good", 0, rng)])
    exporter.shutdown()
    good = next((tmp_path / "steps" / "run_id=good").glob("part-*.parquet"))
    for folder in ("steps/run_id=.hidden", "steps/run_id=a b", "bad table/run_id=good"):
        (tmp_path / folder).mkdir(parents=True)
        shutil.copy(good, tmp_path / folder / good.name)
    assert legacy_tables(tmp_path) == []
    store = Store(tmp_path)  # `bad table` is no table of the previous release: the store is not refused
    try:
        assert "bad table" not in store.tables()
        got = store.sql("SELECT run_id, count(*) AS n FROM steps GROUP BY ALL").values.tolist()
    finally:
        store.close()
    assert got == [["good", pq.read_table(good).num_rows]] == [["good", 1]]


def test_only_folders_named_as_tables_are_taken_for_tables_of_the_previous_release(tmp_path):
    data = pa.table({"step": pa.array([1], pa.int64())})
    for folder in ("bad table", "_quarantine", ".x", "steps"):
        (tmp_path / folder / "run_id=r").mkdir(parents=True)
        pq.write_table(data, tmp_path / folder / "run_id=r" / PART)
    assert legacy_tables(tmp_path) == ["steps"]
    shutil.rmtree(tmp_path / "steps")
    assert legacy_tables(tmp_path) == []
    Store(tmp_path).close()


def test_compact_cli_names_the_bad_run_id(tmp_path):
    out = subprocess.run([sys.executable, "-m", "moescope.cli", "compact", str(tmp_path), "--run", "../x"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2 and "'../x'" in out.stderr and "Traceback" not in out.stderr
