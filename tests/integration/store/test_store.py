"""Store reads one Delta version per table: the views hold the files of the version pinned at the last
refresh (never a folder listing), a table with no Delta table yet is an empty view of its schema, and
data_version moves with every commit and with nothing else; on a folder and on S3."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moescope.store import EmptyStoreError, LegacyStoreError, QueryError, Store, delta
from moescope.store.location import StoreLocation
from moescope.store.schema import SCHEMAS
from moescope.store.store import data_version
from tests.support.deltafiles import parts, read_table, write_run


def test_views_are_the_pinned_version_and_refresh_moves_them(store_location):
    if store_location.is_local:
        os.makedirs(store_location.url)  # an empty folder (a missing one is "no data yet", below)
    store = Store(store_location)
    assert not store.has_data
    for table, schema in SCHEMAS.items():  # no table yet: an empty view of the schema
        assert store.sql(f"SELECT * FROM {table}").columns.tolist() == schema.names
    first = data_version(store_location)

    write_run(store_location, "r", steps=3)
    assert int(store.sql("SELECT count(*) AS n FROM routes").n[0]) == 0  # pinned until refresh
    second = data_version(store_location)
    assert second != first and data_version(store_location) == second
    store.refresh()
    assert store.has_data and store.versions["routes"] == delta.snapshot(store_location, "routes").version
    want = read_table(store_location, "routes")
    got = store.arrow("SELECT * FROM routes ORDER BY step, layer, token")
    assert got.column_names == SCHEMAS["routes"].names  # run_id from the folder, in the schema's place
    assert got.column("run_id").to_pylist() == ["r"] * want.num_rows
    assert sorted(got.column("token_id").to_pylist()) == sorted(want.column("token_id").to_pylist())

    # a file in a table's folder that no commit added is not part of the table
    stray = parts(store_location, "steps")[0]
    data = pq.read_table(store_location.filesystem().open_input_file(
        store_location.join("steps", *stray.path.split("/"))))
    with store_location.filesystem().open_output_stream(
            store_location.join("steps", "run_id=r", "part-stray.parquet")) as f:
        pq.write_table(data, f)
    store.refresh()
    assert int(store.sql("SELECT count(*) AS n FROM steps").n[0]) == 3
    assert data_version(store_location) == second  # no commit, no new version


def test_a_store_opens_from_a_path_a_url_or_a_location(store_location):
    write_run(store_location, "r", steps=2)
    query = "SELECT run_id, count(*) AS n FROM layer_steps GROUP BY run_id"
    answers = [Store(store_location).sql(query).values.tolist()]
    if store_location.is_local:
        answers.append(Store(store_location.url).sql(query).values.tolist())
        answers.append(Store(os.path.relpath(store_location.url)).sql(query).values.tolist())
    else:
        answers.append(Store(store_location.url, dict(store_location.storage_options)).sql(query).values.tolist())
    assert answers == [[["r", 6]]] * len(answers)


def test_a_store_on_object_storage_reads_no_file_itself(s3_store, tmp_path):
    write_run(s3_store, "r", steps=1)
    secret = tmp_path / "secret.parquet"
    pq.write_table(pa.table({"secret": [42]}), secret)
    store = Store(s3_store)
    with pytest.raises(QueryError, match="not allowed"):
        store.sql(f"SELECT * FROM read_parquet('{secret}')")
    assert int(store.sql("SELECT count(*) AS n FROM steps").n[0]) == 1


def test_missing_and_previous_release_stores_say_what_to_do(tmp_path):
    with pytest.raises(EmptyStoreError, match="no data yet"):
        Store(tmp_path / "nothing")
    assert data_version(tmp_path / "nothing") == ""
    folder = tmp_path / "old" / "steps" / "run_id=r"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"run_id": ["r"], "step": [1]}), folder / "part-00000-1-000001-000000000001.parquet")
    with pytest.raises(LegacyStoreError, match=f"moescope store upgrade {tmp_path / 'old'}"):
        Store(tmp_path / "old")
    assert not (tmp_path / "old" / "steps" / "_delta_log").exists()


def test_the_credentials_stay_in_the_environment(s3_store):
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    store = Store(StoreLocation(s3_store.url, s3_store.storage_options))
    assert store.root == s3_store.url
    assert secret not in store.root + repr(store.location) + str(dict(store.location.storage_options))
