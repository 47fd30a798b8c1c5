"""The mutation check (`tests/support/mutations.py`) stays current: every mutation's piece is still in the
code exactly once, its tests exist, and a run whose guards were skipped is not called a survivor."""

from __future__ import annotations

import os

from tests.support import mutations


def test_every_mutation_still_finds_its_piece_once():
    assert mutations.check_pieces(mutations.REPO, mutations.MUTATIONS) == []


def test_every_mutation_names_tests_that_exist():
    for m in mutations.MUTATIONS:
        paths = [arg.split("::")[0] for arg in m.tests if arg.startswith("tests/")]
        assert paths, m.name
        for path in paths:
            assert os.path.isfile(os.path.join(mutations.REPO, path)), f"{m.name}: {path} is gone"


def test_a_moved_piece_is_reported(tmp_path):
    moved = mutations.Mutation("moved", "probe/trust_gate.py", "a piece that is not there", "x", ("tests",), "nothing")
    (problem,) = mutations.check_pieces(mutations.REPO, [moved])
    assert "found 0 times" in problem and "probe/trust_gate.py" in problem


def test_skipped_guards_are_counted(tmp_path):
    (tmp_path / "test_guard.py").write_text(
        "import pytest\n\n\ndef test_runs():\n    pass\n\n\n"
        "@pytest.mark.skip(reason='prometheus is not installed')\ndef test_guard():\n    pass\n")
    status, _, first, skipped = mutations.run_tests(str(tmp_path), ("test_guard.py",), timeout_s=120)
    assert (status, skipped) == (0, 1)
    assert "prometheus is not installed" in first
