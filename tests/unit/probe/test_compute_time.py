"""Compute time per MoE layer (Recording.compute_time): against torch.profiler, and the attribution's arithmetic."""

from __future__ import annotations

import glob

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import moescope
import moescope.probe.timing
from moescope import probe
from moescope.core.exporters import InMemoryExporter
from moescope.probe.adapters import find_moe_layers
from tests.support.zoo import tiny_model

FORWARDS = 6


def _profiled(module: torch.nn.Module, name: str) -> None:
    """Wrap `module.forward` in a profiler range called `name` (instance attribute: undone by `del`)."""
    forward = module.forward

    def timed(*args, **kwargs):
        with record_function(name):
            return forward(*args, **kwargs)
    module.forward = timed


def _range_totals_s(prof: profile, names: set[str]) -> dict[str, float]:
    """Seconds summed over every profiler range of each name (the profiler's own clock)."""
    totals = dict.fromkeys(names, 0.0)
    for event in prof.events():
        if event.name in names:
            totals[event.name] += event.time_range.elapsed_us() / 1e6
    return totals


class _OuterRange:
    """A profiler range opened by a pre-hook registered before the probe's and closed by a forward
    hook registered after it: it encloses the probe's marks around the module."""

    def __init__(self, module: torch.nn.Module, name: str):
        self.module, self.name, self.open = module, name, []
        self.handles = [module.register_forward_pre_hook(self._start)]

    def _start(self, module, args):
        scope = record_function(self.name)
        scope.__enter__()
        self.open.append(scope)

    def close_after_probe(self) -> None:
        self.handles.append(self.module.register_forward_hook(self._end))

    def _end(self, module, args, output):
        self.open.pop().__exit__(None, None, None)


def test_cpu_block_and_expert_times_match_torch_profiler():
    # Switch runs its experts one module at a time: block times and per-expert times are both measured.
    # Each timed module gets two profiler ranges: "inner" inside its forward(), and "outer" opened
    # before the probe's pre-hook and closed after its forward hook. The probe's marks lie between
    # them, so inner <= probe <= outer whatever the machine's load (a preempted thread stretches
    # all three); the slack is for the two clocks (the profiler's and perf_counter): 1% + 50 us a call.
    model = tiny_model("switch_transformers", d_model=64, d_ff=512).eval()
    layers = find_moe_layers(model)
    names, outer = set(), []
    for layer in layers:
        modules = [(layer.block, f"block{layer.index}")]
        modules += [(m, f"expert{layer.index}.{e}") for e, m in enumerate(probe.timing.expert_modules(layer))]
        for module, name in modules:
            _profiled(module, f"inner {name}")
            outer.append(_OuterRange(module, f"outer {name}"))
            names |= {f"inner {name}", f"outer {name}"}
    exporter = InMemoryExporter()
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with probe.attach(model, [exporter], compute_time=True, window=FORWARDS, window_s=None) as session:
            for scope in outer:
                scope.close_after_probe()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(FORWARDS):
                    model(input_ids=ids, decoder_input_ids=ids)
            session.flush()
    (record,) = exporter.records
    assert record.forwards == FORWARDS
    totals = _range_totals_s(prof, names)
    calls = {name: sum(1 for e in prof.events() if e.name == name) for name in names}

    def between(seconds: float, name: str) -> None:
        slack = 50e-6 * calls[f"outer {name}"]
        inner, enclosing = totals[f"inner {name}"], totals[f"outer {name}"]
        assert inner * 0.99 - slack <= seconds <= enclosing * 1.01 + slack, (name, inner, seconds, enclosing)

    for ls in record.layers:
        assert calls[f"outer block{ls.layer}"] == FORWARDS
        between(ls.compute_time_s, f"block{ls.layer}")
        assert ls.expert_compute_time_measured is True
        for e, seconds in enumerate(ls.expert_compute_time_s):
            if ls.expert_load[e] == 0:  # an expert with no token is never called
                assert seconds == 0.0 and calls[f"outer expert{ls.layer}.{e}"] == 0
            else:
                assert seconds > 0
                between(seconds, f"expert{ls.layer}.{e}")
        assert ls.expert_compute_time_s.sum() < ls.compute_time_s
    for scope in outer:
        for handle in scope.handles:
            handle.remove()


class _Ticks:
    """A clock that moves 1/1024 s per read: a forward's marks then take exact, known values."""

    TICK = 1 / 1024

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.reads * self.TICK


def test_attributed_expert_times_split_the_experts_time_by_load(monkeypatch):
    # Mixtral's experts are fused weights: one module, its time attributed by load. With the tick
    # clock each layer reads block start, experts start, experts end, block end: the experts
    # module takes one tick per forward and the block three.
    clock = _Ticks()
    monkeypatch.setattr(probe.timing, "perf_counter", clock)
    model = tiny_model("mixtral").eval()
    layers = find_moe_layers(model)
    chosen: dict[int, list[torch.Tensor]] = {layer.index: [] for layer in layers}
    handles = [layer.experts.register_forward_pre_hook(
        lambda m, args, index=layer.index: chosen[index].append(args[1].detach().clone())) for layer in layers]
    exporter = InMemoryExporter()
    ids = torch.randint(0, 128, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), probe.attach(model, [exporter], compute_time=True, window=FORWARDS, window_s=None) as s:
        for i in range(FORWARDS):
            model(ids[:, : 4 + i])
        s.flush()
    for handle in handles:
        handle.remove()
    (record,) = exporter.records
    assert clock.reads == 4 * len(layers) * FORWARDS
    for ls in record.layers:
        # The model's own choice: the ids its experts module received.
        load = np.bincount(torch.cat([c.reshape(-1) for c in chosen[ls.layer]]).numpy(), minlength=8)
        experts_s = FORWARDS * _Ticks.TICK
        assert ls.compute_time_s == 3 * FORWARDS * _Ticks.TICK
        assert ls.expert_compute_time_measured is False
        np.testing.assert_allclose(ls.expert_compute_time_s, experts_s * load / load.sum(), rtol=1e-12)
        assert ls.expert_compute_time_s.sum() == pytest.approx(experts_s, rel=1e-12)


def _rows(root) -> list[dict]:
    """Every raw layer_steps row under a store folder."""
    return [row for path in sorted(glob.glob(str(root / "layer_steps" / "*" / "*.parquet")))
            for row in pq.read_table(path).to_pylist()]


def test_zero_experts_get_no_time_and_off_by_default(tmp_path):
    model = tiny_model("longcat_flash").eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with moescope.attach(model, store=tmp_path / "on", compute_time=True, window=1) as session:
            for _ in range(3):
                model(ids)
            session.flush()
        with moescope.attach(model, store=tmp_path / "off", window=1) as session:
            model(ids)
            session.flush()
    layer = find_moe_layers(model)[0]
    rows = _rows(tmp_path / "on")
    assert len(rows) == 3 * len(find_moe_layers(model))
    for row in rows:
        times = np.array(row["expert_compute_time_s"])
        load = np.array(row["expert_load"])
        assert len(times) == layer.num_experts + layer.zero_experts
        assert (times[layer.num_experts:] == 0).all()  # identity experts compute nothing
        assert row["expert_compute_time_measured"] is False
        routed = load[: layer.num_experts]
        np.testing.assert_allclose(times[: layer.num_experts] / times.sum(), routed / routed.sum(), rtol=1e-9)
        assert 0 < times.sum() < row["compute_time_s"]
    off = _rows(tmp_path / "off")
    assert off and all(r["compute_time_s"] is None and r["expert_compute_time_s"] is None for r in off)


def test_compute_time_hooks_are_removed_on_close():
    model = tiny_model("switch_transformers")
    before = {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}
    probe.attach(model, compute_time=True).close()
    assert {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()} == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: events are read on the writer")
def test_cuda_event_times_are_read_after_the_window_copy():
    # Device time of each block fits inside the forward's device time (events around the forward).
    model = tiny_model("mixtral", hidden_size=512, intermediate_size=2048).cuda().eval()
    exporter = InMemoryExporter()
    ids = torch.randint(0, 128, (8, 128), device="cuda")
    with torch.no_grad():
        model(ids)
        torch.cuda.synchronize()
        with probe.attach(model, [exporter], compute_time=True, window=FORWARDS, window_s=None) as session:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(FORWARDS):
                model(ids)
            end.record()
            session.flush()
    end.synchronize()
    (record,) = exporter.records
    assert sum(ls.compute_time_s for ls in record.layers) < start.elapsed_time(end) / 1e3
    for ls in record.layers:
        assert ls.compute_time_s > 0 and ls.expert_compute_time_measured is False
        assert ls.expert_compute_time_s.sum() <= ls.compute_time_s


def test_prometheus_histogram_counts_each_forward_at_its_window_mean():
    from moescope.prometheus.exporter import COMPUTE_BUCKETS, PrometheusExporter

    prometheus, records = PrometheusExporter(), InMemoryExporter()
    model = tiny_model("qwen3_moe").eval()
    with torch.no_grad(), probe.attach(model, [prometheus, records], compute_time=True, window=3,
                                       window_s=None) as session:
        for n in range(8):
            model(torch.randint(0, 128, (2, 4 + n)))
        session.flush()
    registry = prometheus.registry
    for layer in {ls.layer for r in records.records for ls in r.layers}:
        rows = [(ls.compute_time_s, ls.forwards) for r in records.records for ls in r.layers if ls.layer == layer]
        assert sum(f for _, f in rows) == 8
        label = {"layer": str(layer)}
        assert registry.get_sample_value("moescope_layer_compute_seconds_count", label) == 8
        assert registry.get_sample_value("moescope_layer_compute_seconds_sum", label) == pytest.approx(
            sum(t for t, _ in rows), rel=1e-12)
        for bound in COMPUTE_BUCKETS:
            expected = sum(f for t, f in rows if t / f <= bound)
            bucket = registry.get_sample_value("moescope_layer_compute_seconds_bucket", {**label, "le": repr(bound)})
            assert bucket == expected
        assert registry.get_sample_value("moescope_layer_compute_seconds_bucket", {**label, "le": "+Inf"}) == 8
