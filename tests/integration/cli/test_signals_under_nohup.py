"""The tests that stop a child with a signal pass when the suite runs under `nohup` in a background
job: SIGHUP, SIGINT and SIGTERM ignored in pytest itself, which its children inherit."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.support.paths import REPO

# One test per way a test starts the child it signals: tests.support.sigterm's Child (SIGTERM and
# SIGINT), a plain Popen (SIGINT to `moescope proxy`), and the only one that sends SIGHUP.
SIGNAL_TESTS = [
    "tests/integration/core/test_lifecycle.py::test_first_signal_drains_and_the_loop_returns_0",
    "tests/integration/ingest/test_proxy.py::test_the_command_runs_as_a_process_and_writes_on_interrupt",
    "tests/integration/cli/test_dashboard_command.py::test_a_killed_dashboard_stops_its_streamlit_server[1]",
]


def _as_a_background_job() -> None:
    """What a shell does to a job started with `&` (SIGINT ignored), and SIGTERM ignored too; nohup
    adds SIGHUP."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@pytest.mark.slow
def test_the_signal_tests_pass_under_nohup_with_the_signals_ignored():
    run = subprocess.run(["nohup", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SIGNAL_TESTS],
                         cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=_as_a_background_job,
                         check=False)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "4 passed" in run.stdout, run.stdout[-2000:]
