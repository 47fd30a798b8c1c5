"""Which alert transitions reach a receiver together, and when: one incident, one notification.

The semantics are Alertmanager's route options (`dispatch/dispatch.go` in prometheus/alertmanager):

- `group_by`: the labels whose values make a group; `['...']` groups by every label (each alert
  its own group). A label an alert does not have is left out of its group's labels, so alerts
  without it share a group.
- `group_wait`: how long a new group waits for the rest of its alerts before its first
  notification (Alertmanager's default, 30 s). A shift seen in every layer, or several experts of
  one layer at one step, lands within a few steps, so it arrives as one notification.
- `group_interval`: once a group has notified, transitions that join it later wait until this
  long after its last notification (Alertmanager's default, 5 min). A group whose alerts have all
  resolved, and been notified so, is over: the next firing starts a new group, which waits
  `group_wait` again.

Unlike Alertmanager, whose every notification lists the group's whole current state and leaves
repeats to its notification log, a notification here lists the transitions (firing or resolved)
not notified yet, each exactly once: it is one row of the outbox, delivered exactly once like any
other. A `group_wait` of 0 turns grouping off: one notification per transition, the `moescope.alert/v1`
payload. Alertmanager receivers are never grouped here; Alertmanager groups what it is sent.

The wait is on the outbox's clock (wall time), as Alertmanager's is; `Outbox.flush()` sends what
is held at once, waits or not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

GROUP_BY_ALL = "..."
GROUPING_KEYS = {"group_by", "group_wait", "group_interval"}


@dataclass(frozen=True)
class Grouping:
    """How an outbox groups transitions for the receivers that take groups (JSON, Slack, Alertmanager
    webhook payload).

    Attributes:
        group_by: label names whose values make a group; `("...",)` for every label.
        group_wait_s: seconds a new group waits before its first notification; 0 turns grouping off.
        group_interval_s: seconds between two notifications of one group.
    """

    group_by: tuple[str, ...] = ("alertname", "run_id")
    group_wait_s: float = 30.0
    group_interval_s: float = 300.0

    def __post_init__(self) -> None:
        if self.group_wait_s < 0 or self.group_interval_s < 0:
            raise ValueError("group_wait and group_interval must be 0 or more seconds")
        if not self.group_by:
            raise ValueError("group_by needs at least one label name (alertname, run_id, layer, ...) or '...'")

    @property
    def enabled(self) -> bool:
        """Whether transitions are grouped at all (a `group_wait` above 0)."""
        return self.group_wait_s > 0

    def group_labels(self, labels: dict[str, str]) -> dict[str, str]:
        """The labels that name an alert's group: those of `group_by` it has, or all of them for '...'."""
        if GROUP_BY_ALL in self.group_by:
            return dict(labels)
        return {name: labels[name] for name in self.group_by if name in labels}

    def group_key(self, labels: dict[str, str]) -> str:
        """The group an alert with `labels` belongs to, as stored (its group labels, as sorted JSON)."""
        return json.dumps(self.group_labels(labels), sort_keys=True, separators=(",", ":"))


class _Reader(Protocol):  # alerts.rules' document reader: errors with file, line and field
    def mapping(self, value: Any, path: tuple, allowed: set[str]) -> dict: ...

    def duration(self, value: Any, path: tuple) -> float: ...

    def fail(self, path: tuple, message: str) -> Exception: ...


def parse_grouping(value: Any, path: tuple, reader: _Reader) -> Grouping:
    """The `grouping:` section of a rules file (a mapping of group_by, group_wait, group_interval).

    Raises:
        RulesError: (through `reader`) naming the file, line and field of a wrong value.
    """
    doc = reader.mapping(value if value is not None else {}, path, GROUPING_KEYS)
    defaults = Grouping()
    group_by = doc.get("group_by", list(defaults.group_by))
    if (not isinstance(group_by, list) or not group_by
            or not all(isinstance(name, str) and name for name in group_by)):
        raise reader.fail(path + ("group_by",), "must be a non-empty list of label names, e.g. "
                          "[alertname, run_id], or ['...'] for every label")
    wait = reader.duration(doc.get("group_wait", defaults.group_wait_s), path + ("group_wait",))
    interval = reader.duration(doc.get("group_interval", defaults.group_interval_s), path + ("group_interval",))
    return Grouping(group_by=tuple(group_by), group_wait_s=wait, group_interval_s=interval)


def common_labels(labels: list[dict[str, str]]) -> dict[str, str]:
    """The labels every one of `labels` has with the same value (Alertmanager's commonLabels)."""
    if not labels:
        return {}
    first, *rest = labels
    return {k: v for k, v in first.items() if all(other.get(k) == v for other in rest)}
