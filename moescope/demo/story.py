"""`moescope demo`: the whole story on a small trained MoE, offline, in a few minutes.

Healthy traffic from three domains sets a baseline; a traffic shift moves routing away from it
(drift alert); a corrupted expert is noticed by its health score, alerted, masked by the trust
gate, and lifted again once its weights are restored. Alerts travel through the real outbox to a
local webhook receiver. Everything lands in a store the dashboard can open.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

import moescope
from moescope.alerts.delivery import OutboxWorker
from moescope.alerts.engine import AlertEngine, EngineExporter
from moescope.alerts.notify import WebhookNotifier
from moescope.alerts.outbox import Outbox, outbox_path
from moescope.alerts.rules import load_rules
from moescope.alerts.storage import AlertTableWriter
from moescope.alerts.trust_policy import TrustPolicy
from moescope.analyses.jitter import jitter
from moescope.analyses.summary import format_summary
from moescope.demo.data import DOMAINS, demo_model_path, domain_texts, domain_windows, load_demo_model
from moescope.demo.receiver import WebhookReceiver
from moescope.demo.rollout import PROMPT_TOKENS, play_rollout
from moescope.metrics.signals import specialisation_by_layer
from moescope.probe.session import ProbeSession
from moescope.store import Store

if TYPE_CHECKING:
    from transformers import MixtralForCausalLM, PreTrainedTokenizerFast

DESCRIPTION = """\
Play the whole moescope story on the shipped demo model (a 2.8M-parameter Mixtral trained
on Python's own source, its documentation and arithmetic, whose experts have a capacity per
sequence, so the parameters a token uses vary), with no download:

  1. healthy traffic from three domains, through forward and generate: the baseline
  2. a traffic shift to one domain: routing drifts, the drift rule fires a webhook
  3. a corrupted expert (weights x1000): its health score falls, an alert fires, the
     trust gate masks it, outputs recover; weights restored: the gate lifts

First, a small RL-style rollout: a bfloat16 copy of the model on other batch shapes plays
the inference engine (written as vLLM responses with routed experts and log-probs, imported),
and the float32 model, the trainer, measures how often it routes differently and how much of
the log-prob gap replaying the engine's routing removes (the Engine vs reference page).

Alerts go through the persistent outbox to a local webhook receiver that prints them.
At the end: headline figures (the share of the parameters each domain used, and how it
drifts with the position in the input) and how to open the dashboard on the store.

examples:
  moescope demo                      # about a minute on 2 CPU cores
  moescope demo --store runs/mine    # keep the store somewhere else
  moescope demo --quick              # shorter phases, for tests
"""

LENGTH = 128  # tokens per sequence: the length the demo model was trained on
POSITION_BUCKETS = 4  # the headline's drift with position: quarters of a LENGTH-token input
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
    """Held-out inputs per domain, LENGTH tokens each (no padding), served as batches of varying size."""

    def __init__(self, tokenizer, seed: int):
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        self.texts = {d: domain_texts(d, 64, seed=seed, max_chars=600) for d in DOMAINS}
        self.windows = {d: torch.tensor(domain_windows(tokenizer, d, 64, LENGTH, seed=seed)) for d in DOMAINS}

    def batch(self, domain: str, size: int) -> dict[str, torch.Tensor]:
        picks = self.rng.choice(len(self.windows[domain]), size=size, replace=False)
        input_ids = self.windows[domain][torch.as_tensor(picks)]
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}

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
    """Print a line of the story above the progress bars, from any thread (the webhook receiver
    prints from its own), flushed at once: stdout into a pipe is block-buffered and the bars' stderr
    is not, so an unflushed line would come out later, inside a bar."""
    with tqdm.external_write_mode():
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def _progress(iterable=None, **options: Any) -> tqdm:
    """A progress bar while stderr is a terminal, none in a log (a pipe, a file): there each redraw is
    one more piece of one endless line, and the webhook's lines would land inside it."""
    return tqdm(iterable, leave=False, disable=None, **options)


def _notification_line(alerts: list[dict]) -> None:
    """One line per notification: its alert, or a group's rule, where its alerts are and how many."""
    first = alerts[0]["alert"]
    if len(alerts) > 1:
        status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"  # as the group's
        if any("expert" in a["alert"].get("labels", {}) for a in alerts):
            places = ", ".join(_where(a["alert"]) for a in alerts)
        else:
            places = "layers " + ", ".join(str(layer) for layer in sorted({a["alert"]["layer"] for a in alerts}))
        steps = sorted({a["alert"]["step"] for a in alerts})
        when = f"step {steps[0]}" + (f"-{steps[-1]}" if len(steps) > 1 else "")
        reasons = {(a["alert"].get("annotations") or {}).get("resolved_reason") for a in alerts}
        why = next(iter(reasons)) if len(reasons) == 1 else None  # said once when every alert says it
        _say(f"    webhook <- [{status}] {first['name']} ({places}, {when}) {len(alerts)} alerts in one notification"
             + (f" ({why})" if why else ""))
        return
    values = ", ".join(f"{k}={v:.3g}" for k, v in (first.get("values") or {}).items()
                       if isinstance(v, (int, float)))
    why = (first.get("annotations") or {}).get("resolved_reason")
    _say(f"    webhook <- [{alerts[0]['status']}] {first['name']} ({_where(first)}, step {first['step']})"
         + (f" {values}" if values else "") + (f" ({why})" if why else ""))


def _where(alert: dict) -> str:
    labels = alert.get("labels", {})
    return f"layer {alert['layer']}" + (f" expert {labels['expert']}" if "expert" in labels else "")


def _run_until(condition: Callable[[], bool], step: Callable[[], None], limit: int, desc: str,
               settle: Callable[[], None]) -> int:
    """Run forwards until `condition` holds (checked after the writer caught up); returns forwards run."""
    bar = _progress(total=limit, desc=desc, unit="fwd")
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
    mixtral: Any = model  # the demo's Mixtral, read by its module names
    experts = mixtral.model.layers[layer].mlp.experts
    return [experts.gate_up_proj, experts.down_proj]


def _fresh_store(path: str) -> str:
    """The demo's store folder, emptied (only ever one an earlier demo made); returns its absolute path."""
    store_root = os.path.abspath(path)
    if os.path.isdir(store_root):
        if not os.path.exists(os.path.join(store_root, ".moescope-demo")):
            raise FileExistsError(f"{store_root} exists and is not a demo store; choose another --store")
        shutil.rmtree(store_root)
    os.makedirs(os.path.join(store_root, ".moescope"), exist_ok=True)
    open(os.path.join(store_root, ".moescope-demo"), "w").close()
    return store_root


class Alerting:
    """The demo's alert path: a signed local webhook receiver, the persistent outbox that delivers
    to it, the rules engine (its transitions to the outbox and the `alerts` table) and the trust
    policy (whose alerts land in the same table once the session binds it to the store)."""

    def __init__(self, store_root: str):
        secret = secrets.token_hex(16)
        self.receiver = WebhookReceiver(on_notification=_notification_line, secret=secret).start()
        with resources.as_file(resources.files("moescope.demo").joinpath("rules.yaml")) as rules_path:
            rules = load_rules(rules_path)  # the packaged file (a temporary copy where it is in a zip)
        # Grouped by the rules file's group_by, and sent when the story settles (a flush sends the groups
        # held): what one act raises under one rule is one notification, on a fast machine or a loaded
        # one, rather than whatever a wall-clock group_wait happened to gather
        grouping = replace(rules.grouping, group_wait_s=24 * 3600.0)
        self.outbox = Outbox(outbox_path(store_root), [WebhookNotifier(self.receiver.url, secret=secret)],
                             base_backoff_s=0.2, grouping=grouping)
        self.worker = OutboxWorker(self.outbox, interval_s=0.1).start()
        self.alert_table = AlertTableWriter(store_root)
        self.engine = EngineExporter(AlertEngine(rules), [self.outbox, self.alert_table])
        self.policy = TrustPolicy(sink=self.outbox)

    def stop(self) -> None:
        """Deliver what is left (the run's end resolves its open alerts), then stop everything; the
        alerts table's writer gives its run back, so the run's final probe_stats are written."""
        self.alert_table.close()
        self.outbox.flush(10.0)
        self.worker.stop()
        self.outbox.close()
        self.receiver.stop()


def _attach(model: torch.nn.Module, store_root: str, alerting: Alerting) -> ProbeSession:
    return moescope.attach(
        model, store=store_root, routes=True, router_inputs=16, kv_cache=True, health=True,
        trust_gate="auto", trust_policy=alerting.policy, exporters=[alerting.engine], tags={"model": "demo"},
        flush_interval_s=1.0,
        # Windows counted in forwards only (no `window_s`): the same seed gives the same rows, and
        # so the same alerts and figures, on a fast machine and a loaded one.
        window=8, window_s=None,
        # The story is a few hundred forwards long: sample expert health at every forward, not
        # every 4th (the default, which keeps its cost down on a busy server), so the incident is
        # judged within a few windows.
        health_options=dict(sample_every=1))


@dataclass
class Story:
    """The three acts, played on an attached model; each returns the figures it measured."""

    model: MixtralForCausalLM
    tokenizer: PreTrainedTokenizerFast
    traffic: Traffic
    session: ProbeSession
    alerting: Alerting
    phases: Phases
    store_root: str

    def forward(self, domain: str, phase: str) -> None:
        with self.session.tag(domain=domain, phase=phase), torch.no_grad():
            self.model(**self.traffic.batch(domain, self.traffic.size()))

    def settle(self) -> None:
        self.session.flush()
        self.alerting.outbox.flush(5.0)

    def healthy(self) -> dict:
        _say("\n1. Healthy traffic: code, prose and arithmetic in turn, batches of 1-8, forward and generate")
        for i in _progress(range(self.phases.baseline), desc="baseline", unit="fwd"):
            self.forward(DOMAINS[i % len(DOMAINS)], "baseline")
        for _ in _progress(range(self.phases.generate), desc="generate", unit="call"):
            with self.session.tag(domain="mixed", phase="generate"), torch.no_grad():
                self.model.generate(**self.traffic.prompts(), max_new_tokens=12, do_sample=False,
                                    pad_token_id=self.tokenizer.pad_token_id)
        self.settle()
        _say(f"   {self.session.step} forwards recorded, {len(self.alerting.receiver.received)} alerts so far in "
             f"{len(self.alerting.receiver.notifications)} notifications "
             "(none expected from the expert health score: an expert is unhealthy for what it computes, and "
             "nothing here computes wrong; a load rule may speak about an expert the trained model barely uses)")
        return {}

    def shift(self) -> dict:
        _say("\n2. Traffic shift: only arithmetic from now on; the routing moves away from the baseline")
        for _ in _progress(range(self.phases.shift), desc="shift", unit="fwd"):
            self.forward("math", "shift")
        self.settle()
        fired = "RoutingDriftFromBaseline" in self.alerting.receiver.names("firing")
        _say("   drift alert " + ("received" if fired else "NOT received"))
        return {"drift_alert": fired}

    def incident(self) -> dict:
        session, traffic = self.session, self.traffic
        gate = session.gate
        assert gate is not None  # attached with trust_gate="auto"
        layer, expert = _busiest_expert(self.store_root, session.run.run_id)
        probe_batch = traffic.batch("code", 4)
        clean = self._check(probe_batch)
        saved = [t.detach()[expert].clone() for t in _expert_tensors(self.model, layer)]
        _say(f"\n3. Corrupting layer {layer}, expert {expert} (its busiest): weights x{CORRUPTION_SCALE:g}")
        with torch.no_grad():
            for t in _expert_tensors(self.model, layer):
                t[expert] *= CORRUPTION_SCALE
        figures: dict = {"corrupted": {"layer": layer, "expert": expert}}
        figures["corrupt_error"] = _relative_error(self._check(probe_batch), clean)
        _say(f"   outputs now off by {figures['corrupt_error']:.3g} (relative to the clean model)")

        def random_domain(phase: str) -> Callable[[], None]:
            return lambda: self.forward(DOMAINS[int(traffic.rng.integers(3))], phase)

        gated = _run_until(lambda: gate.weight(layer, expert) == 0.0, random_domain("incident"),
                           self.phases.max_incident, "incident", self.settle)
        masked = self._check(probe_batch)
        figures.update(gated=gate.weight(layer, expert) == 0.0, gated_after_forwards=gated,
                       masked_finite=bool(masked.isfinite().all()), masked_error=_relative_error(masked, clean))
        _say(f"   gate {'masked' if figures['gated'] else 'did NOT mask'} the expert after {gated} forwards; "
             f"outputs finite: {figures['masked_finite']}, off by {figures['masked_error']:.3g} from the clean model")

        _say("\n   Restoring the expert's weights")
        with torch.no_grad():
            for t, original in zip(_expert_tensors(self.model, layer), saved):
                t[expert] = original
        lifted = _run_until(lambda: gate.weight(layer, expert) == 1.0, random_domain("recovery"),
                            self.phases.max_incident, "recovery", self.settle)
        figures["lifted"] = gate.weight(layer, expert) == 1.0
        figures["recovered_error"] = _relative_error(self._check(probe_batch), clean)
        _say(f"   gate {'lifted' if figures['lifted'] else 'NOT lifted'} after {lifted} forwards; "
             f"outputs off by {figures['recovered_error']:.3g} from the clean model")
        return figures

    def _check(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.session.tag(phase="check"), torch.no_grad():
            return self.model(**batch).logits


def run(args: argparse.Namespace, program: str = "moescope") -> int:
    """Play the story (see DESCRIPTION); 0 when both incidents were caught and the gate lifted.

    `program` is how the commands the story prints call moescope (the command line passes its
    `program_name()`: the demo knows nothing of the command line above it)."""
    phases = Phases.for_args(args.quick)
    torch.manual_seed(args.seed)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    store_root = _fresh_store(args.store)
    started = time.perf_counter()
    model, tokenizer = load_demo_model()
    _say(f"demo model: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters, "
         f"{getattr(model.config, 'num_layers', model.config.num_hidden_layers)} MoE layers x "
         f"{model.config.num_local_experts} experts{_zero_experts(model.config)}, "
         f"top-{model.config.num_experts_per_tok}{_capacity(model.config)} ({demo_model_path()})")
    traffic = Traffic(tokenizer, args.seed)
    # The rollout first: its engine and mismatch runs start before the story's, so the dashboard
    # still opens on the story (the latest run); the Engine vs reference page shows the mismatch run.
    prompts = [traffic.windows[d][-1 - i][:PROMPT_TOKENS].tolist() for d in DOMAINS for i in range(2)]
    rollout = play_rollout(model, prompts, store_root, args.seed, pad=int(tokenizer.pad_token_id or 0))
    alerting = Alerting(store_root)
    _say(f"webhook receiver listening on {alerting.receiver.url} (HMAC-signed deliveries)")
    session = _attach(model, store_root, alerting)
    story = Story(model, tokenizer, traffic, session, alerting, phases, store_root)
    figures: dict = {"store": store_root, "rollout": dataclasses.asdict(rollout)}
    try:
        for act in (story.healthy, story.shift, story.incident):
            figures.update(act())
    finally:
        session.close()  # the run ends: its open alerts resolve ("run ended") and go to the receiver
        alerting.stop()
    figures.update(headline_figures(store_root, session.run.run_id))
    # Routing jitter, once the probe is detached (its forwards are not the story's): the same held-out
    # texts alone, batched, repeated and in bfloat16. Stored in the demo's own run, which the dashboard
    # opens, so its Routing jitter page shows this check (a run of its own would have become the
    # store's latest run, and the dashboard would open that instead of the story).
    texts = [story.traffic.texts[d][i][:400] for d in DOMAINS for i in range(2)]
    figures["jitter"] = jitter(model, texts, tokenizer=tokenizer, conditions=("repeat", "batched", "dtype"),
                               dtypes=("bfloat16",), max_tokens=128, store=store_root, run_id=session.run.run_id,
                               new_run=False).line()
    figures["alerts_received"] = [f"{d['status']}:{d['alert']['name']}" for d in alerting.receiver.received]
    figures["alerts_delivered"] = [{"status": d["status"], "name": d["alert"]["name"], "step": d["alert"]["step"],
                                    "fingerprint": d["alert"]["fingerprint"]} for d in alerting.receiver.received]
    figures["notifications_received"] = len(alerting.receiver.notifications)
    figures["notifications_repeated"] = alerting.receiver.repeats  # POSTs that brought nothing new: 0
    figures["seconds"] = time.perf_counter() - started
    with open(os.path.join(store_root, "demo_summary.json"), "w") as f:
        json.dump(figures, f, indent=2, default=float)
    _report(figures, store_root, session.run.run_id, args.store, program)
    return 0 if figures["drift_alert"] and figures["gated"] and figures["lifted"] else 1


def _report(figures: dict, store_root: str, run_id: str, store_arg: str, program: str) -> None:
    _say("")
    _say(format_summary(store_root, run_id, program=program))
    _say("")
    _say("Headline figures")
    for domain, fraction in figures["active_fraction_by_domain"].items():
        _say(f"  {domain:>6}: this model used {100 * fraction:.2f}% of its parameters per token")
    by_position = figures["active_fraction_by_position"]
    if by_position:
        _say(f"  by position in the {LENGTH}-token inputs ({POSITION_SCOPE}): "
             + ", ".join(f"{b['position_start']}-{b['position_end'] - 1}: {100 * b['active_fraction']:.2f}%"
                         for b in by_position))
    _say(f"  {headline_sentence(figures)}")
    _say(f"  kept-slot specialisation NMI(expert; domain) per layer, {SPECIALISATION_SCOPE} (the model card's "
         "top-1 specialisation counts the router's first choices before the capacity): "
         + ", ".join(f"{v:.3f}" for v in figures["specialisation_by_layer"]))
    _say("    (the Semantic clusters page shows the same figure with the sidebar filter phase=baseline)")
    _say(f"  {figures['jitter']}")
    _say(f"    (the dashboard's Routing jitter page shows it for this run; measure it on your model: "
         f"{program} jitter MODEL_FOLDER --store runs/jitter)")
    rollout = figures["rollout"]
    _say(f"  rollout (bfloat16 engine stand-in vs the float32 trainer, {rollout['tokens']} generated tokens): "
         f"{rollout['mismatch_line']}")
    _say(f"  {rollout['gap_line']}")
    _say(f"    (the dashboard's Engine vs reference page shows it: pick run {rollout['mismatch_run']} in the sidebar; "
         f"on your engine's run: {program} mismatch STORE --run ENGINE_RUN --model MODEL_FOLDER --per-layer)")
    _say(f"  alerts received by the webhook: {len(figures['alerts_received'])} in "
         f"{figures['notifications_received']} notifications, grouped by rule and run "
         f"({', '.join(sorted(set(figures['alerts_received'])))})")
    _say(f"  finished in {figures['seconds']:.0f} s")
    _say("")
    _say("Open the dashboard on this store:")
    _say(f"  {program} dashboard {store_arg} --tokenizer {demo_model_path()}")


def _capacity(config) -> str:
    factor = getattr(config, "capacity_factor", None)
    return "" if factor is None else f", expert capacity factor {factor:g} per sequence " \
        "(assignments past it are dropped, as GShard/Switch do)"


def _zero_experts(config) -> str:
    zero = getattr(config, "zero_expert_num", 0) or 0
    return f" + {zero} zero experts" if zero else ""


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    if not a.isfinite().all():
        return math.inf
    return float((a - b).norm() / b.norm())


def _busiest_expert(root: str, run_id: str) -> tuple[int, int]:
    """The routed expert that got the most tokens so far, outside the last layer (whose hot expert
    is a known quirk of the demo model); zero experts hold no weights to corrupt."""
    with Store(root) as store:
        share = store.expert_share(run_id)
        routed = int(store.layers(run_id).num_experts.min())
    share = share[(share.layer < share.layer.max()) & (share.expert < routed)]
    row = share.sort_values("load", ascending=False).iloc[0]
    return int(row.layer), int(row.expert)


SPECIALISATION_TAGS = {"phase": "baseline"}
SPECIALISATION_SCOPE = "baseline phase, every kept top-k slot"


POSITION_SCOPE = "baseline phase"
DOMAIN_NAMES = {"math": "arithmetic"}  # how the headline sentence says a domain


def headline_sentence(figures: dict) -> str:
    """The field's claim, measured: "prose used X% of its parameters per token, ...; past position
    N it drifts to Z%" (domains from the most to the least; the drift is the last position bucket)."""
    # The text domains only: "mixed" tags the generate phase, whose decode steps never drop.
    ranked = sorted(((d, f) for d, f in figures["active_fraction_by_domain"].items() if d in DOMAINS),
                    key=lambda item: -item[1])
    parts = [f"{DOMAIN_NAMES.get(d, d)} {100 * f:.1f}%" for d, f in ranked]
    if parts:
        parts[0] = parts[0].replace(" ", " used ", 1) + " of its parameters per token"
    sentence = ", ".join(parts)
    buckets = figures["active_fraction_by_position"]
    if len(buckets) > 1:
        first, last = buckets[0], buckets[-1]
        sentence += (f"; past position {last['position_start']} it drifts to {100 * last['active_fraction']:.1f}% "
                     f"(positions {first['position_start']}-{first['position_end'] - 1}: "
                     f"{100 * first['active_fraction']:.1f}%)")
    return sentence[:1].upper() + sentence[1:]


def headline_figures(root: str, run_id: str) -> dict:
    """The figures the demo prints, from the store it wrote: the token-weighted active-parameter
    fraction per domain (`Store.active_fraction_by_tag`), by position over the baseline phase
    (`Store.active_fraction_by_position`, POSITION_BUCKETS buckets), and the specialisation per
    layer over the baseline phase (`Store.expert_tag_load` into
    `moescope.metrics.signals.specialisation_by_layer`, as the Semantic clusters page computes it)."""
    with Store(root) as store:
        per_domain = store.active_fraction_by_tag(run_id, "domain")
        by_position = store.active_fraction_by_position(run_id, POSITION_BUCKETS, tags=SPECIALISATION_TAGS)
        load = store.expert_tag_load(run_id, "domain", tags=SPECIALISATION_TAGS)
    nmi = [float(v) for v in specialisation_by_layer(load).nmi]
    return {"active_fraction_by_domain": dict(zip(per_domain.value, per_domain.active_fraction.astype(float))),
            "active_fraction_by_position": [
                {"position_start": int(b.position_start), "position_end": int(b.position_end), "tokens": int(b.tokens),
                 "active_fraction": float(b.active_fraction)} for b in by_position.itertuples()],
            "specialisation_by_layer": nmi}
