"""Fork safety: delta-rs's runtime does not survive `fork` (a forked child's first delta call raises
PanicException, a BaseException). A child forked after this process used delta-rs routes every
delta call of this package through a helper process it starts on first use (a fresh interpreter,
started with `subprocess`, so no user `__main__` is re-run); only metadata crosses, as JSON
(`moescope.store.delta.messages`), never Arrow data: `write_part` is pyarrow and runs in the child itself.

Every public call of the package starts with `if routed(): return call_helper(op, ...)`, and runs its
delta work through `guarded`, which also catches the panic of a runtime inherited through a fork this
process could not see (code we cannot see started it) and switches to the helper there and then.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from moescope.core import forking
from moescope.store.delta import tables
from moescope.store.delta.errors import CommitError, clean, message
from moescope.store.delta.messages import ERRORS, decode, encode, receive, send
from moescope.store.errors import StoreError
from moescope.store.location import StoreLocation

__all__ = ["call_helper", "guarded", "routed", "serve"]

log = logging.getLogger(__name__)

_ROUTE = False  # this process is a child forked after delta-rs's runtime started: calls go through the helper
_HELPER: _Helper | None = None
_HELPER_LOCK = threading.Lock()


def guarded(call: Callable[[], Any], loc: StoreLocation, op: str, *args: Any, **kwargs: Any) -> Any:
    """Run a delta call in this process; a PanicException from a runtime this process inherited
    through a fork (one we could not see being used) switches the process to the helper and retries
    there (`op(loc, *args, **kwargs)`); an OSError or a delta-rs error becomes a StoreError naming the
    table (`args[0]`)."""
    global _ROUTE
    try:
        return call()
    except StoreError:
        raise
    except Exception as e:
        if not isinstance(e, OSError) and not _is_delta_error(e):
            raise
        raise StoreError(message(f"{op} on {loc.redacted}/{args[0] if args else ''} failed", e)) from e
    except BaseException as e:
        if type(e).__name__ != "PanicException" or "fork" not in str(e).lower():
            raise
        log.info("moescope: delta-rs's runtime came through a fork; this process now commits through a helper")
        _ROUTE = True
        if "app_unseen" in kwargs:  # whatever the runtime did before it panicked, look before committing again
            kwargs = {**kwargs, "app_unseen": False}
        return call_helper(op, loc, *args, **kwargs)


def _is_delta_error(error: BaseException) -> bool:
    deltalake = sys.modules.get("deltalake")
    return deltalake is not None and isinstance(error, deltalake.exceptions.DeltaError)


def routed() -> bool:
    """Whether this process's delta calls go through its helper process."""
    return _ROUTE


def _reset_in_child() -> None:
    """In a forked child: forget the parent's helper; route delta calls through a helper of our own
    if the parent had started delta-rs's runtime (or deltalake was imported by code we cannot see,
    which may have). The parent's tables and filesystems are forgotten by their own modules."""
    global _ROUTE, _HELPER, _HELPER_LOCK
    _ROUTE = _ROUTE or tables.runtime_used() or "deltalake" in sys.modules
    helper, _HELPER = _HELPER, None
    if helper is not None:
        helper.forget()
    _HELPER_LOCK = threading.Lock()


class _Helper:
    """A fresh interpreter that runs this package's delta calls for a forked child. It starts with
    `subprocess` (not multiprocessing's spawn, which re-imports the user's `__main__` and would re-run
    a script without a main guard) and talks over a socket pair in length-prefixed JSON messages
    (`moescope.store.delta.messages`; never pickle); it exits when the child's end closes."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        code = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
                "from moescope.store.delta.helper import serve; serve(int(sys.argv[2]))")
        try:
            self.process = subprocess.Popen([sys.executable, "-c", code, json.dumps(sys.path), str(theirs.fileno())],
                                            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        self.connection = ours
        self.lock = threading.Lock()

    def call(self, op: str, args: tuple, kwargs: dict) -> Any:
        """`op`'s result in the helper; the StoreError it raised there, raised here; EOFError or
        OSError when the helper is gone."""
        with self.lock:
            send(self.connection, {"op": op, "args": [encode(a) for a in args],
                                   "kwargs": {k: encode(v) for k, v in kwargs.items()}})
            answer = receive(self.connection)
        if "error" in answer:
            error = answer["error"]
            raise ERRORS.get(error.get("type"), StoreError)(error.get("message", "the delta helper failed"))
        return decode(answer.get("ok"))

    def forget(self) -> None:
        """In a forked grandchild: close our copy of the connection (the helper is the parent's)."""
        try:
            self.connection.close()
        except OSError:
            pass

    def close(self) -> None:
        """Close our end (the helper then exits) and wait for it, at most 10 s."""
        self.forget()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def call_helper(op: str, *args: Any, **kwargs: Any) -> Any:
    """Run `op(*args, **kwargs)` of this package in the helper (started on first use; started again,
    once, if it died: a commit retried there is not made twice, its app transaction says so)."""
    global _HELPER
    for attempt in range(2):
        with _HELPER_LOCK:
            if _HELPER is None:
                _HELPER = _Helper()
            helper = _HELPER
        if attempt and "app_unseen" in kwargs:  # the helper that died may have made the commit: look for it
            kwargs = {**kwargs, "app_unseen": False}
        try:
            return helper.call(op, args, kwargs)
        except (EOFError, OSError) as e:
            with _HELPER_LOCK:
                if _HELPER is helper:
                    _HELPER = None
            helper.forget()
            if attempt:
                loc = args[0] if args and isinstance(args[0], StoreLocation) else None
                raise CommitError(message(f"the delta helper process of this forked process failed during "
                                          f"{op} on {loc.redacted if loc else 'the store'}", e)) from e
    raise AssertionError("unreachable")


def serve(fd: int) -> None:
    """The helper's loop: answer each {op, args, kwargs} with {"ok": result} or {"error": {type,
    message}}: a StoreError keeps its class (one of this package's), anything else becomes a
    StoreError with the error's cleaned text."""
    # Imported here: the operations route through this module, and the helper process alone serves.
    from moescope.store.delta.commits import checkpoint, commit, create_table
    from moescope.store.delta.retention import vacuum
    from moescope.store.delta.snapshots import snapshot, table_exists, transaction_version

    connection = socket.socket(fileno=fd)
    ops: dict[str, Callable[..., Any]] = {"commit": commit, "snapshot": snapshot, "table_exists": table_exists,
                                          "vacuum": vacuum, "create_table": create_table, "checkpoint": checkpoint,
                                          "transaction_version": transaction_version}
    while True:
        try:
            request = receive(connection)
        except (EOFError, OSError):
            return
        try:
            args = [decode(a) for a in request["args"]]
            kwargs = {k: decode(v) for k, v in request["kwargs"].items()}
            answer: dict[str, Any] = {"ok": encode(ops[request["op"]](*args, **kwargs))}
        except StoreError as e:
            name = type(e).__name__ if type(e) in ERRORS.values() else "StoreError"
            answer = {"error": {"type": name, "message": str(e)}}
        except Exception as e:
            answer = {"error": {"type": "StoreError", "message": clean(e)}}
        try:
            send(connection, answer)
        except (EOFError, OSError):
            return


forking.join_module(_reset_in_child)
