"""Text from outside: control characters are refused in tags and escaped on output (issue 23, item 10)."""

from __future__ import annotations

import pytest

from moescope.ingest.importers.tables import check_tags, parse_tags
from moescope.store.text import control_characters, escape_control

HOSTILE = ["\x1b[2J", "\x07", "\x00", "\x7f", "\x9b", "\u202e", "a\tb", "line\nbreak"]


@pytest.mark.parametrize("value", HOSTILE)
def test_a_tag_value_with_a_control_character_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="control characters") as raised:
        check_tags({"prompt_kind": f"chat{value}"})
    code = ord(next(ch for ch in value if not ch.isalnum() and ch not in "[2J"))
    assert (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}") in str(raised.value)


def test_a_tag_option_with_an_escape_sequence_is_refused():
    with pytest.raises(ValueError, match="tag k"):
        parse_tags(["k=\x1b[31mred"])


def test_printable_unicode_passes():
    assert check_tags({"lang": "français 日本語 🙂"}) == {"lang": "français 日本語 🙂"}
    assert control_characters("français 日本語 🙂") == []


def test_escape_writes_every_control_character_as_its_code_and_keeps_the_rest():
    text = "ok \x1b[2J\x07\x00é\u202e\x9b"
    escaped = escape_control(text)
    assert escaped == "ok \\x1b[2J\\x07\\x00é\\u202e\\x9b"
    assert all(ch.isprintable() for ch in escaped)
    assert control_characters(text) == ["\\x1b", "\\x07", "\\x00", "\\u202e", "\\x9b"]
