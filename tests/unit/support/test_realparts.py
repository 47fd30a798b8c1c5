"""The rule for missing real programs: skip with advice on a workstation, fail in CI."""

from __future__ import annotations

import sys

import pytest

from tests.support.realparts import in_ci, require_program

MISSING = "moescope-no-such-program"


def test_a_missing_program_skips_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(BaseException) as raised:  # a skip is an exception too: take any, then check which
        require_program(MISSING, package="pkg")
    assert raised.type is pytest.skip.Exception
    assert raised.match(f"{MISSING} is not installed.*apt-get install -y pkg")


@pytest.mark.parametrize("value", ["true", "TRUE", "1"])
def test_a_missing_program_fails_in_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    assert in_ci()
    with pytest.raises(BaseException) as raised:  # not a skip: a failure
        require_program(MISSING, package="pkg")
    assert raised.type is pytest.fail.Exception
    assert raised.match("CI=true")


def test_an_installed_program_is_found_by_name_or_path(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert require_program(MISSING, sys.executable, package="python3") == sys.executable
    monkeypatch.setenv("CI", "false")
    assert not in_ci()
