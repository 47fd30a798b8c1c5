"""bench/training.py and bench/cooldown.py run end to end on tiny settings (their figures are the
scripts' own business; these guard against bit rot)."""

from __future__ import annotations

import importlib.util
import json
import os

from tests.support.paths import REPO


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(REPO, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_bench_smoke(capsys):
    assert _load("training").main(["--rounds", "2", "--warmup", "0", "--batch", "2", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert "monitor + cooldown" in out and "bare" in out


def test_cooldown_proof_smoke(tmp_path):
    path = tmp_path / "proof.json"
    assert _load("cooldown").main(["--quick", "--steps", "6", "--json", str(path)]) == 0
    results = json.loads(path.read_text())["results"]
    assert set(results) == {"without cooldown", "with cooldown"}
    for result in results.values():
        assert result["steps_recorded"] == 6
        assert result["aux_loss_max_relative_error"] < 1e-5  # the monitor's aux loss is the model's own
