"""`moescope grafana`: print the Grafana board over the Prometheus exporter's metrics, or provision it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moescope.cli import command_help
from moescope.prometheus.grafana import dashboard_json, provisioning


def _grafana(args: argparse.Namespace) -> int:
    if args.provision is None:
        json.dump(dashboard_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for path in provisioning(Path(args.provision), args.prometheus_url):
        print(path)
    return 0


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "grafana", help=command_help("grafana"),
        description="Print the moescope Grafana dashboard as JSON (moescope grafana > dashboard.json), or "
                    "write it with Grafana provisioning files (--provision DIR).")
    parser.add_argument("--provision", metavar="DIR", default=None,
                        help="write DIR/dashboards/moescope.json and DIR/provisioning/{dashboards,datasources}")
    parser.add_argument("--prometheus-url", default="http://127.0.0.1:9090",
                        help="the Prometheus data source for --provision (default: %(default)s)")
    parser.set_defaults(func=_grafana)
