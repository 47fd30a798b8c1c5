"""The rules file: the default pack loads, and every error names file, line and field."""

from __future__ import annotations

import textwrap

import pytest

from moescope.alerts.rules import (
    RulesError,
    Window,
    default_rules,
    load_rules,
    parse_duration,
    parse_expr,
)

GOOD = """\
version: 1
defaults: {window: 16, for: 30s, cooldown: 1m}
baseline: {run_id: golden, first_steps: 8}
rules:
  - name: Skew
    expr: load_max_mean > 2.5
  - name: Cooldown
    expr: router_entropy < 0.2 and capacity_use >= 0.95
    window: 5m
    for: 0
    severity: info
    labels: {team: infra}
"""


def write(tmp_path, text, name="rules.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_default_pack_has_the_issue_rules():
    pack = default_rules()
    by_name = {r.name: r for r in pack.rules}
    assert set(by_name) == {
        "ExpertLoadSkew",
        "LoadBiasedAgainstUniform",
        "RoutingDriftFromBaseline",
        "DeadExpert",
        "RoutingCooldown",
        "DroppedTokens",
        "RouterEntropyRise",
        "RoutingDriftRate",
        "RankImbalance",
        "WideExpertDispatch",
    }
    assert str(by_name["LoadBiasedAgainstUniform"].conditions[0]) == "kl_uniform > 0.5"
    assert [str(c) for c in by_name["RoutingCooldown"].conditions] == ["router_entropy < 0.25", "capacity_use > 0.95"]
    assert by_name["DeadExpert"].severity == "critical"
    assert by_name["ExpertLoadSkew"].for_s == 120 and by_name["ExpertLoadSkew"].cooldown_s == 300
    assert all(r.annotations.get("summary") for r in pack.rules)


def test_good_yaml_and_equivalent_toml(tmp_path):
    pack = load_rules(write(tmp_path, GOOD))
    skew, cool = pack.rules
    assert skew.window == Window(steps=16) and skew.for_s == 30 and skew.cooldown_s == 60
    assert cool.window == Window(seconds=300) and cool.for_s == 0 and cool.labels == {"team": "infra"}
    assert pack.baseline.run_id == "golden" and pack.baseline.first_steps == 8
    toml = """\
    version = 1
    [defaults]
    window = 16
    for = "30s"
    cooldown = "1m"
    [baseline]
    run_id = "golden"
    first_steps = 8
    [[rules]]
    name = "Skew"
    expr = "load_max_mean > 2.5"
    [[rules]]
    name = "Cooldown"
    expr = "router_entropy < 0.2 and capacity_use >= 0.95"
    window = "5m"
    for = 0
    severity = "info"
    labels = { team = "infra" }
    """
    tpack = load_rules(write(tmp_path, toml, "rules.toml"))
    def strip(p):
        return [(r.name, r.conditions, r.window, r.for_s, r.cooldown_s, r.severity, r.labels) for r in p.rules]

    assert strip(tpack) == strip(pack) and tpack.baseline == pack.baseline


@pytest.mark.parametrize(
    "text, line, fieldname, hint",
    [
        (GOOD.replace("load_max_mean > 2.5", "load_maxmean > 2.5"), 6, "rules[0].expr",
         "unknown signal 'load_maxmean'"),
        (GOOD.replace("load_max_mean > 2.5", "load_max_mean >> 2.5"), 6, "rules[0].expr", "<signal> <op> <number>"),
        (GOOD.replace("    for: 0\n", "    for: soon\n"), 10, "rules[1].for", "30s, 5m"),
        (GOOD.replace("severity: info", "severity: urgent"), 11, "rules[1].severity", "info, warning, critical"),
        (GOOD.replace("    window: 5m\n", "    windw: 5m\n"), 9, "rules[1].windw", "allowed fields"),
        (GOOD.replace("name: Cooldown", "name: Skew"), 7, "rules[1].name", "duplicate rule name"),
        (GOOD.replace("{team: infra}", "{layer: '3'}"), 12, "rules[1].labels.layer", "cannot be overridden"),
        (GOOD.replace("first_steps: 8", "first_steps: 0"), 3, "baseline.first_steps", "at least 1"),
        (GOOD.replace("window: 16", "window: -2"), 2, "defaults.window", "at least 1"),
        (GOOD.replace("  - name: Skew\n", "  - nme: Skew\n"), 5, "rules[0].nme", "allowed fields"),
        (GOOD.replace("version: 1", "version: 2"), 1, "version", "unsupported version"),
        ("version: 1\nrules: []\n", 2, "rules", "non-empty list"),
        (GOOD.replace("    expr: load_max_mean > 2.5\n", ""), 5, "rules[0]", "missing required field 'expr'"),
        (GOOD.replace("    expr: load_max_mean > 2.5\n", "    expr: load_max_mean > 2.5\n    unless: [Cooldwn]\n"), 7,
         "rules[0].unless", "no rule named 'Cooldwn'"),
        (GOOD.replace("    expr: load_max_mean > 2.5\n", "    expr: load_max_mean > 2.5\n    unless: Skew\n"), 7,
         "rules[0].unless", "is this rule"),
        (GOOD.replace("    expr: load_max_mean > 2.5\n", "    expr: load_max_mean > 2.5\n    unless: {a: 1}\n"), 7,
         "rules[0].unless", "a list of rule names"),
        (GOOD.replace("    expr: load_max_mean > 2.5\n",
                      "    expr: load_max_mean > 2.5\n    unless: ['kl_baseline >> 1']\n"),
         7, "rules[0].unless", "neither a rule name nor an expression"),
    ],
)
def test_errors_name_file_line_and_field(tmp_path, text, line, fieldname, hint):
    path = write(tmp_path, text)
    with pytest.raises(RulesError) as err:
        load_rules(path)
    message = str(err.value)
    assert message.startswith(f"{path}:{line}: {fieldname}: "), message
    assert hint in message


def test_toml_errors_name_line_too(tmp_path):
    text = '[[rules]]\nname = "A"\nexpr = "load_cv > 1"\n[[rules]]\nname = "B"\nexpr = "nope > 1"\n'
    path = write(tmp_path, text, "r.toml")
    with pytest.raises(RulesError, match=rf"^{path}:6: rules\[1\]\.expr: unknown signal 'nope'"):
        load_rules(path)


def test_syntax_errors_and_missing_files(tmp_path):
    with pytest.raises(RulesError, match=r"rules.yaml:3: not valid YAML"):
        load_rules(write(tmp_path, "rules:\n  - name: A\n    expr: a: b\n"))
    with pytest.raises(RulesError, match="not valid TOML"):
        load_rules(write(tmp_path, "rules = [", "bad.toml"))
    with pytest.raises(RulesError, match="no such rules file"):
        load_rules(tmp_path / "missing.yaml")
    with pytest.raises(RulesError, match=r"\.yaml, \.yml or \.toml"):
        load_rules(write(tmp_path, GOOD, "rules.json"))


def test_durations_and_expressions():
    assert parse_duration("1h30m") == 5400 and parse_duration("250ms") == 0.25 and parse_duration(90) == 90
    for bad in ("5 minutes", "m5", "", -1, True):
        with pytest.raises((ValueError, TypeError)):
            parse_duration(bad)
    conds = parse_expr("kl_baseline>=0.1 and dead_expert_fraction > 0")
    assert [(c.signal, c.op, c.threshold) for c in conds] == [("kl_baseline", ">=", 0.1),
                                                              ("dead_expert_fraction", ">", 0.0)]
    assert conds[0].holds(0.1) is True and conds[0].holds(0.05) is False and conds[0].holds(float("nan")) is None


@pytest.mark.parametrize("text, line", [
    ("a: &a [*a]\n", 1),
    ("version: 1\nrules:\n  - &r\n    name: A\n    expr: load_cv > 1\n    labels: {x: *r}\n", 6),
    ("version: 1\nrules: &rules\n  - name: A\n    expr: load_cv > 1\n  - *rules\n", 5),
])
def test_a_self_referencing_alias_is_a_clear_error_not_a_recursion_traceback(tmp_path, text, line):
    path = write(tmp_path, text)
    with pytest.raises(RulesError) as err:
        load_rules(path)
    assert str(err.value).startswith(f"{path}:{line}: "), str(err.value)
    assert "refers to itself" in str(err.value)


def test_aliases_that_multiply_stay_cheap(tmp_path):
    # each level names the one below nine times: 9**9 paths if walked naively
    levels = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    path = write(tmp_path, "\n".join(levels) + "\nrules: [{name: A, expr: load_cv > 1, labels: {a: *l8}}]\n")
    with pytest.raises(RulesError, match=r"rules\.yaml:1: l0: unknown field"):
        load_rules(path)


def test_every_error_is_reported_not_just_the_first(tmp_path, capsys):
    from moescope.cli import main as moescope_main

    text = (GOOD.replace("load_max_mean > 2.5", "load_maxmean > 2.5").replace("severity: info", "severity: urgent")
            .replace("first_steps: 8", "first_steps: 0").replace("    window: 5m\n", "    windw: 5m\n"))
    path = write(tmp_path, text)
    with pytest.raises(RulesError) as err:
        load_rules(path)
    assert [line.split(": ")[0:2] for line in str(err.value).splitlines()] == [
        [f"{path}:3", "baseline.first_steps"],
        [f"{path}:6", "rules[0].expr"],
        [f"{path}:9", "rules[1].windw"],
        [f"{path}:11", "rules[1].severity"],
    ]
    assert len(err.value.errors) == 4
    assert moescope_main(["alerts", "check", str(path)]) == 2
    out = capsys.readouterr().err
    assert out.count("error: ") == 4 and "4 errors" in out


def test_unless_names_rules_in_yaml_and_toml_and_the_check_lists_it(tmp_path, capsys):
    from moescope.cli import main as moescope_main
    yaml_path = write(tmp_path, GOOD.replace("    expr: load_max_mean > 2.5\n",
                                             "    expr: load_max_mean > 2.5\n    unless: [Cooldown]\n"))
    toml_path = write(tmp_path, '[[rules]]\nname = "Skew"\nexpr = "load_max_mean > 2.5"\nunless = "Cooldown"\n'
                      '[[rules]]\nname = "Cooldown"\nexpr = "router_entropy < 0.2 and capacity_use >= 0.95"\n',
                      "r.toml")
    for path in (yaml_path, toml_path):
        skew = load_rules(path).rules[0]
        assert skew.unless == ("Cooldown",)
        assert [[str(c) for c in conds] for conds in skew.unless_conditions] == [
            ["router_entropy < 0.2", "capacity_use >= 0.95"]]
        assert skew.signals == ("load_max_mean", "router_entropy", "capacity_use")
    assert moescope_main(["alerts", "check", str(yaml_path)]) == 0
    assert "Skew: load_max_mean > 2.5 unless Cooldown (" in capsys.readouterr().out


def test_unless_takes_an_expression_of_its_own_beside_rule_names(tmp_path, capsys):
    """An expression in `unless` holds back only its rule (no rule of its own, so nothing pages), judged
    like a named rule's expression; Prometheus gets it as PromQL's `unless (...)`."""
    from moescope.cli import main as moescope_main
    from moescope.prometheus.rules import rule_expr
    path = write(tmp_path, GOOD.replace("    expr: load_max_mean > 2.5\n", "    expr: load_max_mean > 2.5\n"
                                        "    unless: [Cooldown, 'kl_baseline_latest_half > 0.1']\n"))
    pack = load_rules(path)
    skew = pack.rules[0]
    assert [r.name for r in pack.rules] == ["Skew", "Cooldown"]
    assert [[str(c) for c in conds] for conds in skew.unless_conditions] == [
        ["router_entropy < 0.2", "capacity_use >= 0.95"], ["kl_baseline_latest_half > 0.1"]]
    base = {"load_max_mean": 3.0, "router_entropy": 0.5, "capacity_use": 0.5}
    assert skew.verdict({**base, "kl_baseline_latest_half": 0.05}) is True
    assert skew.verdict({**base, "kl_baseline_latest_half": 0.2}) is False
    assert skew.verdict({**base, "kl_baseline_latest_half": float("nan")}) is True  # no data holds nothing back
    assert rule_expr(skew).endswith(" unless (moescope_layer_load_kl_baseline_latest_half_nats > 0.1)")
    assert moescope_main(["alerts", "check", str(path)]) == 0
    assert "unless Cooldown, kl_baseline_latest_half > 0.1 (" in capsys.readouterr().out
