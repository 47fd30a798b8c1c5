"""Run ids, ranks and table names become paths: every one is checked, on write and on read."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from moescope.store import Store
from moescope.store.compact import compact, compact_run
from moescope.store.layout import InvalidNameError, encode_replaces, list_parts, list_runs, run_folder
from moescope.store.writer import ParquetExporter, write_table_file
from tests.store.conftest import REPO
from tests.store.helpers import make_record, run_info

ESCAPES = ["x/../../../escaped", "../escaped", "..", ".", ".hidden", "a/b", "", "a" * 129, "run id", "a\x00b",
           "/abs", "run=1"]


def _files_under(path) -> set[str]:
    return {os.path.join(folder, name) for folder, _, names in os.walk(path) for name in names}


@pytest.mark.parametrize("run_id", ESCAPES)
def test_a_hostile_run_id_never_becomes_a_path(tmp_path, run_id):
    root = tmp_path / "store"
    root.mkdir()
    before = _files_under(tmp_path)
    with pytest.raises(InvalidNameError, match="run_id") as error:
        write_table_file(root, "alerts", run_id, pa.table({"run_id": [run_id]}))
    assert repr(run_id) in str(error.value) and "A-Za-z0-9" in str(error.value)
    with pytest.raises(InvalidNameError):
        ParquetExporter(root, run_info(run_id))
    with pytest.raises(InvalidNameError):
        list_parts(root, "routes", run_id)
    with pytest.raises(InvalidNameError):
        compact_run(root, "routes", run_id)
    assert _files_under(tmp_path) == before


def test_an_attach_refused_for_its_run_id_logs_no_second_failure(tmp_path, caplog):
    # The session shuts its processor down, which flushes and shuts the exporter that never
    # attached: it has nothing to write (it used to log two tracebacks of AttributeError).
    import moescope
    from moescope.probe.zoo import tiny_model

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


@pytest.mark.parametrize("table", ["../x", "_quarantine", ".x", "a/b", ""])
def test_table_names_are_checked(tmp_path, table):
    with pytest.raises(InvalidNameError, match="table"):
        run_folder(tmp_path, table, "r")
    with pytest.raises(InvalidNameError, match="table"):
        write_table_file(tmp_path, table, "r", pa.table({"a": [1]}))


@pytest.mark.parametrize("rank", [-1, 1.5, "0", True, None])
def test_ranks_are_checked(tmp_path, rank):
    with pytest.raises(InvalidNameError, match="rank"):
        write_table_file(tmp_path, "routes", "r", pa.table({"a": [1]}), rank=rank)


@pytest.mark.parametrize("name", ["../part-1.parquet", "part-1.parquet/..", "x.parquet", "part-1.csv",
                                  ".tmp-part-1.parquet"])
def test_file_names_given_to_the_writer_are_checked(tmp_path, name):
    with pytest.raises(InvalidNameError, match="file name"):
        write_table_file(tmp_path, "routes", "r", pa.table({"a": [1]}), name=name)


def test_readers_skip_folders_whose_names_are_not_valid(tmp_path):
    rng = np.random.default_rng(0)
    exporter = ParquetExporter(tmp_path, run_info("good"))
    exporter.export([make_record("good", 0, rng)])
    exporter.shutdown()
    good = next((tmp_path / "steps" / "run_id=good").glob("part-*.parquet"))
    for folder in ("steps/run_id=.hidden", "steps/run_id=a b", "bad table/run_id=good"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / good.name).write_bytes(good.read_bytes())
    assert list_runs(tmp_path, "steps") == ["good"]
    store = Store(tmp_path)
    assert "bad table" not in store.tables()
    assert store.sql("SELECT run_id, count(*) AS n FROM steps GROUP BY ALL").values.tolist() == [["good", 1]]


def test_a_footer_cannot_name_files_outside_its_folder(tmp_path):
    """Compaction deletes the files a compacted footer says it replaces: those names are checked."""
    outside = tmp_path / "precious.parquet"
    outside.write_text("not the store's")
    root = tmp_path / "store"
    rng = np.random.default_rng(0)
    exporter = ParquetExporter(root, run_info("r"), max_rows=10)
    for step in range(3):
        exporter.export([make_record("r", step, rng)])
    exporter.shutdown()
    data = pa.table({"run_id": ["r"], "step": pa.array([99], pa.int64())})
    hostile = write_table_file(root, "steps", "r", data, name="part-compacted-1-hostile.parquet",
                               metadata=encode_replaces(["../../../precious.parquet"]))
    with pytest.warns(UserWarning, match="precious"):
        store = Store(root)
    assert 99 not in store.sql("SELECT step FROM steps").step.tolist()
    assert not os.path.exists(hostile)
    compact(root, grace_s=0)
    assert outside.read_text() == "not the store's"
    assert json.loads(json.dumps(store.quarantined()[0].reason)).startswith("unreadable footer")


def test_compact_cli_names_the_bad_run_id(tmp_path):
    out = subprocess.run([sys.executable, "-m", "moescope.cli", "compact", str(tmp_path), "--run", "../x"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2 and "'../x'" in out.stderr and "Traceback" not in out.stderr
