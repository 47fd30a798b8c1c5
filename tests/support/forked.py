"""Run a function in a real forked child (os.fork) and get back what it returned, as JSON."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable


def in_forked_child(body: Callable[[], object]) -> object:
    """Fork; the child runs `body()` and hands its JSON-able result back through a pipe, then leaves
    with os._exit (never returning into pytest). Returns the child's result; raises AssertionError
    with the child's traceback when `body` raised, or when the child did not exit cleanly."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        status = 1
        try:
            os.close(read)
            try:
                message = {"result": body()}
            except BaseException:
                message = {"error": traceback.format_exc()}
            with os.fdopen(write, "w") as out:
                json.dump(message, out)
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read) as answer:
        text = answer.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the forked child failed: {text[-3000:]}"
    message = json.loads(text)
    assert "error" not in message, message["error"]
    return message["result"]
