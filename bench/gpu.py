"""What the probe costs on a GPU, at production shapes: one prepared run, ratios side by side.

    python bench/gpu.py                              # both presets, prefill and decode, on CUDA
    python bench/gpu.py --preset mixtral --rounds 3  # one preset, quicker
    python bench/gpu.py --preset tiny --device cpu   # a smoke run of every code path on a CPU

Presets (bf16, transformers' default experts implementation, random weights):
  mixtral  Mixtral-8x7B-shaped: hidden 4096, expert ffn 14336, 8 experts top-2, 8 layers
  qwen3    Qwen3-30B-A3B-shaped: hidden 2048, expert ffn 768, 128 experts top-8, all 48 layers
Workloads: prefill (4 x 2048 tokens, one forward per block) and decode (batch 64 after a 512-token
KV prefix, one token per step, 16 timed steps per block after a warm-up block; the cache is cropped
back after every block).

One model is loaded; every round runs one block per variant in rotating order, attaching the
variant's probe before its block and closing it after, so each round gives a paired ratio to the
bare block beside it; the figure is the median over rounds, with the interquartile range. Variants:
bare, a do-nothing hook on every router and experts module (the floor of a hook-based probe),
transformers' own output_router_logits, aggregates, routes, health, health + trust gate.
Host syncs are counted with torch.cuda.set_sync_debug_mode("warn") over decode steps, probe minus
bare. Then, on a decode-shaped forward (batch 64, one token, no cache): compiled bare vs compiled
probe (graph breaks from dynamo's counters, probe minus bare), and CUDA-graph replay of a captured
probed forward: its time against a captured bare forward, and a check that after N replays the
device accumulators read out by `session.flush()` equal N times one eager forward's loads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
import transformers

import moescope
from moescope import probe
from moescope.core.exporters import InMemoryExporter

PRESETS = {
    "mixtral": ("MixtralConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                                      num_local_experts=8, num_experts_per_tok=2, num_attention_heads=32,
                                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)),
    "qwen3": ("Qwen3MoeConfig", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                     num_hidden_layers=48, num_experts=128, num_experts_per_tok=8,
                                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                                     max_position_embeddings=4096)),
    "tiny": ("MixtralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_local_experts=8,
                                   num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=1024, max_position_embeddings=1024)),
}
VARIANTS: dict[str, dict | None] = {
    "bare": None,
    "do-nothing hooks": None,
    "output_router_logits": None,
    "aggregates": dict(),
    "routes": dict(routes=True),
    "health": dict(health=True),
    "health + gate": dict(trust_gate="auto"),
}
GOALS = {"prefill": {"aggregates": 1.01, "routes": 1.05, "health + gate": 1.03},
         "decode": {"aggregates": 1.02, "routes": 1.05, "health + gate": 1.05}}


def build(preset: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    config_name, kwargs = PRESETS[preset]
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Workload:
    """A block of work: one prefill forward, or `steps` one-token decode steps on a KV prefix."""

    def __init__(self, model: torch.nn.Module, kind: str, batch: int, tokens: int, steps: int,
                 device: torch.device, vocab: int):
        self.model, self.kind, self.steps = model, kind, steps
        g = torch.Generator().manual_seed(0)
        self.input = torch.randint(0, vocab, (batch, tokens), generator=g).to(device)
        self.next = torch.randint(0, vocab, (batch, 1), generator=g).to(device)
        self.cache = None
        self.extra: dict = {}
        if kind == "decode":
            with torch.no_grad():
                self.cache = model(self.input, use_cache=True).past_key_values
            self.prefix = self.cache.get_seq_length()

    def __call__(self) -> int:
        """Run one block; returns the number of forwards it made."""
        if self.kind == "prefill":
            self.model(self.input, **self.extra)
            return 1
        for _ in range(self.steps):
            self.model(self.next, past_key_values=self.cache, use_cache=True, **self.extra)
        grown = self.cache.get_seq_length() - self.prefix
        if grown:
            self.cache.crop(-grown)
        return self.steps


@contextlib.contextmanager
def variant(model: torch.nn.Module, name: str, work: Workload):
    """The variant's instrumentation for one block, removed after it."""
    options = VARIANTS[name]
    handles, session = [], None
    if name == "do-nothing hooks":
        for layer in probe.find_moe_layers(model):
            handles.append(layer.router.register_forward_hook(lambda m, a, o: None))
            if layer.experts is not None:
                handles.append(layer.experts.register_forward_pre_hook(lambda m, a: None))
    elif name == "output_router_logits":
        work.extra = dict(output_router_logits=True)
    elif options is not None:
        session = moescope.attach(model, exporters=[InMemoryExporter()], **options)
    try:
        yield session
    finally:
        work.extra = {}
        if session is not None:
            session.close()
        for handle in handles:
            handle.remove()


def timed_blocks(model: torch.nn.Module, work: Workload, names: list[str], rounds: int,
                 device: torch.device) -> dict[str, list[float]]:
    """Seconds per forward of each variant per round, blocks in rotating order."""
    times: dict[str, list[float]] = {name: [] for name in names}
    with torch.no_grad():
        for round_ in range(rounds):
            order = names[round_ % len(names):] + names[: round_ % len(names)]
            for name in order:
                with variant(model, name, work):
                    work()  # warm-up block: allocations, first-forward work, a window closing
                    synchronize(device)
                    start = time.perf_counter()
                    forwards = work()
                    synchronize(device)
                    times[name].append((time.perf_counter() - start) / forwards)
            print(f"  round {round_ + 1}/{rounds}", file=sys.stderr, flush=True)
    return times


def count_syncs(model: torch.nn.Module, work: Workload, name: str, device: torch.device) -> int | None:
    """Host syncs during one decode block, as reported by the CUDA sync debug mode."""
    if device.type != "cuda":
        return None
    with torch.no_grad(), variant(model, name, work):
        work()
        synchronize(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                work()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        synchronize(device)
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def ratios(times: dict[str, list[float]]) -> dict[str, tuple[float, float, float, float]]:
    """Per variant: (median seconds per forward, median paired ratio to bare, q1, q3)."""
    out = {}
    for name, values in times.items():
        paired = sorted(v / b for v, b in zip(values, times["bare"]))
        q1, q3 = paired[len(paired) // 4], paired[(3 * len(paired)) // 4]
        out[name] = (statistics.median(values), statistics.median(paired), q1, q3)
    return out


def compiled_and_graphs(model: torch.nn.Module, batch: int, device: torch.device, vocab: int,
                        replays: int) -> dict:
    """Compiled bare vs compiled probe, and CUDA-graph replay, on a decode-shaped forward."""
    from torch._dynamo.utils import counters

    x = torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(1)).to(device)
    result: dict = {}

    def time_it(fn: Callable[[], object], n: int = 20) -> float:
        with torch.no_grad():
            for _ in range(3):
                fn()
            synchronize(device)
            start = time.perf_counter()
            for _ in range(n):
                fn()
            synchronize(device)
        return (time.perf_counter() - start) / n

    breaks = {}
    for name in ("bare", "probe"):
        torch._dynamo.reset()
        counters.clear()
        session = probe.attach(model, exporters=[InMemoryExporter()]) if name == "probe" else None
        compiled = torch.compile(model)
        try:
            result[f"compiled {name} s"] = time_it(lambda: compiled(x, use_cache=False))
            breaks[name] = sum(counters["graph_break"].values())
        finally:
            if session is not None:
                session.close()
    torch._dynamo.reset()
    result["compiled ratio"] = result["compiled probe s"] / result["compiled bare s"]
    result["graph breaks added"] = breaks["probe"] - breaks["bare"]

    if device.type != "cuda":
        return result
    once = InMemoryExporter()
    with torch.no_grad(), probe.attach(model, exporters=[once], window=1):
        model(x, use_cache=False)
    graphs = {}
    for name in ("bare", "probe"):
        memory = InMemoryExporter()
        session = probe.attach(model, exporters=[memory], window=1_000_000, window_s=None) \
            if name == "probe" else None
        with torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    model(x, use_cache=False)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model(x, use_cache=False)
            if session is not None:
                session.flush()  # the eager warm-ups
            result[f"graph {name} s"] = time_it(graph.replay, replays) if name == "bare" else None
            if session is not None:
                before = len(memory.records)
                for _ in range(replays):
                    graph.replay()
                session.flush()  # one read-out behind the replays
                record = memory.records[before] if len(memory.records) > before else None
                expected = [ls.expert_load * replays for ls in once.records[0].layers]
                result["graph replays recorded"] = None if record is None else record.forwards
                result["graph loads equal N x one forward"] = record is not None and all(
                    np.array_equal(a.expert_load, b) for a, b in zip(record.layers, expected))
                result["graph probe s"] = time_it(graph.replay, replays)
                session.close()
        graphs[name] = graph
    result["graph ratio"] = result["graph probe s"] / result["graph bare s"]
    return result


def run_preset(args: argparse.Namespace, preset: str, device: torch.device, dtype: torch.dtype) -> dict:
    model = build(preset, device, dtype)
    vocab = model.config.vocab_size
    names = list(VARIANTS)
    out: dict = {"preset": preset, "params": sum(p.numel() for p in model.parameters())}
    for kind in args.workload:
        if kind == "prefill":
            work = Workload(model, "prefill", args.prefill_batch, args.prefill_tokens, 1, device, vocab)
        else:
            work = Workload(model, "decode", args.decode_batch, args.kv_prefix, args.decode_steps, device, vocab)
        print(f"{preset} {kind}: {len(names)} variants x {args.rounds} rounds", file=sys.stderr, flush=True)
        table = ratios(timed_blocks(model, work, names, args.rounds, device))
        syncs = {}
        if kind == "decode":
            bare = count_syncs(model, work, "bare", device)
            for name in names:
                count = count_syncs(model, work, name, device)
                syncs[name] = None if count is None or bare is None else count - bare
        out[kind] = {name: dict(ms_per_forward=t[0] * 1e3, ratio=t[1], iqr=(t[2], t[3]),
                                syncs_added=syncs.get(name)) for name, t in table.items()}
        del work
    if args.graphs:
        out["decode-shaped forward"] = compiled_and_graphs(model, args.decode_batch, device, vocab, args.replays)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def report(results: list[dict]) -> str:
    lines = []
    for res in results:
        lines.append(f"\n{res['preset']} ({res['params'] / 1e9:.2f} B parameters)")
        for kind in ("prefill", "decode"):
            if kind not in res:
                continue
            lines.append(f"  {kind:<8} {'variant':<22} {'ms/fwd':>9} {'ratio':>7} {'IQR':>13} {'syncs+':>7} goal")
            for name, row in res[kind].items():
                goal = GOALS[kind].get(name)
                verdict = "" if goal is None else f"{goal:.2f} {'ok' if row['ratio'] <= goal else 'MISS'}"
                syncs = "" if row["syncs_added"] is None else str(row["syncs_added"])
                lines.append(f"  {'':<8} {name:<22} {row['ms_per_forward']:>9.3f} {row['ratio']:>7.3f} "
                             f"{row['iqr'][0]:.3f}-{row['iqr'][1]:.3f} {syncs:>7} {verdict}")
        extra = res.get("decode-shaped forward")
        if extra:
            lines.append("  decode-shaped forward (one token per row, no cache): compiled and CUDA graphs")
            for key, value in extra.items():
                lines.append(f"    {key}: {value:.4g}" if isinstance(value, float) else f"    {key}: {value}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", action="append", choices=sorted(PRESETS),
                   help="repeatable; default: mixtral and qwen3")
    p.add_argument("--workload", action="append", choices=("prefill", "decode"), help="default: both")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--kv-prefix", type=int, default=512)
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--replays", type=int, default=50, help="CUDA-graph replays timed and checked")
    p.add_argument("--no-graphs", dest="graphs", action="store_false", help="skip the compiled and CUDA-graph part")
    p.add_argument("--json", help="also write the results to this file")
    return p


def main() -> None:
    args = parser().parse_args()
    args.preset = args.preset or ["mixtral", "qwen3"]
    args.workload = args.workload or ["prefill", "decode"]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu --preset tiny for a smoke run of the code paths")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"transformers {transformers.__version__}", flush=True)
    results = [run_preset(args, preset, device, dtype) for preset in args.preset]
    print(report(results), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=float)


if __name__ == "__main__":
    main()
