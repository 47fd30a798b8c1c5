"""Fixtures every suite may use: a real S3 server and a store location on it or on a local folder.

- `s3_server` (session): moto's S3 API in its own process (tests/s3server.py), started on first
  use and always stopped at the end of the session.
- `s3_store`: a `StoreLocation` for a fresh `s3://moescope-test/<test>-<random>` prefix; the
  server's credentials are in the environment for the test (as a fleet's processes get them) and
  restored after; the prefix's objects are deleted after the test.
- `store_location`: parametrised over "local" (a tmp folder) and "s3" (`s3_store`), for the store
  suites that must behave the same on both.
- `java`: the `java` program PySpark needs (Debian's default-jre-headless), by tests/realparts.py's rule.

A missing Python package of the test extra (moto, boto3) skips its tests, naming the package;
under CI=true it fails them (tests/realparts.py).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.realparts import in_ci, require_program

STORE_KINDS = ("local", "s3")


def require_module(module: str, *, package: str) -> None:
    """Skip the calling test when `module` cannot be imported, naming the pip package; fail it under CI."""
    if importlib.util.find_spec(module) is not None:
        return
    message = f"{module} is not installed: install it with `pip install '{package}'` (the test extra has it)"
    if in_ci():
        pytest.fail(f"{message}. CI=true: a test that needs a real server fails without it", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server (signatures checked) in its own process, for the whole session."""
    require_module("moto", package="moto[server]")
    require_module("boto3", package="boto3")
    from tests.s3server import S3Server

    server = S3Server(set_environment=False)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The server's credentials in os.environ for this test (and nothing of the machine's own AWS set-up)."""
    from tests.s3server import CLEARED_ENV

    for key in CLEARED_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in s3_server.environment().items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture
def s3_store(s3_env, request):
    """A StoreLocation for a fresh prefix of the test bucket; its objects are deleted after the test."""
    prefix = s3_env.fresh_prefix(request.node.name)
    yield s3_env.location(prefix)
    if s3_env.running:
        s3_env.delete_prefix(prefix + "/")


@pytest.fixture(params=STORE_KINDS)
def store_location(request, tmp_path):
    """A StoreLocation on a local folder or on the S3 server: the same store suite runs on both."""
    if request.param == "s3":
        return request.getfixturevalue("s3_store")
    from moescope.store.location import open_location

    return open_location(tmp_path / "store")


@pytest.fixture(scope="session")
def java():
    """The path of `java` (PySpark's JVM); skips naming default-jre-headless, fails under CI."""
    return require_program("java", "/usr/bin/java", package="default-jre-headless")
