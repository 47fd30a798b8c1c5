"""`moescope jitter` as a user runs it: the real command on the shipped demo model, its rows in the
store against the demo model's own router logits, and one line and exit 1 for bad input."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from moescope.cli import main
from moescope.demo.data import DOMAINS, domain_texts, load_demo_model
from tests.support.deltafiles import snapshot_rows


def _routing(model, token_lists) -> list[list[tuple]]:
    """Per input, per layer: (logits, ids) from the model's own router logits, each input alone;
    top-2 by torch.topk over the softmax, as the demo's Mixtral router takes it."""
    out = []
    with torch.no_grad():
        for ids in token_lists:
            ids = torch.tensor([ids])
            result = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_router_logits=True,
                           use_cache=False)
            out.append([(logits.float(), torch.topk(torch.softmax(logits.float(), -1), 2, dim=-1).indices)
                        for logits in result.router_logits])
    return out


def test_the_command_on_the_demo_model_writes_what_the_model_routes(tmp_path):
    store = tmp_path / "store"
    result = subprocess.run(
        [sys.executable, "-m", "moescope.cli", "jitter", "demo", "--texts", "1", "--condition", "repeat",
         "--condition", "dtype", "--dtype", "bfloat16", "--store", str(store), "--run-id", "cli", "--quiet"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "written to" in result.stdout and "run cli" in result.stdout and "dashboard" in result.stdout

    model, tokenizer = load_demo_model()
    texts = [text for domain in DOMAINS for text in domain_texts(domain, 1, seed=0)]
    token_lists = [tokenizer(text)["input_ids"][:128] for text in texts]
    base = _routing(model, token_lists)
    cast = _routing(copy.deepcopy(model).to(torch.bfloat16), token_lists)
    rows = {(r["condition"], r["layer"]): r for r in snapshot_rows(store, "jitter").to_pylist()}
    assert set(rows) == {(c, layer) for c in ("repeat", "bfloat16") for layer in range(4)}
    for layer in range(4):
        set_changed = top1_changed = 0
        for a, b in zip(base, cast):
            (a_logits, a_ids), (b_logits, b_ids) = a[layer], b[layer]
            for t in range(len(a_ids)):
                set_changed += set(a_ids[t].tolist()) != set(b_ids[t].tolist())
                a_top = max(a_ids[t].tolist(), key=lambda e: a_logits[t, e].item())
                b_top = max(b_ids[t].tolist(), key=lambda e: b_logits[t, e].item())
                top1_changed += a_top != b_top
        assert rows[("bfloat16", layer)]["tokens"] == sum(map(len, token_lists))
        assert (rows[("bfloat16", layer)]["set_changed"], rows[("bfloat16", layer)]["top1_changed"]) == (
            set_changed, top1_changed)
        assert rows[("repeat", layer)]["set_changed"] == rows[("repeat", layer)]["kept_changed"] == 0
    flipped = sum(rows[("bfloat16", layer)]["set_changed"] for layer in range(4))
    assert flipped > 0  # bfloat16 moves some tokens of the demo model (the oracle above agrees on how many)
    assert len([t for t in snapshot_rows(store, "jitter_tokens").to_pylist() if t["set_changed"]]) == flipped
    assert ("flipped tokens, narrowest margin first" in result.stdout) == (flipped > 0)
    [run] = snapshot_rows(store, "runs").to_pylist()
    assert (run["source"], run["model_class"]) == ("jitter", "MixtralForCausalLM")


@pytest.mark.parametrize("argv,says", [
    (["jitter", "/no/such/model"], "no model folder at '/no/such/model'"),
    (["jitter", "demo", "--batch-size", "0"], "--batch-size must be at least 1"),
    (["jitter", "demo", "--file", "/no/such/prompts.txt"], "cannot read --file"),
    (["jitter", "demo", "--condition", "dtype", "--dtype", "float17"], "unknown dtype 'float17'"),
    (["jitter", "demo", "--texts", "0"], "--texts must be at least 1"),
])
def test_bad_input_is_one_line_and_exit_1(argv, says, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and err.startswith("moescope jitter: ")


def test_a_folder_without_a_model_is_refused(tmp_path, capsys):
    assert main(["jitter", str(tmp_path)]) == 1
    assert "holds no config.json" in capsys.readouterr().err


def test_a_store_that_is_a_file_is_refused(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("not a store")
    assert main(["jitter", "demo", "--texts", "1", "--condition", "repeat", "--store", str(path), "--quiet"]) == 1
    assert "is a file" in capsys.readouterr().err


def test_help_teaches_with_examples(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["jitter", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "moescope jitter demo --store runs/jitter" in out and "left_padding" in out
