"""Where the model's thread waits for moescope: CPU time per thread, with the writer's work removed part by part.

A ratio of wall times says how much slower the model ran, not why. This script splits it: each
round runs in a fresh interpreter (so the first attach is the process's first), builds
bench/overhead.py's decode preset (hidden 64, 16 layers, 16 experts top-2, batch 32), copies it
twice (a bare copy and one to attach to), warms both bare, and then measures on every thread of
the process (psutil's per-thread user + system time; the model's own thread also by
`time.thread_time`) and on the writer process, if any:

- attach: `moescope.attach` (or the variant's attach) itself;
- first steps: a 16-token prefill and 8 one-token decode steps with a KV cache right after
  attach (bench/fresh_attach.py's steps), against the same steps on the bare copy just before;
- flush: `session.flush()` (the first window closed, its tables written);
- decode: 4 x 16 decode steps (bench/overhead.py's decode block) and the wait for the writer's
  thread to export them, against the same steps bare.

The threads are grouped: the model's (the main thread), torch's intra-op threads (native threads
Python does not know, the first ones started), the probe's pipeline worker (`moescope-*`, where
the store's work runs with `writer="thread"`), the store's native runtimes (deltalake's
`tokio-rt-worker`, pyarrow's `jemalloc_bg_thd`), and the writer process. The model's thread's
extra time (wall after attach less wall bare) is its own extra CPU plus its extra waiting (wall
that is not its CPU: the interpreter lock, or a core taken by another thread).

The variants remove the writer's work part by part:

    hooks only          probe.attach(model): hooks, windows and records, no exporter
    store               moescope.attach(model, store): the aggregates' tables, writer thread
    store after imports the same after importing pyarrow, pandas and deltalake before attach
    store + routes      routes=True
    store + health      health=True (health sampling, the health score and the trust policy)
    store in a process  writer="process"

    python bench/thread_wait.py                       # 3 rounds of every variant
    python bench/thread_wait.py --rounds 5 --variants "store,store + health"
    python bench/thread_wait.py --profile "store"     # cProfile of the pipeline worker, first 25 lines
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time

VARIANTS: dict[str, dict] = {
    "hooks only": {},
    "store": {},
    "store after imports": {},
    "store + routes": dict(routes=True),
    "store + health": dict(health=True),
    "store in a process": dict(writer="process"),
}
GROUPS = ("model", "torch", "pipeline", "native", "other", "writer process")
PHASES = ("attach", "first steps", "flush", "decode")


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) so far, per group of threads, and the writer process's."""
    import psutil

    me = psutil.Process()
    python = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out = dict.fromkeys(GROUPS, 0.0)
    for t in me.threads():
        cpu = t.user_time + t.system_time
        if t.id == main:
            group = "model"
        elif t.id in python:
            group = "pipeline" if python[t.id].startswith("moescope") else "other"
        else:
            try:
                with open(f"/proc/self/task/{t.id}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue  # the thread ended: its CPU is lost to the figures, a few ms at most
            group = "native" if comm.startswith(("tokio", "jemalloc")) else "torch"
        out[group] += cpu
    for child in me.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        out["writer process"] += times.user + times.system
    return out


def child(args: argparse.Namespace) -> dict:
    """One round of one variant, in this fresh interpreter: per phase, wall and CPU per group."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import moescope
    from bench.fresh_attach import decode_pair
    from bench.overhead import Workload
    from moescope import probe

    shape, bare, probed, steps = decode_pair(args.threads, 8)
    decode_bare, decode_probed = Workload(shape, bare), Workload(shape, probed)
    for _ in range(2):
        steps(bare)
        steps(probed)
    with torch.no_grad():
        decode_bare()
        decode_probed()

    def timed(run) -> dict:
        cpu, own, start = thread_cpu(), time.thread_time(), time.perf_counter()
        result = run()
        wall, own = time.perf_counter() - start, time.thread_time() - own
        after = thread_cpu()
        return {"wall": wall, "model_thread_time": own, **{g: after[g] - cpu[g] for g in GROUPS}, "result": result}

    def decode_block(workload: Workload, session=None) -> None:
        with torch.no_grad():
            for _ in range(4):
                workload()
        if session is not None:
            session.processor.wait_idle()

    variant = VARIANTS[args.variant]
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:  # the pipeline worker's own profile: wrap its loop
        from moescope.core.pipeline import BatchProcessor

        run = BatchProcessor._run

        def profiled(self) -> None:
            profiler.runcall(run, self)

        BatchProcessor._run = profiled
    if args.variant == "store after imports":
        import deltalake  # noqa: F401
        import pandas  # noqa: F401
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401

    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="moescope-wait-") as tmp:
        out["first steps bare"] = timed(lambda: steps(bare))
        if args.variant == "hooks only":
            attach = timed(lambda: probe.attach(probed))
        else:
            attach = timed(lambda: moescope.attach(probed, store=os.path.join(tmp, "store"), **variant))
        session = attach.pop("result")
        out["attach"] = attach
        out["first steps"] = timed(lambda: steps(probed))
        out["flush"] = timed(session.flush)
        out["decode bare"] = timed(lambda: decode_block(decode_bare))
        out["decode"] = timed(lambda: decode_block(decode_probed, session))
        session.close()
    for phase in out.values():
        phase.pop("result", None)
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
        out["profile"] = text.getvalue()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2, bench/overhead.py's)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="a comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--profile", default="", help="a variant to run once more under cProfile (the pipeline worker)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names + ([args.profile] if args.profile else []) if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant(s) {unknown}: choose among {', '.join(VARIANTS)}")

    def run_child(variant: str, profile: bool = False) -> dict:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--variant", variant,
               "--threads", str(args.threads)] + (["--profile", variant] if profile else [])
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode:
            sys.exit(f"variant {variant!r} failed:\n{result.stderr}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    print(f"where the model's thread waits: decode preset, {args.rounds} rounds of each variant (a fresh interpreter "
          f"each, in turn), {args.threads} torch threads, {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            runs[name].append(run_child(name))
    print(report(runs))
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.profile:
        profile = run_child(args.profile, True)["profile"]
        print(f"\ncProfile of the pipeline worker, variant {args.profile!r}:\n{profile}")


def report(runs: dict[str, list[dict]]) -> str:
    """A markdown table: per variant and phase, the medians over rounds, in ms; first steps and decode less bare."""
    def med(rounds: list[dict], phase: str, key: str, bare: str | None = None) -> float:
        return 1000 * statistics.median(r[phase][key] - (r[bare][key] if bare else 0.0) for r in rounds)

    lines = ["| variant | phase | wall | model thread: CPU | waiting | torch | pipeline | native | other "
             "| writer process |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, rounds in runs.items():
        for phase in PHASES:
            bare = f"{phase} bare" if f"{phase} bare" in rounds[0] else None
            wall = med(rounds, phase, "wall", bare)
            own = med(rounds, phase, "model_thread_time", bare)
            waiting = 1000 * statistics.median(
                (r[phase]["wall"] - r[phase]["model_thread_time"])
                - ((r[bare]["wall"] - r[bare]["model_thread_time"]) if bare else 0.0) for r in rounds)
            cells = [f"{med(rounds, phase, g, bare):+.0f}" if bare else f"{med(rounds, phase, g):.0f}"
                     for g in ("torch", "pipeline", "native", "other", "writer process")]
            sign = "+" if bare else ""
            lines.append(f"| {name} | {phase}{' (less bare)' if bare else ''} | {wall:{sign}.0f} | {own:{sign}.0f} "
                         f"| {waiting:{sign}.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
