"""The training monitor inside a job that gets SIGTERM (a preemption, `kill`, Kubernetes): a real
training loop in a real process (tests/support/children/sigterm_training_child.py), real signals, and the
store read from its raw Parquet files."""

from __future__ import annotations

import signal
import sys
import time

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

import moescope.training as training
from tests.support.sigterm import parquet_files, parquet_rows, started

pytestmark = pytest.mark.integration


def training_job(store, mode: str, *extra: str):
    return started([sys.executable, "-m", "tests.support.children.sigterm_training_child", str(store), mode, *extra])


def printed_steps(child) -> list[int]:
    return [int(line.split()[1]) for line in list(child.out) if line.startswith("step ")]


def sigterm_after_steps(child, store, steps: int = 5) -> tuple[float, list[int]]:
    """Wait for `steps` optimizer steps, check nothing is in the store yet (it flushes every 60 s),
    send SIGTERM; returns when it was sent and the steps printed by then."""
    child.wait_for(lambda: len(printed_steps(child)) >= steps, what=f"{steps} optimizer steps")
    assert not parquet_files(store, "steps") and not parquet_files(store, "train_steps")
    sent = child.signal()
    return sent, printed_steps(child)


def assert_every_step_recorded(store, printed: list[int]) -> int:
    """Every optimizer step the job took is in train_steps (both layers) with its record in steps;
    returns how many optimizer steps the store holds."""
    train = parquet_rows(store, "train_steps")
    taken = sorted({r["optimizer_step"] for r in train})
    # the step under way when the signal came may have ended (and been recorded) before its print
    assert taken == list(range(1, len(taken) + 1)) and len(taken) in (printed[-1], printed[-1] + 1)
    assert sorted((r["optimizer_step"], r["layer"]) for r in train) == [(s, layer) for s in taken for layer in (0, 1)]
    records = {(r["step"], r["step_end"]) for r in parquet_rows(store, "steps")}
    assert {(r["step"], r["step_end"]) for r in train} <= records
    # and no more than one record beyond them: the forward of a step the signal cut short
    assert len(taken) <= len(records) <= len(taken) + 1
    return len(taken)


def test_sigterm_drains_every_step_writes_the_final_probe_stats_and_exits_0(tmp_path):
    store = tmp_path / "store"
    with training_job(store, "plain") as child:
        sent, before = sigterm_after_steps(child, store)
        assert child.exit_status(20) == 0, child.output()
        took = time.monotonic() - sent
    assert took < 10, f"exited {took:.1f} s after SIGTERM; the grace period is 10 s"
    assert "moescope training monitor: SIGTERM received, draining" in "\n".join(child.err)
    printed = printed_steps(child)
    assert printed[: len(before)] == before
    assert_every_step_recorded(store, printed)
    records = len(parquet_rows(store, "steps"))
    final = [r for r in parquet_rows(store, "probe_stats") if r["table_name"] == "steps" and r["reason"] is None]
    assert final and final[-1]["written_rows"] == records  # the final snapshot, written by the drain
    assert [r["last_step"] for r in parquet_rows(store, "run_ends")] == [records - 1]


def test_a_sigterm_during_an_optimizer_step_waits_for_its_end_and_records_it(tmp_path):
    store = tmp_path / "store"
    with training_job(store, "slow-step") as child:
        child.wait_for_line("in step 3", "out")  # the job's pre-hook: the update of step 3 is under way
        child.signal()
        assert child.exit_status(20) == 0, child.output()
    assert printed_steps(child) == [1, 2]  # the job never printed step 3: the monitor ended it in the step
    assert assert_every_step_recorded(store, [3]) == 3  # ... after recording it
    assert len(parquet_rows(store, "steps")) == 3


def test_the_jobs_own_sigterm_handler_runs_after_the_drain_and_decides_how_the_job_ends(tmp_path):
    store = tmp_path / "store"
    with training_job(store, "own-handler") as child:
        sigterm_after_steps(child, store)
        assert child.exit_status(20) == 75, child.output()  # the job's own exit, not the monitor's
    taken = assert_every_step_recorded(store, printed_steps(child))
    [seen] = [line for line in child.out if line.startswith("job handler:")]
    # the job's handler found every train_steps row (2 layers a step) and the final probe_stats already written
    train_rows, stats_rows = int(seen.split()[2]), int(seen.split()[5])
    assert train_rows == 2 * taken and stats_rows >= 1
    assert child.out[-1] == "job: checkpoint saved, exiting 75"


def test_a_second_sigterm_exits_at_once(tmp_path):
    store = tmp_path / "store"
    with training_job(store, "slow-drain", "60") as child:  # one exporter takes 120 s to shut down
        sigterm_after_steps(child, store)
        child.wait_for_line("SIGTERM received, draining")
        sent = child.signal()
        assert child.exit_status(10) == 143, child.output()
        assert time.monotonic() - sent < 3
    assert "moescope training monitor: second SIGTERM, exiting now without draining" in child.err[-1]


def test_a_drain_past_the_grace_period_exits_1_when_it_ends(tmp_path):
    store = tmp_path / "store"
    with training_job(store, "slow-drain", "1.5") as child:
        sent, _ = sigterm_after_steps(child, store)
        assert child.exit_status(20) == 1, child.output()
        took = time.monotonic() - sent
    assert 1.5 <= took < 6, took
    assert "moescope training monitor: could not drain within the 1.5 s grace period" in child.err[-1]


def test_the_handler_is_the_monitors_while_it_runs_and_the_jobs_again_after_close(tmp_path):
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                             num_experts_per_tok=2, vocab_size=64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def job_handler(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, job_handler)
    try:
        monitor = training.watch(model, optimizer, store=tmp_path / "a")
        assert signal.getsignal(signal.SIGTERM) is not job_handler
        monitor.close()
        assert signal.getsignal(signal.SIGTERM) is job_handler
        monitor = training.watch(model, optimizer, store=tmp_path / "b", stop_on_sigterm=False)
        assert signal.getsignal(signal.SIGTERM) is job_handler  # left to the job
        monitor.close()
    finally:
        signal.signal(signal.SIGTERM, before)
