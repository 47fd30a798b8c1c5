"""bench/replay.py runs as docs/replay.md says, at small sizes, and times both variants on every copy."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.paths import REPO


def test_replay_benchmark_prints_the_ratio_of_replay_to_a_plain_forward():
    done = subprocess.run([sys.executable, "bench/replay.py", "--preset", "decode", "--layers", "2", "--hidden", "32",
                           "--intermediate", "64", "--experts", "4", "--decode-steps", "2", "--rounds", "2", "--steps",
                           "1", "--warmup", "0"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = dict(re.findall(r"^(bare|replay)\s+[\d.]+\s+([\d.]+)\s", done.stdout, re.M))
    assert set(rows) == {"bare", "replay"} and float(rows["bare"]) == 1.0, done.stdout
    assert "load average" in done.stdout
