"""moescope's alerts: judgement over the store's records.

A rules engine with per-alert state (`AlertEngine`, `load_rules`, `default_rules`) over the signals of
`moescope.metrics.signals` (one definition per derived number), notifiers for plain JSON, Slack and
Alertmanager delivered from a persistent outbox, the expert-health score and the policies that turn it
(and the routing-collapse rule) into trust-gate weights and router cooldowns. The names below are
imported on first use.

`moescope.alerts.PrometheusExporter` still resolves, for code written before the exporter moved to its
own room, but it is not one of alerts' names (`__all__`): import it from `moescope.prometheus`. The
exporter sits above alerts (it reads alerts' observations), so the alias resolves only when asked for
and is not typed here: nothing in alerts imports upwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moescope.core.lazy import lazy_exports

_EXPORTS = {
    "AlertEngine": "moescope.alerts.engine",
    "AlertTransition": "moescope.alerts.engine",
    "EngineExporter": "moescope.alerts.engine",
    "RulePack": "moescope.alerts.rules",
    "RulesError": "moescope.alerts.rules",
    "default_rules": "moescope.alerts.rules",
    "load_rules": "moescope.alerts.rules",
    "PrometheusExporter": "moescope.prometheus.exporter",  # the alias (above)
    "TrustPolicy": "moescope.alerts.trust_policy",
    "TrustPolicyConfig": "moescope.alerts.trust_policy",
    "CooldownConfig": "moescope.alerts.cooldown_policy",
    "CooldownPolicy": "moescope.alerts.cooldown_policy",
    "Outbox": "moescope.alerts.outbox",
    "Grouping": "moescope.alerts.grouping",
}

__all__ = ["AlertEngine", "AlertTransition", "CooldownConfig", "CooldownPolicy", "EngineExporter", "Grouping",
           "Outbox", "RulePack", "RulesError", "TrustPolicy", "TrustPolicyConfig", "default_rules", "load_rules"]

if TYPE_CHECKING:
    from moescope.alerts.cooldown_policy import CooldownConfig, CooldownPolicy
    from moescope.alerts.engine import AlertEngine, AlertTransition, EngineExporter
    from moescope.alerts.grouping import Grouping
    from moescope.alerts.outbox import Outbox
    from moescope.alerts.rules import RulePack, RulesError, default_rules, load_rules
    from moescope.alerts.trust_policy import TrustPolicy, TrustPolicyConfig
else:
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
