"""The probe under torch.compile (CPU, inductor) and CUDA graphs (skipped without CUDA).

Oracles: the router logits the compiled model itself returns (`output_router_logits=True`), the
eager model's own routing, and dynamo's graph-break counters.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import moescope
from moescope import probe
from moescope.core.exporters import InMemoryExporter
from tests.support.zoo import tiny_model

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def test_compiled_probe_has_no_graph_break_and_records_what_the_compiled_router_chose():
    model = tiny_model("qwen3_moe")
    x = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    # transformers' own output_router_logits breaks the graph (a lock, setattr on a type): count
    # the bare model's breaks first, so the probe's own are what is left.
    with torch.no_grad():
        torch.compile(model, backend="eager")(x, output_router_logits=True)
    bare_breaks = _graph_breaks()
    torch._dynamo.reset()
    counters.clear()
    memory = InMemoryExporter()
    with probe.attach(model, exporters=[memory], routes=True, router_logits=True, window=1) as session:
        compiled = torch.compile(model)  # inductor
        outputs = []
        with torch.no_grad():
            for _ in range(3):
                outputs.append(compiled(x, output_router_logits=True))
            assert _graph_breaks() <= bare_breaks, "the probe must not break the compiled graph"
            counters.clear()
            compiled(x)
            assert _graph_breaks() == 0, "a plain compiled forward of a probed model has no graph break"
    assert session.hook_errors == 0
    assert [r.step for r in memory.records] == [0, 1, 2, 3], "every compiled forward is recorded"
    k = session.layers[0].top_k
    for record, output in zip(memory.records, outputs):
        for ls, logits in zip(record.layers, output.router_logits):
            logits = logits.reshape(-1, logits.shape[-1])
            expected = torch.topk(logits.softmax(-1), k, dim=-1).indices.numpy()
            np.testing.assert_array_equal(np.sort(ls.routes.expert_ids, -1), np.sort(expected, -1))
            np.testing.assert_allclose(ls.router_logits.values, logits.float().numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(ls.expert_load, np.bincount(expected.ravel(), minlength=8))


def test_compiled_windows_sum_the_compiled_forwards():
    model = tiny_model("mixtral")
    x = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    eager, compiled_records = InMemoryExporter(), InMemoryExporter()
    with probe.attach(model, exporters=[eager], window=1), torch.no_grad():
        model(x)
    with probe.attach(model, exporters=[compiled_records], window=4, window_s=None) as session:
        compiled = torch.compile(model, backend="aot_eager")
        with torch.no_grad():
            for _ in range(8):
                compiled(x)
    assert dict(counters["graph_break"]) == {}
    assert session.hook_errors == 0
    assert [(r.step, r.step_end, r.forwards) for r in compiled_records.records] == [(0, 3, 4), (4, 7, 4)]
    for record in compiled_records.records:
        for a, b in zip(eager.records[0].layers, record.layers):
            np.testing.assert_array_equal(b.expert_load, 4 * a.expert_load)
            assert b.router_entropy_mean == pytest.approx(a.router_entropy_mean, rel=1e-6)


@CUDA
def test_cuda_graph_replays_accumulate_on_the_device():
    model = tiny_model("mixtral").cuda()
    x = torch.randint(0, 128, (2, 6), device="cuda")
    once, replayed = InMemoryExporter(), InMemoryExporter()
    with probe.attach(model, exporters=[once], window=1), torch.no_grad():
        model(x)
    with probe.attach(model, exporters=[replayed], window=1_000_000, window_s=None) as session, torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up, recorded eagerly
                model(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(x)
        session.flush()  # the two eager warm-ups
        for _ in range(5):
            graph.replay()
        session.flush()  # read out behind the replays, no sync on the model's stream
    assert session.graphed
    warm, replays = replayed.records[-2], replayed.records[-1]
    assert warm.forwards == 2 and replays.forwards == 5
    for a, b in zip(once.records[0].layers, replays.layers):
        np.testing.assert_array_equal(b.expert_load, 5 * a.expert_load)
        assert b.tokens == 5 * a.tokens


@CUDA
def test_no_host_sync_in_any_mode():
    model = tiny_model("mixtral").cuda()
    x = torch.randint(0, 128, (2, 6), device="cuda")
    with moescope.attach(model, routes=True, router_logits=4, router_inputs=4, health=True, trust_gate="auto",
                      window=2, window_s=None) as session, torch.no_grad():
        model(x)  # first forward: allocations, fingerprints
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(6):
                model(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        session.flush()
    assert session.hook_errors == 0
