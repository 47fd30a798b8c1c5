"""What a fresh `moescope.attach` costs the model's first steps, and the CPU of a first attach.

A job that attaches and serves at once sees the attach's start-up (the writer starting, the
store's first tables, the first window) on its first requests. Each round runs in a fresh
interpreter, so every round's attach is the first of its process, to a new store folder:

- the model (bench/overhead.py's decode preset: hidden 64, 16 layers, 16 experts top-2, batch 32)
  is built and copied twice, a bare copy and one to attach to, and both are warmed up bare (torch's
  first calls are not the probe's);
- then, in an order that alternates by round, the same steps run on each: a prefill of 32x16 tokens
  and 8 one-token decode steps with a KV cache. On the probed copy they run right after
  `moescope.attach(model, store=<new folder>)`. The figure is the median over rounds of the paired
  ratio probed / bare of the steps' wall time;
- the CPU of the first attach is the process's CPU time (`time.process_time`, every thread) from
  before `attach` to after the steps and a `session.flush()` (the first window closed, its tables
  created and written), less the CPU of the same steps on the bare copy.

The wall time of `attach` itself is printed beside it, and the ratio of attach plus the steps to
the bare steps: what a job that attaches and serves at once sees on its first requests.

A second attach in the same process, to another new folder, shows what is left once the imports
and first calls are paid ("later").

    python bench/fresh_attach.py               # 9 rounds, 2 threads
    python bench/fresh_attach.py --rounds 5
    python bench/fresh_attach.py --writers thread,process   # the store's work in the model's process and
                                               # in a writer process (moescope.attach's writer=), a round
                                               # of each in turn, side by side
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# issue 52's goals (issue 37's were 1.5 and 0.5 s)
TARGET_RATIO = 1.2  # the prefill and 8 decode steps right after attach, to the same steps bare
TARGET_CPU_S = 0.3  # CPU of the first attach to a new store, beyond the steps' own, in the model's process


def decode_pair(threads: int, decode_steps: int):
    """bench/overhead.py's decode preset, a bare copy and one to attach to, and the steps a round times
    on either (a 16-token prefill and `decode_steps` one-token steps with a KV cache): (shape, bare,
    probed, steps). bench/thread_wait.py builds its rounds with it too."""
    import torch
    from transformers import DynamicCache

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.overhead import PRESETS, arguments, build_model

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    shape = arguments(["--preset", "decode"])
    model = build_model(shape)
    bare, probed = copy.deepcopy(model), copy.deepcopy(model)
    del model
    batch = PRESETS["decode"]["batch"]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1024, (batch, PRESETS["decode"]["seq"]), generator=g)
    token = torch.randint(0, 1024, (batch, 1), generator=g)

    def steps(model: torch.nn.Module) -> None:
        with torch.no_grad():
            cache = DynamicCache()
            model(prompt, past_key_values=cache, use_cache=True)
            for _ in range(decode_steps):
                model(token, past_key_values=cache, use_cache=True)

    return shape, bare, probed, steps


def child(args: argparse.Namespace) -> dict:
    """One round, in this fresh interpreter: the figures as a dict."""
    _, bare, probed, steps = decode_pair(args.threads, args.decode_steps)
    import moescope

    for _ in range(2):
        steps(bare)
        steps(probed)

    def run_bare() -> tuple[float, float]:
        cpu, start = time.process_time(), time.perf_counter()
        steps(bare)
        return time.perf_counter() - start, time.process_time() - cpu

    def run_probed(store: str) -> tuple[float, float, float]:
        cpu, before = time.process_time(), time.perf_counter()
        session = moescope.attach(probed, store=store, **({"writer": args.writer} if args.writer else {}))
        start = time.perf_counter()
        steps(probed)
        wall = time.perf_counter() - start
        session.flush()
        used = time.process_time() - cpu
        session.close()
        return wall, used, start - before

    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="moescope-fresh-") as tmp:
        if args.bare_first:
            out["bare"], out["bare_cpu"] = run_bare()
            out["probed"], out["probed_cpu"], out["attach"] = run_probed(os.path.join(tmp, "first"))
        else:
            out["probed"], out["probed_cpu"], out["attach"] = run_probed(os.path.join(tmp, "first"))
            out["bare"], out["bare_cpu"] = run_bare()
        out["later"], out["later_cpu"], out["later_attach"] = run_probed(os.path.join(tmp, "later"))
        out["later_bare"], out["later_bare_cpu"] = run_bare()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2, bench/overhead.py's)")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bare-first", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the rounds' interpreters (repeatable)")
    p.add_argument("--writers", default="",
                   help="where the store's work runs (moescope.attach's writer=): one or both of thread,process, "
                        "a round of each in turn; default moescope.attach's default")
    p.add_argument("--writer", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    writers = [w.strip() for w in args.writers.split(",") if w.strip()] or [""]
    env = {**os.environ, **dict(item.split("=", 1) for item in args.env)}
    print(f"fresh attach: decode preset (hidden 64, 16 layers, batch 32), a 16-token prefill and {args.decode_steps} "
          f"decode steps right after attach, vs bare; {args.rounds} rounds"
          f"{' per writer (' + ', '.join(writers) + ', in turn)' if writers != [''] else ''}, a fresh interpreter "
          f"each, {args.threads} threads, {os.cpu_count()} CPUs{' ' + ' '.join(args.env) if args.env else ''}")
    before = os.getloadavg()[0]
    rounds: dict[str, list[dict]] = {writer: [] for writer in writers}
    for i in range(args.rounds):
        for writer in writers:  # the writers' rounds interleaved: the machine's drift hits them alike
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--threads", str(args.threads),
                   "--decode-steps", str(args.decode_steps)] + (["--bare-first"] if i % 2 else []) + (
                   ["--writer", writer] if writer else [])
            result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if result.returncode:
                sys.exit(f"round {i} failed:\n{result.stderr}")
            rounds[writer].append(json.loads(result.stdout.strip().splitlines()[-1]))
            r = rounds[writer][-1]
            print(f"  round {i}{' ' + writer if writer else ''}: bare {r['bare']:.3f} s, after attach "
                  f"{r['probed']:.3f} s ({r['probed'] / r['bare']:.2f}x), attach {r['attach']:.3f} s; "
                  f"attach CPU {r['probed_cpu'] - r['bare_cpu']:.2f} s, "
                  f"later {r['later_cpu'] - r['later_bare_cpu']:.2f} s", flush=True)
    for writer, runs in rounds.items():
        if writer:
            print(f"\n== writer={writer}")
        report(runs)
    print(f"load average {before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")


def report(rounds: list[dict]) -> None:
    """The figures over one writer's rounds."""
    def figure(key: str, bare: str) -> tuple[float, float, float]:
        ratios = sorted(r[key] / r[bare] for r in rounds)
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        return statistics.median(ratios), q[0], q[2]

    med, lo, hi = figure("probed", "bare")
    later, later_lo, later_hi = figure("later", "later_bare")
    with_attach = statistics.median((r["attach"] + r["probed"]) / r["bare"] for r in rounds)
    print(f"attach plus the steps / bare steps (a job that attaches and serves at once): median {with_attach:.2f}x, "
          f"the first attach {statistics.median(r['attach'] for r in rounds):.3f} s of wall, a later one "
          f"{statistics.median(r['later_attach'] for r in rounds):.3f} s")
    cpu = statistics.median(r["probed_cpu"] - r["bare_cpu"] for r in rounds)
    later_cpu = statistics.median(r["later_cpu"] - r["later_bare_cpu"] for r in rounds)
    print(f"steps after the first attach / bare: median {med:.2f}x (IQR {lo:.2f}-{hi:.2f}; target {TARGET_RATIO}), "
          f"bare {statistics.median(r['bare'] for r in rounds):.3f} s, "
          f"after attach {statistics.median(r['probed'] for r in rounds):.3f} s")
    print(f"steps after a later attach / bare: median {later:.2f}x (IQR {later_lo:.2f}-{later_hi:.2f})")
    print(f"CPU of the first attach to a new store, beyond the steps: median {cpu:.2f} s (target {TARGET_CPU_S}); "
          f"a later attach {later_cpu:.2f} s")


if __name__ == "__main__":
    main()
