"""A store recorded by the real probe on a real (tiny, random-initialised) Mixtral, for the tests.

Two runs, each tagged by domain (code / prose / math, token ids drawn from different ranges so
the router sees different inputs per domain) and by router version (A / B), with per-token
routes, sampled router inputs and logits; then the real alerts engine over the store with a
rule pack sensitive enough to fire on this model, so the alerts table holds real transitions.
"""

from __future__ import annotations

import os

import torch

import moescope
from tests.support.zoo import tiny_model

DOMAINS = {"code": (0, 48), "prose": (40, 96), "math": (88, 128)}
STEPS_PER_RUN = 36
BATCH, SEQ = 2, 16
RULES = """
version: 1
defaults: {window: 4, for: 0s, cooldown: 0s}
baseline: {first_steps: 8}
rules:
  - name: ExpertLoadSkew
    expr: load_max_mean > 1.5
  - name: RoutingDriftFromBaseline
    expr: kl_baseline > 0.02
"""


def record_store(root: str | os.PathLike, runs: int = 2, steps: int = STEPS_PER_RUN) -> list[str]:
    """Record `runs` runs into `root`; returns their run ids (oldest first)."""
    model = tiny_model("mixtral")
    generator = torch.Generator().manual_seed(0)
    run_ids = []
    for index in range(runs):
        version = "AB"[index % 2]
        session = moescope.attach(model, store=root, routes=True, router_inputs=16, router_logits=8,
                               tags={"router": version}, run_id=f"run-{index}-{version}")
        try:
            for step in range(steps):
                domain = list(DOMAINS)[step % len(DOMAINS)]
                lo, hi = DOMAINS[domain]
                with session.tag(domain=domain), torch.no_grad():
                    model(torch.randint(lo, hi, (BATCH, SEQ), generator=generator))
        finally:
            session.close()
        run_ids.append(session.run.run_id)
    return run_ids


def record_alerts(root: str | os.PathLike) -> int:
    """Run the real alerts engine over the store; returns the number of transitions written."""
    from moescope.alerts.rules import parse_rules
    from moescope.alerts.storage import StoreAlertRunner

    runner = StoreAlertRunner(os.fspath(root), parse_rules(RULES, "tests/support/recording.py"))
    return len(runner.poll_once())


if __name__ == "__main__":
    import sys

    ids = record_store(sys.argv[1])
    print(ids, record_alerts(sys.argv[1]), "transitions")
