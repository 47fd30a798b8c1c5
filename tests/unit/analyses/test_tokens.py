"""Tokens shown as text (`moescope.analyses.tokens`): a token that is part of a multi-byte character is
shown as its bytes alone and whole in its context, never as U+FFFD. Expected bytes come from the
vocabulary through GPT-2's own byte alphabet (transformers' `bytes_to_unicode`) and from the text the
tokens were cut from, not from the functions under test."""

from __future__ import annotations

import re

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from moescope.analyses.jitter import expert_change
from moescope.analyses.tokens import context_parts, token_text
from moescope.demo.data import load_demo_model

TEXT = "café – naïve “quoted” 日本 ≤ x\n\tdef f(): return 'ok'"


@pytest.fixture(scope="module")
def byte_level():
    """The demo model's tokenizer: byte-level BPE, which cuts é, – and 日 into byte tokens."""
    return load_demo_model()[1]


@pytest.fixture(scope="module")
def byte_fallback():
    """A SentencePiece-style tokenizer (▁ for spaces, `<0xNN>` pieces for what its vocabulary lacks),
    built like Llama's: é and – are not in its vocabulary, so they fall back to bytes."""
    letters = sorted(set("abcdefghijklmnopqrstuvwxyz▁"))
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in [*letters, "▁c", "▁ca", "▁caf"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "c"), ("▁c", "a"), ("▁ca", "f")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def vocabulary_bytes(tokenizer, token_id: int) -> bytes:
    alphabet = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(alphabet[c] for c in tokenizer.convert_ids_to_tokens(token_id))


def test_a_byte_token_alone_is_its_bytes_not_a_replacement_character(byte_level):
    ids = byte_level(TEXT)["input_ids"]
    split = [i for i in ids if "\ufffd" in byte_level.decode([i])]
    assert split, "the text has characters the demo tokenizer cuts into bytes"
    for token_id in ids:
        data = vocabulary_bytes(byte_level, token_id)
        try:
            expected = data.decode("utf-8")
        except UnicodeDecodeError:
            expected = repr(data)[2:-1]  # the bytes as Python writes them, \xNN
        assert token_text(byte_level, token_id) == expected
        assert "\ufffd" not in token_text(byte_level, token_id)


def shown_bytes(text: str) -> bytes:
    """What a shown text stands for: its \\xNN escapes as those bytes, the rest as UTF-8."""
    return b"".join(bytes([int(part[2:], 16)]) if part.startswith("\\x") else part.encode()
                    for part in re.split(r"(\\x[0-9a-f]{2})", text))


@pytest.mark.parametrize("cut", [(0, None), (3, 9), (5, 17)], ids=["whole", "cut-inside-e-acute", "cut-inside-dash"])
def test_a_context_keeps_each_character_whole_around_its_token(byte_level, cut):
    ids = byte_level(TEXT)["input_ids"][cut[0]:cut[1]]
    data = b"".join(vocabulary_bytes(byte_level, i) for i in ids)
    for at in range(len(ids)):
        before, token, after = context_parts(byte_level, ids, at)
        assert "\ufffd" not in before + token + after
        assert shown_bytes(before + token + after) == data  # nothing lost, nothing added
        # the token's part holds the token's own bytes, and the rest of the characters they are part of
        start = len(b"".join(vocabulary_bytes(byte_level, i) for i in ids[:at]))
        end = start + len(vocabulary_bytes(byte_level, ids[at]))
        assert len(shown_bytes(before)) <= start and end <= len(shown_bytes(before + token))
        if cut == (0, None):  # no character cut by the window: every part is whole characters
            assert "\\x" not in before + token + after
    whole = byte_level(TEXT)["input_ids"]
    at = next(i for i, t in enumerate(whole) if vocabulary_bytes(byte_level, t) == "é".encode()[1:])
    assert context_parts(byte_level, whole, at) == ("caf", "é", TEXT[4:])
    assert context_parts(byte_level, whole, at - 1) == ("caf", "é", TEXT[4:])
    assert context_parts(byte_level, whole[3:], 0)[1] == "\\xa9"  # é's first byte left the window


def test_byte_fallback_pieces_are_bytes_too(byte_fallback):
    text = "café – abc"
    ids = byte_fallback(text)["input_ids"]
    pieces = byte_fallback.convert_ids_to_tokens(ids)
    assert "<0xC3>" in pieces and "<0xE2>" in pieces
    assert [token_text(byte_fallback, i) for i in ids] == [
        " caf", "\\xc3", "\\xa9", " ", "\\xe2", "\\x80", "\\x93", " ", "a", "b", "c"]
    at = pieces.index("<0x80>")
    assert context_parts(byte_fallback, ids, at) == (" café ", "–", " abc")


def test_expert_sets_read_as_plain_integers():
    import numpy as np

    assert expert_change(np.array([4, 2], dtype=np.int32), np.array([6, 4], dtype=np.int64)) == "[2, 4] -> [4, 6]"
    assert expert_change([1], [0], "→") == "[1] → [0]"
