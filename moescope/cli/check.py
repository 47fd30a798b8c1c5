"""`moescope check STORE --run RUN`: can an engine's routed-experts trace be trusted?

The trace checks (`moescope.ingest.trace_checks`) run on every import and behind the proxy, and
their findings are written with the run; this command shows them and runs the checks the store can
answer again over the stored routes (`moescope.ingest.stored_trace`), with a placement map for
`physical_ids`. Exit status 0 when nothing was found, 3 when something was (so a pipeline that
replays a trace can stop on it), 1 on an error.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from moescope.cli import command_help
from moescope.cli.arguments import add_store_arguments, positive_int, store_epilog, store_location

__all__ = ["FOUND_STATUS", "add_engine_map_arguments", "add_subcommands", "engine_map_from",
           "judge_trace", "read_engine_map"]

FOUND_STATUS = 3  # the exit status when a check found something

CHECK_HELP = """\
Check an engine's routed-experts trace before anyone trains on (or replays) it. Shows what the
trace checks found when the run was imported or proxied, and checks its stored routes again:

  zero_rows       token rows with expert 0 in every slot of every layer (a capture that never
                  wrote its buffer: vLLM PR 33013, issue 54730); with top-k > 1 an honest router
                  gives none
  sentinel_rows   rows marked not computed (-1: prefix-cache hits); import and proxy only
  repeated_ids    (token, layer) rows naming one expert twice
  row_count       sequences whose rows differ from prompt + generated - 1; import and proxy only
  final_row_zero  sequences ending in an all-zero row (verl PR 7075): a fake hot expert 0
  physical_ids    slots holding physical (post-EPLB) ids under --placement's map: layers naming ids
                  past its logical experts, or whose counts per id match the load the engine
                  recorded per physical slot better than per logical expert (a vLLM map with its
                  expert_load_window, an SGLang recorder dump); a permutation map without a
                  recorded load is not identifiable from the trace

An id that cannot be stored (out_of_range) was refused at import, naming the check. What each
finding means and what usually causes it: the manual's "Trace checks" page. Exit status 3 when a
check found something, 0 when none did.

example:  moescope check runs/ --run vllm-rollout-7
          moescope check runs/ --run vllm-rollout-7 --placement eplb_map.json --ranks 8 --save
"""


def add_engine_map_arguments(p: argparse.ArgumentParser) -> None:
    """`--placement FILE [--ranks N]`, the engine's map for the physical_ids check (`check`, `import`,
    `proxy`); `engine_map_from(args)` reads it."""
    p.add_argument("--placement", metavar="FILE",
                   help="the engine's map (JSON or YAML as `moescope placement` reads, with the load the engine "
                        "recorded beside it where it has one, or an SGLang recorder dump .pt): the trace checks "
                        "report physical (post-EPLB) ids under it (physical_ids; see `moescope check --help`)")
    p.add_argument("--ranks", type=positive_int,
                   help="expert-parallel size, for a --placement map that does not say it")


def engine_map_from(args: argparse.Namespace):
    """The map `--placement` names (`read_engine_map`), or None without one."""
    return read_engine_map(args.placement, args.ranks) if args.placement else None


def read_engine_map(path: str, ranks: int | None = None):
    """An engine's map for the physical_ids check, from any placement source of `moescope placement`
    (a placement file, an engine's `physical_to_logical_map` with the load it recorded beside it, an
    SGLang recorder dump): a `moescope.metrics.placement.RecordedMap`. Raises PlacementError (a
    ValueError) for a file that cannot be read or a map that lists no expert."""
    from moescope.cli.placement import load_recorded_map

    recorded = load_recorded_map(path, ranks)
    recorded.logical_experts  # noqa: B018 - a map that lists no expert is refused before anything is read
    return recorded


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Register `check` on the moescope command's subparsers."""
    p = subparsers.add_parser("check", help=command_help("check"), description=CHECK_HELP,
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog=store_epilog("moescope check STORE --run RUN"))
    add_store_arguments(p, what="the store holding the run: a folder or a URL (s3://BUCKET/PREFIX, ...)")
    p.add_argument("--run", help="run id (default: the most recently started run)")
    add_engine_map_arguments(p)
    p.add_argument("--save", action="store_true",
                   help="write what the stored routes gave as the run's trace_findings rows (origin check), for "
                        "the dashboard, summary and alert rules")
    p.add_argument("--rules", metavar="FILE",
                   help="judge with this rule pack instead of alerts/mismatch_rules.yaml (its BrokenTrace rule reads "
                        "trace_broken_share and trace_checked_rows)")
    p.add_argument("--format", choices=("table", "json"), default="table", help="output format (default table)")
    p.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    from moescope.ingest.stored_trace import RECHECKED, check_stored_trace, findings_table
    from moescope.ingest.trace_checks import broken_share
    from moescope.store import Store
    from moescope.store.writer import run_writer

    engine_map = engine_map_from(args)
    location = store_location(args)
    with Store(location) as store:
        run_id = store.check_run(args.run) if args.run else store.latest_run()
        stored = store.trace_findings(run_id, origins=("import", "proxy", "mismatch"))
        checks = check_stored_trace(store, run_id, engine_map)
        layers = store.layers(run_id)
    findings = checks.findings(num_experts=int(layers.num_experts.max()) if not layers.empty else None)
    if args.save:
        with run_writer(location, run_id) as writer:
            table = findings_table(run_id, findings)
            if table.num_rows and not writer.write("trace_findings", table):
                raise OSError(f"the store {location.redacted!r} did not take the trace_findings rows "
                              f"({writer.last_error or 'see the log'})")
    recorded: list[dict[str, Any]] = [
        dict(check=r.check_name, count=int(r["count"]), checked=int(r.checked), expected=float(r.expected),
             sequences=list(r.sequences), rows=list(r.rows), detail=r.detail, origins=r.origins)
        for _, r in stored.iterrows()]
    again: list[dict[str, Any]] = [
        dict(check=f.check, count=f.count, checked=f.checked, expected=f.expected, sequences=f.sequences,
             rows=f.rows, detail=f.detail) for f in findings]
    rechecked = [c for c in RECHECKED if c != "physical_ids" or engine_map]
    values = {"trace_broken_share": broken_share((f["check"], f["count"], f["checked"]) for f in recorded + again),
              "trace_checked_rows": float(checks.rows)}
    fired = judge_trace(run_id, int(layers.layer.min()) if not layers.empty else 0, values, _rules(args.rules))
    if args.save and fired:
        from moescope.cli.mismatch import write_alerts

        write_alerts(location, fired)
    if args.format == "json":
        print(json.dumps({"run_id": run_id, "rows_checked": checks.rows, "rechecked": rechecked,
                          "recorded": recorded, "stored_routes": again, "signals": values,
                          "alerts": [t.alertname for t in fired]}, indent=2))
    else:
        print(f"run {run_id}: trace checks")
        print("  when recorded (import / proxy / mismatch): " + ("no finding" if not recorded else ""))
        _print_findings(recorded)
        print(f"  stored routes again ({checks.rows:,} token rows; {', '.join(rechecked)}): "
              + ("no finding" if not again else ""))
        _print_findings(again)
        for t in fired:
            print(f"ALERT {t.alertname} firing ({t.severity}): " + ", ".join(
                f"{name} {value:.4g}" for name, value in t.values.items() if value is not None))
    return FOUND_STATUS if recorded or again else 0


def _rules(path: str | None):
    from moescope.alerts.rules import load_rules, mismatch_rules

    return load_rules(path) if path else mismatch_rules()


def judge_trace(run_id: str, layer: int, values: dict[str, float], pack: Any) -> list[Any]:
    """The alert transitions (firing, source "trace_check") of the rules in `pack` that read only the
    trace signals and hold for `values`. The trace is judged whole: its alert sits on the run's first
    MoE layer (`layer`), labelled scope=trace."""
    from moescope.alerts.engine import fire_once

    return fire_once(pack, values, run_id=run_id, layer=layer, source="trace_check", labels={"scope": "trace"})


def _print_findings(findings: list[dict[str, Any]]) -> None:
    for finding in findings:
        print(f"    {finding['check']:<15} {finding['count']:>10,} of {finding['checked']:,}  {finding['detail']}")
        if finding["rows"]:
            print(f"    {'':<15} e.g. {'; '.join(finding['rows'][:3])}")
