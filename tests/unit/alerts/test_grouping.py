"""The rules file's `grouping:` section and the group an alert falls in, on the cases Alertmanager's
dispatch treats apart (getGroupLabels: '...' takes every label; a label an alert lacks is left out)."""

from __future__ import annotations

import pytest

from moescope.alerts.grouping import Grouping, common_labels
from moescope.alerts.rules import RulesError, parse_rules

RULES = "rules:\n  - {name: Skew, expr: load_max_mean > 2.0}\n"


def test_defaults_are_alertmanagers_by_rule_and_run():
    pack = parse_rules(RULES)
    assert pack.grouping == Grouping(group_by=("alertname", "run_id"), group_wait_s=30.0, group_interval_s=300.0)
    assert pack.grouping.enabled


def test_the_section_is_read_and_zero_wait_turns_grouping_off():
    pack = parse_rules("grouping:\n  group_by: [alertname, run_id, layer]\n  group_wait: 10s\n  group_interval: 2m\n"
                       + RULES)
    assert pack.grouping == Grouping(group_by=("alertname", "run_id", "layer"), group_wait_s=10.0,
                                     group_interval_s=120.0)
    assert not parse_rules("grouping: {group_wait: 0}\n" + RULES).grouping.enabled


@pytest.mark.parametrize("section, message", [
    ("grouping: {group_wiat: 10s}", "rules:1: grouping.group_wiat: unknown field"),
    ("grouping: {group_by: alertname}", "rules:1: grouping.group_by: must be a non-empty list of label names"),
    ("grouping: {group_by: []}", "grouping.group_by: must be a non-empty list"),
    ("grouping: {group_wait: soon}", "grouping.group_wait: 'soon' is not a duration"),
    ("grouping: {group_interval: -1}", "grouping.group_interval: a duration must be a finite, non-negative"),
    ("grouping: [alertname]", "grouping: must be a mapping"),
])
def test_a_wrong_section_names_file_line_and_field(section, message):
    with pytest.raises(RulesError, match=message.replace("[", r"\[").replace(".", r"\.")):
        parse_rules(section + "\n" + RULES, source="rules")


def test_group_labels_as_alertmanager_takes_them():
    labels = {"alertname": "Skew", "run_id": "r1", "layer": "3", "severity": "warning"}
    by_rule_and_run = Grouping()
    assert by_rule_and_run.group_labels(labels) == {"alertname": "Skew", "run_id": "r1"}
    assert by_rule_and_run.group_labels({"alertname": "Skew"}) == {"alertname": "Skew"}  # a missing label left out
    assert Grouping(group_by=("...",)).group_labels(labels) == labels  # '...': every label, each alert its own group
    # the stored key does not depend on the order of group_by or of the labels
    assert Grouping(group_by=("run_id", "alertname")).group_key(labels) == by_rule_and_run.group_key(
        dict(reversed(list(labels.items()))))


def test_common_labels_are_those_every_alert_shares():
    assert common_labels([{"a": "1", "b": "2"}, {"a": "1", "b": "3"}, {"a": "1"}]) == {"a": "1"}
    assert common_labels([]) == {}


def test_a_waiting_transition_is_stored_whole_and_read_back_by_another_version():
    """The outbox keeps a grouped transition as JSON until its group is sent (maybe after a restart)."""
    import dataclasses
    import json

    from moescope.alerts.notify import transition_document, transition_from_document
    from tests.support.alert_delivery import transitions

    for t in transitions((0, 1)):
        doc = json.loads(json.dumps(transition_document(t)))
        assert transition_from_document(doc) == t
        assert transition_from_document({**doc, "field_of_a_later_version": 1}) == t
        older = {k: v for k, v in doc.items() if k not in ("window_steps", "baseline_steps")}
        assert transition_from_document(older) == dataclasses.replace(t, window_steps=None, baseline_steps=None)
