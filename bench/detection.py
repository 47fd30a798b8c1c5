"""How long a corrupted expert runs before the trust gate takes it out: forwards from the fault to
the gate, for the health sampler's settings as they ship, on three setups.

The cost of health sampling (bench/overhead.py --health) buys detection; this script measures
what it buys, so a cheaper sampler can be shown not to detect later. Each trial takes a fresh copy
of the model, attaches it with the trust gate on its automatic policy (`trust_gate="auto"`, the
policy's default thresholds), runs three healthy windows, corrupts one expert's weights in place
(every weight NaN, or every weight x 1000), then runs window after window until the gate's weight
for that expert drops below 1. Windows are counted in forwards (`window_s=None`) and the session
is flushed at each window's end, so the count is the same on a fast machine and a loaded one. The
figure is forwards from the fault to the gate, a multiple of the window (median and max over the
trials; `>N` when a trial was never gated within its limit).

Setups:
- decode: the decode preset of bench/overhead.py (hidden 64, 16 layers, 16 experts top-2, batch 32,
  one token per forward on a KV cache), the default sampling (`probe.HealthSampling()`), window 32;
- demo: the committed demo model (4 layers, 8 experts) with the demo's settings (window 8,
  `sample_every=1`), batches of 2 x 16 tokens;
- fault test: a random-initialised Mixtral from `tiny_model` with tests/integration/alerts/test_health_fault.py's
  settings (window 1, `sample_every=1`), batches of 2 x 16 tokens.

    python bench/detection.py                 # 4 experts per setup and fault
    python bench/detection.py --trials 8 --setups decode
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch
from tqdm import tqdm

import moescope
from moescope.alerts.trust_policy import TrustPolicy
from moescope.probe.health_sampling import _expert_tensors

# tests/support/zoo.py holds the small random-initialised models of every family (not shipped in the wheel)
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run as a script; imported by a test, the repository is on the path already
    sys.path.insert(0, _REPO)
from tests.support.zoo import tiny_model  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402  (bench/overhead.py: the decode preset and its workload)

FAULTS = ("nan", "scale")
SETUPS = ("decode", "demo", "fault test")


def corrupt(layer, expert: int, fault: str) -> None:
    """Every weight of one expert NaN, or scaled by 1000, in place."""
    with torch.no_grad():
        for param, row in _expert_tensors(layer)[expert]:
            view = param.view(-1) if row is None else param.view(layer.num_experts, -1)[row]
            view.fill_(float("nan")) if fault == "nan" else view.mul_(1000.0)


def token_batches(seed: int, vocab: int) -> Iterator[Callable[[torch.nn.Module], None]]:
    g = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(0, vocab, (2, 16), generator=g)
        yield lambda model: model(ids)


class Setup:
    def __init__(self, name: str, model: torch.nn.Module, window: int, options: dict,
                 forward: Callable[[torch.nn.Module], Callable[[], None]]):
        self.name, self.model, self.window, self.options, self.forward = name, model, window, options, forward


def setups(names: list[str]) -> list[Setup]:
    out = []
    if "decode" in names:
        args = argparse.Namespace(**overhead.PRESETS["decode"])

        def decode_step(model: torch.nn.Module) -> Callable[[], None]:
            args.decode_steps = 1  # one forward per call; the cache is cropped back every 16
            work = overhead.Workload(args, model)
            calls = [0]

            def step() -> None:
                work.model(work.tokens, past_key_values=work.cache, use_cache=True)
                calls[0] += 1
                if calls[0] % 16 == 0:
                    work.cache.crop(-16)  # back to the prompt
            return step
        out.append(Setup("decode", overhead.build_model(args), 32, {}, decode_step))
    if "demo" in names:
        from moescope.demo.data import load_demo_model

        model, tokenizer = load_demo_model()
        vocab = tokenizer.vocab_size
        out.append(Setup("demo", model, 8, dict(sample_every=1), lambda m: _batch_step(m, vocab)))
    if "fault test" in names:
        out.append(Setup("fault test", tiny_model("mixtral"), 1, dict(sample_every=1), lambda m: _batch_step(m, 128)))
    return out


def _batch_step(model: torch.nn.Module, vocab: int) -> Callable[[], None]:
    batches = token_batches(7, vocab)
    return lambda: next(batches)(model)


def forwards_to_gate(setup: Setup, layer_at: int, expert: int, fault: str, limit: int) -> int | None:
    model = copy.deepcopy(setup.model)
    step = setup.forward(model)
    session = moescope.attach(model, trust_gate="auto", trust_policy=TrustPolicy(), window=setup.window,
                              window_s=None, health_options=setup.options or None)
    try:
        layer = session.layers[layer_at]
        with torch.no_grad():
            for _ in range(3 * setup.window):
                step()
            session.flush()
            corrupt(layer, expert, fault)
            forwards = 0
            while session.gate.weight(layer.index, expert) == 1.0:
                if forwards >= limit:
                    return None
                for _ in range(setup.window):
                    step()
                session.flush()
                forwards += setup.window
            return forwards
    finally:
        session.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=4, help="experts corrupted per setup and fault (default 4)")
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    p.add_argument("--limit", type=int, default=2048, help="forwards after the fault before a trial gives up")
    p.add_argument("--seed", type=int, default=0, help="which layers and experts are corrupted")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(args.seed)
    lines = []
    for setup in setups(args.setups):
        probe_layers = moescope.probe.find_moe_layers(setup.model)
        for fault in FAULTS:
            counts, started = [], time.perf_counter()
            for _ in tqdm(range(args.trials), desc=f"{setup.name} {fault}", unit="trial", leave=False):
                at = int(torch.randint(0, len(probe_layers), (1,), generator=g))
                expert = int(torch.randint(0, probe_layers[at].num_experts, (1,), generator=g))
                counts.append(forwards_to_gate(setup, at, expert, fault, args.limit))
            gated = [c for c in counts if c is not None]
            median = statistics.median(gated) if gated else None
            worst = f">{args.limit}" if len(gated) < len(counts) else str(max(gated))
            lines.append(f"{setup.name:11s} {fault:6s} window {setup.window:3d}  forwards to the gate: median "
                         f"{median if median is not None else '-'}, max {worst}  ({len(counts)} trials, "
                         f"{time.perf_counter() - started:.0f} s)")
            print(lines[-1], flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
