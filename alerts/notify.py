"""Notifiers: how an alert transition becomes an HTTP request for one kind of receiver.

A notifier only *renders* (body at enqueue time, headers at send time); the outbox
(`alerts.outbox`) stores the body and does the sending, retrying and de-duplicating. Four kinds:

`webhook` — plain JSON, POSTed with `Content-Type: application/json`::

    {
      "schema": "moescope.alert/v1",
      "idempotency_key": "<fingerprint>:<episode start>:<status>",
      "status": "firing" | "resolved",
      "alert": {
        "name": "ExpertLoadSkew", "fingerprint": "3f2a...", "severity": "warning",
        "run_id": "...", "layer": 3, "step": 812, "at": "2025-01-01T00:13:32+00:00",
        "starts_at": "...", "ends_at": null | "...", "expr": "load_max_mean > 2.0",
        "values": {"load_max_mean": 4.5}, "labels": {...}, "annotations": {...}
      }
    }

  Headers: `X-Moescope-Idempotency-Key` (a copy of the body's key, for receivers that cannot
  read the body), and, when a secret is set, `X-Moescope-Timestamp` (Unix seconds at sending)
  and `X-Moescope-Signature: sha256=<hex>`, the HMAC-SHA256 with the secret of
  `<timestamp>.<raw body>`.

  How a receiver should verify a request (`moescope.demo.receiver.WebhookReceiver` does exactly this):

  1. Read the raw body bytes; do not parse and re-serialise before checking.
  2. Refuse a timestamp more than a few minutes from your clock (`verify_signature` allows
     300 s): a captured request cannot be replayed later.
  3. Compute HMAC-SHA256(secret, `<timestamp>.<raw body>`) and compare it with the header in
     constant time (`hmac.compare_digest`), never with `==`.
  4. Deduplicate on the `idempotency_key` *inside the body*, which the signature covers; never on
     the header, which an attacker replaying a captured request within the window can change.
     The outbox resends a key after a lost answer, possibly hours later under a fresh
     timestamp, so keep seen keys for as long as you care about repeats (days, not minutes).

  With grouping (`alerts.grouping.Grouping`, a rules file's `grouping:` section), the transitions
  of one group arrive as one notification, `moescope.alert-group/v1`, signed the same way::

    {
      "schema": "moescope.alert-group/v1",
      "idempotency_key": "group:<hash of the group and its transitions>",
      "status": "firing" | "resolved",          (firing while any of its alerts fires)
      "group_labels": {"alertname": "...", "run_id": "..."},
      "common_labels": {...},                   (the labels every alert has alike)
      "alerts": [{"idempotency_key": "...", "status": "...", "alert": {...}}, ...]
    }

  each entry of `alerts` a `moescope.alert/v1` document without its schema. Deduplicate on the
  group's key and on each alert's.

`slack` — a Slack incoming webhook: `text` (the fallback shown in notifications) plus `blocks`;
a group is one message with a line per alert (the first 20, then how many more).

`alertmanager` — pushes to an existing Alertmanager's `POST /api/v2/alerts` (give the
Alertmanager's base URL). Firing alerts carry `endsAt` = now + `firing_ttl_s`, so an alert whose
engine died resolves by itself; resolved ones carry the resolve time.

`alertmanager-webhook` — the Alertmanager webhook payload, version 4, POSTed to any receiver
that understands Alertmanager's webhook_config (one alert per notification, or a group's alerts
with its `groupLabels` and `commonLabels`, as Alertmanager sends them). `alertmanager` is never
grouped here: Alertmanager groups what it receives by its own route.

A receiver's URL may hold secrets (a Slack token in the path, `user:password@`, `?token=`).
The URL itself lives only in memory, in the notifier; everything that is stored or shown (the
outbox's `receiver` column, logs, the dashboard) uses the notifier's `name`, which is
`<kind>:<redact_url(url)>`. Two receivers whose URLs differ only in secrets would share a name,
so they must be given names of their own.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import hmac
import json
import re
import time
import urllib.parse
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from moescope.alerts.engine import FIRING, RESOLVED, AlertTransition
from moescope.alerts.grouping import common_labels

SCHEMA = "moescope.alert/v1"
GROUP_SCHEMA = "moescope.alert-group/v1"
SIGNATURE_HEADER = "X-Moescope-Signature"
TIMESTAMP_HEADER = "X-Moescope-Timestamp"
IDEMPOTENCY_HEADER = "X-Moescope-Idempotency-Key"
_ZERO_TIME = "0001-01-01T00:00:00Z"


class NotifierError(ValueError):
    """A receiver cannot be configured as given; the message says what to write instead."""


def validate_url(url: str, what: str = "receiver") -> str:
    """Return `url` if it is an http(s) URL with a host; raise NotifierError otherwise."""
    example = "e.g. https://hooks.example.com/moescope or http://127.0.0.1:9093"
    if not isinstance(url, str) or not url or any(c.isspace() for c in url):
        raise NotifierError(f"{what} URL {url!r} is empty or contains spaces; give a full URL, {example}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise NotifierError(f"{what} URL {url!r} must start with http:// or https://, {example}")
    if not parts.hostname:
        raise NotifierError(f"{what} URL {url!r} names no host, {example}")
    try:
        _ = parts.port  # raises ValueError for a port out of range
    except ValueError:
        raise NotifierError(f"{what} URL {url!r} has an invalid port, {example}") from None
    return url


_SECRET_SEGMENT = re.compile(r"^(?=.*[0-9])(?=.*[A-Za-z]).{8,}$|^.{20,}$")  # letters+digits, or long
_SLACK_ID = re.compile(r"^[TB][A-Z0-9]{6,}$")  # Slack's team and hook ids: names, not credentials


def redact_url(url: str) -> str:
    """Return `url` as it may be stored and shown: `scheme://host[:port]/path`, with `user:password@`
    left out, a query or fragment shown as `?***`, and every path segment that looks like a token
    (8+ characters mixing letters and digits, or 20+ characters) replaced by `***`.

    e.g. `https://hooks.slack.com/services/T0123/B0456/vKx3...` -> `.../services/T0123/B0456/***`.
    Never raises: a URL it cannot read is shown as `<unreadable URL>`.
    """
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except (ValueError, AttributeError):
        return "<unreadable URL>"
    netloc = (f"[{host}]" if ":" in host else host) + (f":{port}" if port is not None else "")
    slack = host == "hooks.slack.com"
    segments = [
        seg if not _SECRET_SEGMENT.match(urllib.parse.unquote(seg)) or (slack and _SLACK_ID.match(seg)) else "***"
        for seg in parts.path.split("/")
    ]
    query = "?***" if parts.query or parts.fragment else ""
    return f"{parts.scheme}://{netloc}{'/'.join(segments)}{query}"


def redact_receiver_name(name: str) -> str:
    """Return a receiver name (`<kind>:<URL>` or `<kind>:<NAME>`) with the URL in it, if any, redacted;
    older moescope versions stored receivers by their full URL."""
    kind, sep, rest = name.partition(":")
    return f"{kind}:{redact_url(rest)}" if sep and "://" in rest else name


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """Return the signature header value for a body sent at `timestamp` (Unix seconds, as text)."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def verify_signature(
    secret: str, timestamp: str, body: bytes, signature: str, tolerance_s: float = 300, now: float | None = None
) -> bool:
    """Return True when `signature` is ours for this body and the timestamp is recent enough."""
    try:
        age = abs((time.time() if now is None else now) - float(timestamp))
    except (TypeError, ValueError):
        return False
    return age <= tolerance_s and hmac.compare_digest(sign(secret, timestamp, body), signature or "")


def _iso(ts: dt.datetime | None) -> str | None:
    return None if ts is None else ts.astimezone(dt.timezone.utc).isoformat()


def _rfc3339(ts: dt.datetime) -> str:
    return ts.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Notifier(Protocol):
    name: str  # unique among configured receivers, free of secrets; the outbox stores and routes by it
    url: str  # where the request goes; may hold secrets, so it is kept in memory only

    def render(self, transition: AlertTransition) -> bytes: ...

    def headers(self, body: bytes, idempotency_key: str) -> dict[str, str]: ...


@runtime_checkable
class GroupNotifier(Notifier, Protocol):
    """A notifier that can say several transitions in one notification (`alerts.grouping`)."""

    def render_group(self, idempotency_key: str, group_labels: dict[str, str],
                     transitions: list[AlertTransition]) -> bytes: ...


_TIMES = ("at", "starts_at", "ends_at")


def transition_document(t: AlertTransition) -> dict:
    """A transition as JSON-ready data, every field kept (the outbox stores it until its group is sent)."""
    doc = dataclasses.asdict(t)
    for name in _TIMES:
        doc[name] = _iso(doc[name])
    return doc


def transition_from_document(doc: dict) -> AlertTransition:
    """The transition `transition_document` wrote (by this or another version: fields it does not
    know are left out, fields it lacks take their defaults)."""
    known = {f.name for f in dataclasses.fields(AlertTransition)}
    times = {name: None if doc.get(name) is None else dt.datetime.fromisoformat(doc[name]) for name in _TIMES}
    return AlertTransition(**{**{k: v for k, v in doc.items() if k in known}, **times})


def group_status(transitions: list[AlertTransition]) -> str:
    """A group's status, as Alertmanager's: firing while any of its alerts fires, else resolved."""
    return FIRING if any(t.state != RESOLVED for t in transitions) else RESOLVED


@dataclass
class _Base:
    url: str
    name: str = ""

    kind = "base"

    def __post_init__(self) -> None:
        validate_url(self.url, self.kind)
        self.name = self.name or f"{self.kind}:{redact_url(self.url)}"

    def headers(self, body: bytes, idempotency_key: str) -> dict[str, str]:
        return {"Content-Type": "application/json", "User-Agent": "moescope-alerts",
                IDEMPOTENCY_HEADER: idempotency_key}


def alert_document(t: AlertTransition) -> dict:
    return {
        "name": t.alertname,
        "fingerprint": t.fingerprint,
        "severity": t.severity,
        "run_id": t.run_id,
        "layer": t.layer,
        "step": t.step,
        "at": _iso(t.at),
        "starts_at": _iso(t.starts_at),
        "ends_at": _iso(t.ends_at),
        "expr": t.expr,
        "values": t.values,
        "labels": t.labels,
        "annotations": t.annotations,
    }


@dataclass
class WebhookNotifier(_Base):
    """Plain JSON webhook; signs with HMAC-SHA256 when `secret` is set."""

    secret: str | None = None
    kind = "webhook"

    def render(self, transition: AlertTransition) -> bytes:
        doc = {
            "schema": SCHEMA,
            "idempotency_key": transition.idempotency_key(),
            "status": transition.state,
            "alert": alert_document(transition),
        }
        return json.dumps(doc, sort_keys=True).encode()

    def render_group(self, idempotency_key: str, group_labels: dict[str, str],
                     transitions: list[AlertTransition]) -> bytes:
        doc = {
            "schema": GROUP_SCHEMA,
            "idempotency_key": idempotency_key,
            "status": group_status(transitions),
            "group_labels": group_labels,
            "common_labels": common_labels([t.labels for t in transitions]),
            "alerts": [{"idempotency_key": t.idempotency_key(), "status": t.state, "alert": alert_document(t)}
                       for t in transitions],
        }
        return json.dumps(doc, sort_keys=True).encode()

    def headers(self, body: bytes, idempotency_key: str) -> dict[str, str]:
        headers = super().headers(body, idempotency_key)
        if self.secret:
            timestamp = str(int(time.time()))
            headers[TIMESTAMP_HEADER] = timestamp
            headers[SIGNATURE_HEADER] = sign(self.secret, timestamp, body)
        return headers


def _summary(t: AlertTransition) -> str:
    return t.annotations.get("summary") or f"{t.alertname}: {t.expr}"


@dataclass
class SlackNotifier(_Base):
    """Slack incoming webhook: `text` for notifications, `blocks` for the message body."""

    kind = "slack"

    def render(self, transition: AlertTransition) -> bytes:
        t = transition
        icon = ":white_check_mark:" if t.state == RESOLVED else ":rotating_light:"
        status = "RESOLVED" if t.state == RESOLVED else f"FIRING ({t.severity})"
        values = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.values.items())
        text = f"{icon} [{status}] {t.alertname} run {t.run_id} layer {t.layer}: {_summary(t)}"
        blocks = [
            {"type": "section",
             "text": {"type": "mrkdwn", "text": f"{icon} *[{status}] {t.alertname}*\n{_summary(t)}"}},
            {
                "type": "section",
                "fields": [
                    {"type": "mrkdwn", "text": f"*Run*\n`{t.run_id}`"},
                    {"type": "mrkdwn", "text": f"*Layer*\n{t.layer}"},
                    {"type": "mrkdwn", "text": f"*Rule*\n`{t.expr}`"},
                    {"type": "mrkdwn", "text": f"*Values*\n{values or '-'}"},
                ],
            },
            {"type": "context",
             "elements": [{"type": "mrkdwn", "text": f"step {t.step} at {_iso(t.at)} · {t.fingerprint}"}]},
        ]
        return json.dumps({"text": text, "blocks": blocks}).encode()

    def render_group(self, idempotency_key: str, group_labels: dict[str, str],
                     transitions: list[AlertTransition]) -> bytes:
        firing = [t for t in transitions if t.state != RESOLVED]
        icon = ":rotating_light:" if firing else ":white_check_mark:"
        status = (f"FIRING:{len(firing)}" + (f", RESOLVED:{len(transitions) - len(firing)}"
                                             if len(firing) < len(transitions) else "")) if firing else "RESOLVED"
        first = transitions[0]
        title = " ".join(f"{k}={v}" for k, v in group_labels.items())
        text = f"{icon} [{status}] {title}: {_summary(first)}"
        lines = []
        for t in transitions[:_SLACK_LINES]:
            expert = f" expert {t.labels['expert']}" if "expert" in t.labels else ""
            values = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.values.items())
            lines.append(f"• {t.state} · layer {t.layer}{expert} · step {t.step}" + (f" · {values}" if values else ""))
        if len(transitions) > _SLACK_LINES:
            lines.append(f"… and {len(transitions) - _SLACK_LINES} more (the alerts table has them all)")
        blocks = [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"{icon} *[{status}] {title}*\n{_summary(first)}"}},
            {"type": "section", "text": {"type": "mrkdwn", "text": "\n".join(lines)}},
            {"type": "context",
             "elements": [{"type": "mrkdwn", "text": f"{len(transitions)} alerts · {idempotency_key}"}]},
        ]
        return json.dumps({"text": text, "blocks": blocks}).encode()


_SLACK_LINES = 20  # a Slack section holds 3000 characters: the rest of a large group is counted


def _am_alert(t: AlertTransition, ends_at: str) -> dict:
    annotations = dict(t.annotations)
    annotations.setdefault("summary", _summary(t))
    annotations["expr"] = t.expr
    annotations["values"] = json.dumps(t.values, sort_keys=True)
    return {
        "labels": t.labels,
        "annotations": annotations,
        "startsAt": _rfc3339(t.starts_at),
        "endsAt": ends_at,
        "generatorURL": "",
    }


@dataclass
class AlertmanagerNotifier(_Base):
    """Pushes alerts to an Alertmanager at `url` (its base URL) through /api/v2/alerts."""

    firing_ttl_s: float = 24 * 3600
    kind = "alertmanager"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.base_url = self.url.rstrip("/")
        self.url = self.base_url + "/api/v2/alerts"

    def render(self, transition: AlertTransition) -> bytes:
        t = transition
        if t.state == RESOLVED:
            ends = _rfc3339(t.ends_at or t.at)
        else:
            ends = _rfc3339(dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=self.firing_ttl_s))
        return json.dumps([_am_alert(t, ends)]).encode()


@dataclass
class AlertmanagerWebhookNotifier(_Base):
    """Speaks Alertmanager's webhook payload (version 4) to any receiver that reads it."""

    receiver: str = "moescope"
    external_url: str = ""
    kind = "alertmanager-webhook"

    def render(self, transition: AlertTransition) -> bytes:
        return self._payload({"alertname": transition.alertname}, [transition])

    def render_group(self, idempotency_key: str, group_labels: dict[str, str],
                     transitions: list[AlertTransition]) -> bytes:
        return self._payload(group_labels, transitions)

    def _payload(self, group_labels: dict[str, str], transitions: list[AlertTransition]) -> bytes:
        alerts = []
        for t in transitions:
            alert = _am_alert(t, _rfc3339(t.ends_at) if t.state == RESOLVED and t.ends_at else _ZERO_TIME)
            alert["status"] = t.state
            alert["fingerprint"] = t.fingerprint
            alerts.append(alert)
        annotations = [a["annotations"] for a in alerts]
        doc = {
            "version": "4",
            "groupKey": "{}:" + json.dumps(group_labels, sort_keys=True),
            "truncatedAlerts": 0,
            "status": group_status(transitions),
            "receiver": self.receiver,
            "groupLabels": group_labels,
            "commonLabels": common_labels([t.labels for t in transitions]),
            "commonAnnotations": common_labels(annotations),
            "externalURL": self.external_url,
            "alerts": alerts,
        }
        return json.dumps(doc).encode()


KINDS = {
    "webhook": WebhookNotifier,
    "slack": SlackNotifier,
    "alertmanager": AlertmanagerNotifier,
    "alertmanager-webhook": AlertmanagerWebhookNotifier,
}
