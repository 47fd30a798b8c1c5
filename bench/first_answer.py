"""What a fresh process waits for on a fleet-sized store: its first answer, and the placement and
traffic commands (issue 52 part 3, issue 47 part 3).

Each figure is a fresh Python process, timed from its start to its answer (wall) with the CPU it
used (every thread), in a rotating order, `--rounds` times (median [min-max]); the load average is
printed beside them. Per store:

- first answer: `Store(STORE).runs()`, what the dashboard's landing page asks first (the runs table);
- first routes answer: the route rows per layer (`SELECT layer, count(*) FROM routes GROUP BY layer`):
  every routes file checked, then read;
- every file checked now: `Store(STORE).check_files()` (`moescope store check`), the price every
  reader paid at its open before reads were checked per table, with the page checksums summed;
- every file read through: every file decoded page by page (`quarantine.read_through`), what the
  open's check cost before the checksums were summed without decoding (the old `deep_check`);
- `moescope placement STORE --ranks 8` and `moescope traffic STORE --ranks 8`, as an operator runs them.

    python bench/first_answer.py --stores /work/scale5m/store-0-5000000,/work/scale50m/store-0-50000000
    python bench/first_answer.py --stores STORE --rounds 5 --only first,routes

The stores are bench/scale.py's (`--keep`); nothing is written into them (a damaged file would be
quarantined: the stores here are whole).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what each figure runs in its fresh process (the store's path is argv[1])
SNIPPETS = {
    "first": "from moescope.store import Store\nprint(len(Store(sys.argv[1]).runs()))",
    "routes": ("from moescope.store import Store\n"
               "print(len(Store(sys.argv[1]).sql('SELECT layer, count(*) FROM routes GROUP BY layer')))"),
    "check": ("from moescope.store import Store\n"
              "print(sum(len(f) for f in Store(sys.argv[1]).check_files().values()))"),
    "read_through": ("from moescope.store import Store, delta\nfrom moescope.store.quarantine import read_through\n"
                     "from moescope.store.location import open_location\n"
                     "loc = open_location(sys.argv[1])\n"
                     "bad = [p.path for t in Store(loc).tables() if (s := delta.snapshot(loc, t)) for p in s.files\n"
                     "       if read_through(loc.join(t, *p.path.split('/')))]\n"
                     "print(bad)"),
}
COMMANDS = {
    "placement": ["placement", "--ranks", "8"],
    "traffic": ["traffic", "--ranks", "8"],
}
LABELS = {
    "first": "first answer (runs: the landing page's)",
    "routes": "first routes answer (rows per layer)",
    "check": "every file checked now (check_files)",
    "read_through": "every file read through (the old check)",
    "placement": "moescope placement --ranks 8",
    "traffic": "moescope traffic --ranks 8",
}


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall s, CPU s of the child) of one fresh process; raises when it fails."""
    before = os.times()
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    after = os.times()
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def argv_of(figure: str, store: str) -> list[str]:
    if figure in SNIPPETS:
        return [sys.executable, "-c", "import sys\n" + SNIPPETS[figure], store]
    return [sys.executable, "-m", "moescope.cli", *COMMANDS[figure][:1], store, *COMMANDS[figure][1:]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--stores", required=True, help="comma-separated store folders, smallest first")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per figure (default 3)")
    parser.add_argument("--only", default=",".join(LABELS), help=f"figures to take (default all: {','.join(LABELS)})")
    args = parser.parse_args(argv)
    figures = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = [f for f in figures if f not in LABELS]
    if unknown:
        parser.error(f"unknown figure(s) {unknown}: choose among {', '.join(LABELS)}")
    for store in args.stores.split(","):
        walls: dict[str, list[float]] = {f: [] for f in figures}
        cpus: dict[str, list[float]] = {f: [] for f in figures}
        loads = []
        for round_ in range(args.rounds):
            order = figures[round_ % len(figures):] + figures[:round_ % len(figures)]
            for figure in order:
                wall, cpu = timed(argv_of(figure, store))
                walls[figure].append(wall)
                cpus[figure].append(cpu)
                loads.append(os.getloadavg()[0])
        print(f"{store}: {args.rounds} fresh processes each, load average (1 min) {min(loads):.1f}-{max(loads):.1f}")
        for figure in figures:
            w, c = walls[figure], cpus[figure]
            print(f"  {LABELS[figure]:<44} {statistics.median(w):6.2f} s [{min(w):.2f}-{max(w):.2f}]  "
                  f"CPU {statistics.median(c):6.2f} s")


if __name__ == "__main__":
    main()
