"""What `moescope jitter` prints for a flipped token: its expert sets as plain integers and its context
with every character whole, never U+FFFD for a token that is part of one. The listed rows are laid out
as the check lists them, over a text the demo tokenizer cuts into bytes; the expected line comes from
that text."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from moescope.analyses.jitter import TOKEN_COLUMNS, JitterReport
from moescope.cli.jitter import format_report
from moescope.demo.data import load_demo_model

TEXT = "Le café – naïve\n"


@pytest.fixture(scope="module")
def tokenizer():
    return load_demo_model()[1]


def listed(ids: list[int], position: int, start: int) -> dict:
    """A listed token as `jitter` lists it (numpy integers, as the store gives them back)."""
    row = dict.fromkeys(TOKEN_COLUMNS)
    row.update(condition="bfloat16", layer=1, sequence=0, position=position, token_id=ids[position], set_changed=True,
               top1_changed=False, topk_margin=0.01, top1_margin=0.5, baseline_ids=np.array([4, 2], np.int32),
               condition_ids=np.array([6, 2], np.int32), context_ids=ids[start:position + 5], context_start=start)
    return row


def test_a_flipped_tokens_line_reads_as_the_text_did(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    # the second byte of é: decoded alone it is U+FFFD, and so is its first byte
    position = next(i for i, t in enumerate(ids) if tokenizer.decode(ids[:i + 1]).endswith("café"))
    assert tokenizer.decode([ids[position]]) == "\ufffd"
    start = max(0, position - 3)
    report = JitterReport(pd.DataFrame(), pd.DataFrame([listed(ids, position, start)]), {}, model_class="Mixtral")
    out = format_report(report, tokenizer, 1, show=1)
    [line] = [line for line in out.splitlines() if "bfloat16" in line]
    assert "\ufffd" not in line
    assert "experts [2, 4] -> [2, 6]" in line
    window = tokenizer.decode(ids[start:position + 5])
    assert "\ufffd" not in window  # the window cuts no character here
    before = window[:window.index("é")]
    assert line.endswith(f"{before}[é]{window[len(before) + 1:]}".replace("\n", "\\n"))
