"""The JSON Lines reader behind `moescope mismatch --logprobs FILE` and `--token-ids FILE`: what a
good file gives, and a message naming the line for each kind of bad one."""

from __future__ import annotations

import json

import pytest

from moescope.analyses.logprob_gap import read_logprobs_file
from moescope.cli.mismatch import read_token_ids


def _write(tmp_path, lines: list[str]) -> str:
    path = tmp_path / "given.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_keys_default_rank_and_sequence_to_0_and_blank_lines_are_skipped(tmp_path):
    path = _write(tmp_path, [json.dumps({"step": 3, "token_ids": [5, 6]}), "",
                             json.dumps({"step": 3, "rank": 1, "sequence": 2, "token_ids": []})])
    assert read_token_ids(path) == {(3, 0, 0): [5, 6], (3, 1, 2): []}
    path = _write(tmp_path, [json.dumps({"step": 1, "sequence": 4, "position": 7, "logprobs": [-0.5, None]})])
    got = read_logprobs_file(path)
    assert list(got) == [(1, 0, 4)] and got[(1, 0, 4)][0] == 7
    assert got[(1, 0, 4)][1][0] == -0.5 and got[(1, 0, 4)][1][1] != got[(1, 0, 4)][1][1]  # None is NaN


@pytest.mark.parametrize("bad, why", [
    ("not json", "JSONDecodeError"),
    (json.dumps({"sequence": 1, "token_ids": [1]}), "KeyError"),            # no step
    (json.dumps({"step": 0, "token_ids": [1, True]}), "list of integers"),  # a bool is no token id
    (json.dumps([1, 2]), "TypeError"),                                       # not an object
])
def test_a_bad_line_is_named_by_file_and_number(tmp_path, bad, why):
    path = _write(tmp_path, [json.dumps({"step": 0, "token_ids": [1]}), bad])
    with pytest.raises(ValueError, match=rf"given\.jsonl:2: expected .*token_ids.*{why}"):
        read_token_ids(path)


def test_a_key_given_twice_and_an_unreadable_file(tmp_path):
    line = json.dumps({"step": 2, "sequence": 1, "position": 1, "logprobs": [-1.0]})
    with pytest.raises(ValueError, match=r"given\.jsonl:2: step 2 sequence 1 is given twice"):
        read_logprobs_file(_write(tmp_path, [line, line]))
    with pytest.raises(ValueError, match=r"given\.jsonl:1: expected .*logprobs.*at most 0"):
        read_logprobs_file(_write(tmp_path, [json.dumps({"step": 0, "position": 1, "logprobs": [0.5]})]))
    with pytest.raises(ValueError, match=r"cannot read --logprobs .*missing\.jsonl"):
        read_logprobs_file(str(tmp_path / "missing.jsonl"))
