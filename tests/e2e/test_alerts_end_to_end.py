"""A skewed run recorded by the real probe raises the alert at local receivers (no server needed),
and in a real Prometheus and at a real Alertmanager (those skip where the servers are not
installed, and fail in CI); plus the command line."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest
import torch
from prometheus_client import CollectorRegistry

import moescope
from moescope.alerts.notify import AlertmanagerNotifier, AlertmanagerWebhookNotifier, WebhookNotifier
from moescope.alerts.outbox import Outbox
from moescope.alerts.rules import default_rules
from moescope.alerts.storage import StoreAlertRunner, read_alerts
from moescope.cli import main as moescope_main
from moescope.cli.alerts import add_subcommands
from moescope.prometheus.exporter import PrometheusExporter
from moescope.prometheus.rules import prometheus_rules_yaml
from tests.support.fixtures.servers import Receiver, http_get_json, start_alertmanager, start_prometheus, wait_until
from tests.support.zoo import tiny_model

pytestmark = pytest.mark.integration


def skewed_model():
    """gpt_oss routers have a bias: +10 on expert 0 sends every token's first choice there."""
    model = tiny_model("gpt_oss")
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.router"):
                module.bias[0] = 10.0
    return model


def forwards(model, steps):
    """Forwards of 1024 tokens: a window of any length holds what ExpertLoadSkew asks for."""
    with torch.no_grad():
        for _ in range(steps):
            model(input_ids=torch.randint(0, 128, (16, 64)))


def record_skewed_run(store_dir, steps=6):
    model = skewed_model()
    with moescope.attach(model, store=str(store_dir), run_id="skewed-run"):
        forwards(model, steps)


def immediate_default_pack():
    """The default pack with `for` at 0: the recorded run lasts a second, not minutes."""
    pack = default_rules()
    return dataclasses.replace(pack, rules=tuple(dataclasses.replace(r, for_s=0.0) for r in pack.rules))


def test_skewed_run_alerts_at_local_receivers(tmp_path):
    """No server needed: the probe's run, the exporter's gauge, the rules engine over the store, the
    outbox to a plain JSON receiver and an Alertmanager-webhook-format receiver, the alerts table."""
    store = tmp_path / "store"
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry, window_steps=4)
    receiver = Receiver()
    try:
        pack = immediate_default_pack()
        model = skewed_model()
        with moescope.attach(model, store=str(store), exporters=[exporter], run_id="skewed-run") as session:
            forwards(model, 6)
            session.flush()
        # the gauge a Prometheus would scrape: 32 of the 64 slots of each forward on expert 0
        assert registry.get_sample_value("moescope_layer_load_max_over_mean", {"layer": "0"}) == pytest.approx(4.0,
                                                                                                          abs=0.01)

        outbox = Outbox(str(tmp_path / "outbox.db"), [
            WebhookNotifier(receiver.url + "/hook", secret="s"),
            AlertmanagerWebhookNotifier(receiver.url + "/v4"),
        ])
        runner = StoreAlertRunner(str(store), pack, sinks=[outbox])
        found = runner.poll_once()
        firing = {(t.alertname, t.layer) for t in found if t.state == "firing"}
        assert {("ExpertLoadSkew", 0), ("ExpertLoadSkew", 1)} <= firing
        assert outbox.flush(15), outbox.deliveries()

        # the local JSON receiver and the Alertmanager-webhook receiver
        hook = [r.json() for r in receiver.received("/hook")]
        assert {(d["alert"]["name"], d["alert"]["layer"]) for d in hook if d["status"] == "firing"} == firing
        skew = next(d for d in hook if d["alert"]["name"] == "ExpertLoadSkew")
        assert skew["alert"]["values"]["load_max_mean"] == pytest.approx(4.0, abs=0.01)  # 32 of 64 slots on expert 0
        v4 = [r.json() for r in receiver.received("/v4")]
        assert {a["labels"]["alertname"] for d in v4 for a in d["alerts"]} == {n for n, _ in firing}

        # every transition is in the store's alerts table
        table = read_alerts(runner.store, "skewed-run")
        assert {("ExpertLoadSkew", 0, "firing"), ("ExpertLoadSkew", 1, "firing")} <= set(
            zip(table.alertname, table.layer, table.state))
        outbox.close()
    finally:
        receiver.stop()
        exporter.close()


def test_skewed_run_alerts_in_prometheus_and_at_alertmanager(tmp_path):
    """The real servers: Prometheus scrapes the exporter while the probe records and fires the
    generated rule; the outbox pushes to a real Alertmanager, which routes to its webhook; the alert
    Prometheus fired reaches the same Alertmanager."""
    store = tmp_path / "store"
    exporter = PrometheusExporter(registry=CollectorRegistry(), window_steps=4)
    port = exporter.serve(port=0)
    receiver = Receiver()
    servers = []
    session = None
    try:
        pack = immediate_default_pack()
        am, am_url = start_alertmanager(tmp_path, receiver.url + "/am")
        servers.append(am)
        rules_file = tmp_path / "moescope.rules.yml"
        rules_file.write_text(prometheus_rules_yaml(pack))
        prom, prom_url = start_prometheus(tmp_path, f"127.0.0.1:{port}", rules_file, alertmanager=am_url)
        servers.append(prom)

        # record while Prometheus scrapes (the exporter keeps serving after the session, until close())
        model = skewed_model()
        session = moescope.attach(model, store=str(store), exporters=[exporter], run_id="skewed-run")
        forwards(model, 6)
        session.flush()

        # Prometheus scrapes the exporter and fires the generated rule
        def prom_firing():
            alerts = http_get_json(prom_url + "/api/v1/alerts")["data"]["alerts"]
            return {a["labels"]["layer"] for a in alerts
                    if a["labels"]["alertname"] == "ExpertLoadSkew" and a["state"] == "firing"}
        assert wait_until(prom_firing, 40, what="Prometheus to fire ExpertLoadSkew\n" + prom.log()) == {"0", "1"}
        value = http_get_json(prom_url + "/api/v1/query?query=moescope_layer_load_max_over_mean")["data"]["result"]
        assert {r["metric"]["layer"]: float(r["value"][1]) for r in value}["0"] == pytest.approx(4.0, abs=0.01)

        # the run goes on (its session open, its rows flushed): its alerts stay active at Alertmanager
        outbox = Outbox(str(tmp_path / "outbox.db"), [AlertmanagerNotifier(am_url)])
        runner = StoreAlertRunner(str(store), pack, sinks=[outbox])
        assert {("ExpertLoadSkew", 0), ("ExpertLoadSkew", 1)} <= {
            (t.alertname, t.layer) for t in runner.poll_once() if t.state == "firing"}
        assert outbox.flush(15), outbox.deliveries()

        # Alertmanager holds the pushed alerts and routes them to its webhook receiver
        def am_routed():
            got = [a for r in receiver.received("/am") for a in r.json()["alerts"]]
            return [a for a in got if a["labels"].get("run_id") == "skewed-run"
                    and a["labels"]["alertname"] == "ExpertLoadSkew"]
        routed = wait_until(am_routed, 30, what="Alertmanager to notify its receiver\n" + am.log())
        assert {a["labels"]["layer"] for a in routed} >= {"0"} and routed[0]["status"] == "firing"
        held = http_get_json(am_url + "/api/v2/alerts?filter=run_id%3D%22skewed-run%22")
        assert {(a["labels"]["alertname"], a["labels"]["layer"]) for a in held} >= {("ExpertLoadSkew", "0"),
                                                                                    ("ExpertLoadSkew", "1")}

        # the alert Prometheus fired reached the same Alertmanager and its receiver
        wait_until(lambda: [a for r in receiver.received("/am") for a in r.json()["alerts"]
                            if a["labels"].get("job") == "moescope"], 30, what="Prometheus -> Alertmanager")
        outbox.close()
    finally:
        if session is not None:
            session.close()
        for server in servers:
            server.stop()
        receiver.stop()
        exporter.close()


def test_cli_run_once_check_prometheus_rules_and_test_webhook(tmp_path, receiver, capsys):
    store = tmp_path / "store"
    record_skewed_run(store, steps=3)
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {name: Skew, expr: load_max_mean > 2.0, for: 0}\n")
    assert moescope_main(["alerts", "run", str(store), "--rules", str(rules), "--once",
                        "--webhook", receiver.url + "/hook", "--outbox", str(tmp_path / "o.db")]) == 0
    out = capsys.readouterr().out
    assert "firing    Skew run=skewed-run layer=0" in out
    # grouped by rule and run (the rules file's default grouping), sent when --once drains: one notification
    [notification] = [r.json() for r in receiver.received("/hook")]
    assert notification["group_labels"] == {"alertname": "Skew", "run_id": "skewed-run"}
    alerts = [a["alert"] for a in notification["alerts"]]
    assert {a["layer"] for a in alerts} == {0, 1}
    # the recorded run's session closed: its alerts resolve in the same pass, saying why
    got = sorted((a["alert"]["layer"], a["status"], a["alert"]["annotations"].get("resolved_reason"))
                 for a in notification["alerts"])
    assert got == [(0, "firing", None), (0, "resolved", "run ended"), (1, "firing", None), (1, "resolved", "run ended")]
    # a second run over the same store and outbox notifies nothing again
    assert moescope_main(["alerts", "run", str(store), "--rules", str(rules), "--once",
                        "--webhook", receiver.url + "/hook", "--outbox", str(tmp_path / "o.db")]) == 0
    assert len(receiver.received("/hook")) == 1

    assert moescope_main(["alerts", "run", str(store), "--webhook", "ftp://x"]) == 2
    assert "must start with http:// or https://" in capsys.readouterr().err
    rules.write_text("rules:\n  - {name: Skew, expr: load_maxmean > 2.0}\n")
    assert moescope_main(["alerts", "check", str(rules)]) == 2
    assert f"{rules}:2: rules[0].expr: unknown signal 'load_maxmean'" in capsys.readouterr().err

    os.environ["MOESCOPE_TEST_SECRET"] = "s3cret"
    try:
        assert moescope_main(["alerts", "test-webhook", receiver.url + "/test",
                              "--secret-env", "MOESCOPE_TEST_SECRET"]) == 0
    finally:
        del os.environ["MOESCOPE_TEST_SECRET"]
    [sample] = receiver.received("/test")
    assert sample.json()["alert"]["run_id"] == "moescope-test" and "X-Moescope-Signature" in sample.headers
    receiver.status = 500
    assert moescope_main(["alerts", "test-webhook", receiver.url + "/test", "--timeout", "2"]) == 1
    assert "HTTP 500" in capsys.readouterr().err

    out_file = tmp_path / "prom.yml"
    assert moescope_main(["alerts", "prometheus-rules", "-o", str(out_file)]) == 0
    assert "moescope_layer_load_max_over_mean > 2.0" in out_file.read_text()


def test_help_texts_teach_what_why_and_an_example():
    parser = argparse.ArgumentParser(prog="moescope")
    add_subcommands(parser.add_subparsers(dest="command"))
    alerts = next(a for a in parser._subparsers._group_actions[0].choices.values())
    commands = alerts._subparsers._group_actions[0].choices
    assert set(commands) == {"run", "test-webhook", "prometheus-rules", "check", "outbox"}
    for name, sub in commands.items():
        text = sub.format_help()
        assert "example:" in text and f"moescope alerts {name}" in text, name
        if name != "check":
            assert "Why" in text, name
