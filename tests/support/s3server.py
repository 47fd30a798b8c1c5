"""A real S3 API for the tests: moto's server on 127.0.0.1, in its own process.

`S3Server` starts `python tests/support/s3server.py` (moto's `ThreadedMotoServer` on a free port) and
talks HTTP to it like any S3 client: boto3, delta-rs, pyarrow's S3FileSystem, s3fs. The server
runs in its OWN process because some delta-rs calls (`DeltaTable.history()`) hold the GIL while
they wait for the network: a server thread in the test process could then never answer, and the
call would hang until its HTTP timeout.

The server checks request signatures (moto's IAM authentication, switched on once the server has
made its user): a client with a wrong secret gets 403 as from AWS. The user's key is put in the
environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) while the server runs, which is where
moescope and every library it uses take credentials from; `storage_options` holds only what is not
a secret (endpoint, region, plain http, path-style addressing), as `StoreLocation` requires.

    with S3Server() as s3:
        loc = s3.location("my-test")        # StoreLocation("s3://moescope-test/my-test")

The child exits when the parent closes its stdin: on `stop()`, and when the parent dies.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

BUCKET = "moescope-test"
REGION = "us-east-1"
START_TIMEOUT_S = 60.0

# The environment the server's clients get for its lifetime. Session tokens and profiles of the
# machine running the tests would otherwise be signed in (or searched for) too.
CLEARED_ENV = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3")


class S3Server:
    """moto's S3 server in a child process, a bucket in it, and the credentials to reach it.

    auth: check request signatures (the default), so wrong credentials are refused as by AWS.
    set_environment: put the server's credentials in `os.environ` from `start()` to `stop()` (and
    restore what was there).
    """

    def __init__(self, *, auth: bool = True, set_environment: bool = True, bucket: str = BUCKET):
        self.auth = auth
        self.bucket = bucket
        self.set_environment = set_environment
        self.endpoint = ""
        self.access_key = ""
        self.secret_key = ""
        self._proc: subprocess.Popen[str] | None = None
        self._stderr: Any = None
        self._saved_env: dict[str, str | None] | None = None

    # -- lifetime -----------------------------------------------------------------------------

    def start(self) -> S3Server:
        """Start the server, make its user and bucket; returns self. Raises RuntimeError (with the
        child's stderr) when it does not come up within START_TIMEOUT_S."""
        if self._proc is not None:
            return self
        self._stderr = tempfile.TemporaryFile(mode="w+")
        env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", "--bucket", self.bucket,
             *(["--auth"] if self.auth else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)
        try:
            ready = self._read_line(START_TIMEOUT_S)
            info = json.loads(ready)
        except BaseException:
            self.stop()
            raise
        self.endpoint = info["endpoint"]
        self.access_key, self.secret_key = info["access_key"], info["secret_key"]
        if self.set_environment:
            self._saved_env = {k: os.environ.get(k) for k in (*CLEARED_ENV, *self.environment())}
            for key in CLEARED_ENV:
                os.environ.pop(key, None)
            os.environ.update(self.environment())
        return self

    def stop(self) -> None:
        """Stop the server and restore the environment; safe to call twice."""
        if self._saved_env is not None:
            for key, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            self._saved_env = None
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_child(proc)
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _read_line(self, timeout_s: float) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            readable, _, _ = select.select([self._proc.stdout], [], [], 0.2)
            if readable:
                line = self._proc.stdout.readline()
                if line:
                    return line
            if self._proc.poll() is not None:
                break
        raise RuntimeError(f"the S3 test server did not start (exit {self._proc.poll()}): {self._child_stderr()}")

    def _child_stderr(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read()[-4000:]

    # -- what clients need --------------------------------------------------------------------

    def environment(self) -> dict[str, str]:
        """The credentials, as the environment variables every client reads."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}

    def storage_options(self, endpoint: str | None = None, **extra: str) -> dict[str, str]:
        """delta-rs / StoreLocation options to reach the server (or `endpoint`, e.g. a fault proxy in
        front of it): no secrets in them."""
        return {"AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_REGION": REGION, "AWS_ALLOW_HTTP": "true",
                "AWS_FORCE_PATH_STYLE": "true", **extra}

    def url(self, prefix: str = "", bucket: str | None = None) -> str:
        path = prefix.strip("/")
        return f"s3://{bucket or self.bucket}" + (f"/{path}" if path else "")

    def location(self, prefix: str = "", *, endpoint: str | None = None, bucket: str | None = None,
                 **extra: str) -> Any:
        """A `moescope.store.location.StoreLocation` for `s3://<bucket>/<prefix>` on this server."""
        from moescope.store.location import StoreLocation

        return StoreLocation(self.url(prefix, bucket), self.storage_options(endpoint, **extra))

    def fresh_prefix(self, hint: str = "t") -> str:
        """A prefix no other test uses: `hint` (made S3-safe) and a random suffix."""
        safe = re.sub(r"[^A-Za-z0-9._-]+", "-", hint).strip("-")[:60] or "t"
        return f"{safe}-{uuid.uuid4().hex[:8]}"

    def s3fs_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """`storage_options` for s3fs / fsspec (Dask): endpoint and region; credentials from the environment."""
        return {"endpoint_url": endpoint or self.endpoint, "client_kwargs": {"region_name": REGION}}

    def client(self, endpoint: str | None = None, *, access_key: str | None = None,
               secret_key: str | None = None, **config: Any) -> Any:
        """A boto3 S3 client for the server (or `endpoint`); `config` goes to botocore's Config."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=endpoint or self.endpoint, region_name=REGION,
                            aws_access_key_id=access_key or self.access_key,
                            aws_secret_access_key=secret_key or self.secret_key,
                            config=Config(s3={"addressing_style": "path"}, **config))

    def keys(self, prefix: str = "", bucket: str | None = None) -> list[str]:
        """Every object key under `prefix`, listed through the S3 API."""
        client = self.client()
        keys: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket or self.bucket, Prefix=prefix):
            keys.extend(item["Key"] for item in page.get("Contents", ()))
        return keys

    def delete_prefix(self, prefix: str, bucket: str | None = None) -> int:
        """Delete every object under `prefix` (keeps the server's memory bounded); returns how many."""
        keys = self.keys(prefix, bucket)
        client = self.client()
        for start in range(0, len(keys), 1000):
            client.delete_objects(Bucket=bucket or self.bucket,
                                  Delete={"Objects": [{"Key": k} for k in keys[start:start + 1000]], "Quiet": True})
        return len(keys)


# -- the child process ---------------------------------------------------------------------------

_ALLOW_ALL = json.dumps({"Version": "2012-10-17",
                         "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]})


def _serve(bucket: str, auth: bool) -> int:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    import boto3
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin
    from moto.server import ThreadedMotoServer

    settings.INITIAL_NO_AUTH_ACTION_COUNT = float("inf")  # open until the user exists
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        setup = dict(endpoint_url=endpoint, region_name=REGION, aws_access_key_id="setup",
                     aws_secret_access_key="setup")
        access_key, secret_key = "moescope-test-key", "moescope-test-secret"
        if auth:
            iam = boto3.client("iam", **setup)
            iam.create_user(UserName="moescope-test")
            created = iam.create_access_key(UserName="moescope-test")["AccessKey"]
            iam.put_user_policy(UserName="moescope-test", PolicyName="everything", PolicyDocument=_ALLOW_ALL)
            access_key, secret_key = created["AccessKeyId"], created["SecretAccessKey"]
        boto3.client("s3", **setup).create_bucket(Bucket=bucket)
        if auth:
            settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # from here on every request is checked
            ActionAuthenticatorMixin.request_count = 0
        print(json.dumps({"endpoint": endpoint, "access_key": access_key, "secret_key": secret_key}), flush=True)
        for _ in sys.stdin:  # until the parent closes stdin (stop(), or it died)
            pass
    finally:
        server.stop()
    return 0



def stop_child(proc: subprocess.Popen) -> None:
    """Stop a helper process started with a stdin pipe: closing its stdin is its signal to stop;
    killed if it has not gone within 10 s. Used by the S3 server and the fault proxy."""
    try:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait(timeout=10)
    if proc.stdout:
        proc.stdout.close()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="moto's S3 server for the tests (started by S3Server)")
    parser.add_argument("--serve", action="store_true", required=True)
    parser.add_argument("--bucket", default=BUCKET)
    parser.add_argument("--auth", action="store_true")
    args = parser.parse_args()
    # run by path, this folder leads sys.path: its packages (store, probe, ...) must not shadow anything
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.exit(_serve(args.bucket, args.auth))

