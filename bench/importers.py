"""Importer benchmark: time and peak memory of `moescope import vllm` on a large capture.

    python bench/importers.py                       # 1 M token rows x 16 layers x top-8 of 128 experts
    python bench/importers.py --rows 100000         # a quick look
    python bench/importers.py --format npy          # one CompletionOutput array instead of JSON Lines

The capture is written first, off the clock: `--format jsonl` (default) is JSON Lines of vLLM
responses, `--requests` of them, each with its prompt's `prompt_routed_experts` as base64 of an
int16 `.npy` (the form vLLM returns) and its token ids; `--format npy` is one `[rows, layers,
top_k]` int16 array saved with `np.save`. Every token's top-k ids are distinct, drawn uniformly.
The import then runs in a fresh child process (`import_files(..., num_experts=E)`, pinned to
`--cores` cores where the platform allows), and the script prints its wall time, CPU time and
peak resident memory (the child's own VmHWM, else its ru_maxrss), beside the file size, the route rows written and
the load average. Targets (issue 23): under 60 s and under 1 GB on two cores for the default size.
The store and the capture are removed at the end (`--keep` keeps them).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

CHILD = """
import json, sys, time
from moescope.ingest.importers import import_files
kind, path, root, experts = sys.argv[1:5]
start = time.perf_counter()
summary = import_files(kind, [path], root, num_experts=int(experts))
wall_s = time.perf_counter() - start
try:  # VmHWM: this process's own peak (ru_maxrss would start from the parent's at the fork)
    peak_kib = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
except OSError:
    import resource
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // (1024 if sys.platform == "darwin" else 1)
print(json.dumps({"wall_s": wall_s, "routes": summary.routes, "steps": summary.steps, "peak_kib": peak_kib}))
"""


def routing(rng: np.random.Generator, rows: int, layers: int, top_k: int, experts: int) -> np.ndarray:
    """(rows, layers, top_k) int16 ids, distinct within each token: the top-k of uniform scores."""
    scores = rng.random((rows, layers, experts), dtype=np.float32)
    return np.argpartition(scores, top_k, axis=2)[:, :, :top_k].astype(np.int16)


def write_capture(path: str, fmt: str, rows: int, layers: int, top_k: int, experts: int, requests: int) -> None:
    rng = np.random.default_rng(0)
    if fmt == "npy":
        out = np.lib.format.open_memmap(path, mode="w+", dtype=np.int16, shape=(rows, layers, top_k))
        for start in range(0, rows, 65536):
            end = min(rows, start + 65536)
            out[start:end] = routing(rng, end - start, layers, top_k, experts)
        out.flush()
        return
    per_request = -(-rows // requests)
    with open(path, "w") as f:
        for r, start in enumerate(range(0, rows, per_request)):
            n = min(per_request, rows - start)
            buffer = io.BytesIO()
            np.save(buffer, routing(rng, n, layers, top_k, experts))
            body = {"id": f"cmpl-{r}", "object": "text_completion", "created": 1_700_000_000 + r, "model": "bench",
                    "prompt_token_ids": rng.integers(0, 32000, n).tolist(),
                    "prompt_routed_experts": base64.b64encode(buffer.getvalue()).decode(),
                    "choices": [{"index": 0, "text": "", "token_ids": [], "routed_experts": []}],
                    "usage": {"prompt_tokens": n, "completion_tokens": 0}}
            f.write(json.dumps(body) + "\n")


def run_import(path: str, root: str, experts: int, cores: int) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = subprocess.Popen([sys.executable, "-c", CHILD, "vllm", path, root, str(experts)], cwd=repo,
                             stdout=subprocess.PIPE, text=True,
                             preexec_fn=(lambda: os.sched_setaffinity(0, range(min(cores, os.cpu_count() or 1))))
                             if hasattr(os, "sched_setaffinity") else None)
    out, _ = child.communicate()
    if child.returncode:
        raise SystemExit(f"the import failed (exit {child.returncode})")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    figures = json.loads(out.strip().splitlines()[-1])
    figures["peak_rss_mb"] = figures.pop("peak_kib") / 1024
    figures["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="token rows in the capture (default 1 M)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--requests", type=int, default=1000, help="responses the rows are spread over (jsonl)")
    parser.add_argument("--format", choices=("jsonl", "npy"), default="jsonl")
    parser.add_argument("--cores", type=int, default=2, help="cores the import may use (default 2)")
    parser.add_argument("--root", help="folder for the capture and the store (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the capture and the store")
    args = parser.parse_args(argv)
    root = args.root or tempfile.mkdtemp(prefix="moescope-bench-import-")
    os.makedirs(root, exist_ok=True)
    capture = os.path.join(root, f"capture.{args.format}")
    try:
        started = time.perf_counter()
        write_capture(capture, args.format, args.rows, args.layers, args.top_k, args.experts, args.requests)
        print(f"capture: {args.rows:,} rows x {args.layers} layers x top-{args.top_k} of {args.experts} experts, "
              f"{args.format}, {os.path.getsize(capture) / 2**20:,.0f} MiB (written in "
              f"{time.perf_counter() - started:.1f} s)", flush=True)
        figures = run_import(capture, os.path.join(root, "store"), args.experts, args.cores)
        figures.update(rows=args.rows, layers=args.layers, top_k=args.top_k, experts=args.experts,
                       format=args.format, file_mb=os.path.getsize(capture) / 2**20, load=os.getloadavg()[0])
        print(f"import: {figures['wall_s']:.1f} s wall, {figures['cpu_s']:.1f} s CPU, peak RSS "
              f"{figures['peak_rss_mb']:,.0f} MiB on {args.cores} cores; {figures['routes']:,} route rows, "
              f"{figures['steps']} steps (load average {figures['load']:.1f}; targets: < 60 s, < 1024 MiB)")
        return figures
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
