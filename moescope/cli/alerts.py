"""`moescope alerts ...`: run the rules over a store, test a receiver, export Prometheus rules.

`moescope/cli/__init__.py` calls `add_subcommands(subparsers)`; each command's function returns the
process exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import re
import sys
import threading
import time
from collections.abc import Sequence

from moescope.alerts.delivery import OutboxWorker, post
from moescope.alerts.engine import FIRING, AlertTransition
from moescope.alerts.notify import KINDS, NotifierError
from moescope.alerts.outbox import (
    DEAD,
    DELIVERED,
    DROPPED,
    OUTBOX_NAME,
    PENDING,
    Outbox,
    notifiers_by_name,
    outbox_path,
)
from moescope.alerts.rules import RulesError, default_rules, load_rules
from moescope.cli import command_help
from moescope.cli.arguments import add_store_arguments, positive_int, store_epilog, store_location
from moescope.core.lifecycle import GracefulStop, add_grace_period_argument
from moescope.prometheus.rules import prometheus_rules_yaml
from moescope.store.location import make_state_dir

_RUN_HELP = """\
Evaluate alert rules over a moescope store, as new steps land, and notify receivers.

Why: catch expert skew, dead experts, drift from a baseline or dropped tokens while a run is
going, in the tools you already watch (a webhook, Slack, Alertmanager).

Every transition (pending, firing, resolved) is written to the store's `alerts` table.
Notifications go through a persistent outbox (--outbox; by default a SQLite file in the store's
state folder: STORE/.moescope/ for a local store, --state-dir or ~/.cache/moescope/<hash of the
URL> for a store on object storage, which cannot hold it), so a receiver that is down gets every
alert when it comes back, once; receivers are stored by name, never by their secret URL, and
`moescope alerts outbox list|drop` shows and drops what a receiver no longer configured is owed.
Without --rules the default rule pack is used (alerts/default_rules.yaml); `moescope alerts
check FILE` validates your own. What belongs together reaches the JSON, Slack and Alertmanager
webhook receivers as one notification, as Alertmanager groups: by rule and run, after a 30 s
group_wait, unless the rules file's `grouping:` section says otherwise (group_wait: 0 sends one
notification per transition); Alertmanager itself gets every alert and groups them itself.

On a full disk it keeps evaluating and delivering: the outbox moves to memory until the file can
be written again, writes to the alerts table are retried every poll, and what could not be saved
is reported at exit.

SIGTERM or Ctrl-C stops it cleanly: the poll under way finishes, its transitions are written to
the alerts table, the outbox delivers what it can within the grace period (--grace-period,
default 10 s or $MOESCOPE_GRACE_PERIOD_S; what is left stays in the outbox for the next run),
and it exits 0. A second signal exits at once (status 143 for SIGTERM).

example:
  export MOESCOPE_WEBHOOK_SECRET=...   # signs JSON webhooks (HMAC-SHA256)
  moescope alerts run runs/ --rules my_rules.yaml \\
      --webhook https://hooks.example.com/moe --alertmanager http://127.0.0.1:9093
"""


_OUTBOX_HELP = (f"outbox file (default: {OUTBOX_NAME} in the state folder, STORE/.moescope for a local store, "
                "--state-dir or ~/.cache/moescope/<hash of the URL> for a URL)")
_NAMED = re.compile(r"^([A-Za-z0-9_.-]+)=(.*)$")


def receivers_from_options(webhook: Sequence[str] = (), slack: Sequence[str] = (), alertmanager: Sequence[str] = (),
                           am_webhook: Sequence[str] = (), secret: str | None = None) -> list:
    """The notifiers for `[NAME=]URL` receiver options; the secret signs the plain JSON webhooks.

    A receiver is stored and shown by its name: `<kind>:NAME` when given, else `<kind>:` and the
    URL without its secrets. Raises NotifierError for a bad URL.
    """
    notifiers = []
    for kind, values in (("webhook", webhook), ("slack", slack), ("alertmanager", alertmanager),
                         ("alertmanager-webhook", am_webhook)):
        for value in values:
            named = _NAMED.match(value)
            name, url = (f"{kind}:{named.group(1)}", named.group(2)) if named else ("", value)
            extra = {"secret": secret} if kind == "webhook" else {}
            notifiers.append(KINDS[kind](url, name=name, **extra))
    return notifiers


def _secret(args: argparse.Namespace) -> str | None:
    """The HMAC secret named by --secret-env; raises NotifierError when that variable is unset or empty,
    so nothing is ever sent unsigned by mistake."""
    if not args.secret_env:
        return None
    secret = os.environ.get(args.secret_env)
    if not secret:
        raise NotifierError(f"--secret-env {args.secret_env}: that environment variable is not set or empty; "
                            "export it, or leave --secret-env out to send unsigned")
    return secret


def _receivers(args: argparse.Namespace) -> list:
    return receivers_from_options(args.webhook, args.slack, args.alertmanager, args.am_webhook, _secret(args))


def _outbox_path(args: argparse.Namespace) -> str:
    """--outbox, else the outbox file in the store's state folder (`alerts.outbox.outbox_path`)."""
    return args.outbox or outbox_path(store_location(args), args.state_dir)


def _placement(args: argparse.Namespace):
    """The placement for the rank signals (RankImbalance): --placement FILE or --ranks R; None without."""
    if args.placement is None and args.ranks is None:
        return None
    from moescope.cli.placement import load_placement

    placement = load_placement(args.placement, args.ranks)
    if placement.moe_rows:  # vLLM's map, a row per MoE layer: on the MoE layers of the run watched
        from moescope.analyses.placement import placement_for_run
        from moescope.metrics.placement import PlacementError
        from moescope.store import Store
        from moescope.store.errors import EmptyStoreError

        with Store(store_location(args)) as store:
            try:
                run_id = store.check_run(args.run[0] if args.run else None)
            except EmptyStoreError:
                raise PlacementError(f"{args.placement} has a row per MoE layer, and the store holds no run yet "
                                     "to take the MoE layers from: start the alerts once a run is recorded") from None
            placement = placement_for_run(store, run_id, placement)
    return placement


def _load_pack(path: str | None):
    return load_rules(path) if path else default_rules()


def cmd_run(args: argparse.Namespace) -> int:
    from moescope.alerts.storage import StoreAlertRunner
    from moescope.store.store import StoreError

    try:
        pack = _load_pack(args.rules)
        notifiers = _receivers(args)
        notifiers_by_name(notifiers)
        placement = _placement(args)
    except (RulesError, NotifierError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    location = store_location(args)
    outbox_path = _outbox_path(args)
    with contextlib.suppress(OSError):  # a full disk: the outbox then says it runs in memory
        if args.outbox:
            os.makedirs(os.path.dirname(os.path.abspath(outbox_path)), exist_ok=True)
        else:
            make_state_dir(location, args.state_dir)
    outbox = Outbox(outbox_path, notifiers, grouping=pack.grouping)
    try:
        runner = StoreAlertRunner(location, pack, sinks=[outbox], run_ids=args.run or None, placement=placement)
        if placement is not None:
            from moescope.metrics.traffic import default_rank_node

            runner.engine.rank_node = default_rank_node(placement.ranks, args.ranks_per_node)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        outbox.close()
        return 2
    with GracefulStop(grace_s=args.grace_period, what="moescope alerts run") as stop:
        worker = OutboxWorker(outbox, interval_s=1.0).start()
        print(f"evaluating {len(pack.rules)} rules from {pack.source} over {location.redacted}; "
              f"{len(notifiers)} receivers; outbox {outbox_path}", file=sys.stderr, flush=True)
        if not outbox.persistent:
            print(f"warning: cannot write the outbox {outbox_path} ({outbox.unsaved_reason}): notifications are "
                  "kept in memory only until there is room again", file=sys.stderr)
        try:
            if args.once:
                for t in runner.poll_once():
                    print(f"{t.at.isoformat()} {t.state:9s} {t.alertname} run={t.run_id} layer={t.layer} {t.values}")
            else:
                # a signal during a poll lets it finish: its transitions are written and enqueued below
                while not stop.requested.is_set():
                    for t in runner.poll_once():
                        print(f"{t.at.isoformat()} {t.state:9s} {t.alertname} run={t.run_id} layer={t.layer}",
                              flush=True)
                    stop.requested.wait(args.interval)
        finally:
            if runner.writer is not None and runner.writer.unwritten:
                runner.writer.handle([])  # the last try for rows a full disk refused at a poll
            budget = args.flush_timeout
            if stop.requested.is_set():  # leave a little of the grace period for closing and the report
                budget = min(budget, max(0.0, stop.remaining_s() - min(1.0, stop.grace_s / 4)))
            delivered_in_time = _deliver_pending(worker, outbox, budget)
            left = outbox.pending()
            if delivered_in_time or not outbox.persistent:  # an outbox in memory tries to save itself at close
                outbox.close()
            _report_unsaved(runner, outbox, outbox_path, left)
            runner.close()  # each run's writer writes its final probe_stats
    return 0


def _deliver_pending(worker: OutboxWorker, outbox: Outbox, timeout_s: float) -> bool:
    """Stop the delivery thread and deliver what is due, all within `timeout_s`; True when no delivery
    is still in flight (then the outbox may be closed). What is not delivered stays pending in the
    outbox file for the next run; a delivery still in flight at exit is sent again then, under the
    same idempotency key."""
    deadline = time.monotonic() + timeout_s
    worker.stop(timeout_s)
    if time.monotonic() >= deadline:  # the thread is still posting to a slow receiver
        return False
    flushing = threading.Thread(target=outbox.flush, args=(deadline - time.monotonic(),),
                                name="moescope-outbox-flush", daemon=True)
    flushing.start()
    flushing.join(max(0.0, deadline - time.monotonic()) + 0.1)
    return not flushing.is_alive()


def _report_unsaved(runner, outbox: Outbox, outbox_path: str, left: int) -> None:
    """Say, at exit, what `alerts run` could not persist and what happens to it."""
    writer = runner.writer
    if writer is not None and writer.unwritten:
        n = len(writer.unwritten)
        print(f"error: {n} alert transition{'s' if n != 1 else ''} could not be written to the alerts table "
              f"({writer.last_error}); they were notified, and a later `moescope alerts run` over this store "
              "writes them (it replays the recorded steps)", file=sys.stderr)
    if writer is not None and writer.lost:
        print(f"error: {writer.lost} more transitions were over the in-memory limit and not kept", file=sys.stderr)
    if outbox.unsaved:
        pending = outbox.unsaved.get(PENDING, 0)
        print(f"error: the outbox could not be saved to {outbox_path} ({outbox.unsaved_reason}): "
              f"{pending} undelivered notifications are lost (a later run replays the store and enqueues them "
              f"again), and the record of {outbox.unsaved.get(DELIVERED, 0)} delivered ones too (a later run may "
              "send them once more, under the same idempotency keys)", file=sys.stderr)
    elif left:
        print(f"{left} notifications still pending in {outbox_path}; they are sent on the next run", file=sys.stderr)


def sample_transition() -> AlertTransition:
    """A firing ExpertLoadSkew alert, as `test-webhook` sends it."""
    now = dt.datetime.now(dt.timezone.utc)
    labels = {"alertname": "ExpertLoadSkew", "severity": "warning", "run_id": "moescope-test", "layer": "0"}
    return AlertTransition(
        fingerprint="0000000000000000", alertname="ExpertLoadSkew", state=FIRING, previous_state="pending",
        at=now, step=0, run_id="moescope-test", layer=0, severity="warning", expr="load_max_mean > 2.0",
        labels=labels, annotations={"summary": "Test alert from `moescope alerts test-webhook`"},
        values={"load_max_mean": 4.5}, starts_at=now, ends_at=None,
    )


def cmd_test_webhook(args: argparse.Namespace) -> int:
    try:
        secret = _secret(args)
        notifier = KINDS[args.kind](args.url, **({"secret": secret} if args.kind == "webhook" else {}))
    except NotifierError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    transition = sample_transition()
    key = transition.idempotency_key() + ":test"
    ok, _permanent, error = post(notifier, key, notifier.render(transition), timeout_s=args.timeout)
    if ok:
        print(f"sent a sample {args.kind} alert to {notifier.name}")
        return 0
    print(f"error: {notifier.name} did not accept the sample alert: {error}", file=sys.stderr)
    return 1


def cmd_prometheus_rules(args: argparse.Namespace) -> int:
    try:
        text = prometheus_rules_yaml(_load_pack(args.rules), group=args.group)
    except RulesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    try:
        pack = load_rules(args.rules)
    except RulesError as exc:
        errors = getattr(exc, "errors", None) or [exc]
        for error in errors:
            print(f"error: {error}", file=sys.stderr)
        if len(errors) > 1:
            print(f"{len(errors)} errors in {args.rules}", file=sys.stderr)
        return 2
    for rule in pack.rules:
        unless = f" unless {', '.join(rule.unless)}" if rule.unless else ""
        print(f"{rule.name}: {rule.expr}{unless} (for {rule.describe_for()}, cooldown {rule.describe_cooldown()}, "
              f"{rule.severity})")
    return 0


def _open_outbox(args: argparse.Namespace) -> Outbox | None:
    path = _outbox_path(args)
    if not os.path.isfile(path):
        print(f"error: no outbox at {path}; `moescope alerts run` creates it (or name one with --outbox)",
              file=sys.stderr)
        return None
    return Outbox(path)


def cmd_outbox_list(args: argparse.Namespace) -> int:
    outbox = _open_outbox(args)
    if outbox is None:
        return 2
    try:
        summaries = outbox.receivers()
    finally:
        outbox.close()
    if not summaries:
        print("the outbox is empty")
        return 0
    for s in summaries:
        oldest = s["oldest_pending_at"]
        since = (f" since {dt.datetime.fromtimestamp(oldest, dt.timezone.utc).isoformat(timespec='seconds')}"
                 if oldest else "")
        print(f"{s['receiver']}: {s[PENDING]} pending{since}, {s[DELIVERED]} delivered, {s[DEAD]} dead, "
              f"{s[DROPPED]} dropped")
        if (s[PENDING] or s[DEAD]) and s["last_error"]:
            print(f"    last error: {s['last_error'][:200]}")
    print("\nrows are kept for a receiver until it is configured again; "
          "`moescope alerts outbox drop STORE --receiver NAME` drops what it is owed", file=sys.stderr)
    return 0


def cmd_outbox_drop(args: argparse.Namespace) -> int:
    outbox = _open_outbox(args)
    if outbox is None:
        return 2
    try:
        dropped = {name: outbox.drop(name) for name in args.receiver}
    finally:
        outbox.close()
    if outbox.unsaved:
        print(f"error: could not write {outbox.path} ({outbox.unsaved_reason}); nothing was dropped",
              file=sys.stderr)
        return 1
    status = 0
    for name, n in dropped.items():
        if n:
            print(f"dropped {n} undelivered notifications to {name}")
        else:
            print(f"error: no undelivered notification for receiver {name!r}; `moescope alerts outbox list` "
                  "shows the receivers by name", file=sys.stderr)
            status = 2
    return status


def add_subcommands(subparsers) -> None:
    """Register `alerts run|test-webhook|prometheus-rules|check|outbox` on a `moescope` subparsers object."""
    fmt = argparse.RawDescriptionHelpFormatter
    alerts = subparsers.add_parser("alerts", help=command_help("alerts"),
                                   description="Alert rules over moescope stores.", formatter_class=fmt)
    sub = alerts.add_subparsers(dest="alerts_command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="evaluate rules over a store as data lands", description=_RUN_HELP,
                         epilog=store_epilog("moescope alerts run STORE --webhook https://hooks.example.com/moe"),
                         formatter_class=fmt)
    add_store_arguments(run, what="the store the probe writes: a folder or a URL (s3://BUCKET/PREFIX, gs://..., "
                                  "az://...)", state_dir=True)
    run.add_argument("--rules", metavar="FILE", help="rules file (.yaml/.toml); default: the built-in pack")
    run.add_argument("--run", action="append", default=[], metavar="RUN_ID", help="only these runs (repeatable)")
    run.add_argument("--ranks", type=int, metavar="R", help="expert-parallel ranks of the default layout, for "
                     "RankImbalance (or the ranks of an engine's map given with --placement)")
    run.add_argument("--placement", metavar="FILE", help="placement file for RankImbalance (docs/placement.md); "
                     "without it or --ranks, the rank signals are no data")
    run.add_argument("--ranks-per-node", type=positive_int, default=8, metavar="G",
                     help="consecutive ranks per node, for WideExpertDispatch's nodes (default 8)")
    run.add_argument("--interval", type=float, default=5.0, help="seconds between polls of the store (default 5)")
    run.add_argument("--once", action="store_true", help="evaluate what is there, deliver, and exit")
    run.add_argument("--webhook", action="append", default=[], metavar="[NAME=]URL",
                     help="plain JSON webhook (repeatable); NAME is how the outbox and dashboard show it")
    run.add_argument("--slack", action="append", default=[], metavar="[NAME=]URL", help="Slack incoming-webhook URL")
    run.add_argument("--alertmanager", action="append", default=[], metavar="[NAME=]URL",
                     help="Alertmanager base URL; alerts are pushed to URL/api/v2/alerts")
    run.add_argument("--am-webhook", action="append", default=[], metavar="[NAME=]URL",
                     help="any receiver of Alertmanager's webhook payload (version 4)")
    run.add_argument("--secret-env", metavar="VAR", default=None,
                     help="environment variable holding the HMAC secret for --webhook (never pass it inline)")
    run.add_argument("--outbox", metavar="PATH", help=_OUTBOX_HELP)
    run.add_argument("--flush-timeout", type=float, default=10.0, help="seconds to keep delivering at exit")
    add_grace_period_argument(run, "finish the poll, write its alerts and deliver what the outbox can within this "
                                   "many seconds, then exit 0 (what is left waits in the outbox)")
    run.set_defaults(func=cmd_run)

    test = sub.add_parser(
        "test-webhook", formatter_class=fmt, help="send a sample alert to a receiver",
        description="Send one sample firing alert to URL and report whether it was accepted.\n\n"
                    "Why: check a receiver's URL, secret and format before a real alert depends on it.\n\n"
                    "example:\n  moescope alerts test-webhook https://hooks.slack.com/services/T/B/X --kind slack")
    test.add_argument("url", metavar="URL")
    test.add_argument("--kind", choices=sorted(KINDS), default="webhook", help="payload format (default webhook)")
    test.add_argument("--secret-env", metavar="VAR", default=None, help="environment variable with the HMAC secret")
    test.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the receiver")
    test.set_defaults(func=cmd_test_webhook)

    prom = sub.add_parser(
        "prometheus-rules", formatter_class=fmt, help="write a Prometheus rules file equivalent to a rule pack",
        description="Write the rule pack as Prometheus alerting rules over the exporter's moe_* metrics.\n\n"
                    "Why: alert from Prometheus (and route through its Alertmanager) instead of running\n"
                    "`moescope alerts run`. Check the result with `promtool check rules FILE`.\n\n"
                    "example:\n  moescope alerts prometheus-rules -o /etc/prometheus/rules/moescope.yml")
    prom.add_argument("--rules", metavar="FILE", help="rules file; default: the built-in pack")
    prom.add_argument("-o", "--output", metavar="FILE", help="where to write (default: stdout)")
    prom.add_argument("--group", default="moescope", help="rule group name (default moescope)")
    prom.set_defaults(func=cmd_prometheus_rules)

    check = sub.add_parser(
        "check", formatter_class=fmt, help="validate a rules file",
        description="Validate a rules file and list its rules; errors name the file, line and field.\n\n"
                    "example:\n  moescope alerts check my_rules.yaml")
    check.add_argument("rules", metavar="FILE")
    check.set_defaults(func=cmd_check)

    outbox = sub.add_parser(
        "outbox", formatter_class=fmt, help="list or drop what the outbox still owes receivers",
        description="List the receivers in a store's alerts outbox, or drop what one of them is owed.\n\n"
                    "Why: an earlier `alerts run` with another receiver URL leaves its undelivered rows\n"
                    "behind; they never block other receivers, but are kept until you drop them.\n\n"
                    "example:\n  moescope alerts outbox list runs/\n"
                    "  moescope alerts outbox drop runs/ --receiver 'webhook:https://old.example.com/hook'")
    actions = outbox.add_subparsers(dest="outbox_command", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="receivers with their pending, delivered, dead and dropped counts")
    add_store_arguments(listing, what="the store `alerts run` watched (its outbox is found by it)", state_dir=True)
    listing.add_argument("--outbox", metavar="PATH", help=_OUTBOX_HELP)
    listing.set_defaults(func=cmd_outbox_list)
    drop = actions.add_parser("drop", help="drop a receiver's undelivered notifications (kept as 'dropped')")
    add_store_arguments(drop, what="the store `alerts run` watched (its outbox is found by it)", state_dir=True)
    drop.add_argument("--receiver", action="append", required=True, metavar="NAME",
                      help="receiver name as `outbox list` shows it (repeatable)")
    drop.add_argument("--outbox", metavar="PATH", help=_OUTBOX_HELP)
    drop.set_defaults(func=cmd_outbox_drop)
