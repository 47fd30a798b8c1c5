"""Token ids as text for people: one token alone, or a token among its neighbours.

A byte-level tokenizer (GPT-2's, Llama 3's, the demo model's) or one with byte fallback
(SentencePiece's `<0xE2>` pieces) can cut a character of several UTF-8 bytes across tokens.
Decoded alone, such a token is not text, and `tokenizer.decode` hands back U+FFFD (�) for it,
which hides which token it was. Here a token's *bytes* are read from its vocabulary piece, so:

- a token alone that is not whole characters is shown as its bytes, `\\xe2\\x80`
  (`token_text`);
- a token among its neighbours keeps every character it is part of whole: the bytes of a
  character cut at the token's edge move into the token's part, so the context reads as the
  text did (`context_parts`). Only bytes whose character the context window cuts off stay
  bytes.

The dashboard's pages and `moescope jitter` both show tokens through these functions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback
_SPACE_PIECE = "\u2581"  # SentencePiece's word boundary (▁), a space in the text


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes are themselves, the rest
    are shifted to U+0100 and up (`bytes_to_unicode` in GPT-2's encoder)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


def _is_byte_level(tokenizer: Any) -> bool:
    if getattr(tokenizer, "byte_decoder", None) is not None:  # transformers' slow GPT-2 tokenizer
        return True
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:
        return decoder is not None and b"ByteLevel" in decoder.__getstate__()
    except (AttributeError, TypeError):
        return False


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes of the text that token `token_id` stands for (a part of a character, maybe).

    Read from the token's vocabulary piece for a byte-level tokenizer and for SentencePiece's
    byte pieces; any other token's text is its `decode` (whole characters by construction)."""
    token_id = int(token_id)
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        if _is_byte_level(tokenizer):
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        elif _SPACE_PIECE in piece and "\ufffd" not in tokenizer.decode([token_id]):
            # decode drops a piece's leading ▁ at the start of a text: alone, every token is there
            return piece.replace(_SPACE_PIECE, " ").encode()
    return tokenizer.decode([token_id]).encode()


def _text(data: bytes) -> str:
    """UTF-8 text, with any byte that is no whole character written as \\xNN."""
    return data.decode("utf-8", errors="backslashreplace")


def token_text(tokenizer: Any, token_id: int) -> str:
    """The text of one token alone; where the token is no whole character (a part of a multi-byte
    one), its bytes as `\\xNN` escapes instead of a replacement character."""
    return _text(token_bytes(tokenizer, token_id))


def _incomplete_tail(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character that does not end there."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII): its character needs this many bytes
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return back if need > back else 0
    return 0


def _continuation_head(data: bytes) -> int:
    """How many bytes at the start of `data` continue a character begun before it (at most 3)."""
    n = 0
    while n < min(3, len(data)) and data[n] & 0xC0 == 0x80:
        n += 1
    return n


def context_parts(tokenizer: Any, ids: Sequence[int], at: int) -> tuple[str, str, str]:
    """(before, token, after): the text of `ids[:at]`, of `ids[at]` and of `ids[at + 1:]`, where a
    character cut at the token's edges belongs whole to the token's part (so the token's part holds
    at least the characters it is part of) and no part shows a replacement character for a cut one.

    Raises:
        IndexError: when `at` is not an index of `ids`.
    """
    if not 0 <= at < len(ids):
        raise IndexError(f"token index {at} outside a context of {len(ids)} tokens")
    pieces = [token_bytes(tokenizer, i) for i in ids]
    before, token, after = b"".join(pieces[:at]), pieces[at], b"".join(pieces[at + 1:])
    # The token's bytes are extended to whole characters: back to the lead byte of a character it
    # continues, on to the end of a character it begins (or continues) and does not finish.
    back = _incomplete_tail(before) if token and token[0] & 0xC0 == 0x80 else 0
    if back:
        before, token = before[:-back], before[-back:] + token
    on = _continuation_head(after) if _incomplete_tail(token) else 0
    if on:
        token, after = token + after[:on], after[on:]
    return _text(before), _text(token), _text(after)
