"""`moescope demo`: the whole story on a small trained MoE, offline, in a few minutes.

Healthy traffic from three domains sets a baseline; a traffic shift moves routing away from it
(drift alert); a corrupted expert is noticed by its health score, alerted, masked by the trust
gate, and lifted again once its weights are restored. Alerts travel through the real outbox to a
local webhook receiver. Everything lands in a store the dashboard can open.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

import numpy as np
import torch
from tqdm import tqdm

import probe
from alerts.engine import AlertEngine, EngineExporter
from alerts.notify import WebhookNotifier
from alerts.outbox import Outbox, OutboxWorker
from alerts.rules import load_rules
from alerts.storage import AlertTableWriter
from alerts.trust_policy import TrustPolicy
from moescope.demo_data import DOMAINS, demo_model_path, domain_texts, load_demo_model
from moescope.receiver import WebhookReceiver
from moescope.specialisation import normalized_mutual_info
from moescope.summary import format_summary
from store import Store

DESCRIPTION = """\
Play the whole moescope story on the shipped demo model (a 2.8M-parameter Mixtral trained
on Python's own source, its documentation and arithmetic), with no download:

  1. healthy traffic from three domains, through forward and generate: the baseline
  2. a traffic shift to one domain: routing drifts, the drift rule fires a webhook
  3. a corrupted expert (weights x1000): its health score falls, an alert fires, the
     trust gate masks it, outputs recover; weights restored: the gate lifts

Alerts go through the persistent outbox to a local webhook receiver that prints them.
At the end: headline figures and how to open the dashboard on the store.

examples:
  moescope demo                      # about a minute on 2 CPU cores
  moescope demo --store runs/mine    # keep the store somewhere else
  moescope demo --quick              # shorter phases, for tests
"""

LENGTH = 64  # tokens per sequence
CORRUPTION_SCALE = 1000.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default="runs/demo",
                        help="store folder (default: runs/demo); an earlier demo store there is replaced")
    parser.add_argument("--quick", action="store_true", help="shorter phases (for tests)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the traffic (default: 0)")


@dataclass
class Phases:
    baseline: int
    generate: int
    shift: int
    max_incident: int

    @classmethod
    def for_args(cls, quick: bool) -> Phases:
        return cls(baseline=30, generate=3, shift=24, max_incident=40) if quick else \
            cls(baseline=72, generate=8, shift=48, max_incident=60)


class Traffic:
    """Tokenised held-out texts per domain, served as batches of varying size."""

    def __init__(self, tokenizer, seed: int):
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        self.texts = {d: domain_texts(d, 64, seed=seed, max_chars=600) for d in DOMAINS}

    def batch(self, domain: str, size: int) -> dict[str, torch.Tensor]:
        picks = self.rng.choice(len(self.texts[domain]), size=size, replace=False)
        texts = [self.texts[domain][i] for i in picks]
        return self.tokenizer(texts, return_tensors="pt", padding="max_length", truncation=True,
                              max_length=LENGTH)

    def prompts(self) -> dict[str, torch.Tensor]:
        """One prompt per domain in one left-padded batch, so every decode step mixes the domains."""
        texts = [self.texts[d][int(self.rng.integers(len(self.texts[d])))][:80] for d in DOMAINS]
        self.tokenizer.padding_side = "left"
        try:
            return self.tokenizer(texts, return_tensors="pt", padding=True)
        finally:
            self.tokenizer.padding_side = "right"

    def size(self) -> int:
        return int(self.rng.integers(1, 9))


def _say(text: str = "") -> None:
    tqdm.write(text)


def _alert_line(document: dict) -> None:
    alert = document["alert"]
    labels = alert.get("labels", {})
    where = f"layer {alert['layer']}" + (f", expert {labels['expert']}" if "expert" in labels else "")
    values = ", ".join(f"{k}={v:.3g}" for k, v in (alert.get("values") or {}).items()
                       if isinstance(v, (int, float)))
    _say(f"    webhook <- [{document['status']}] {alert['name']} ({where}, step {alert['step']})"
         + (f" {values}" if values else ""))


def _run_until(condition: Callable[[], bool], step: Callable[[], None], limit: int, desc: str,
               settle: Callable[[], None]) -> int:
    """Run forwards until `condition` holds (checked after the writer caught up); returns forwards run."""
    bar = tqdm(total=limit, desc=desc, unit="fwd", leave=False)
    try:
        for n in range(1, limit + 1):
            step()
            bar.update()
            settle()
            if condition():
                return n
        return limit
    finally:
        bar.close()


def _expert_tensors(model: torch.nn.Module, layer: int) -> list[torch.nn.Parameter]:
    experts = model.model.layers[layer].mlp.experts
    return [experts.gate_up_proj, experts.down_proj]


def run(args: argparse.Namespace) -> int:
    phases = Phases.for_args(args.quick)
    torch.manual_seed(args.seed)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    store_root = os.path.abspath(args.store)
    if os.path.isdir(store_root):
        if not os.path.exists(os.path.join(store_root, ".moescope-demo")):
            raise FileExistsError(f"{store_root} exists and is not a demo store; choose another --store")
        shutil.rmtree(store_root)
    os.makedirs(os.path.join(store_root, ".moescope"), exist_ok=True)
    open(os.path.join(store_root, ".moescope-demo"), "w").close()

    started = time.perf_counter()
    model, tokenizer = load_demo_model()
    traffic = Traffic(tokenizer, args.seed)
    _say(f"demo model: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters, "
         f"{model.config.num_hidden_layers} MoE layers x {model.config.num_local_experts} experts, "
         f"top-{model.config.num_experts_per_tok} ({demo_model_path()})")

    secret = secrets.token_hex(16)
    receiver = WebhookReceiver(on_alert=_alert_line, secret=secret).start()
    outbox = Outbox(os.path.join(store_root, ".moescope", "alerts-outbox.sqlite"),
                    [WebhookNotifier(receiver.url, secret=secret)], base_backoff_s=0.2)
    worker = OutboxWorker(outbox, interval_s=0.1).start()
    rules = load_rules(resources.files("moescope").joinpath("rules", "demo.yaml"))
    engine = EngineExporter(AlertEngine(rules), [outbox, AlertTableWriter(store_root)])
    policy = TrustPolicy(sink=outbox)
    _say(f"webhook receiver listening on {receiver.url} (HMAC-signed deliveries)")

    session = probe.attach(
        model, store=store_root, routes=True, router_inputs=16, kv_cache=True, health=True,
        trust_gate="auto", trust_policy=policy, exporters=[engine], tags={"model": "demo"},
        flush_interval_s=1.0,
        # The story is a few hundred forwards long: sample expert health at every forward, not
        # every 4th (the default, which keeps its cost down on a busy server), so the incident is
        # judged within a few windows.
        health_options=dict(sample_every=1))

    def forward(domain: str, phase: str) -> None:
        with session.tag(domain=domain, phase=phase), torch.no_grad():
            model(**traffic.batch(domain, traffic.size()))

    def settle() -> None:
        session.flush()
        outbox.flush(5.0)

    figures: dict = {"store": store_root}
    try:
        # -- 1. healthy traffic ------------------------------------------------------------
        _say("\n1. Healthy traffic: code, prose and arithmetic in turn, batches of 1-8, forward and generate")
        for i in tqdm(range(phases.baseline), desc="baseline", unit="fwd", leave=False):
            forward(DOMAINS[i % len(DOMAINS)], "baseline")
        for _ in tqdm(range(phases.generate), desc="generate", unit="call", leave=False):
            with session.tag(domain="mixed", phase="generate"), torch.no_grad():
                model.generate(**traffic.prompts(), max_new_tokens=12, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id)
        settle()
        _say(f"   {session.step} forwards recorded, {len(receiver.received)} alerts so far "
             "(an alert here is about the trained model itself, e.g. an expert it barely uses)")

        # -- 2. traffic shift --------------------------------------------------------------
        _say("\n2. Traffic shift: only arithmetic from now on; the routing moves away from the baseline")
        for _ in tqdm(range(phases.shift), desc="shift", unit="fwd", leave=False):
            forward("math", "shift")
        settle()
        figures["drift_alert"] = "RoutingDriftFromBaseline" in receiver.names("firing")
        _say("   drift alert " + ("received" if figures["drift_alert"] else "NOT received"))

        # -- 3. a corrupted expert ----------------------------------------------------------
        layer, expert = _busiest_expert(store_root, session.run.run_id)
        probe_batch = traffic.batch("code", 4)
        with session.tag(phase="check"), torch.no_grad():
            clean = model(**probe_batch).logits
        saved = [t.detach()[expert].clone() for t in _expert_tensors(model, layer)]
        _say(f"\n3. Corrupting layer {layer}, expert {expert} (its busiest): weights x{CORRUPTION_SCALE:g}")
        with torch.no_grad():
            for t in _expert_tensors(model, layer):
                t[expert] *= CORRUPTION_SCALE
            with session.tag(phase="check"):
                broken = model(**probe_batch).logits
        figures["corrupt_error"] = _relative_error(broken, clean)
        _say(f"   outputs now off by {figures['corrupt_error']:.3g} (relative to the clean model)")
        gated = _run_until(lambda: session.gate.weight(layer, expert) == 0.0,
                           lambda: forward(DOMAINS[int(traffic.rng.integers(3))], "incident"),
                           phases.max_incident, "incident", settle)
        figures["gated"] = session.gate.weight(layer, expert) == 0.0
        with session.tag(phase="check"), torch.no_grad():
            masked = model(**probe_batch).logits
        figures["gated_after_forwards"] = gated
        figures["masked_finite"] = bool(masked.isfinite().all())
        figures["masked_error"] = _relative_error(masked, clean)
        _say(f"   gate {'masked' if figures['gated'] else 'did NOT mask'} the expert after {gated} forwards; "
             f"outputs finite: {figures['masked_finite']}, off by {figures['masked_error']:.3g} from the clean model")

        _say("\n   Restoring the expert's weights")
        with torch.no_grad():
            for t, original in zip(_expert_tensors(model, layer), saved):
                t[expert] = original
        lifted = _run_until(lambda: session.gate.weight(layer, expert) == 1.0,
                            lambda: forward(DOMAINS[int(traffic.rng.integers(3))], "recovery"),
                            phases.max_incident, "recovery", settle)
        figures["lifted"] = session.gate.weight(layer, expert) == 1.0
        with session.tag(phase="check"), torch.no_grad():
            figures["recovered_error"] = _relative_error(model(**probe_batch).logits, clean)
        _say(f"   gate {'lifted' if figures['lifted'] else 'NOT lifted'} after {lifted} forwards; "
             f"outputs off by {figures['recovered_error']:.3g} from the clean model")
        figures["corrupted"] = {"layer": layer, "expert": expert}
    finally:
        session.close()
        outbox.flush(10.0)
        worker.stop()
        outbox.close()
        receiver.stop()

    figures.update(headline_figures(store_root, session.run.run_id))
    figures["alerts_received"] = [f"{d['status']}:{d['alert']['name']}" for d in receiver.received]
    figures["seconds"] = time.perf_counter() - started
    with open(os.path.join(store_root, "demo_summary.json"), "w") as f:
        json.dump(figures, f, indent=2, default=float)
    _say("")
    _say(format_summary(store_root, session.run.run_id))
    _say("")
    _say("Headline figures")
    for domain, fraction in figures["active_fraction_by_domain"].items():
        _say(f"  {domain:>6}: this model used {100 * fraction:.2f}% of its parameters per token")
    _say("  specialisation, NMI(domain, top-1 expert) per layer: "
         + ", ".join(f"{v:.2f}" for v in figures["nmi_by_layer"]))
    _say(f"  alerts received by the webhook: {len(receiver.received)} "
         f"({', '.join(sorted(set(figures['alerts_received'])))})")
    _say(f"  finished in {figures['seconds']:.0f} s")
    _say("")
    _say("Open the dashboard on this store:")
    _say(f"  moescope dashboard {args.store} --tokenizer {demo_model_path()}")
    ok = figures["drift_alert"] and figures["gated"] and figures["lifted"]
    return 0 if ok else 1


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    if not a.isfinite().all():
        return math.inf
    return float((a - b).norm() / b.norm())


def _busiest_expert(root: str, run_id: str) -> tuple[int, int]:
    share = Store(root).expert_share(run_id)
    share = share[share.layer < share.layer.max()]  # the last layer's hot expert is a known quirk
    row = share.sort_values("load", ascending=False).iloc[0]
    return int(row.layer), int(row.expert)


def headline_figures(root: str, run_id: str) -> dict:
    """The figures the demo prints, computed in DuckDB from the store it wrote."""
    store = Store(root)
    per_domain = store.sql("""
        SELECT tags['domain'] AS domain, sum(active_params * tokens) / sum(tokens) / any_value(total_params) AS f
        FROM steps WHERE run_id = ? AND tags['domain'] IS NOT NULL AND tags['phase'] <> 'check'
        GROUP BY domain ORDER BY domain""", [run_id])
    top1 = store.sql("""
        SELECT layer, tags['domain'] AS domain, expert_ids[1] AS expert
        FROM routes WHERE run_id = ? AND tags['phase'] = 'baseline'""", [run_id])
    nmi = []
    for layer in sorted(top1.layer.unique()):
        rows = top1[top1.layer == layer]
        nmi.append(normalized_mutual_info(rows.domain.astype("category").cat.codes.to_numpy(),
                                          rows.expert.to_numpy()))
    return {"active_fraction_by_domain": dict(zip(per_domain.domain, per_domain.f.astype(float))),
            "nmi_by_layer": nmi}
