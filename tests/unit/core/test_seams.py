"""The exporter seam: exporters added to a running pipeline (BatchProcessor.add_exporter) and to a
probe session (ProbeSession.add_exporter, bind_trust_policy), and the trust gate's modes defined once."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import torch

import moescope
from moescope.core.exporters import AttachListener, BindsProcessor, DrainListener, InMemoryExporter, ProbeStatsReader
from moescope.core.pipeline import BatchProcessor
from moescope.core.records import StepRecord
from tests.support.zoo import tiny_model


class Ordered(InMemoryExporter[int]):
    """Keeps its records and writes its name into a shared log at each batch."""

    def __init__(self, name: str, log: list[str], delay_s: float = 0.0) -> None:
        super().__init__()
        self.name, self.log, self.delay_s = name, log, delay_s
        self.closed = 0

    def export(self, records: Sequence[int]) -> bool:
        self.log.append(self.name)
        time.sleep(self.delay_s)
        return super().export(records)

    def shutdown(self) -> None:
        self.closed += 1


def test_exporters_added_while_the_worker_exports_each_get_every_batch_from_then_on():
    log: list[str] = []
    base = Ordered("base", log, delay_s=0.0005)
    processor: BatchProcessor[int] = BatchProcessor([base], max_batch=4, flush_interval_s=0.05)
    records = list(range(2000))
    emitter = threading.Thread(target=lambda: [processor.emit(r) for r in records])
    emitter.start()
    added = []
    while emitter.is_alive() and len(added) < 40:  # added while batches are being exported
        exporter = Ordered(f"added-{len(added)}", log)
        processor.add_exporter(exporter)
        added.append(exporter)
        time.sleep(0.002)
    emitter.join()
    processor.shutdown()
    assert base.records == records
    assert len(added) > 1
    for exporter in added:  # whole batches, in order, from the one after it joined to the last
        assert exporter.records == records[len(records) - len(exporter.records):]
        assert exporter.closed == 1  # shut down with the processor
    assert processor.exporters == (base, *added)
    assert processor.drop_counts() == ({}, {})


def test_an_exporter_added_first_sees_each_batch_before_the_others():
    log: list[str] = []
    later, first = Ordered("later", log), Ordered("first", log)
    processor: BatchProcessor[int] = BatchProcessor([later])
    processor.add_exporter(first, first=True)
    processor.emit(1)
    assert processor.force_flush(30)
    processor.shutdown()
    assert log == ["first", "later"] and processor.exporters == (first, later)


def test_the_exporters_are_changed_only_through_add_exporter_and_not_after_shutdown():
    processor: BatchProcessor[int] = BatchProcessor([])
    assert not hasattr(processor.exporters, "append")  # a snapshot: nothing appends behind the worker's back
    processor.shutdown()
    with pytest.raises(ValueError, match="shut down"):
        processor.add_exporter(InMemoryExporter[int]())


class Listening(InMemoryExporter[StepRecord], AttachListener, BindsProcessor[StepRecord], ProbeStatsReader):
    def __init__(self) -> None:
        super().__init__()
        self.run = self.processor = self.stats = None

    def on_attach(self, run):
        self.run = run

    def bind_processor(self, processor):
        self.processor = processor

    def bind_probe_stats(self, source):
        self.stats = source


def test_a_session_introduces_an_exporter_added_to_it_as_one_given_at_attach():
    model = tiny_model("mixtral", seed=0)
    with moescope.attach(model, window=1) as session:
        late = Listening()
        session.add_exporter(late)
        assert late.run is session.run and late.processor is session.processor
        assert late.stats is not None and late.stats() == session.probe_stats()
        with torch.no_grad():
            model(input_ids=torch.randint(0, model.config.vocab_size, (2, 6)))
        session.flush()
        assert [r.step for r in late.records] == [0]
    with pytest.raises(ValueError, match="closed"):
        session.add_exporter(InMemoryExporter[StepRecord]())


def test_a_session_runs_one_trust_policy_bound_through_it():
    model = tiny_model("mixtral", seed=0)
    with moescope.attach(model, trust_gate="manual") as session:
        policy = session.trust
        assert policy is not None and policy in session.processor.exporters
        with pytest.raises(ValueError, match="already runs a trust policy"):
            session.bind_trust_policy(policy)
        with pytest.raises(AttributeError):
            session.trust = None  # type: ignore[misc]  # bound through the session, never set from outside


def test_the_trust_gate_modes_are_defined_once():
    from moescope import probe
    from moescope.alerts import trust_policy

    assert trust_policy.TRUST_GATE_MODES is probe.TRUST_GATE_MODES == (None, "manual", "auto")
    with pytest.raises(ValueError, match="trust_gate"):
        moescope.attach(tiny_model("mixtral", seed=0), trust_gate="sometimes")


class Draining(Ordered):
    """Logs each flush, and the drain, in the shared log; a `DrainListener`."""

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        self.log.append(f"{self.name} flush")
        return True

    def on_drain(self) -> None:
        self.log.append(f"{self.name} drain")


class Flushing(Ordered):
    """Logs each flush; not a `DrainListener`."""

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        self.log.append(f"{self.name} flush")
        return True


def test_the_pipeline_tells_a_drain_listener_it_drains_after_the_last_record_and_flushes_the_others():
    log: list[str] = []
    listener, plain = Draining("listener", log), Flushing("plain", log)
    assert isinstance(listener, DrainListener) and not isinstance(plain, DrainListener)
    processor: BatchProcessor[int] = BatchProcessor([listener, plain], flush_interval_s=60)
    for record in range(10):
        processor.emit(record)
    processor.force_flush()
    del log[:]
    processor.emit(10)
    processor.shutdown()
    processor.shutdown()  # twice: told once
    # the last record is exported to both, then the listener is told (once, instead of a last flush)
    assert log == ["listener", "plain", "listener drain", "plain flush"]
    assert listener.records == plain.records == list(range(11))
    assert listener.closed == plain.closed == 1  # shut down after the drain, as every exporter
