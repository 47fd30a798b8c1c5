"""Fleet processes writing one store, and raw reads of its Delta log, for the fleet suites."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from tests.support.paths import REPO


class Child:
    """One process of the fleet: `python -m MODULE ROLE ...` from the repository root (this module's
    entry points by default).
    stdout lines are collected by a thread (`lines`), stderr goes to a file (`stderr()`), stdin
    stays open: a line on it is the child's cue (`send`), closing it the signal to stop."""

    def __init__(self, role: str, args: list[str], env: dict[str, str] | None = None,
                 module: str = "tests.integration.store.test_fleet"):
        self.role = role
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", module, role, *args], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def send(self, line: str) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def close_stdin(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def has(self, prefix: str) -> bool:
        return any(line.startswith(prefix) for line in self.lines)

    def result(self) -> dict[str, Any]:
        """The JSON of the child's `result ...` line (it prints one as it exits)."""
        for line in reversed(self.lines):
            if line.startswith("result "):
                return json.loads(line[len("result "):])
        raise AssertionError(f"{self.role} (pid {self.proc.pid}, exit {self.proc.poll()}) printed no result: "
                             f"{self.stderr()[-3000:]}")

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        return code

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()

    def stop(self) -> None:
        """Kill the process if it still runs and let go of its pipes; safe twice."""
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if stream:
                    stream.close()
        self._reader.join(timeout=10)
        self._stderr.close()


@contextlib.contextmanager
def fleet_processes() -> Iterator[list[Child]]:
    """A list to start children into; every one is stopped on the way out, whatever happened."""
    children: list[Child] = []
    try:
        yield children
    finally:
        for child in children:
            child.stop()


def raw_filesystem(url: str, storage_options: dict[str, str]) -> tuple[Any, str]:
    """A pyarrow filesystem for the store and the store's root path in it (credentials from the
    environment, as the fleet's processes get them)."""
    from pyarrow import fs

    if "://" not in url:
        return fs.LocalFileSystem(), url
    endpoint = urlsplit(storage_options["AWS_ENDPOINT_URL"])
    filesystem = fs.S3FileSystem(endpoint_override=endpoint.netloc, scheme=endpoint.scheme,
                                 region=storage_options.get("AWS_REGION", "us-east-1"), force_virtual_addressing=False)
    return filesystem, url.split("://", 1)[1]


def delta_files(url: str, storage_options: dict[str, str], table: str) -> tuple[int, list[str]]:
    """(version, the live data files as paths of `raw_filesystem`) of the table's latest snapshot, by delta-rs."""
    import deltalake

    uri = f"{url.rstrip('/')}/{table}" if "://" in url else os.path.join(url, table)
    delta_table = deltalake.DeltaTable(uri, storage_options=storage_options or None)
    files = [u.split("://", 1)[1] if "://" in u else u for u in delta_table.file_uris()]
    return delta_table.version(), files


def raw_table(url: str, storage_options: dict[str, str], table: str) -> Any:
    """Every row of the table's latest snapshot, read file by file with pyarrow (page checksums
    verified), `run_id` taken from each file's folder; a `file` column says where each row was."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    filesystem, _ = raw_filesystem(url, storage_options)
    _, files = delta_files(url, storage_options, table)
    parts = []
    for path in files:
        data = pq.read_table(path, filesystem=filesystem, page_checksum_verification=True, partitioning=None)
        run_id = next(p.split("=", 1)[1] for p in path.split("/") if p.startswith("run_id="))
        data = data.append_column("run_id", pa.array([run_id] * data.num_rows, pa.string()))
        parts.append(data.append_column("file", pa.array([path] * data.num_rows, pa.string())))
    if not parts:
        return pa.table({})
    return pa.concat_tables(parts, promote_options="default")


def log_actions(url: str, storage_options: dict[str, str], table: str) -> dict[str, int]:
    """Counts over the table's raw `_delta_log/*.json` commits: commits, adds, removes, removes with
    dataChange false (compaction), checkpoints; and the versions of the first compaction (a commit
    removing files without changing data) and of the last append (adding files, removing none)."""
    from pyarrow import fs

    filesystem, root = raw_filesystem(url, storage_options)
    log_dir = f"{root.rstrip('/')}/{table}/_delta_log" if "://" in url else os.path.join(root, table, "_delta_log")
    counts: collections.Counter[str] = collections.Counter()
    for info in filesystem.get_file_info(fs.FileSelector(log_dir)):
        name = info.path.rsplit("/", 1)[-1]
        if name.endswith(".checkpoint.parquet"):
            counts["checkpoints"] += 1
        if not name.endswith(".json") or name.startswith("_"):
            continue
        counts["commits"] += 1
        version = int(name.split(".", 1)[0])
        with filesystem.open_input_stream(info.path) as stream:
            actions = [json.loads(line) for line in stream.read().decode().splitlines() if line.strip()]
        adds = sum("add" in a for a in actions)
        removes = [a["remove"] for a in actions if "remove" in a]
        counts["adds"] += adds
        counts["removes"] += len(removes)
        compacted = sum(not r.get("dataChange", True) for r in removes)
        counts["compacted_removes"] += compacted
        if compacted:
            counts["first_compaction"] = min(counts.get("first_compaction", version), version)
        elif adds and not removes:
            counts["last_append"] = max(counts.get("last_append", version), version)
    return dict(counts)


def duplicated_keys(data: Any, key: tuple[str, ...]) -> int:
    """Rows whose key another row of `data` also has."""
    if not data.num_rows:
        return 0
    groups = data.group_by(list(key)).aggregate([([], "count_all")])
    counts = groups.column("count_all").to_pylist()
    return sum(n - 1 for n in counts if n > 1)
