"""`moescope query` as a user runs it, into a pipe whose reader stops early."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.deltafiles import write_run
from tests.support.paths import REPO

MOESCOPE = [sys.executable, "-m", "moescope.cli"]
STDOUT_CLOSED = 128 + 13  # what a shell reports for `git log | head`: git died of SIGPIPE


def _environment(buffered: bool) -> dict[str, str]:
    """The environment of a user's shell (stdout block-buffered into a pipe), or with PYTHONUNBUFFERED
    (as under some CI runners and in containers)."""
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return environment if buffered else {**environment, "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_a_reader_that_stops_after_one_line_ends_the_query_quietly(tmp_path, buffered):
    """`moescope query STORE SQL --max-rows 100000 | head -1`, with a real pipe: 100 000 rows are far
    more than a pipe holds, so the command is still printing when head exits."""
    write_run(tmp_path, "r", steps=2)
    query = subprocess.Popen([*MOESCOPE, "query", str(tmp_path), "SELECT * FROM range(100000)", "--max-rows",
                              "100000"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=_environment(buffered))
    head = subprocess.Popen(["head", "-1"], stdin=query.stdout, stdout=subprocess.PIPE)
    query.stdout.close()  # head holds the only reading end: when it exits, the pipe is closed
    first, _ = head.communicate(timeout=120)
    err = query.stderr.read()
    query.stderr.close()
    assert query.wait(120) == STDOUT_CLOSED, err
    assert first.decode().strip() == "range"
    assert err == b"", "no error line, no traceback, no 'Exception ignored'"


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_a_pipe_closed_before_the_first_line_ends_the_query_quietly(tmp_path, buffered):
    """Buffered, a short answer stays in Python's buffer until exit, and the interpreter's own last
    flush into the closed pipe printed "Exception ignored ... BrokenPipeError" (status 120)."""
    write_run(tmp_path, "r", steps=2)
    reading, writing = os.pipe()
    os.close(reading)  # the reader is gone before the command prints anything
    try:
        done = subprocess.run([*MOESCOPE, "query", str(tmp_path), "SELECT count(*) AS n FROM steps"], cwd=REPO,
                              stdout=writing, stderr=subprocess.PIPE, env=_environment(buffered), timeout=120,
                              check=False)
    finally:
        os.close(writing)
    assert done.returncode == STDOUT_CLOSED and done.stderr == b""
