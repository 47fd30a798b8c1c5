"""How long a command takes to its first line: `moescope --help`, `summary --help`, `summary STORE`,
`query STORE ...` and `compact STORE`, each in a fresh process, beside a bare `python -c pass` and an
`import torch` measured in the same run (issue 34: at most 0.5 s to a command's first line on a quiet
2-core machine; before, every command imported torch, transformers and the demo).

    .venv/bin/python bench/startup.py            # 15 rounds, the commands in a rotating order
    .venv/bin/python bench/startup.py --rounds 5

Prints, per command, the median and the 90th percentile of the wall time from the process's start
to its first byte on stdout (the command runs on; its first line is what a user waits for), and the
median's ratio to the bare interpreter's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def first_line_s(argv: list[str]) -> float:
    """Seconds from starting `argv` to its first byte on stdout (the process is then let finish)."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO)
    assert process.stdout is not None
    process.stdout.read(1)
    elapsed = time.perf_counter() - start
    process.stdout.read()
    process.wait()
    return elapsed


def small_store(root: str) -> str:
    import numpy as np

    from moescope.store.writer import ParquetExporter
    from tests.support.store_records import make_record, run_info

    exporter = ParquetExporter(root)
    exporter.on_attach(run_info("run-a"))
    rng = np.random.default_rng(0)
    exporter.export([make_record("run-a", step, rng) for step in range(16)])
    exporter.shutdown()
    return root


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rounds", type=int, default=15, help="rounds of every command (default: 15)")
    args = parser.parse_args()
    store = small_store(os.path.join(tempfile.mkdtemp(prefix="moescope-startup-"), "store"))
    moescope = [sys.executable, "-m", "moescope.cli"]
    commands = {
        "python -c pass": [sys.executable, "-c", "print()"],
        "python -c 'import torch'": [sys.executable, "-c", "import torch; print()"],
        "moescope --help": [*moescope, "--help"],
        "moescope summary --help": [*moescope, "summary", "--help"],
        "moescope summary STORE": [*moescope, "summary", store],
        "moescope query STORE": [*moescope, "query", store, "select count(*) from steps"],
        "moescope compact STORE": [*moescope, "compact", store],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    names = list(commands)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each round starts one further on
            times[name].append(first_line_s(commands[name]))
    bare = statistics.median(times["python -c pass"])
    print(f"{'command':<28} {'median s':>9} {'p90 s':>7} {'x bare':>7}   ({args.rounds} rounds)")
    for name, values in times.items():
        values.sort()
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        print(f"{name:<28} {statistics.median(values):9.3f} {p90:7.3f} {statistics.median(values) / bare:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
