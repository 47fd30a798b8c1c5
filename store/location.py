"""Where a store lives: a local folder or an object-storage URL, and how to reach it.

`store=` is a local path (as before) or a URL: `s3://bucket/prefix` (AWS S3, and S3-compatible
servers — MinIO, Ceph, R2 — through `endpoint`), `gs://bucket/prefix`, `az://container/prefix`
(where delta-rs and pyarrow support them). `open_location(store, storage_options)` turns either into
a `StoreLocation`, which every reader and writer takes.

Credentials never reach the store, a log line or the dashboard: they come from the standard
environment chain (AWS_* variables, `~/.aws` profiles, instance roles; GOOGLE_* ; AZURE_*), which
both delta-rs and pyarrow read themselves. `storage_options` carries what is not a secret: endpoint,
region, path-style addressing, allowing plain http for a local test server, retry settings. A key
that looks like a secret is refused there, with a message that names the environment variable to
use instead. Messages name a location by `redacted` (userinfo and query stripped), never by what
the user typed.

State that cannot live on object storage (the alerts outbox, a SQLite file) stays beside a local
store, under `<store>/.moescope/`; for a URL store it goes to a local folder, by default
`~/.cache/moescope/<hash of the redacted URL>` (`state_dir`, `make_state_dir`).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

__all__ = ["LOCAL_STATE", "SCHEMES", "LocationError", "StoreLocation", "cache_root", "make_state_dir", "open_location",
           "parse_storage_options", "state_dir"]

SCHEMES = ("s3", "gs", "az")
LOCAL_STATE = ".moescope"  # a local store's own state folder, under its root

# storage_options keys users give on the command line, in the spelling delta-rs (object_store)
# takes; short names map to them. Retry keys must be lowercase for object_store to honour them.
_ALIASES = {
    "endpoint": "AWS_ENDPOINT_URL",
    "endpoint_url": "AWS_ENDPOINT_URL",
    "aws_endpoint_url": "AWS_ENDPOINT_URL",
    "region": "AWS_REGION",
    "aws_region": "AWS_REGION",
    "allow_http": "AWS_ALLOW_HTTP",
    "aws_allow_http": "AWS_ALLOW_HTTP",
    "force_path_style": "AWS_FORCE_PATH_STYLE",
    "aws_force_path_style": "AWS_FORCE_PATH_STYLE",
    "virtual_hosted_style_request": "AWS_VIRTUAL_HOSTED_STYLE_REQUEST",
}
_SECRET = re.compile(r"(secret|password|token|session|credential|access_key|sas|account_key)", re.IGNORECASE)


class LocationError(ValueError):
    """A store location that cannot be used as given; the message says what to do."""


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if not parts.scheme or parts.scheme == "file":
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return f"{parts.scheme}://{host}{parts.path}"


def parse_storage_options(pairs: Sequence[str] | Mapping[str, Any] | None) -> dict[str, str]:
    """`--storage-option key=value` pairs (or a dict) as the options delta-rs and pyarrow take.

    Short names are accepted (`endpoint`, `region`, `allow_http`, `force_path_style`); other keys go
    through as given (e.g. `max_retries`, `retry_timeout`, `timeout`). Raises LocationError for a
    pair without `=`, an empty key, or a key that holds a secret (give those in the environment)."""
    if pairs is None:
        return {}
    items: list[tuple[str, Any]]
    if isinstance(pairs, Mapping):
        items = list(pairs.items())
    else:
        items = []
        for pair in pairs:
            key, sep, value = str(pair).partition("=")
            if not sep or not key.strip():
                raise LocationError(f"--storage-option {pair!r}: give KEY=VALUE, e.g. endpoint=http://127.0.0.1:9000")
            items.append((key.strip(), value))
    options: dict[str, str] = {}
    for key, value in items:
        if _SECRET.search(key):
            raise LocationError(
                f"storage option {key!r} holds a secret: give credentials in the environment instead "
                "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or AWS_PROFILE for s3://, "
                "GOOGLE_APPLICATION_CREDENTIALS for gs://, AZURE_STORAGE_* for az://), so it never reaches "
                "a command line, a log or the store")
        name = _ALIASES.get(key.lower(), key)
        if isinstance(value, bool):
            value = "true" if value else "false"
        options[name] = str(value)
    return options


@dataclass(frozen=True)
class StoreLocation:
    """A store's root: `url` is an absolute local folder, or `scheme://bucket/prefix` without a
    trailing slash. `storage_options` are delta-rs's (object_store's) options, secrets excluded."""

    url: str
    storage_options: Mapping[str, str] = field(default_factory=dict)

    @property
    def scheme(self) -> str:
        return urlsplit(self.url).scheme if "://" in self.url else ""

    @property
    def is_local(self) -> bool:
        return not self.scheme

    @property
    def redacted(self) -> str:
        """The location as messages, logs and the dashboard show it."""
        return _redact(self.url)

    def __repr__(self) -> str:  # storage options stay out of reprs and tracebacks
        return f"StoreLocation({self.redacted!r})"

    def table_uri(self, table: str) -> str:
        """Where table `table` lives, as delta-rs and pyarrow's filesystems take it."""
        return os.path.join(self.url, table) if self.is_local else f"{self.url}/{table}"

    def join(self, *parts: str) -> str:
        """A path below the root, for `filesystem()` (no scheme for object storage)."""
        if self.is_local:
            return os.path.join(self.url, *parts)
        base = self.url.split("://", 1)[1]
        return "/".join([base.rstrip("/"), *parts])

    def filesystem(self) -> Any:
        """A `pyarrow.fs.FileSystem` for this location (credentials from the environment chain)."""
        from pyarrow import fs

        if self.is_local:
            return fs.LocalFileSystem()
        if self.scheme == "s3":
            options = {k.upper(): v for k, v in self.storage_options.items()}
            endpoint = options.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
            kwargs: dict[str, Any] = {}
            if endpoint:
                parts = urlsplit(endpoint)
                kwargs["endpoint_override"] = parts.netloc or parts.path
                kwargs["scheme"] = parts.scheme or "https"
            region = options.get("AWS_REGION") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            if region:
                kwargs["region"] = region
            if options.get("AWS_FORCE_PATH_STYLE", "").lower() == "true":
                kwargs["force_virtual_addressing"] = False
            # a file is one PUT, not a multipart upload's three requests (POST, PUT, POST)
            return fs.S3FileSystem(allow_delayed_open=True, **kwargs)
        if self.scheme == "gs":
            return fs.GcsFileSystem()
        return fs.AzureFileSystem(account_name=os.environ.get("AZURE_STORAGE_ACCOUNT_NAME", ""))


def open_location(store: str | os.PathLike | StoreLocation,
                  storage_options: Mapping[str, Any] | Sequence[str] | None = None) -> StoreLocation:
    """`store=` as a `StoreLocation`: a local path (made absolute) or a URL of a supported scheme.

    Raises LocationError for an unknown scheme, a URL without a bucket, or a secret among the options.
    A `StoreLocation` passes through (with `storage_options`, if given, merged over its own)."""
    if isinstance(store, StoreLocation):
        if not storage_options:
            return store
        return StoreLocation(store.url, {**store.storage_options, **parse_storage_options(storage_options)})
    text = os.fspath(store)
    options = parse_storage_options(storage_options)
    if "://" not in text:
        if options:
            raise LocationError(f"storage options apply to object storage (s3://, gs://, az://), not to the local "
                                f"folder {text!r}")
        return StoreLocation(os.path.abspath(text))
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme == "file":
        return StoreLocation(os.path.abspath(parts.path))
    if scheme in ("s3a", "s3n"):
        scheme = "s3"
    if scheme not in SCHEMES:
        raise LocationError(f"store {_redact(text)!r}: the scheme {parts.scheme!r} is not supported; give a local "
                            f"folder or a URL of {', '.join(s + '://' for s in SCHEMES)}")
    if not parts.hostname:
        raise LocationError(f"store {_redact(text)!r} names no bucket: give {scheme}://BUCKET/PREFIX")
    if parts.username or parts.password:
        raise LocationError(f"store {_redact(text)!r}: credentials do not go in the URL; give them in the "
                            "environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE for s3://)")
    if parts.query or parts.fragment:
        raise LocationError(f"store {_redact(text)!r}: a query or fragment is not part of a store URL; give "
                            "options with --storage-option KEY=VALUE")
    path = parts.path.rstrip("/")
    return StoreLocation(f"{scheme}://{parts.hostname}{path}", options)


def cache_root() -> str:
    """moescope's folder under the user's cache: `$XDG_CACHE_HOME/moescope`, else `~/.cache/moescope`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moescope")


def state_dir(location: StoreLocation, given: str | os.PathLike | None = None) -> str:
    """The local folder for a store's state that cannot live on object storage (it is not created
    here): `given` if set; `<root>/.moescope` for a local store (where it always was); for a URL
    store `~/.cache/moescope/<hash>`, the hash of the redacted URL, so every command on one machine
    that names the same store finds the same state, and the folder's name holds no part of the URL."""
    if given:
        return os.path.abspath(os.fspath(given))
    if location.is_local:
        return os.path.join(location.url, LOCAL_STATE)
    digest = hashlib.sha256(location.redacted.encode()).hexdigest()[:16]
    return os.path.join(cache_root(), digest)


def make_state_dir(location: StoreLocation, given: str | os.PathLike | None = None) -> str:
    """`state_dir`, created; for a URL store it holds a `STORE` file naming the store (redacted), so
    a person looking through ~/.cache/moescope can tell whose state it is. Raises OSError."""
    path = state_dir(location, given)
    os.makedirs(path, exist_ok=True)
    if not location.is_local:
        marker = os.path.join(path, "STORE")
        if not os.path.exists(marker):
            with open(marker, "w", encoding="utf-8") as fh:
                fh.write(location.redacted + "\n")
    return path
