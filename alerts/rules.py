"""Alert rules: the rules file, its validation, and the condition each rule tests.

A rules file is YAML (`.yaml`/`.yml`) or TOML (`.toml`). Every error names the file, the line
and the field, and says what would be accepted, e.g.::

    rules.yaml:14: rules[2].expr: unknown signal 'load_maxmean'; known signals: ...

The shape (YAML shown; TOML uses `[defaults]`, `[baseline]` and `[[rules]]`)::

    version: 1
    defaults: {window: 32, for: 2m, cooldown: 5m, severity: warning}
    baseline: {first_steps: 32}        # or {run_id: "golden-run", first_steps: 200}
    rules:
      - name: ExpertLoadSkew
        expr: load_max_mean > 2.0      # conditions joined by `and`
        window: 32                     # steps, or a duration such as 10m
        for: 2m                        # how long the condition must hold before firing
        cooldown: 5m                   # how long it must be false before the alert resolves
        severity: warning              # info | warning | critical
        labels: {team: training}
        annotations: {summary: "...", runbook_url: "https://..."}
        unless: [RoutingDriftFromBaseline]  # silent while a named rule's expression holds over this window
                                            # (or an expression of its own: "kl_baseline_latest_half > 0.1")

`for` and `cooldown` are durations of event time (the recorded steps' timestamps), or a count of
steps written `200 steps`: a count means the same forwards on a fast machine and a slow one.

`unless` is PromQL's `A unless B`: the rule holds only where none of the named rules' expressions
holds, each judged over this rule's window (the forwards it judges), so a consequence stays silent
while the alert that says its cause holds, whichever fires first. Only a named rule's expression
counts, not its own window, `for` or `unless`; a named expression on a signal of no data holds
nothing back. An entry may also be an expression of its own (`"kl_baseline_latest_half > 0.1"`),
which holds back only this rule and pages no one.

`alerts/default_rules.yaml` is the default rule pack; each rule there says why its threshold is
what it is.
"""

from __future__ import annotations

import math
import operator
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

import yaml

from moescope.alerts.grouping import Grouping, parse_grouping

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser is the `tomli` package
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

# signal name -> what it measures; the engine computes exactly these (`moescope.alerts.observations.compute_signals`)
SIGNALS: dict[str, str] = {
    "window_tokens": "tokens the layer routed over the window (guards a rule against small samples)",
    "load_cv": "coefficient of variation of tokens per expert over the window",
    "load_max_mean": "max/mean tokens per expert over the window (MaxVio + 1)",
    "load_balancedness": "mean/max tokens per expert over the window (SGLang/vLLM balancedness)",
    "load_entropy": "normalised entropy of the window's load distribution",
    "kl_uniform": "KL(load || uniform) in nats, 0.5-token smoothing",
    "js_uniform": "Jensen-Shannon divergence of the load against uniform, nats",
    "kl_baseline": "KL(load || baseline load) in nats, 0.5-token smoothing",
    "kl_baseline_latest_half": "kl_baseline over the latest half of the window's forwards (the routing moving "
                               "now, before the whole window has moved)",
    "js_baseline": "Jensen-Shannon divergence of the load against the baseline, nats",
    "router_entropy": "mean per-token router entropy / ln(experts), averaged over the window",
    "dead_expert_fraction": "fraction of experts with no token over the window",
    "lost_expert_fraction": "fraction of experts with no token over the window although their baseline share "
                            "predicted at least 16 of its slots (an expert always barely routed is not newly dead)",
    "lost_expert_alone_fraction": "lost_expert_fraction while the other experts' load keeps its baseline shape (KL "
                                  "of their renormalised load under 0.03 nats): experts gone, not a traffic change",
    "router_entropy_rise": "router_entropy over the window minus the same over the layer's baseline rows "
                           "(fractions of ln experts; needs a baseline from the run's own first steps)",
    "dropped_token_rate_rise": "dropped_token_rate over the window minus the same over the layer's baseline rows "
                               "(needs a baseline from the run's own first steps)",
    "dropped_token_rate": "dropped tokens / tokens over the window",
    "capacity_use": "fullest expert's load / capacity, averaged over the window",
    "active_param_fraction": "this layer's routed-expert parameters used per token / model parameters",
    "routing_drift_rate": "top-1 expert changes between adjacent tokens, per 1000 pairs (needs routes)",
    "switch_entropy": "normalised entropy of top-1 transitions over the last 1024 routed tokens",
    "whatif_drop_rate_cf1": "dropped-token rate the routes would have had at capacity factor 1.0",
    "whatif_drop_rate_cf1_25": "same at capacity factor 1.25",
    "whatif_drop_rate_cf1_5": "same at capacity factor 1.5",
    "whatif_drop_rate_cf2": "same at capacity factor 2.0",
    "rank_balancedness": "mean/max slots per expert-parallel rank over the window (needs a placement: --ranks R "
                         "or --placement FILE)",
    "rank_imbalance": "(max - mean)/mean slots per expert-parallel rank over the window (TensorRT-LLM's "
                      "imbalance; needs a placement)",
    "remote_ranks_per_token": "mean distinct expert-parallel ranks other than its own a token's kept experts sit "
                              "on (DeepEP's GPU sends per token; needs routes and a placement)",
    "remote_nodes_per_token": "mean distinct nodes other than its own a token's kept experts sit on (RDMA sends "
                              "per token; needs routes and a placement, nodes of --ranks-per-node ranks)",
    "intra_node_share": "GPU sends that stay inside a node / all GPU sends (needs routes and a placement)",
    # measured once per check by `moescope mismatch` (alerts/mismatch_rules.yaml), not over a window of
    # recorded steps: on a run's steps these are no data and a rule on them never fires
    "mismatch_decision_share": "(token, layer) pairs whose expert set an engine and the reference choose "
                               "differently / pairs compared, per layer (moescope mismatch)",
    "mismatch_token_share": "tokens whose expert set differs in at least one layer / tokens compared "
                            "(moescope mismatch; R3's figure, the same for every layer)",
    "mismatch_pairs": "(token, layer) pairs the mismatch check compared in the layer (guards against small samples)",
    # measured once by `moescope placement --rebalance` (alerts/placement_rules.yaml), likewise no data on steps
    "placement_staleness": "1 - the live placement's mean/max slots per rank / a fresh EPLB fit's, on the run's "
                           "latest window, per layer (moescope placement --rebalance)",
    # measured once per check of an engine's trace by `moescope check` (moescope.ingest.trace_checks), the
    # same for every layer: on a run's steps these are no data too
    "trace_broken_share": "the largest share any trace check found broken: zero rows, repeated ids, rows missing "
                          "or extra, zeroed final rows, physical ids, each over what it checked (moescope check; "
                          "-1 rows, prefix-cache hits, are not counted)",
    "trace_checked_rows": "token rows the trace checks read (moescope check)",
    # the log-prob gap (moescope mismatch with engine log-probs): one value for the whole check, judged once
    "mismatch_logprob_k3": "mean k3 KL (AReaL's, nats per generated token) between the reference's log-probs, "
                           "with its own routing, and the engine's (moescope mismatch with engine log-probs)",
    "mismatch_logprob_k3_replay": "the same with the engine's routing replayed in every MoE layer",
    "mismatch_logprob_removed": "share of the k3 KL that replaying the engine's routing removes",
    "mismatch_logprob_tokens": "generated tokens whose log-prob gap was measured (guards against small samples)",
}

OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
}
SEVERITIES = ("info", "warning", "critical")
# labels the engine sets itself; a rule may not override them
RESERVED_LABELS = ("alertname", "severity", "run_id", "layer")

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_COND_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_STEPS_RE = re.compile(r"(\d+)\s*steps?")

_TOP_KEYS = {"version", "defaults", "baseline", "rules", "grouping"}
_DEFAULT_KEYS = {"window", "for", "cooldown", "severity"}
_BASELINE_KEYS = {"run_id", "first_steps"}
_RULE_KEYS = {"name", "expr", "window", "for", "cooldown", "severity", "labels", "annotations", "unless"}


class RulesError(ValueError):
    """A rules file that cannot be used (a ValueError); the message names file, line and field.

    `errors` lists every problem found in the file (each a RulesError of one line, in line
    order); the message is those lines joined.

    Args:
        message: what is wrong, with file, line and field.
        errors: every problem found; None: this error alone.
        line: the line of the file it is about, or None.
    """

    def __init__(self, message: str, errors: list[RulesError] | None = None, line: int | None = None):
        super().__init__(message)
        self.line = line
        self.errors: list[RulesError] = errors if errors is not None else [self]


@dataclass(frozen=True)
class Condition:
    signal: str
    op: str
    threshold: float

    def holds(self, value: float) -> bool | None:
        """Return whether value meets the condition; None when the value is NaN (no data)."""
        if value is None or math.isnan(value):
            return None
        return OPERATORS[self.op](value, self.threshold)

    def __str__(self) -> str:
        return f"{self.signal} {self.op} {self.threshold:g}"


@dataclass(frozen=True)
class Window:
    """The steps a rule looks at: the last `steps` steps, or the steps of the last `seconds`."""

    steps: int | None = None
    seconds: float | None = None

    def key(self) -> tuple:
        return (self.steps, self.seconds)


@dataclass(frozen=True)
class Rule:
    name: str
    expr: str
    conditions: tuple[Condition, ...]
    window: Window
    for_s: float
    cooldown_s: float
    severity: str
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    line: int | None = None
    # `for` / `cooldown` counted in steps (forwards) instead of seconds; None: the seconds above count
    for_steps: int | None = None
    cooldown_steps: int | None = None
    # rules whose expressions hold this one back (PromQL's `A unless B`), and those expressions
    unless: tuple[str, ...] = ()
    unless_conditions: tuple[tuple[Condition, ...], ...] = ()

    def describe_for(self) -> str:
        return f"{self.for_steps} steps" if self.for_steps is not None else f"{self.for_s:g}s"

    def describe_cooldown(self) -> str:
        return f"{self.cooldown_steps} steps" if self.cooldown_steps is not None else f"{self.cooldown_s:g}s"

    @property
    def signals(self) -> tuple[str, ...]:
        """The signals the rule reads: its expression's, then those of the rules named in `unless`."""
        named = [c.signal for c in self.conditions] + [c.signal for conds in self.unless_conditions for c in conds]
        return tuple(dict.fromkeys(named))

    def verdict(self, values: dict[str, float]) -> bool | None:
        """Whether the rule holds for `values` (each of its `signals`, over its window).

        PromQL's `A unless B`: the expression must hold, and no expression named in `unless` may hold
        (a named expression with a signal of no data has no element, so it holds nothing back).

        Returns:
            True or False; None when a signal of the rule's own expression is no data (NaN).
        """
        verdicts = [c.holds(values[c.signal]) for c in self.conditions]
        if any(v is None for v in verdicts):
            return None
        held_back = any(all(c.holds(values[c.signal]) for c in conds) for conds in self.unless_conditions)
        return all(verdicts) and not held_back


@dataclass(frozen=True)
class Baseline:
    """Where the baseline load comes from: another run, or the run's own first steps."""

    run_id: str | None = None
    first_steps: int = 32


@dataclass(frozen=True)
class RulePack:
    """A parsed rule pack: its rules, the baseline they compare with, and where it came from.

    Attributes:
        rules: the rules, in file order.
        baseline: what load the baseline signals compare with (a run's first steps).
        source: the file it was read from.
        grouping: how notifications are grouped (the file's `grouping:` section; `alerts.grouping`).
    """
    rules: tuple[Rule, ...]
    baseline: Baseline
    source: str
    grouping: Grouping = Grouping()

    def max_window_steps(self) -> int:
        """The longest window in steps among the rules (0 when every window is a time window).

        Returns:
            Steps.
        """
        return max((r.window.steps or 0 for r in self.rules), default=0)


def parse_duration(value: Any) -> float:
    """Return seconds for `90`, `"30s"`, `"5m"`, `"1h30m"`, `"250ms"`; raise ValueError otherwise."""
    if isinstance(value, bool):
        raise TypeError("a duration must be a number of seconds or a string like '5m'")
    if isinstance(value, (int, float)):
        if value < 0 or not math.isfinite(value):
            raise ValueError("a duration must be a finite, non-negative number of seconds")
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        if text == "0":
            return 0.0
        pos, total = 0, 0.0
        for m in _DURATION_RE.finditer(text):
            if m.start() != pos:
                break
            total += float(m.group(1)) * _UNITS[m.group(2)]
            pos = m.end()
        if text and pos == len(text):
            return total
    raise ValueError(f"{value!r} is not a duration; write seconds (90) or units such as 30s, 5m, 1h30m")


def parse_expr(expr: str) -> tuple[Condition, ...]:
    """Return the conditions of `signal op number [and signal op number ...]`; raise ValueError."""
    if not isinstance(expr, str) or not expr.strip():
        raise ValueError("expr must be a string such as 'load_max_mean > 2.0'")
    conditions = []
    for part in re.split(r"\s+and\s+", expr.strip()):
        m = _COND_RE.match(part)
        if not m:
            raise ValueError(
                f"cannot read {part!r}; write '<signal> <op> <number>' with op one of "
                f"{', '.join(OPERATORS)}, conditions joined by 'and'"
            )
        signal, op, number = m.groups()
        if signal not in SIGNALS:
            raise ValueError(f"unknown signal {signal!r}; known signals: {', '.join(SIGNALS)}")
        conditions.append(Condition(signal, op, float(number)))
    return tuple(conditions)


# ---- reading files with line numbers -------------------------------------------------------

Path = tuple  # a path into the document: ("rules", 2, "expr")


class _Loader(yaml.SafeLoader):
    """PyYAML's SafeLoader, refusing an alias used inside the node its anchor names (`a: &a [*a]`):
    PyYAML would build a structure that contains itself, which nothing downstream can walk."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._open_anchors: list[str] = []

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) and event.anchor in self._open_anchors:
            raise yaml.composer.ComposerError(
                None, None, f"the alias *{event.anchor} refers to itself (it is used inside the value its anchor "
                f"&{event.anchor} names); write the value out instead", event.start_mark)
        anchor = None if isinstance(event, yaml.AliasEvent) else getattr(event, "anchor", None)
        if anchor is not None:
            self._open_anchors.append(anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            if anchor is not None:
                self._open_anchors.pop()


def _yaml_lines(root: yaml.Node | None) -> dict[Path, int]:
    """Map the key and item paths of a composed YAML document to their 1-based lines.

    Each node is walked once: a node reached again through an alias keeps the lines of the
    first path, so aliases that multiply (`[*a, *a, ...]` nested) cost no more than the text.
    """
    lines: dict[Path, int] = {}
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, Path]] = [] if root is None else [(root, ())]
    while stack:
        node, path = stack.pop()
        lines.setdefault(path, node.start_mark.line + 1)
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = key_node.value
                lines[path + (key,)] = key_node.start_mark.line + 1
                stack.append((value_node, path + (key,)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, path + (i,)) for i, item in enumerate(node.value))
    return lines


def _toml_lines(text: str) -> dict[Path, int]:
    """Map top-level keys, tables and `[[rules]]` keys of a TOML document to their lines.

    tomllib keeps no positions, so this reads the text line by line; it handles the layouts
    this module documents (one key per line), which is what error messages need.
    """
    lines: dict[Path, int] = {}
    section: Path = ()
    rule_index = -1
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if line.startswith("[["):
            name = line.strip("[] ")
            if name == "rules":
                rule_index += 1
                section = ("rules", rule_index)
                lines.setdefault(("rules",), number)
            else:
                section = (name,)
            lines.setdefault(section, number)
        elif line.startswith("["):
            name = line.strip("[] ")
            parts = tuple(name.split("."))
            if parts[0] == "rules" and rule_index >= 0:
                section = ("rules", rule_index) + parts[1:]
            else:
                section = parts
            lines.setdefault(section, number)
        elif "=" in line and not line.startswith("#"):
            key = line.split("=", 1)[0].strip().strip('"')
            lines.setdefault(section + (key,), number)
    return lines


class _Reader:
    """Validates a parsed document, collecting a RulesError (file:line: field) for every problem."""

    def __init__(self, source: str, lines: dict[Path, int]):
        self.source = source
        self.lines = lines
        self.errors: list[RulesError] = []

    def fail(self, path: Path, message: str) -> RulesError:
        line = None
        for cut in range(len(path), -1, -1):
            line = self.lines.get(path[:cut])
            if line is not None:
                break
        field_name = ""
        for part in path:
            field_name += f"[{part}]" if isinstance(part, int) else (f".{part}" if field_name else part)
        where = f"{self.source}:{line}" if line is not None else self.source
        return RulesError(f"{where}: {field_name or '(top level)'}: {message}", line=line)

    def report(self, path: Path, message: str) -> None:
        self.errors.append(self.fail(path, message))

    def attempt(self, check: Callable[..., Any], *args: Any, default: Any = None) -> Any:
        """Return `check(*args)`, or record its RulesError and return `default`, so checking goes on."""
        try:
            return check(*args)
        except RulesError as exc:
            self.errors.append(exc)
            return default

    def raise_errors(self) -> None:
        """Raise one RulesError listing every problem recorded, in line order; do nothing if none."""
        if self.errors:
            errors = sorted(self.errors, key=lambda e: (e.line is None, e.line or 0))
            raise RulesError("\n".join(str(e) for e in errors), errors=errors, line=errors[0].line)

    def mapping(self, value: Any, path: Path, allowed: set[str]) -> dict:
        """Return the allowed fields of a mapping, recording each unknown one; raise if not a mapping."""
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a mapping, got {type(value).__name__}")
        for key in value:
            if key not in allowed:
                self.report(path + (key,), f"unknown field; allowed fields: {', '.join(sorted(map(str, allowed)))}")
        return {k: v for k, v in value.items() if k in allowed}

    def duration(self, value: Any, path: Path) -> float:
        try:
            return parse_duration(value)
        except (ValueError, TypeError) as exc:
            raise self.fail(path, str(exc)) from None

    def span(self, value: Any, path: Path) -> tuple[float, int | None]:
        """A `for` or `cooldown`: (seconds, None) for a duration, (0.0, n) for `n steps`."""
        if isinstance(value, str) and (m := _STEPS_RE.fullmatch(value.strip())):
            return 0.0, int(m.group(1))
        try:
            return parse_duration(value), None
        except (ValueError, TypeError) as exc:
            raise self.fail(path, f"{exc}, or a count of steps such as '200 steps'") from None

    def window(self, value: Any, path: Path) -> Window:
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 1:
                raise self.fail(path, "a window of steps must be at least 1")
            return Window(steps=value)
        seconds = self.duration(value, path)
        if seconds <= 0:
            raise self.fail(path, "a window must be a positive number of steps (32) or a duration (10m)")
        return Window(seconds=seconds)

    def severity(self, value: Any, path: Path) -> str:
        if value not in SEVERITIES:
            raise self.fail(path, f"{value!r} is not a severity; use one of {', '.join(SEVERITIES)}")
        return value

    def string_map(self, value: Any, path: Path, reserved: tuple[str, ...] = ()) -> dict[str, str]:
        if not isinstance(value, dict):
            raise self.fail(path, "must be a mapping of names to strings")
        out = {}
        for key, item in value.items():
            if not isinstance(key, str) or not _LABEL_RE.match(key) or key.startswith("__"):
                self.report(path + (key,), "names must match [a-zA-Z_][a-zA-Z0-9_]* and not start with __")
            elif key in reserved:
                self.report(path + (key,), f"{key!r} is set by moescope and cannot be overridden")
            elif not isinstance(item, (str, int, float)) or isinstance(item, bool):
                self.report(path + (key,), "values must be strings")
            else:
                out[key] = str(item)
        return out


def _rule_names(value: Any, path: Path, reader: _Reader) -> list[str]:
    """An `unless`: a rule name or an expression, or a list of them."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise reader.fail(path, "must be a rule name or a list of rule names (or expressions), such as "
                                "[RoutingDriftFromBaseline, 'kl_baseline_latest_half > 0.1']")
    return [n.strip() for n in names]


def _resolve_unless(rules: list[Rule], reader: _Reader) -> list[Rule]:
    """Each rule with the expressions its `unless` names or writes; an unknown name, the rule's own or an
    expression that does not parse is an error."""
    by_name = {r.name: r for r in rules}
    out = []
    for i, rule in enumerate(rules):
        held: list[tuple[Condition, ...]] = []
        for name in rule.unless:
            if not _NAME_RE.match(name):  # an expression of its own
                try:
                    held.append(parse_expr(name))
                except ValueError as exc:
                    reader.report(("rules", i, "unless"), f"{name!r} is neither a rule name nor an expression: {exc}")
            elif name == rule.name:
                reader.report(("rules", i, "unless"), f"{name!r} is this rule; name another rule of the pack")
            elif name not in by_name:
                reader.report(("rules", i, "unless"), f"no rule named {name!r} in this pack; "
                              f"rules: {', '.join(by_name)}")
            else:
                held.append(by_name[name].conditions)
        out.append(replace(rule, unless_conditions=tuple(held)) if held else rule)
    return out


def _build(doc: Any, reader: _Reader) -> RulePack:
    """Return the rule pack of a parsed document; raise one RulesError naming every problem."""
    doc = reader.attempt(reader.mapping, doc if doc is not None else {}, (), _TOP_KEYS)
    if doc is None:
        reader.raise_errors()
    version = doc.get("version", 1)
    if version != 1:
        reader.report(("version",), f"unsupported version {version!r}; this moescope reads version 1")
    defaults_doc = reader.attempt(reader.mapping, doc.get("defaults", {}), ("defaults",), _DEFAULT_KEYS, default={})
    default_window = reader.attempt(reader.window, defaults_doc.get("window", 32), ("defaults", "window"),
                                    default=Window(steps=32))
    default_for = reader.attempt(reader.span, defaults_doc.get("for", "1m"), ("defaults", "for"),
                                 default=(60.0, None))
    default_cooldown = reader.attempt(reader.span, defaults_doc.get("cooldown", "5m"), ("defaults", "cooldown"),
                                      default=(300.0, None))
    default_severity = reader.attempt(reader.severity, defaults_doc.get("severity", "warning"),
                                      ("defaults", "severity"), default="warning")

    base_doc = reader.attempt(reader.mapping, doc.get("baseline", {}), ("baseline",), _BASELINE_KEYS, default={})
    run_id = base_doc.get("run_id")
    if run_id is not None and (not isinstance(run_id, str) or not run_id):
        reader.report(("baseline", "run_id"), "must be the run_id of a recorded run, as a string")
    first_steps = base_doc.get("first_steps", 32)
    if not isinstance(first_steps, int) or isinstance(first_steps, bool) or first_steps < 1:
        reader.report(("baseline", "first_steps"), "must be a whole number of steps, at least 1")

    rules_doc = doc.get("rules")
    if not isinstance(rules_doc, list) or not rules_doc:
        reader.report(("rules",), "must be a non-empty list of rules")
        rules_doc = []
    rules: list[Rule] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(rules_doc):
        path = ("rules", i)
        item = reader.attempt(reader.mapping, item, path, _RULE_KEYS)
        if item is None:
            continue
        missing = [f for f in ("name", "expr") if f not in item]
        for required in missing:
            reader.report(path, f"missing required field {required!r}")
        if missing:
            continue
        name = item["name"]
        if not isinstance(name, str) or not _NAME_RE.match(name):
            reader.report(path + ("name",), "must be an identifier such as ExpertLoadSkew ([A-Za-z_][A-Za-z0-9_]*)")
        elif name in seen:
            reader.report(path + ("name",), f"duplicate rule name {name!r} (first used by rules[{seen[name]}])")
        else:
            seen[name] = i
        try:
            conditions = parse_expr(item["expr"])
        except ValueError as exc:
            reader.report(path + ("expr",), str(exc))
            conditions = ()

        def field(key: str, check: Callable[[Any, Path], Any], default: Any) -> Any:
            return reader.attempt(check, item[key], path + (key,), default=default) if key in item else default

        unless = reader.attempt(_rule_names, item.get("unless", []), path + ("unless",), reader, default=[])
        for_s, for_steps = field("for", reader.span, default_for)
        cooldown_s, cooldown_steps = field("cooldown", reader.span, default_cooldown)
        rules.append(
            Rule(
                name=str(name),
                expr=str(item["expr"]).strip(),
                conditions=conditions,
                window=field("window", reader.window, default_window),
                for_s=for_s, for_steps=for_steps, cooldown_s=cooldown_s, cooldown_steps=cooldown_steps,
                severity=field("severity", reader.severity, default_severity),
                labels=reader.attempt(reader.string_map, item.get("labels", {}), path + ("labels",), RESERVED_LABELS,
                                      default={}),
                annotations=reader.attempt(reader.string_map, item.get("annotations", {}), path + ("annotations",),
                                           default={}),
                line=reader.lines.get(path),
                unless=tuple(unless),
            )
        )
    rules = _resolve_unless(rules, reader)
    grouping = reader.attempt(parse_grouping, doc.get("grouping"), ("grouping",), reader, default=Grouping())
    reader.raise_errors()
    return RulePack(rules=tuple(rules), baseline=Baseline(run_id=run_id, first_steps=first_steps), source=reader.source,
                    grouping=grouping)


def parse_rules(text: str, source: str = "<rules>", fmt: str = "yaml") -> RulePack:
    """Return the rule pack in `text` (fmt 'yaml' or 'toml'); raise RulesError naming source:line: field."""
    if fmt == "toml":
        if tomllib is None:
            raise RulesError(f"{source}: TOML rules need Python 3.11+ or `pip install tomli`; or write YAML")
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise RulesError(f"{source}: not valid TOML: {exc}") from None
        return _build(doc, _Reader(source, _toml_lines(text)))
    if fmt != "yaml":
        raise RulesError(f"{source}: unknown rules format {fmt!r}; use .yaml, .yml or .toml")
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        lines = _yaml_lines(root)
        doc = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise RulesError(f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}",
                         line=None if mark is None else mark.line + 1) from None
    except RecursionError:  # nesting deeper than Python's stack: no rules file needs that
        raise RulesError(f"{source}: nested too deeply to read; a rules file is a few levels deep") from None
    finally:
        loader.dispose()
    return _build(doc, _Reader(source, lines))


def load_rules(path: str | os.PathLike) -> RulePack:
    """Read the rule pack in a YAML or TOML file.

    Args:
        path: the file; it must end in .yaml, .yml or .toml.

    Returns:
        The rule pack.

    Raises:
        RulesError: for a file that cannot be used (every problem listed in `errors`), a file name
            of another extension, or a file that does not exist.
        OSError: when the file exists but cannot be read.
    """
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    fmt = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml"}.get(ext)
    if fmt is None:
        raise RulesError(f"{path}: rules files end in .yaml, .yml or .toml")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise RulesError(f"{path}: no such rules file; `moescope alerts run --help` shows an example") from None
    return parse_rules(text, source=path, fmt=fmt)


def default_rules_text() -> str:
    return resources.files("moescope.alerts").joinpath("default_rules.yaml").read_text(encoding="utf-8")


def mismatch_rules() -> RulePack:
    """The rule pack `moescope mismatch` judges its results with, shipped in alerts/mismatch_rules.yaml
    (each rule there says why its threshold is what it is).

    Returns:
        The rule pack.
    """
    text = resources.files("moescope.alerts").joinpath("mismatch_rules.yaml").read_text(encoding="utf-8")
    return parse_rules(text, source="alerts/mismatch_rules.yaml")


def placement_rules() -> RulePack:
    """The rule pack `moescope placement --rebalance` judges the live placement's staleness with, shipped
    in alerts/placement_rules.yaml (the rule there says why its threshold is what it is).

    Returns:
        The rule pack.
    """
    text = resources.files("moescope.alerts").joinpath("placement_rules.yaml").read_text(encoding="utf-8")
    return parse_rules(text, source="alerts/placement_rules.yaml")


def default_rules() -> RulePack:
    """The default rule pack shipped in alerts/default_rules.yaml.

    Returns:
        The rule pack.
    """
    return parse_rules(default_rules_text(), source="alerts/default_rules.yaml")
