"""`moescope dashboard`: the command line, the settings it hands the app, and gate requests."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from moescope.cli import dashboard as cli
from moescope.dashboard import settings
from moescope.dashboard.gate_requests import REQUESTS_TABLE, GateRequestError, write_request
from moescope.store.location import StoreLocation
from moescope.store.store import Store
from tests.support.paths import REPO
from tests.support.sigterm import default_signals, started


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moescope")
    cli.add_subcommands(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_subcommand_defaults_and_flags():
    args = parse(["dashboard", "runs/demo"])
    assert (args.host, args.port, args.allow_writes, args.tokenizer) == ("127.0.0.1", 8501, False, None)
    assert args.func is cli.run
    args = parse(["dashboard", "s", "--host", "0.0.0.0", "--port", "9000", "--allow-writes", "--tokenizer", "tok"])
    assert (args.host, args.port, args.allow_writes, args.tokenizer) == ("0.0.0.0", 9000, True, "tok")


def test_help_teaches(capsys):
    with pytest.raises(SystemExit):
        parse(["dashboard", "--help"])
    text = capsys.readouterr().out
    for needle in ("STORE", "--allow-writes", "--tokenizer", "127.0.0.1", "trust_gate_requests", "examples:"):
        assert needle in text


def test_command_is_headless_streamlit_bound_to_the_host(tmp_path):
    args = parse(["dashboard", str(tmp_path), "--port", "8600", "--allow-writes", "--tokenizer", str(tmp_path)])
    command = cli.command(args)
    assert command[1:4] == ["-m", "streamlit", "run"] and command[4].endswith("dashboard/app.py")
    pairs = dict(zip(command[5::2], command[6::2]))
    assert pairs["--server.address"] == "127.0.0.1" and pairs["--server.port"] == "8600"
    assert pairs["--server.headless"] == "true" and pairs["--browser.gatherUsageStats"] == "false"
    loaded = settings.load(cli.environment(args))
    assert loaded == settings.Settings(store=str(tmp_path), allow_writes=True, tokenizer=str(tmp_path),
                                       refresh_s=settings.DEFAULT_REFRESH_S)


def test_a_store_url_reaches_the_app_with_its_options_and_state_folder_only(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-the-settings")
    args = parse(["dashboard", "s3://bucket/fleet/", "--storage-option", "endpoint=http://127.0.0.1:9000",
                  "--storage-option", "region=eu-west-1", "--state-dir", str(tmp_path / "state")])
    env = cli.environment(args)
    loaded = settings.load(env)
    assert loaded == settings.Settings(store="s3://bucket/fleet", refresh_s=settings.DEFAULT_REFRESH_S,
                                       storage_options={"AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
                                                        "AWS_REGION": "eu-west-1"},
                                       state_dir=str(tmp_path / "state"))
    # the child gets the credentials from the environment it inherits, never inside a setting
    assert not [k for k, v in env.items() if k.startswith("MOESCOPE_DASHBOARD") and "not-for-the-settings" in v]
    by_hand = settings.load({}, ["s3://bucket/fleet", "--storage-option", "endpoint=http://127.0.0.1:9000"])
    assert by_hand.location == StoreLocation("s3://bucket/fleet", {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"})


@pytest.mark.parametrize("argv, says", [
    (["s3://bucket/fleet", "--storage-option", "aws_secret_access_key=xyz"], "environment"),
    (["gopher://bucket/fleet"], "not supported"),
])
def test_a_store_that_cannot_be_opened_is_refused_before_the_server_starts(argv, says, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "xyz" not in err


def test_settings_from_script_arguments_and_missing():
    loaded = settings.load({}, ["runs/x", "--allow-writes"])
    assert loaded.store == "runs/x" and loaded.allow_writes and loaded.tokenizer is None
    assert settings.load({}, []) is None


def test_missing_tokenizer_folder_is_refused(tmp_path, capsys):
    assert cli.main([str(tmp_path), "--tokenizer", str(tmp_path / "nope")]) == 2
    assert "no tokenizer folder" in capsys.readouterr().err


def test_gate_request_is_an_atomic_store_row(tmp_path):
    root = str(tmp_path / "store")
    row = write_request(root, "run-1", 2, 5, 0.0, "  NaN outputs  ")
    assert row["reason"] == "NaN outputs" and row["requested_at"] <= dt.datetime.now(dt.timezone.utc)
    write_request(root, "run-1", 2, 5, 0.3, "recovered", action="release")
    written = Store(root).sql(
        f"SELECT layer, expert, action, weight, reason FROM {REQUESTS_TABLE} ORDER BY requested_at")
    assert written.values.tolist() == [[2, 5, "override", 0.0, "NaN outputs"], [2, 5, "release", 1.0, "recovered"]]
    assert not list((tmp_path / "store").rglob(".tmp-*")) and not list((tmp_path / "store").rglob("*.inprogress"))
    for bad in [{"weight": 1.5}, {"weight": -0.1}, {"reason": " "}, {"expert": -1}, {"action": "mask"}]:
        kwargs = {"layer": 0, "expert": 0, "weight": 0.5, "reason": "why"} | bad
        with pytest.raises(GateRequestError):
            write_request(root, "run-1", **kwargs)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_killed_dashboard_stops_its_streamlit_server(tmp_path, signum):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = REPO
    proc = subprocess.Popen([sys.executable, "-m", "moescope.cli", "dashboard", str(tmp_path), "--port", str(port)],
                            cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=default_signals)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not _answers(port):
            assert proc.poll() is None and time.monotonic() < deadline, "the dashboard did not come up"
            time.sleep(0.2)
        children = _children(proc.pid)
        assert children, "streamlit runs as a child process"
        proc.send_signal(signum)
        sent = time.monotonic()
        assert proc.wait(timeout=30) == 0  # a stop that was asked for, once its child is gone
        assert time.monotonic() - sent < 10, "not within the 10 s grace period"
        for child in children:
            assert not os.path.exists(f"/proc/{child}") or _is_zombie(child), "the Streamlit child outlived the CLI"
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.connect(("127.0.0.1", port))
    finally:
        for pid in [proc.pid, *children]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(5)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# The dashboard command around a server that ignores SIGTERM (as a hung one would): what the
# command does when its child will not stop.
STUBBORN = """
import sys
from moescope.cli import dashboard as cli
cli.command = lambda args: [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                            "print('server up', flush=True); time.sleep(600)"]
sys.exit(cli.main(sys.argv[1:]))
"""


@contextlib.contextmanager
def stubborn_dashboard(store, *extra: str):
    with started([sys.executable, "-c", STUBBORN, str(store), *extra]) as child:
        server: list[int] = []
        try:
            child.wait_for_line("server up", "out", timeout_s=60)
            server = _children(child.pid)
            assert len(server) == 1
            yield child, server[0]
        finally:
            for pid in server:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_a_second_sigterm_kills_the_server_and_exits_at_once(tmp_path):
    with stubborn_dashboard(tmp_path) as (child, server):
        child.signal()
        child.wait_for_line("moescope dashboard: SIGTERM received, draining")
        assert _alive(server), "the server ignores SIGTERM, so the command waits for it"
        sent = child.signal()
        assert child.exit_status(10) == 143
        assert time.monotonic() - sent < 3
        assert not _alive(server), "the server outlived the command"


def test_a_server_that_outlives_the_grace_period_is_killed_and_the_command_exits_1(tmp_path):
    with stubborn_dashboard(tmp_path, "--grace-period", "1") as (child, server):
        sent = child.signal()
        assert child.exit_status(15) == 1
        assert 1 <= time.monotonic() - sent < 5
        assert not _alive(server), "the server outlived the command"
        assert "could not drain within the 1 s grace period" in child.err[-1]


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and not _is_zombie(pid)
