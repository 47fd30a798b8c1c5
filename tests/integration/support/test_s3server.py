"""The test infrastructure itself: the S3 server (tests/support/s3server.py), the fault proxy
(tests/support/s3faults.py) and the store fixtures (tests/support/fixtures/s3.py), checked with clients that are not
moescope's: boto3, delta-rs's own writer, pyarrow's S3 filesystem."""

from __future__ import annotations

import os
import socket
import time
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moescope.store.location import StoreLocation
from tests.support.fixtures.s3 import require_module
from tests.support.s3faults import SLOWDOWN_BODY, FaultProxy

pytestmark = pytest.mark.integration


def _listening(url: str) -> bool:
    parts = urlsplit(url)
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((parts.hostname, parts.port)) == 0


def _no_retries(s3_server, endpoint: str):
    return s3_server.client(endpoint, retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=5,
                            read_timeout=30)


# -- the server --------------------------------------------------------------------------------


def test_a_server_of_its_own_sets_the_environment_for_its_lifetime_and_restores_it(monkeypatch):
    require_module("moto", package="moto[server]")
    from tests.support.s3server import S3Server

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "the-machine's-own")
    monkeypatch.setenv("AWS_PROFILE", "prod")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    with S3Server() as server:
        assert server.running and _listening(server.endpoint)
        assert urlsplit(server.endpoint).hostname == "127.0.0.1"
        assert os.environ["AWS_ACCESS_KEY_ID"] == server.access_key != "the-machine's-own"
        assert os.environ["AWS_SECRET_ACCESS_KEY"] == server.secret_key
        assert "AWS_PROFILE" not in os.environ  # a profile would be searched for and signed with
        assert server.client().head_bucket(Bucket=server.bucket)["ResponseMetadata"]["HTTPStatusCode"] == 200
        endpoint = server.endpoint
    assert not server.running and not _listening(endpoint)
    assert os.environ["AWS_ACCESS_KEY_ID"] == "the-machine's-own"
    assert os.environ["AWS_PROFILE"] == "prod"
    assert "AWS_SECRET_ACCESS_KEY" not in os.environ
    server.stop()  # twice is fine


def test_the_server_checks_signatures_as_s3_does(s3_env):
    from botocore.exceptions import ClientError

    s3_env.client().put_object(Bucket=s3_env.bucket, Key="auth/object", Body=b"x")
    for wrong in ({"secret_key": "not-the-secret"}, {"access_key": "AKIANOSUCHKEY0000000"}):
        with pytest.raises(ClientError) as refused:
            s3_env.client(**wrong).get_object(Bucket=s3_env.bucket, Key="auth/object")
        assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    with pytest.raises(ClientError, match="NoSuchBucket"):
        s3_env.client().list_objects_v2(Bucket="no-such-bucket")
    s3_env.delete_prefix("auth/")


def test_s3_store_is_a_fresh_prefix_with_options_and_no_secret(s3_store, s3_server, request):
    assert isinstance(s3_store, StoreLocation) and not s3_store.is_local
    bucket, _, prefix = s3_store.url.removeprefix("s3://").partition("/")
    assert bucket == s3_server.bucket and prefix.startswith(request.node.name[:20].replace("[", "-"))
    assert s3_server.keys(prefix) == []
    options = dict(s3_store.storage_options)
    assert options["AWS_ENDPOINT_URL"] == s3_server.endpoint
    assert s3_server.secret_key not in options.values() and s3_server.access_key not in options.values()
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == s3_server.secret_key  # credentials come from the environment


def test_delta_rs_and_pyarrow_reach_the_store_with_the_locations_options(s3_store, s3_server):
    """delta-rs's own writer, its history() (which holds the GIL: the server must be another process)
    and pyarrow's S3 filesystem, all with only what the StoreLocation carries."""
    from deltalake import DeltaTable, write_deltalake

    options = dict(s3_store.storage_options, timeout="10s", max_retries="1")
    uri = s3_store.table_uri("t")
    for step in range(3):
        write_deltalake(uri, pa.table({"step": [step, step]}), mode="append", storage_options=options)
    table = DeltaTable(uri, storage_options=options)
    started = time.monotonic()
    assert len(table.history()) == 3
    assert time.monotonic() - started < 5
    filesystem = s3_store.filesystem()
    read = pa.concat_tables(
        [pq.read_table(uri.split("://", 1)[1], filesystem=filesystem) for uri in table.file_uris()])
    assert sorted(read["step"].to_pylist()) == [0, 0, 1, 1, 2, 2]
    prefix = s3_store.url.split("/", 3)[3]
    assert sum(key.startswith(f"{prefix}/t/_delta_log/") for key in s3_server.keys(prefix)) == 3


def test_store_location_is_local_then_s3(store_location, tmp_path, s3_server):
    if store_location.is_local:
        assert store_location.url.startswith(str(tmp_path))
    else:
        assert store_location.url.startswith(f"s3://{s3_server.bucket}/")
    filesystem = store_location.filesystem()
    filesystem.create_dir(store_location.join("t"))
    with filesystem.open_output_stream(store_location.join("t", "f.bin")) as out:
        out.write(b"abc")
    with filesystem.open_input_stream(store_location.join("t", "f.bin")) as source:
        assert source.read() == b"abc"


def test_dask_reads_through_s3fs_with_the_servers_options(s3_store, s3_server):
    require_module("s3fs", package="s3fs")
    import s3fs

    filesystem = s3fs.S3FileSystem(**s3_server.s3fs_options(), skip_instance_cache=True)
    path = s3_store.join("t", "f.parquet")
    with filesystem.open(path, "wb") as out:
        pq.write_table(pa.table({"a": [1, 2, 3]}), out)
    assert filesystem.info(path)["size"] > 0
    assert pq.read_table(path, filesystem=s3_store.filesystem())["a"].to_pylist() == [1, 2, 3]


# -- the fault proxy ---------------------------------------------------------------------------


@pytest.fixture
def proxy(s3_env):
    with FaultProxy(s3_env.endpoint) as started:
        yield started
    assert not _listening(started.url)


def test_the_proxy_forwards_bodies_heads_and_errors_unchanged(proxy, s3_env):
    client = _no_retries(s3_env, proxy.url)
    body = os.urandom(300_000)
    client.put_object(Bucket=s3_env.bucket, Key="px/a", Body=body)
    assert client.head_object(Bucket=s3_env.bucket, Key="px/a")["ContentLength"] == len(body)
    assert client.get_object(Bucket=s3_env.bucket, Key="px/a")["Body"].read() == body
    assert client.get_object(Bucket=s3_env.bucket, Key="px/a", Range="bytes=10-19")["Body"].read() == body[10:20]
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError, match="NoSuchKey"):
        client.get_object(Bucket=s3_env.bucket, Key="px/none")
    counts = proxy.counts()
    assert counts["requests"] == {"PUT": 1, "HEAD": 1, "GET": 3}
    assert counts["statuses"] == {"200": 3, "206": 1, "404": 1} and counts["faults"] == {}
    path = f"/{s3_env.bucket}/px/a"
    assert proxy.log() == [("PUT", path, "200"), ("HEAD", path, "200"), ("GET", path, "200"), ("GET", path, "206"),
                           ("GET", f"/{s3_env.bucket}/px/none", "404")]
    proxy.reset_counts()
    assert proxy.log() == [] and proxy.counts()["requests"] == {}
    s3_env.delete_prefix("px/")


def test_slowdown_every_nth_request_is_s3s_503_and_never_reaches_the_server(proxy, s3_env):
    from botocore.exceptions import ClientError

    proxy.set_faults(slowdown_every=3, methods=("PUT",))
    client = _no_retries(s3_env, proxy.url)
    outcomes = []
    for index in range(1, 7):
        try:
            client.put_object(Bucket=s3_env.bucket, Key=f"slow/{index}", Body=b"x")
            outcomes.append("ok")
        except ClientError as error:
            assert error.response["Error"]["Code"] == "SlowDown"
            assert error.response["ResponseMetadata"]["HTTPStatusCode"] == 503
            outcomes.append("503")
    assert outcomes == ["ok", "ok", "503", "ok", "ok", "503"]
    assert sorted(s3_env.keys("slow/")) == [f"slow/{i}" for i in (1, 2, 4, 5)]
    client.list_objects_v2(Bucket=s3_env.bucket, Prefix="slow/")  # a GET: not among the faulted methods
    counts = proxy.counts()
    assert counts["requests"] == {"PUT": 6, "GET": 1} and counts["faults"] == {"slowdown": 2}
    assert b"<Code>SlowDown</Code>" in SLOWDOWN_BODY
    s3_env.delete_prefix("slow/")


def test_a_reset_connection_gets_no_response_and_the_request_is_not_applied(proxy, s3_env):
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError

    proxy.set_faults(reset_every=2)
    client = _no_retries(s3_env, proxy.url)
    client.put_object(Bucket=s3_env.bucket, Key="reset/1", Body=b"x")
    with pytest.raises((ConnectionClosedError, EndpointConnectionError, ConnectionError)):
        client.put_object(Bucket=s3_env.bucket, Key="reset/2", Body=b"x")
    assert s3_env.keys("reset/") == ["reset/1"]
    assert proxy.counts()["faults"] == {"reset": 1}
    assert [outcome for _, _, outcome in proxy.log()] == ["200", "reset"]
    s3_env.delete_prefix("reset/")


def test_after_forward_the_write_happens_but_the_client_sees_the_fault(proxy, s3_env):
    from botocore.exceptions import ClientError

    proxy.set_faults(slowdown_every=1, after_forward=True, budget=1)
    client = _no_retries(s3_env, proxy.url)
    with pytest.raises(ClientError, match="SlowDown"):
        client.put_object(Bucket=s3_env.bucket, Key="ambiguous/1", Body=b"x")
    assert s3_env.keys("ambiguous/") == ["ambiguous/1"]
    client.put_object(Bucket=s3_env.bucket, Key="ambiguous/2", Body=b"x")  # the budget is spent
    assert proxy.counts()["faults"] == {"slowdown": 1}
    s3_env.delete_prefix("ambiguous/")


def test_latency_delays_every_request(proxy, s3_env):
    proxy.set_faults(latency_s=0.5)
    client = _no_retries(s3_env, proxy.url)
    started = time.monotonic()
    client.list_objects_v2(Bucket=s3_env.bucket, Prefix="none/")
    client.list_objects_v2(Bucket=s3_env.bucket, Prefix="none/")
    assert 1.0 <= time.monotonic() - started < 10


def test_delta_rs_retries_through_slowdowns_and_every_row_lands(proxy, s3_store):
    """A sanity check of the proxy with delta-rs's own writer: 503 on every 4th request costs retries, not rows."""
    from deltalake import DeltaTable, write_deltalake

    proxy.set_faults(slowdown_every=4)
    options = dict(StoreLocation(s3_store.url, {**s3_store.storage_options, "AWS_ENDPOINT_URL": proxy.url})
                   .storage_options, **{"backoff_config.init_backoff": "20ms", "backoff_config.max_backoff": "200ms"})
    uri = s3_store.table_uri("t")
    for step in range(4):
        write_deltalake(uri, pa.table({"step": [step] * 10}), mode="append", storage_options=options)
    counts = proxy.counts()
    assert counts["faults"]["slowdown"] >= 3
    proxy.set_faults()
    assert DeltaTable(uri, storage_options=options).count() == 40


def test_the_proxy_stops_itself_after_its_lifetime(s3_env):
    proxy = FaultProxy(s3_env.endpoint, lifetime_s=1.0)
    try:
        assert _listening(proxy.url)
        deadline = time.monotonic() + 15
        while _listening(proxy.url) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _listening(proxy.url)
    finally:
        proxy.stop()
