"""The store's work in a process of its own: records in over a pipe, Delta commits out.

    probe session ──emit──► BatchProcessor ──export──► ProcessExporter ══ socket ══► writer process
                                                                                   DeltaExporter ──► commits

A decode forward that runs Python code needs the interpreter lock, and so does everything the
store does with a record: Arrow tables from its fields, Parquet files, Delta commits. In the
model's process that work takes the lock from the model's thread; `ProcessExporter` hands each
batch of records to a writer process instead, as one frame of compact arrays with a declared layout
(`moescope.core.wire`: never pickle), and that process runs the store's own `DeltaExporter` on
them. The model's process keeps only the frame's encoding and a wait on a socket, which holds no
lock. The writer process is a fresh interpreter started with `subprocess` (never a fork of the
model's process, whose threads and delta-rs runtime do not survive a fork), at a lower scheduling
priority (`WRITER_NICE`), and imports neither torch nor the model's code.

What the in-process exporter guarantees holds here too:

- **bounded memory**: a batch is handed over and answered before the next (a request each), so
  what waits is the pipeline's queue (bounded in bytes and records, with its "block" or "drop"
  policy and its drop counts) plus one batch in flight, and the writer process buffers at most a
  flush interval per table, as `DeltaExporter` does;
- **kill -9 of the model's process**: the writer process reads the end of its pipe, commits what
  it buffers and the run's counts, and exits (no `run_ends` row: the session did not close). So the
  loss is at most what was queued in the model's process, less than a flush interval;
- **a writer process that dies** (killed, out of memory) is noticed at the next batch or flush (the
  pipeline flushes every `flush_interval_s`): the rows it held are counted as lost
  (`writer_died`, in `probe_stats` and `session.probe_stats()`), an error is logged, and a new one is
  started, which gets the batch that found the old one gone. After `MAX_RESTARTS` failed starts in
  a row it is not started again: every later record is counted as dropped (`writer_failed`) and said
  so once in the log;
- **draining**: the pipeline's last flush (`on_drain`, when the session closes or a SIGTERM drains
  the process) sends the last batch and waits for the writer process to commit its buffers and the
  `run_ends` row, then for it to exit;
- **fork**: a forked child that records (a training worker) starts a writer process of its own at
  its first record; the parent's stays the parent's.

Errors that the in-process exporter raises at attach (a store that cannot be reached, a previous
release's store, a run id that cannot be a folder) are raised here at attach too: `on_attach` waits
for the writer process to open the store. The `probe_stats` and `run_ends` rows carry the writer
process's pid, the part names too (a writer's pid keeps its part names its own).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from moescope.core import wire
from moescope.core.exporters import AttachListener, BindsProcessor, DrainListener, Exporter, ForkAware, WritesRows
from moescope.core.pipeline import BatchProcessor
from moescope.core.records import RunInfo, StepRecord
from moescope.store.location import StoreLocation, open_location

__all__ = ["MAX_RESTARTS", "WRITER_NICE", "ProcessExporter", "serve"]

log = logging.getLogger(__name__)

# The writer process runs this much nicer than the model's process: the model's threads come first
# when the cores are busy, and the writer catches up when they wait (its queue is bounded).
WRITER_NICE = 10
# Writer processes started in a row without one that answered before the pipeline gives up on the store.
MAX_RESTARTS = 3
START_TIMEOUT_S = 120.0  # a writer process's start and its store's opening (an object store may be slow)


class _Child:
    """One writer process and our end of its socket."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        code = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
                "from moescope.store.writer_process import serve; serve(int(sys.argv[2]))")
        try:
            self.process = subprocess.Popen([sys.executable, "-c", code, json.dumps(sys.path), str(theirs.fileno())],
                                            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, close_fds=True)  # its log goes to stderr
        finally:
            theirs.close()
        self.connection = ours

    @property
    def pid(self) -> int:
        return self.process.pid

    def request(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Its answer; EOFError or OSError when it is gone (TimeoutError is an OSError)."""
        self.connection.settimeout(timeout_s)
        wire.send(self.connection, wire.encode(message))
        answer = wire.decode(wire.receive(self.connection))
        if not isinstance(answer, dict):
            raise EOFError("the writer process answered what it should not")
        return answer

    def forget(self) -> None:
        """Close our end without waiting (in a forked child: the process is the parent's)."""
        try:
            self.connection.close()
        except OSError:
            pass

    def close(self, timeout_s: float = 30.0) -> None:
        """Close our end (it then exits) and wait for it; kill it if it does not exit in time."""
        self.forget()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.error("moescope: the store's writer process %d did not exit in %.0f s; killed", self.pid, timeout_s)
            self.process.kill()
            self.process.wait()


class ProcessExporter(Exporter[StepRecord], AttachListener, BindsProcessor[StepRecord], WritesRows, ForkAware,
                      DrainListener):
    """The probe pipeline's exporter to a store through a writer process; see the module doc.

    `moescope.attach(model, store, writer="process")` makes one. It takes what `DeltaExporter` takes
    and writes the same rows; `written_rows` and the drop counts come back from the writer process
    with each answer.

    Args:
        store: a folder or a URL (`moescope.store.location.open_location`, with `storage_options`).
        max_rows: rows per table at which a buffer is written (default 262144).
        max_age_s: seconds after a buffer's first row at which it is written (default 5.0).
        max_bytes: bytes per table at which a buffer is written (default 64 MiB).
        storage_options: how to reach a URL store (a dict or `key=value` strings; no secrets).

    Raises:
        moescope.store.location.LocationError: for a store that cannot be used as given.
    """

    def __init__(self, store: str | os.PathLike | StoreLocation, max_rows: int = 256 * 1024, max_age_s: float = 5.0,
                 max_bytes: int = 64 * 1024 * 1024, storage_options: Mapping[str, Any] | Sequence[str] | None = None):
        self.location = open_location(store, storage_options)
        self.options = {"max_rows": max_rows, "max_age_s": max_age_s, "max_bytes": max_bytes}
        self.run: RunInfo | None = None
        self.processor: BatchProcessor[StepRecord] | None = None
        self._child: _Child | None = None
        self._lock = threading.Lock()  # one request at a time: the pipeline's worker, and close
        self._written_before: Counter[str] = Counter()  # rows earlier writer processes wrote
        self._written: Counter[str] = Counter()  # rows the current one wrote
        self._buffered: dict[str, int] = {}  # rows the current one holds, per table (lost if it dies)
        self._reported: Counter[tuple[str, str]] = Counter()  # drops the writer processes counted
        self._run_rows = True  # the next writer process writes the run's own rows (runs, layers)
        self._failed_starts = 0
        self._given_up = False
        self._closed = False

    # -- what the session asks ----------------------------------------------------------------------

    def bind_processor(self, processor: BatchProcessor[StepRecord]) -> None:
        """Take the probe's processor: its drop counts go into `probe_stats`, and the writer process's into it."""
        self.processor = processor

    def on_attach(self, run: RunInfo) -> None:
        """Start the writer process and have it open the store and write the run's own rows.

        Raises:
            InvalidNameError: for a run id or rank that cannot be part of a path.
            StoreAccessError: for a store that cannot be reached.
            LegacyStoreError: for a store written before Delta tables.
            StoreError: for a writer process that could not start.
        """
        self.run = run
        with self._lock:
            try:
                self._start()
            except _StartFailed as e:
                raise e.error from None

    @property
    def written_rows(self) -> Counter[str]:
        """Rows written per table by this exporter's writer processes (as they last said)."""
        return self._written_before + self._written

    @property
    def writer_pid(self) -> int | None:
        """The pid of the writer process now running, or None."""
        child = self._child
        return child.pid if child is not None else None

    def after_fork_in_child(self) -> None:
        """A forked child that records starts a writer process of its own at its first record; the
        rows buffered at the fork, the run's own rows and the parent's writer process are the parent's."""
        if self._child is not None:
            self._child.forget()
        self._child = None
        self._lock = threading.Lock()
        self._written_before, self._written, self._buffered = Counter(), Counter(), {}
        self._reported = Counter()
        self._run_rows = False
        self._failed_starts, self._given_up = 0, False

    # -- the exporter -------------------------------------------------------------------------------

    def export(self, records: Sequence[StepRecord]) -> bool:
        """Hand `records` to the writer process and wait for its answer (on the pipeline's worker,
        which holds no interpreter lock while it waits).

        Returns:
            False once shut down (the records are refused); True otherwise: records a dead writer
                process lost are counted (`writer_died`, `writer_failed`), not refused.
        """
        if self._closed:
            return False
        self._call({"op": "export", "records": list(records)}, list(records))
        return True

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Have the writer process write every buffer and its changed counts; a dead one is noticed here.

        Args:
            timeout_s: accepted for the exporter interface; the writes are not cut short (as
                `DeltaExporter`'s are not).

        Returns:
            True (failed writes are counted as dropped rows, not returned).
        """
        if not self._closed and self.run is not None:
            self._call({"op": "flush"}, [])
        return True

    def on_drain(self) -> None:
        """The pipeline drains: the writer process commits its buffers, the run's end and counts, and exits."""
        self.shutdown()

    def shutdown(self) -> None:
        """Have the writer process write what it buffers, the `run_ends` row and the counts, then exit.

        Safe to call twice; records exported afterwards are refused.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            child, self._child = self._child, None
            if child is None:
                return
            try:
                self._answered(child.request({"op": "shutdown", **self._parent_counts()}, timeout_s=START_TIMEOUT_S))
            except (EOFError, OSError, wire.WireError) as e:
                self._died(child, e, [])
            child.close()

    # -- the writer process -------------------------------------------------------------------------

    def _call(self, message: dict[str, Any], records: list[StepRecord]) -> None:
        """Send `message` to the writer process (started if none runs) and take its answer; a dead
        one is counted and replaced, and the message sent once more to the new one."""
        with self._lock:
            for attempt in range(2):
                if self._child is None:
                    if self._given_up:
                        self._count_lost(records, "writer_failed")
                        return
                    try:
                        self._start()
                    except _StartFailed:
                        self._count_lost(records, "writer_failed")
                        return
                child = self._child
                assert child is not None
                try:
                    answer = child.request({**message, **self._parent_counts()})
                except (EOFError, OSError, wire.WireError) as e:
                    self._died(child, e, records if attempt else [])
                    continue
                self._answered(answer)
                if "error" in answer:
                    log.error("moescope: the store's writer process failed at %s: %s", message["op"],
                              answer["error"].get("message"))
                return

    def _start(self) -> None:
        """Start a writer process and have it open the store (the run's rows first, if they are due).
        Raises _StartFailed, with the error to raise at attach."""
        assert self.run is not None
        child: _Child | None = None
        try:
            child = _Child()
            answer = child.request({"op": "attach", "store": self.location.url,
                                    "storage_options": dict(self.location.storage_options), "run": self.run,
                                    "run_rows": self._run_rows, **self.options}, timeout_s=START_TIMEOUT_S)
        except (EOFError, OSError, wire.WireError) as e:
            if child is not None:
                child.close(timeout_s=5)
            self._start_failed()
            raise _StartFailed(_store_error("StoreError", f"the store's writer process could not start: {e}")) from e
        if "error" in answer:
            child.close(timeout_s=5)
            self._start_failed()
            error = answer["error"]
            raise _StartFailed(_store_error(str(error.get("type")), str(error.get("message"))))
        self._child = child
        self._written, self._buffered = Counter(), {}
        self._answered(answer)
        self._failed_starts = 0

    def _start_failed(self) -> None:
        self._failed_starts += 1
        if self._failed_starts >= MAX_RESTARTS and not self._given_up:
            self._given_up = True
            log.error("moescope: the store's writer process failed to start %d times in a row; this session's "
                      "records are no longer written to %s and are counted as dropped (writer_failed)",
                      self._failed_starts, self.location.redacted)

    def _answered(self, answer: dict[str, Any]) -> None:
        """Take the writer process's counts: rows written, rows it holds, rows it lost."""
        self._written = Counter(answer.get("written", {}))
        self._buffered = dict(answer.get("buffered", {}))
        self._run_rows = bool(answer.get("run_rows_due", False))
        for table, reason, rows in answer.get("dropped", []):
            new = int(rows) - self._reported[(table, reason)]
            if new > 0:
                self._reported[(table, reason)] += new
                if self.processor is not None:
                    self.processor.count_dropped_rows(table, reason, new)

    def _died(self, child: _Child, error: BaseException, records: list[StepRecord]) -> None:
        """The writer process is gone: count what it held, and `records` (a batch it will not get)."""
        child.forget()
        try:
            status = child.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.process.kill()
            status = child.process.wait()
        held = dict(self._buffered)
        log.error("moescope: the store's writer process %d ended (exit status %s: %s); the rows it held (%s) are "
                  "counted as lost (writer_died)%s", child.pid, status, error,
                  ", ".join(f"{n} of {t}" for t, n in sorted(held.items())) or "none",
                  "" if self._closed else "; a new one is started")
        if self.processor is not None:
            for table, rows in held.items():
                self.processor.count_dropped_rows(table, "writer_died", int(rows))
        self._count_lost(records, "writer_died")
        self._written_before += self._written
        self._written, self._buffered = Counter(), {}
        self._child = None

    def _count_lost(self, records: list[StepRecord], reason: str) -> None:
        if self.processor is None:
            return
        for record in records:
            for table, rows in record.rows().items():
                self.processor.count_dropped_rows(table, reason, rows)

    def _parent_counts(self) -> dict[str, Any]:
        """The pipeline's drop counts for the writer process's `probe_stats`: those it counted itself
        left out (they are in its own counts)."""
        if self.processor is None:
            return {"parent_dropped": [], "parent_records": {}}
        rows, records = self.processor.drop_counts()
        mine = self._reported
        return {"parent_dropped": [[t, r, n - mine.get((t, r), 0)] for (t, r), n in rows.items()
                                   if n - mine.get((t, r), 0) > 0],
                "parent_records": dict(records)}


class _StartFailed(Exception):
    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def _store_error(name: str, text: str) -> Exception:
    """The exception the writer process raised, as the store's own class (imported only now)."""
    from moescope.store.delta.errors import CommitError, LegacyStoreError, StoreAccessError
    from moescope.store.errors import StoreError
    from moescope.store.location import LocationError
    from moescope.store.naming import InvalidNameError

    classes: dict[str, type[Exception]] = {cls.__name__: cls for cls in (
        StoreError, CommitError, StoreAccessError, LegacyStoreError, LocationError, InvalidNameError)}
    return classes.get(name, StoreError)(text)


# -- the writer process's side --------------------------------------------------------------------

class _ParentCounts:
    """The model process's pipeline drop counts, as its last message said (a `DropCounts`)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], int] = {}
        self.records: dict[str, int] = {}

    def take(self, message: dict[str, Any]) -> None:
        if "parent_dropped" in message:
            self.rows = {(str(t), str(r)): int(n) for t, r, n in message["parent_dropped"]}
            self.records = {str(k): int(v) for k, v in message.get("parent_records", {}).items()}

    def drop_counts(self) -> tuple[dict[tuple[str, str], int], dict[str, int]]:
        return dict(self.rows), dict(self.records)


def serve(fd: int) -> None:
    """The writer process's loop: answer each request of the model's process (attach, export, flush,
    shutdown) with the counts; at the end of the pipe (the model's process is gone), commit what is
    buffered and the counts, and return."""
    try:
        os.nice(WRITER_NICE)
    except OSError:
        pass
    from moescope.store.errors import StoreError
    from moescope.store.exporter import DeltaExporter
    from moescope.store.location import LocationError
    from moescope.store.naming import InvalidNameError

    connection = socket.socket(fileno=fd)
    exporter: DeltaExporter | None = None
    parent = _ParentCounts()
    while True:
        try:
            message = wire.decode(wire.receive(connection))
        except (EOFError, OSError, wire.WireError):
            if exporter is not None:  # the model's process is gone: keep what it handed over
                exporter.abandon()
            return
        op = message.get("op") if isinstance(message, dict) else None
        parent.take(message if isinstance(message, dict) else {})
        answer: dict[str, Any] = {}
        try:
            if op == "attach":
                exporter = DeltaExporter(message["store"], max_rows=int(message["max_rows"]),
                                         max_age_s=float(message["max_age_s"]), max_bytes=int(message["max_bytes"]),
                                         storage_options=message["storage_options"] or None)
                exporter.on_attach(message["run"], run_rows=bool(message["run_rows"]))
                assert exporter.writer is not None
                exporter.writer.watch(parent)
            elif exporter is None:
                raise StoreError(f"the writer process got {op!r} before attach")
            elif op == "export":
                exporter.export(message["records"])
            elif op == "flush":
                exporter.force_flush()
            elif op == "shutdown":
                exporter.shutdown()
            else:
                raise StoreError(f"the writer process got a request it does not know: {str(op)[:40]}")
        except (StoreError, LocationError, InvalidNameError) as e:
            answer["error"] = {"type": type(e).__name__, "message": str(e)}
        except Exception as e:  # told to the model's process, which logs it: never lost silently
            log.exception("moescope: the store's writer process failed at %s", op)
            answer["error"] = {"type": "StoreError", "message": f"{type(e).__name__}: {e}"}
        if exporter is not None:
            answer.update(exporter.state())
        try:
            wire.send(connection, wire.encode(answer))
        except OSError:
            if exporter is not None:
                exporter.abandon()
            return
        if op == "shutdown" or (op == "attach" and "error" in answer):
            return

