"""Text that came from outside (a tag value, a router version, a name in a file) and is shown on a
terminal or a page.

Control characters (C0, DEL, C1) can clear a screen, ring a bell, end a string early in C code or
rewrite a line an operator is reading, and bidirectional overrides make text read in another order
than it is stored. A value is refused at the door when it holds one (`control_characters`), and
anything printed from a store is escaped (`escape_control`), so a store written before the door
was closed cannot reach the terminal either.
"""

from __future__ import annotations

import re

# C0 controls, DEL, C1 controls, and the bidirectional embeddings, overrides and isolates.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def control_characters(text: str) -> list[str]:
    """The distinct control characters in `text`, as `\\xNN`/`\\uNNNN` escapes, in order of first use."""
    seen: dict[str, None] = {}
    for match in _CONTROL.finditer(text):
        seen.setdefault(_escape(match), None)
    return list(seen)


def escape_control(text: str) -> str:
    """`text` with every control character written as its escape (`\\x1b`, `\\u202e`); the rest as is."""
    return _CONTROL.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
