"""Attaching and detaching: hooks, refusals, tags, generate, custom MoE modules, compile."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest
import torch
from torch import nn

import moescope
from moescope import probe
from moescope.core.exporters import InMemoryExporter
from moescope.store import Store
from tests.support.zoo import tiny_model


def _hook_counts(model: nn.Module) -> dict[str, int]:
    return {name: len(m._forward_hooks) + len(m._forward_pre_hooks) for name, m in model.named_modules()}


def test_close_removes_exactly_its_hooks_and_keeps_others():
    model = tiny_model("mixtral")
    calls = []
    mine = model.model.layers[0].mlp.gate.register_forward_hook(lambda *a: calls.append(1))
    before = _hook_counts(model)
    session = probe.attach(model)
    assert _hook_counts(model) != before
    session.close()
    session.close()  # safe twice
    assert _hook_counts(model) == before
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 4)))
    assert calls == [1]
    mine.remove()


def test_hooks_removed_after_an_exception_in_the_block():
    model = tiny_model("qwen3_moe")
    before = _hook_counts(model)
    with pytest.raises(RuntimeError, match="boom"):
        with probe.attach(model):
            raise RuntimeError("boom")
    assert _hook_counts(model) == before


def test_dense_model_is_refused_with_advice():
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    dense = transformers.LlamaForCausalLM(config)
    before = _hook_counts(dense)
    with pytest.raises(probe.NoMoELayersError, match="no MoE layer.*MoESpec"):
        probe.attach(dense)
    assert _hook_counts(dense) == before


def test_compiled_model_is_refused_with_advice():
    model = tiny_model("mixtral")
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(probe.ProbeAttachError, match="Attach first, then compile"):
        probe.attach(compiled)


def test_hooks_registered_before_compiling_record_the_same():
    torch._dynamo.reset()
    model = tiny_model("mixtral")
    x = torch.randint(0, 128, (2, 6))
    eager, compiled_records = InMemoryExporter(), InMemoryExporter()
    with probe.attach(model, exporters=[eager], routes=True), torch.no_grad():
        model(x)
    with probe.attach(model, exporters=[compiled_records], routes=True, window=1) as session:
        compiled = torch.compile(model, backend="aot_eager")
        with torch.no_grad():
            compiled(x)
            compiled(x)
    assert session.hook_errors == 0
    assert len(compiled_records.records) == 2
    for a, b in zip(eager.records[0].layers, compiled_records.records[1].layers):
        np.testing.assert_array_equal(a.expert_load, b.expert_load)
        np.testing.assert_array_equal(a.routes.expert_ids, b.routes.expert_ids)
        np.testing.assert_allclose(a.routes.gate_weights, b.routes.gate_weights, rtol=1e-6)
    torch._dynamo.reset()


def test_probe_does_not_change_outputs():
    model = tiny_model("deepseek_v3")
    x = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        bare = model(x).logits
        with probe.attach(model, routes=True, router_logits=4, router_inputs=4, kv_cache=True):
            probed = model(x).logits
    assert torch.equal(bare, probed)


def test_tags_nest_and_land_on_records(tmp_path):
    model = tiny_model("olmoe")
    x = torch.randint(0, 128, (1, 5))
    with moescope.attach(model, store=tmp_path, routes=True, tags={"run": "a"}) as session, torch.no_grad():
        model(x)
        with session.tag(domain="code"):
            model(x)
            with session.tag(split="eval"):
                model(x)
        model(x)
    store = Store(tmp_path)
    steps = store.sql("SELECT step, tags FROM steps ORDER BY step")
    tags = [dict(t) if not isinstance(t, dict) else t for t in steps.tags]
    assert tags == [{"run": "a"}, {"run": "a", "domain": "code"}, {"run": "a", "domain": "code", "split": "eval"},
                    {"run": "a"}]
    per_tag = store.sql("SELECT tags['domain'] AS d, count(*) AS n FROM routes GROUP BY d ORDER BY d NULLS LAST")
    assert per_tag.n.tolist() == [2 * 2 * 5, 2 * 2 * 5]


def test_generate_records_every_step_with_kv_cache(tmp_path):
    model = tiny_model("mixtral")
    prompt = torch.randint(0, 128, (2, 5))
    with moescope.attach(model, store=tmp_path, routes=True, kv_cache=True, window=1), torch.no_grad():
        model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    store = Store(tmp_path)
    steps = store.sql("SELECT step, step_end, forwards, tokens, seq_len FROM steps ORDER BY step")
    assert steps.tokens.tolist() == [10, 2, 2, 2]
    assert steps.step.tolist() == steps.step_end.tolist() == [0, 1, 2, 3] and set(steps.forwards) == {1}
    kv = store.sql("SELECT step, layer, bytes, seq_len FROM kv_cache ORDER BY step, layer")
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    for row in kv.itertuples():
        expected = 2 * 2 * config.num_key_value_heads * row.seq_len * head_dim * 4  # k and v, batch 2, fp32
        assert row.bytes == expected
    assert kv.groupby("step").seq_len.first().tolist() == [5, 6, 7, 8]
    # Decode steps route one new token per row; positions continue where the prompt ended is the
    # model's business, the routes table keeps the row and the position inside this forward.
    routes = store.sql("SELECT step, count(*) AS n FROM routes GROUP BY step ORDER BY step")
    assert routes.n.tolist() == [2 * 10, 2 * 2, 2 * 2, 2 * 2]


def test_a_window_sums_the_forwards_it_covers(tmp_path):
    """Default windows: a short generate is two records, the prefill and its three decode steps (a
    row holds one kind of forward); each record's sums equal its per-forward records' and its routes
    still say which forward each token came from."""
    model = tiny_model("mixtral")
    prompt = torch.randint(0, 128, (2, 5))
    per_forward, windowed = InMemoryExporter(), InMemoryExporter()
    for exporter, window in ((per_forward, 1), (windowed, 32)):
        with moescope.attach(model, store=tmp_path / str(window), exporters=[exporter], routes=True,
                          window=window, window_s=None), torch.no_grad():
            model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert len(per_forward.records) == 4 and len(windowed.records) == 2
    prefill, decode = windowed.records
    assert (prefill.step, prefill.step_end, prefill.forwards, prefill.tokens, prefill.seq_len) == (0, 0, 1, 10, 5)
    assert (decode.step, decode.step_end, decode.forwards, decode.tokens, decode.seq_len) == (1, 3, 3, 6, 1)
    for window, members in ((prefill, per_forward.records[:1]), (decode, per_forward.records[1:])):
        for layer, ls in enumerate(window.layers):
            parts = [r.layers[layer] for r in members]
            np.testing.assert_array_equal(ls.expert_load, sum(p.expert_load for p in parts))
            np.testing.assert_array_equal(ls.coselection, sum(p.coselection for p in parts))
            assert ls.tokens == sum(p.tokens for p in parts) == window.tokens
            entropy = sum(p.router_entropy_mean * p.tokens for p in parts) / window.tokens
            assert ls.router_entropy_mean == pytest.approx(entropy, rel=1e-12)
            np.testing.assert_array_equal(ls.routes.step, np.repeat([r.step for r in members],
                                                                    [r.tokens for r in members]))
            np.testing.assert_array_equal(ls.routes.expert_ids,
                                          np.concatenate([p.routes.expert_ids for p in parts]))
    routes = Store(tmp_path / "32").sql("SELECT step, count(*) AS n FROM routes GROUP BY step ORDER BY step")
    assert routes.n.tolist() == [2 * 10, 2 * 2, 2 * 2, 2 * 2]


def test_a_row_never_mixes_prefill_and_decode(tmp_path):
    """Two generates back to back, then a plain forward: every steps row's forwards are of one kind,
    its seq_len is theirs and its tokens their sum, checked against the shapes the model itself was
    called with (a forward pre-hook of the test's own)."""
    model = tiny_model("mixtral")
    shapes: list[tuple[int, int]] = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: shapes.append(tuple(kwargs.get("input_ids", args[0] if args else None).shape)),
        with_kwargs=True)
    with moescope.attach(model, store=tmp_path, window=32, window_s=None), torch.no_grad():
        model.generate(torch.randint(0, 128, (2, 7)), max_new_tokens=4, do_sample=False, pad_token_id=0)
        model.generate(torch.randint(0, 128, (3, 6)), max_new_tokens=3, do_sample=False, pad_token_id=0)
        model(torch.randint(0, 128, (1, 9)))
    # the runs of like forwards, as the model saw them
    runs: list[list[tuple[int, int]]] = []
    for shape in shapes:
        if runs and (runs[-1][-1][1] == 1) == (shape[1] == 1):
            runs[-1].append(shape)
        else:
            runs.append([shape])
    steps = Store(tmp_path).sql("SELECT step, step_end, forwards, tokens, batch_size, seq_len FROM steps ORDER BY step")
    assert len(steps) == len(runs) == 5  # prefill, decode x3, prefill, decode x2, one forward
    first = 0
    for row, run in zip(steps.itertuples(), runs):
        assert (row.step, row.step_end, row.forwards) == (first, first + len(run) - 1, len(run))
        assert row.tokens == sum(b * n for b, n in run)
        assert (row.batch_size, row.seq_len) == run[-1]
        first += len(run)


def test_duckdb_reads_the_store_with_nothing_but_a_glob(tmp_path):
    model = tiny_model("mixtral")
    with moescope.attach(model, store=tmp_path, routes=True) as session, torch.no_grad():
        model(torch.randint(0, 128, (2, 4)))
    rows = duckdb.sql(f"select * from read_parquet('{tmp_path}/routes/**/*.parquet')").df()
    assert len(rows) == 2 * 2 * 4
    assert set(rows.run_id) == {session.run.run_id}


class _TinyMoE(nn.Module):
    """A custom MoE block, not from transformers: softmax router, top-k, per-expert MLPs."""

    def __init__(self, hidden=8, experts=4, k=2):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))
        self.k = k
        self.last_choice = None

    def dispatch(self, x, ids, weights):
        out = torch.zeros_like(x)
        for slot in range(ids.shape[1]):
            for e, expert in enumerate(self.experts):
                rows = ids[:, slot] == e
                out[rows] += weights[rows, slot, None] * expert(x[rows])
        return out

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(-1)
        weights, ids = probs.topk(self.k, dim=-1)
        self.last_choice = (ids, weights)
        return self.dispatch(flat, ids, weights).reshape(x.shape)


def test_custom_moe_module_through_a_spec():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _TinyMoE(), _TinyMoE())
    calls = []
    # The experts here are a ModuleList called through the block's own method; the spec reads
    # the choice from the router output instead.
    spec = probe.MoESpec(
        match=_TinyMoE, num_experts=4, top_k=2, router="router", experts="experts",
        router_choice=lambda out, logits: probe.Choice(*reversed(out.softmax(-1).topk(2, dim=-1))))
    memory = InMemoryExporter()
    with probe.attach(model, specs=[spec], exporters=[memory], routes=True) as session:
        with torch.no_grad():
            model(torch.randn(3, 5, 8))
    assert [layer.name for layer in session.layers] == ["1", "2"]
    for block, ls in zip([model[1], model[2]], memory.records[0].layers):
        ids, weights = block.last_choice
        np.testing.assert_array_equal(ls.routes.expert_ids, ids.numpy())
        np.testing.assert_allclose(ls.routes.gate_weights, weights.numpy())
        assert ls.expert_load.tolist() == np.bincount(ids.numpy().ravel(), minlength=4).tolist()
        expert_params = sum(p.numel() for p in block.experts.parameters()) // 4
        assert session.run.layers[ls.layer].params_per_expert == expert_params
    del calls


def test_layers_filter_hooks_only_named_blocks():
    model = tiny_model("mixtral")
    with probe.attach(model, layers="model.layers.1.mlp") as session:
        assert [layer.name for layer in session.layers] == ["model.layers.1.mlp"]
    with pytest.raises(probe.NoMoELayersError):
        probe.attach(model, layers=["no.such.block"])


def test_a_failing_reader_never_breaks_the_forward(caplog):
    model = tiny_model("mixtral")
    memory = InMemoryExporter()
    with probe.attach(model, exporters=[memory]) as session:
        session.layers[0].read_logits = lambda output: (_ for _ in ()).throw(ValueError("bad reader"))
        with torch.no_grad():
            out = model(torch.randint(0, 128, (1, 4)))
    assert out.logits.isfinite().all()
    assert session.hook_errors >= 1
    # The layer that failed is missing from the record; the other layer is still there.
    assert [ls.layer for ls in memory.records[0].layers] == [1]


def test_a_failing_reader_with_rings_keeps_the_window():
    # The group is reduced layer by layer and writes no ring row that forward; the window's record
    # is still built (it was lost as build_failed: numpy cannot infer a dimension of 0 rows).
    model = tiny_model("mixtral")
    memory = InMemoryExporter()
    with probe.attach(model, exporters=[memory], routes=True, router_logits=2, window=1) as session:
        session.layers[0].read_choice = lambda *args: (_ for _ in ()).throw(ValueError("bad reader"))
        with torch.no_grad():
            model(torch.randint(0, 128, (1, 4)))
    assert session.hook_errors == 1 and session.dropped_records == 0
    [layer] = memory.records[0].layers
    assert layer.layer == 1 and layer.tokens == 4 and int(layer.expert_load.sum()) == 4 * 2
    assert len(layer.routes.expert_ids) == 0 and len(layer.router_logits.token) == 0


def test_a_router_called_with_its_input_by_keyword_never_breaks_the_forward():
    # router_inputs reads the router's positional input; a block that passes it by keyword gives
    # none: the forward goes on (it raised TypeError) and the window keeps no input row.
    model = tiny_model("mixtral")
    memory = InMemoryExporter()
    with probe.attach(model, exporters=[memory], router_inputs=True, window=1) as session:
        router = session.layers[0].router
        router.register_forward_pre_hook(lambda module, args, kwargs: ((), {"hidden_states": args[0], **kwargs}),
                                         with_kwargs=True, prepend=True)
        with torch.no_grad():
            out = model(torch.randint(0, 128, (1, 4)))
    assert out.logits.isfinite().all()
    assert session.hook_errors == 0 and session.dropped_records == 0
    assert [ls.layer for ls in memory.records[0].layers] == [0, 1]
    assert all(len(ls.router_inputs.token) == 0 for ls in memory.records[0].layers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the deferred copy path)")
def test_cuda_records_arrive_without_a_sync_and_match_the_cpu():
    cpu_model = tiny_model("mixtral")
    gpu_model = tiny_model("mixtral").cuda()
    x = torch.randint(0, 128, (2, 6))
    cpu, gpu = InMemoryExporter(), InMemoryExporter()
    with probe.attach(cpu_model, exporters=[cpu], routes=True, router_inputs=4), torch.no_grad():
        cpu_model(x)
    with probe.attach(gpu_model, exporters=[gpu], routes=True, router_inputs=4, window=1) as session, \
            torch.no_grad():
        for _ in range(3):
            gpu_model(x.cuda())
        session.flush()
        assert [r.step for r in gpu.records] == [0, 1, 2]
    for a, b in zip(cpu.records[0].layers, gpu.records[0].layers):
        np.testing.assert_array_equal(a.expert_load, b.expert_load)
        np.testing.assert_array_equal(a.routes.expert_ids, b.routes.expert_ids)
