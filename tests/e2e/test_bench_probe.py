"""The probe's benchmark scripts run as docs/benchmarks.md says, at small sizes, and what they count holds:
no tensor op per MoE layer in decode inference, and a corrupted expert gated within the policy's
windows. Oracles: the op counter's own aten calls (a TorchDispatchMode), and the trust gate's
weight read back from the session."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.support.paths import REPO


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_decode_inference_adds_no_op_per_moe_layer():
    out = _run("bench/overhead.py", "--preset", "decode", "--ops", "--layers", "2", "--hidden", "32",
               "--intermediate", "64", "--experts", "4")
    rows = {m.group(1): (float(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^(aggregates|routes to Parquet)\s+(-?[\d.]+)\s+(-?[\d.]+)$", out, re.M)}
    assert set(rows) == {"aggregates", "routes to Parquet"}, out
    for name, (per_layer, constant) in rows.items():
        assert abs(per_layer) < 0.01, (name, out)  # a window's forwards are reduced together
        # the forward count only: a window's reduction runs on the writer's thread, which the
        # counter (a dispatch mode, per thread) does not see
        assert 0 < constant < 4, (name, out)


def test_detection_gates_a_corrupted_expert_within_the_policys_windows():
    out = _run("bench/detection.py", "--setups", "fault test", "--trials", "2", "--limit", "64")
    found = re.findall(r"fault test\s+(nan|scale)\s+window\s+1\s+forwards to the gate: median ([\d.]+), max (\d+)", out)
    assert {fault for fault, _, _ in found} == {"nan", "scale"}, out
    for _, median, worst in found:
        # gate_after=2 health windows of 4 forwards (HealthConfig.window_steps) plus the window the
        # fault began in, and one more window: sampled every forward, the 2 layers take turns
        assert float(median) <= int(worst) <= 3 * 4 + 4, out


def test_overhead_runs_every_variant_on_every_copy_and_waits_for_its_writer():
    saved = list(sys.path)
    sys.path.insert(0, os.path.join(REPO, "bench"))
    try:
        import overhead
    finally:
        sys.path[:] = saved  # as it was: a later spawned process inherits this process's path
    import moescope

    args = overhead.arguments(["--preset", "decode", "--layers", "2", "--hidden", "32", "--intermediate", "64",
                               "--experts", "4", "--decode-steps", "2", "--rounds", "1", "--steps", "2", "--warmup",
                               "0"])
    variants = {**overhead.VARIANTS, **overhead.HEALTH_VARIANTS}
    placed: dict[str, list[int]] = {}
    waits: dict[str, int] = {}

    def attach(model, **options):
        name = next(n for n, o in variants.items() if o == {k: v for k, v in options.items() if k != "store"})
        placed.setdefault(name, []).append(id(model))
        session = moescope.attach(model, **options)
        wait_idle = session.processor.wait_idle

        def counted(*a, **k):
            waits[name] = waits.get(name, 0) + 1
            return wait_idle(*a, **k)
        session.processor.wait_idle = counted
        return session

    times = overhead.measure(args, variants, attach=attach)
    # one round asked for, rounded up to one per part of the Latin square: a part per variant
    assert {n: len(t) for n, t in times.items()} == dict.fromkeys(variants, len(variants))
    probed = [n for n, o in variants.items() if o]
    copies = {c for ids in placed.values() for c in ids}
    assert set(placed) == set(probed) and len(copies) == len(variants)
    assert all(sorted(ids) == sorted(copies) for ids in placed.values()), "each variant ran on every copy once"
    assert waits == dict.fromkeys(probed, len(variants)), "every timed block waited for its own writer"
