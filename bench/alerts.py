"""Every default alert rule and the health alert on labelled incidents: precision, recall, and the
forwards from a fault's onset to the first firing.

Each scenario is one fresh run of a model through the real probe (health sampling as it ships:
every 4th forward), the store (Parquet in a temporary folder), the rules engine in the probe's
pipeline (`alerts.engine.EngineExporter`) and the health policy (`ExpertUnhealthy`); the firings are
read back from the store's `alerts` table. A run is `WARM` forwards of healthy mixed traffic (the
rules' baseline is its first 32 steps), then `AFTER` forwards of the scenario, which begins at the
onset (step `WARM`). Records are one per forward (`window=1`), so a rule's window counts forwards.

The rules are `alerts/default_rules.yaml` with its expressions, windows and thresholds as shipped,
and `for` / `cooldown` counted in steps (`for: 0 steps`, `cooldown: 48 steps`, like the demo's
pack): a scenario is a few minutes of a busy server, far shorter than the pack's `for: 2m`/`5m` of
event time. A longer `for` only removes firings, so the precision here is a floor for the pack
as shipped and the steps to fire are the evidence's own, before `for` is added.

Labels (`LABELS`, reasons in docs/alerts.md): which scenarios each rule should fire on. A rule's
scenario counts as a true positive when it fired after the onset, a false positive when it
fired in a scenario it is not labelled for (or before the onset). Per rule: precision = true
positives / scenarios it fired in, recall = true positives / scenarios labelled.

    python bench/alerts.py                      # both models, every scenario
    python bench/alerts.py --models qwen3_moe   # the tiny random-initialised Qwen3-MoE only
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

import moescope
from moescope.alerts.engine import AlertEngine, EngineExporter
from moescope.alerts.rules import RulePack, default_rules
from moescope.alerts.storage import AlertTableWriter
from moescope.alerts.trust_policy import TrustPolicy
from moescope.probe.health_sampling import _expert_tensors
from moescope.store.store import Store

# tests/support/zoo.py holds the small random-initialised models of every family (not shipped in the wheel)
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run as a script; imported by a test, the repository is on the path already
    sys.path.insert(0, _REPO)
from tests.support.zoo import tiny_model  # noqa: E402

WARM, AFTER = 48, 96
HEALTH_RULE = "ExpertUnhealthy"
EXPERT = 3  # the expert a fault hits, in layer 0
HEALTHY = ("healthy_forward", "healthy_generate", "batch_change")
SHIFTS = ("domain_shift", "long_context")
EXPERT_FAULTS = ("expert_scale", "expert_nan", "expert_zero")
ROUTER_FAULTS = ("router_collapse", "router_skew", "router_hot", "dead_expert", "capacity_overflow")
# router_skew: the share of tokens whose first choice it forces to the expert (layer 0 only). From an even
# share (a quarter of the tokens choose an expert under top-2, E = 8) the expert's share of slots becomes
# (1/4 + p * 3/4) / 2: p = 1/3 puts it on the skew rule's 2x exactly (no margin), p = 1/2 at 2.5x but with the
# others scaled by 0.79 (KL 0.12 past the drift's 0.1); p = 2/5 gives 2.2x with KL 0.08: a skew past 2x
# with the rest of the distribution in place, by this hand computation, fixed before the first run.
SKEW_FRACTION = 0.4
SCENARIOS = HEALTHY + SHIFTS + EXPERT_FAULTS + ROUTER_FAULTS

# Which scenarios each rule should fire on; docs/alerts.md gives the reason for each. A rule on a
# signal the model does not have (drops, on a dropless family) is labelled for nothing there.
LABELS: dict[str, frozenset[str]] = {
    HEALTH_RULE: frozenset(EXPERT_FAULTS),
    "RoutingDriftFromBaseline": frozenset({"domain_shift", "expert_nan", "router_collapse", "router_hot",
                                           "dead_expert"}),
    "DeadExpert": frozenset({"dead_expert"}),
    "ExpertLoadSkew": frozenset({"expert_nan", "router_collapse", "router_skew"}),
    "LoadBiasedAgainstUniform": frozenset({"expert_nan"}),
    "DroppedTokens": frozenset({"capacity_overflow", "router_collapse", "expert_nan"}),
    "RouterEntropyRise": frozenset({"router_hot"}),
    "RoutingCooldown": frozenset(),
    "RoutingDriftRate": frozenset(),  # needs per-token routes, which these runs do not record
    "RankImbalance": frozenset(),
    "WideExpertDispatch": frozenset(),
}
CAPACITY_RULES = frozenset({"DroppedTokens"})  # no data on a model without an expert capacity


def bench_rules() -> RulePack:
    """The default pack, `for` and `cooldown` counted in steps (see the module docstring)."""
    pack = default_rules()
    rules = tuple(dataclasses.replace(r, for_s=0.0, for_steps=0, cooldown_s=0.0, cooldown_steps=48) for r in pack.rules)
    return dataclasses.replace(pack, rules=rules)


@dataclass
class Model:
    """A model, its traffic per domain, and what its scenarios can do to it."""

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[str, int, int, np.random.Generator], torch.Tensor]  # (domain, rows, length, rng) -> ids
    length: int  # tokens per row of normal traffic
    long: int  # tokens per row of long-context traffic
    domains: tuple[str, ...]  # healthy traffic's
    shift: str  # the domain a shift moves all traffic to
    capacity: bool  # has an expert capacity (tokens can drop)
    pad: int = 0
    skip: tuple[str, ...] = field(default_factory=tuple)


def demo_model() -> Model:
    from moescope.demo.data import DOMAINS, domain_windows, load_demo_model

    _, tokenizer = load_demo_model()
    windows = {(d, n): torch.tensor(domain_windows(tokenizer, d, 48, n, seed=1)) for d in DOMAINS for n in (64, 384)}

    def batch(domain: str, rows: int, length: int, rng: np.random.Generator) -> torch.Tensor:
        pool = windows[(domain, length)]
        return pool[torch.as_tensor(rng.choice(len(pool), size=rows, replace=False))]
    return Model("demo", lambda: load_demo_model()[0], batch, 64, 384, DOMAINS, "math", capacity=True,
                 pad=int(tokenizer.pad_token_id or 0))


def qwen3_model() -> Model:
    # Random-initialised: a "domain" is a third of the vocabulary; the shift goes to a narrow one (4
    # token ids, as arithmetic is digits and operators), so it moves the routing as different token
    # embeddings do.
    ranges = {"low": (1, 43), "mid": (43, 86), "high": (86, 128), "digits": (1, 5)}

    def batch(domain: str, rows: int, length: int, rng: np.random.Generator) -> torch.Tensor:
        lo, hi = ranges[domain]
        return torch.as_tensor(rng.integers(lo, hi, size=(rows, length)))
    return Model("qwen3_moe", lambda: tiny_model("qwen3_moe"), batch, 16, 128, ("low", "mid", "high"), "digits",
                 capacity=False,
                 # a dropless family: no capacity to overflow; a random-initialised router is near uniform
                 # already (mean per-token entropy 0.997 of ln E), so a hotter one is not a change
                 skip=("capacity_overflow", "router_hot"))


MODELS = {"demo": demo_model, "qwen3_moe": qwen3_model}


def _expert_views(layer, expert: int) -> list[torch.Tensor]:
    return [p.view(-1) if row is None else p.view(layer.num_experts, -1)[row]
            for p, row in _expert_tensors(layer)[expert]]


def router_fault(router: torch.nn.Module, kind: str, expert: int, seed: int = 0):
    """A forward hook, run before the probe's, that rebuilds the router's (logits, weights, ids) from
    faulty logits by the router's own rule (softmax, top-k, renormalised where the router does)."""
    chance = torch.Generator().manual_seed(seed)  # which tokens router_skew hits, the same on every run

    def hook(module, args, output):
        logits = output[0]
        if kind == "router_collapse":
            logits = logits.clone()
            logits[:, expert] += 30.0  # every token's first choice
        elif kind == "router_skew":
            logits = logits.clone()
            hit = torch.rand(logits.shape[0], generator=chance) < SKEW_FRACTION
            logits[hit, expert] += 30.0  # the first choice of SKEW_FRACTION of the tokens
        elif kind == "router_hot":
            logits = logits / 100.0  # temperature x100: near uniform
        else:  # dead_expert
            logits = logits.clone()
            logits[:, expert] = -1e4
        probs = torch.softmax(logits.float(), dim=-1)
        top, ids = torch.topk(probs, module.top_k, dim=-1)
        if getattr(module, "norm_topk_prob", True):
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(output[1].dtype), ids
    return router.register_forward_hook(hook, prepend=True)


@dataclass
class Outcome:
    scenario: str
    firings: dict[str, list[int]]  # rule -> steps it fired at (every layer and expert)
    fault_expert_fired: bool  # ExpertUnhealthy fired for the faulty (layer 0, EXPERT) itself
    seconds: float
    root: str  # the run's store
    capacity: bool = True  # the model has an expert capacity (tokens can drop)


def play(model: Model, scenario: str, seed: int = 0, warm: int = WARM, after: int = AFTER) -> Outcome:
    """One scenario on a fresh copy of `model`: the firings read back from the store's alerts table."""
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    net = model.build()
    root = tempfile.mkdtemp(prefix=f"alerts-bench-{model.name}-{scenario}-")
    table = AlertTableWriter(root)
    engine = EngineExporter(AlertEngine(bench_rules()), [table])
    session = moescope.attach(net, store=root, health=True, trust_policy=TrustPolicy(), exporters=[engine],
                              window=1, window_s=None)
    layer = session.layers[0]
    handles = []

    def forward(domain: str, rows: int, length: int) -> None:
        ids = model.batch(domain, rows, length, rng)
        net(input_ids=ids, attention_mask=torch.ones_like(ids))

    def healthy(i: int) -> None:
        forward(model.domains[i % len(model.domains)], int(rng.integers(1, 5)), model.length)

    try:
        with torch.no_grad():
            for i in range(warm):
                healthy(i)
            if scenario in EXPERT_FAULTS:
                for view in _expert_views(layer, EXPERT):
                    {"expert_scale": lambda v: v.mul_(1000.0), "expert_nan": lambda v: v.fill_(float("nan")),
                     "expert_zero": lambda v: v.zero_()}[scenario](view)
            elif scenario in ("router_collapse", "router_hot", "dead_expert"):
                handles = [router_fault(moe.router, scenario, EXPERT) for moe in session.layers]
            elif scenario == "router_skew":  # one expert's router row, in one layer
                handles = [router_fault(layer.router, scenario, EXPERT, seed)]
            elif scenario == "capacity_overflow":
                for module in net.modules():
                    if hasattr(module, "capacity_factor"):
                        module.capacity_factor = 0.25  # a quarter of the trained capacity
            for i in range(after):
                if scenario == "healthy_generate" and i % 8 == 0:
                    prompt = model.batch(model.domains[i // 8 % len(model.domains)], 2, model.length, rng)
                    net.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=7,
                                 do_sample=False, pad_token_id=model.pad)  # 8 forwards: a prefill and 7 decodes
                elif scenario == "healthy_generate":
                    continue
                elif scenario == "domain_shift":
                    forward(model.shift, int(rng.integers(1, 5)), model.length)
                elif scenario == "batch_change":
                    forward(model.domains[i % len(model.domains)], 16, model.length)
                elif scenario == "long_context":
                    forward(model.domains[i % len(model.domains)], 1, model.long)
                else:
                    healthy(i)
    finally:
        for handle in handles:
            handle.remove()
        session.close()  # the policy's alerts reach the table; the engine's resolve ("run ended")
        table.close()
    return read_outcome(root, scenario, time.perf_counter() - started, model.capacity)


def read_outcome(root: str, scenario: str, seconds: float = 0.0, capacity: bool = True) -> Outcome:
    """A played scenario's firings, from its store's `alerts` table."""
    with Store(root) as store:
        rows = store.sql("SELECT alertname, step, layer, expert FROM alerts WHERE state = 'firing' ORDER BY step")
    firings: dict[str, list[int]] = {}
    for name, step in zip(rows.alertname, rows.step):
        firings.setdefault(str(name), []).append(int(step))
    faulty = bool(((rows.alertname == HEALTH_RULE) & (rows.layer == 0) & (rows.expert == EXPERT)).any())
    return Outcome(scenario, firings, faulty, seconds, root, capacity)


@dataclass
class Score:
    rule: str
    labelled: int
    fired: int
    true_positives: int
    latency: list[int]  # forwards from the onset to the first firing, per true positive

    @property
    def precision(self) -> float | None:
        return self.true_positives / self.fired if self.fired else None

    @property
    def recall(self) -> float | None:
        return self.true_positives / self.labelled if self.labelled else None


def standing(outcomes: list[Outcome], warm: int = WARM) -> set[str]:
    """Rules that fired before the onset in every scenario: warnings about the model itself (the
    demo model's never-routed expert, its drops at capacity factor 1.0), not about a scenario. They
    are listed apart, and only their firings after the onset are scored."""
    return set.intersection(*({r for r, steps in o.firings.items() if min(steps) < warm} for o in outcomes)) \
        if outcomes else set()


def score(outcomes: list[Outcome], warm: int = WARM) -> list[Score]:
    """Per rule, over the outcomes (see the module docstring)."""
    scores = []
    model_warnings = standing(outcomes, warm)
    for rule, positives in LABELS.items():
        labelled = fired = tp = 0
        latency = []
        for o in outcomes:
            steps = o.firings.get(rule, [])
            if rule in model_warnings:
                steps = [s for s in steps if s >= warm]
            positive = o.scenario in positives and (o.capacity or rule not in CAPACITY_RULES)
            labelled += positive
            fired += bool(steps)
            after = [s for s in steps if s >= warm]
            hit = positive and bool(after) and not [s for s in steps if s < warm]
            if rule == HEALTH_RULE and positive:
                hit = hit and o.fault_expert_fired and all(s >= warm for s in steps)
            if hit:
                tp += 1
                latency.append(after[0] - warm)
        scores.append(Score(rule, labelled, fired, tp, latency))
    return scores


def table(scores: list[Score]) -> str:
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"
    lines = ["| rule | labelled | fired in | true pos. | precision | recall | forwards to fire (median, max) |",
             "|---|---|---|---|---|---|---|"]
    for s in scores:
        lat = f"{int(np.median(s.latency))}, {max(s.latency)}" if s.latency else "-"
        lines.append(f"| {s.rule} | {s.labelled} | {s.fired} | {s.true_positives} | {fmt(s.precision)} | "
                     f"{fmt(s.recall)} | {lat} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    everything: list[Score] = []
    for name in args.models:
        model = MODELS[name]()
        outcomes = []
        for scenario in args.scenarios:
            if scenario in model.skip:
                continue
            o = play(model, scenario, args.seed)
            fired = ", ".join(f"{r} x{len(s)} first at {s[0] - WARM:+d}" for r, s in sorted(o.firings.items()))
            print(f"{name:10s} {scenario:18s} {o.seconds:5.0f} s  {fired or 'nothing fired'}", flush=True)
            outcomes.append(o)
        warnings = ", ".join(sorted(standing(outcomes))) or "none"
        scores = score(outcomes)  # a model's standing warnings are its own, not the other model's
        print(f"\n{name} (warnings about the model itself, before every onset: {warnings})\n"
              f"{table(scores)}\n", flush=True)
        everything.extend(scores)
    if len(args.models) > 1:
        summed = [Score(rule, sum(s.labelled for s in mine), sum(s.fired for s in mine),
                        sum(s.true_positives for s in mine), [x for s in mine for x in s.latency])
                  for rule in LABELS for mine in [[s for s in everything if s.rule == rule]]]
        print(f"all models\n{table(summed)}\n")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
