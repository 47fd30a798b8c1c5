"""End to end: a real fault in a running model, judged, gated, alerted, and lifted.

Real parts only: tiny `transformers` models with the probe attached (health on, trust gate
"auto"), the real outbox delivering to a real local HTTP receiver, real Parquet read by DuckDB.
The fault is injected into one expert's weights while the model runs: scaled a thousandfold, or
NaN. Oracles: the clean model (same seed) with the same expert masked through a manual gate
(the healed output must equal it), and the clean model un-gated (the healed output must be close).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
import pytest
import torch

import moescope
from moescope.alerts.health_score import HealthConfig
from moescope.alerts.notify import WebhookNotifier
from moescope.alerts.outbox import Outbox
from moescope.alerts.trust_policy import TrustPolicy
from moescope.probe.health_sampling import _expert_tensors
from moescope.store.store import Store
from tests.support.zoo import tiny_model

torch.set_num_threads(1)
FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
WINDOW = 4  # HealthConfig.window_steps


class _Receiver(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).bodies.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    handler = type("Receiver", (_Receiver,), {"bodies": []})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hook", handler.bodies
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def outbox(tmp_path, receiver):
    url, _ = receiver
    box = Outbox(str(tmp_path / "outbox.sqlite"), [WebhookNotifier(url)], base_backoff_s=0.05)
    try:
        yield box
    finally:
        box.close()


def _batches(count: int, seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(count)]


def _expert_views(layer, expert: int) -> list[torch.Tensor]:
    return [param.view(-1) if row is None else param.view(layer.num_experts, -1)[row]
            for param, row in _expert_tensors(layer)[expert]]


@pytest.mark.parametrize("fault", ["scale", "nan"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_corrupted_expert_is_gated_alerted_and_lifted(family, fault, tmp_path, receiver, outbox):
    url, bodies = receiver
    model, clean = tiny_model(family), tiny_model(family)
    policy = TrustPolicy(sink=outbox)
    session = moescope.attach(model, store=tmp_path / "store", trust_gate="auto", trust_policy=policy, window=1,
                           health_options=dict(sample_every=1))  # every forward sampled: a bounded detection time
    reference = moescope.attach(clean, trust_gate="manual")  # the clean model, gated by hand like the policy
    layer = session.layers[0]
    batches = iter(_batches(200))
    # the busiest expert of layer 0: the fault matters most there
    with torch.no_grad():
        for _ in range(3 * WINDOW):
            model(next(batches))
            session.flush()
    rows = [r for r in policy.health_rows if r.layer == 0]
    assert len(rows) == 3 * layer.num_experts and not session.gate.changes  # 3 windows judged, nothing gated
    # each expert's load share is its tokens over the window's forwards, against a fair share of the
    # window's assignments: a loop over the raw layer_steps rows
    loads = Store(tmp_path / "store").sql("SELECT step, expert_load FROM layer_steps WHERE layer = 0")
    per_step = {int(step): np.asarray(load, dtype=float) for step, load in zip(loads.step, loads.expert_load)}
    for r in rows:
        window = sum(per_step[s] for s in range(r.step_start, r.step_end + 1))
        assert r.load_share_ratio == pytest.approx(window[r.expert] * layer.num_experts / window.sum(), rel=1e-9)
    shares = [sum(r.load_share_ratio for r in rows if r.expert == e) for e in range(layer.num_experts)]
    expert = int(np.argmax(shares))

    saved = [view.clone() for view in _expert_views(layer, expert)]
    with torch.no_grad():
        for view in _expert_views(layer, expert):
            view.mul_(1000.0) if fault == "scale" else view.fill_(float("nan"))
        broken_ids = next(batches)
        broken = model(broken_ids).logits
        session.flush()
        if fault == "nan":
            assert not torch.isfinite(broken).all()
        else:  # finite, and further from the clean model's output on the same tokens than a healed one may be
            clean_out = clean(broken_ids).logits
            assert torch.isfinite(broken).all()
            assert (broken - clean_out).norm() > 0.2 * clean_out.norm()

        forwards = 1
        while session.gate.weight(0, expert) == 1.0 and forwards < 5 * WINDOW:
            model(next(batches))
            session.flush()
            forwards += 1
        assert session.gate.weight(0, expert) == 0.0, "the corrupted expert was not gated within 5 windows"
        assert forwards <= 3 * WINDOW  # gate_after=2 windows, plus the window the fault began in
        row = next(r for r in policy.health_rows if r.layer == 0 and r.expert == expert and r.score < 40)
        assert ("non-finite" in row.reasons) if fault == "nan" else ("output norm" in row.reasons or
                                                                     "weights drifted" in row.reasons)

        # healed: finite, equal to the clean model with the same expert masked, close to the clean one
        reference.trust.override(0, expert, 0.0, "mirror the policy")
        ids = next(batches)
        healed = model(ids).logits
        session.flush()
        gated_clean = clean(ids).logits
        reference.trust.release(0, expert)
        ungated_clean = clean(ids).logits
        assert torch.isfinite(healed).all()
        torch.testing.assert_close(healed, gated_clean, rtol=1e-5, atol=1e-6)
        drift = (healed - ungated_clean).norm() / ungated_clean.norm()
        assert drift < 0.2, f"healed output {drift:.2f} away from the clean model's"
        if fault == "scale":
            assert (healed - ungated_clean).norm() < 0.2 * (broken - ungated_clean).norm()

        # restored: the score recovers and the gate lifts
        for view, good in zip(_expert_views(layer, expert), saved):
            view.copy_(good)
        forwards = 0
        while session.gate.weight(0, expert) < 1.0 and forwards < 8 * WINDOW:
            model(next(batches))
            session.flush()
            forwards += 1
        assert session.gate.weight(0, expert) == 1.0, "the gate did not lift once the expert was restored"
        assert forwards <= 5 * WINDOW  # lift_after=3 good windows
        ids = next(batches)
        assert all((session.gate.weights(layer.index) == 1).all() for layer in session.layers), session.gate.changes
        torch.testing.assert_close(model(ids).logits, clean(ids).logits, rtol=0, atol=0)
    session.close()
    reference.close()

    # only that expert was ever gated, once down and once up, each change recorded and alerted
    assert [(c.layer, c.expert, c.old_weight, c.new_weight, c.source) for c in session.gate.changes] == [
        (0, expert, 1.0, 0.0, "auto"), (0, expert, 0.0, 1.0, "auto")]
    events = Store(tmp_path / "store").sql("SELECT * FROM trust_gate_events ORDER BY ts")
    assert events[["layer", "expert", "old_weight", "new_weight", "source"]].values.tolist() == [
        [0, expert, 1.0, 0.0, "auto"], [0, expert, 0.0, 1.0, "auto"]]
    assert events.score.iloc[0] < 40 and events.score.iloc[1] >= 70 and events.reason.str.len().min() > 0
    health = Store(tmp_path / "store").sql(
        "SELECT min(score) AS worst, max(score) AS best FROM expert_health WHERE layer = 0 AND expert = ?", [expert])
    assert health.worst.iloc[0] < 40 and health.best.iloc[0] > 90

    assert outbox.flush(10.0)
    seen = sorted((b["alert"]["name"], b["status"], b["alert"]["labels"]["expert"]) for b in bodies)
    assert seen == sorted([("ExpertUnhealthy", "firing", str(expert)), ("ExpertUnhealthy", "resolved", str(expert)),
                           ("TrustGateChanged", "firing", str(expert)), ("TrustGateChanged", "resolved", str(expert))])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_long_healthy_run_gates_nothing_and_alerts_nothing(family, tmp_path, receiver, outbox):
    url, bodies = receiver
    model = tiny_model(family)
    policy = TrustPolicy(sink=outbox)
    g = torch.Generator().manual_seed(3)
    with moescope.attach(model, store=tmp_path / "store", trust_gate="auto", trust_policy=policy, window=1,
                      health_options=dict(sample_every=1)) as session, \
            torch.no_grad():
        for step in range(160):  # 40 windows, batches of varying size and content
            batch, length = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(4, 24, (1,), generator=g))
            model(torch.randint(0, 128, (batch, length), generator=g))
        session.flush()
    assert len(policy.health_rows) == 40 * sum(layer.num_experts for layer in session.layers)
    assert session.gate.changes == [] and policy.alerts == []
    assert min(r.score for r in policy.health_rows) >= 40
    assert outbox.flush(5.0) and bodies == []


def test_the_policy_keeps_only_the_latest_health_rows_in_memory(tmp_path):
    model = tiny_model("mixtral")
    policy = TrustPolicy(keep_rows=3 * model.config.num_local_experts)  # three windows' rows of one layer
    with moescope.attach(model, store=tmp_path / "store", trust_gate="auto", trust_policy=policy, window=1,
                         health_options=dict(sample_every=1)) as session, torch.no_grad():
        for _ in range(10 * HealthConfig().window_steps):  # 10 health windows
            model(torch.randint(0, 128, (2, 8)))
        session.flush()
    layers = [layer.index for layer in session.layers]
    assert len(policy.health_rows) == 3 * model.config.num_local_experts
    # the last rows scored: the final window's rows of every layer, the last layer first to go
    kept = {(r.window, r.layer) for r in policy.health_rows}
    assert max(w for w, _ in kept) == 9 and all((9, layer) in kept for layer in layers)


@pytest.mark.parametrize("fault", ["scale", "nan"])
def test_default_sampling_finds_a_broken_expert_on_a_tiny_qwen3_moe(fault):
    """The default sampler (every 4th forward, two experts of one layer per visit) on 2 layers x 8
    experts: each expert's output is measured every 32 forwards, and a window holds one or two
    sampled experts. A thousandfold expert once scored 100 there, judged against a median of the
    window's own samples (itself); a NaN expert was found. Both must be, within the sampling
    interval plus the policy's windows; the fault comes after the first weight check, so only the
    output sample can see it."""
    model = tiny_model("qwen3_moe")
    policy = TrustPolicy()
    session = moescope.attach(model, trust_policy=policy, health=True, window=1)
    layer, expert = session.layers[0], 3
    g = torch.Generator().manual_seed(1)
    interval = 4 * 8  # sample_every x visits to cover a layer's 8 experts, 2 a visit, layers in turn
    with torch.no_grad():
        for _ in range(10):
            model(torch.randint(0, 128, (2, 16), generator=g))
            session.flush()
        for view in _expert_views(layer, expert):
            view.mul_(1000.0) if fault == "scale" else view.fill_(float("nan"))
        forwards = 0
        while not policy.alerts and forwards < 60:
            model(torch.randint(0, 128, (2, 16), generator=g))
            session.flush()
            forwards += 1
    session.close()
    fired = [(a.alertname, a.layer, a.expert) for a in policy.alerts if a.state == "firing"]
    assert fired == [("ExpertUnhealthy", 0, expert)], f"after {forwards} forwards: {fired}"
    assert forwards <= interval + 3 * WINDOW  # a visit, then gate_after=2 windows, plus the window it began in
    measured = [r for r in policy.health_rows if r.layer == 0 and r.expert == expert and r.output_norm_mean is not None]
    if fault == "scale":  # the sampled norm, against the other experts' own measured norms
        others = [r.output_norm_mean for r in policy.health_rows
                  if r.layer == 0 and r.expert != expert and r.output_norm_mean is not None]
        assert measured[-1].output_norm_mean > 1e4 * float(np.median(others))
        assert measured[-1].output < 1 and "output norm outlier" in measured[-1].reasons
