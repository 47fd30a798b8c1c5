"""Issue 33, part 4: the Routing jitter page in headless Chromium shows expert ids as plain integers
(`[2, 4] → [4, 6]`, not `[np.int32(2), n…`) and tokens that are part of a multi-byte character as
their bytes alone and whole in their context, never as U+FFFD (�).

The store is `moescope.jitter` on the demo model (its tokenizer is byte-level BPE) over held-out texts
whose e and o are written é and ö, so most contexts hold characters cut across tokens. Expected values
come from the texts themselves, the raw Parquet rows (through the Delta log) and GPT-2's byte alphabet
(transformers' `bytes_to_unicode`), never from the page's own functions."""

from __future__ import annotations

import re

import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

import moescope
from moescope.demo.data import DOMAINS, demo_model_path, domain_texts, load_demo_model
from tests.support.browser import grid_rows, page_with_tables
from tests.support.deltafiles import snapshot_rows

pytestmark = pytest.mark.integration


def accented(text: str) -> str:
    return text.replace("e", "é").replace("o", "ö")


@pytest.fixture(scope="module")
def jitter_store(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("jitter-tokens") / "store")
    model, tokenizer = load_demo_model()
    texts = [accented(t) for d in DOMAINS for t in domain_texts(d, 3, seed=0, max_chars=400)]
    moescope.jitter(model, texts, tokenizer=tokenizer, conditions=("dtype",), dtypes=("bfloat16",), max_tokens=128,
                    store=root, run_id="jit")
    return {"root": root, "texts": texts, "tokenizer": tokenizer}


@pytest.fixture(scope="module")
def page(jitter_store, tmp_path_factory):
    with page_with_tables(jitter_store["root"], tmp_path_factory.mktemp("server"), "jitter", "Flipped tokens",
                          tokenizer=str(demo_model_path()), height=6000) as page:
        yield page


def flipped_rows(page) -> list[dict]:
    """The Flipped tokens table, one dict per row drawn."""
    return grid_rows(page, 1)


def vocabulary_bytes(tokenizer, token_id: int) -> bytes:
    alphabet = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(alphabet[c] for c in tokenizer.convert_ids_to_tokens(token_id))


def shown_bytes(text: str) -> bytes:
    """What a shown text stands for: the page's signs for whitespace undone, \\xNN escapes as bytes."""
    text = text.translate(str.maketrans({"␣": " ", "↵": "\n", "⇥": "\t", "␍": "\r"}))
    return b"".join(bytes([int(part[2:], 16)]) if part.startswith("\\x") else part.encode()
                    for part in re.split(r"(\\x[0-9a-f]{2})", text))


def test_no_replacement_character_and_plain_expert_ids(page):
    body = page.evaluate("() => document.body.innerText")
    assert "\ufffd" not in body
    rows = flipped_rows(page)
    assert len(rows) >= 5
    for row in rows:
        assert "\ufffd" not in "".join(row.values()) and "np." not in row["experts before → after"]
        assert re.fullmatch(r"\[\d+(, \d+)*\] → \[\d+(, \d+)*\]", row["experts before → after"]), row


def test_each_row_shows_its_stored_experts_token_bytes_and_text(page, jitter_store):
    tokenizer, texts = jitter_store["tokenizer"], jitter_store["texts"]
    listed = snapshot_rows(jitter_store["root"], "jitter_tokens").to_pandas()
    rows = flipped_rows(page)
    cut = 0
    for row in rows:
        [stored] = listed[(listed.layer == int(row["layer"])) & (listed.sequence == int(row["input"]))
                          & (listed.position == int(row["position"]))].itertuples()
        before = ", ".join(str(int(e)) for e in sorted(stored.baseline_ids))
        after = ", ".join(str(int(e)) for e in sorted(stored.condition_ids))
        assert row["experts before → after"] == f"[{before}] → [{after}]"
        own = vocabulary_bytes(tokenizer, int(stored.token_id))
        assert shown_bytes(row["token"]) == own  # alone: its own bytes, escaped where they are no text
        cut += own.decode("utf-8", errors="replace") != own.decode("utf-8", errors="ignore")
        # In context: the input's own text (the window's edges may cut a character: those stay bytes),
        # the token between « » widened to the whole characters its bytes belong to.
        context = row["in context"]
        left, centre, right = re.fullmatch(r"(.*)«(.*)»(.*)", context, re.S).groups()
        text = texts[int(row["input"])].encode()
        whole = shown_bytes(left + centre + right)
        assert whole in text
        assert own in shown_bytes(centre)
        assert shown_bytes(centre).decode("utf-8")  # the centre holds whole characters only
    assert cut > 0, "some listed token is part of a character: the case this test is about"
