"""moescope.cli.closed_pipe: which BrokenPipeError is the reader of stdout going away."""

from __future__ import annotations

import os

from moescope.cli import closed_pipe


def test_a_pipe_without_a_reader_is_closed_and_one_with_a_reader_or_a_file_is_not(tmp_path):
    reading, writing = os.pipe()
    with os.fdopen(writing, "w") as stream:
        assert not closed_pipe(stream)
        os.close(reading)
        assert closed_pipe(stream)
    with open(tmp_path / "out.txt", "w") as stream:
        assert not closed_pipe(stream)
    assert not closed_pipe(object())  # no descriptor (a replaced sys.stdout): not a pipe to give up on
