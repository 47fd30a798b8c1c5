"""Two specialisation figures, two names, on every surface that shows one.

*Kept-slot specialisation* (NMI(expert; tag) over every kept top-k slot, `signals.specialisation_by_layer`:
the Clusters page, the demo's printed line) and the demo model card's *top-1 specialisation* (NMI between
the domain and the router's first choice, before any capacity) differ several-fold on the demo model; both
were called "specialisation", and a reader of the lower one concluded the experts do not specialise.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moescope.demo.data import demo_model_path
from tests.support.pages import app_for, assert_clean, open_page
from tests.support.paths import REPO

ROOT = Path(REPO)
# The README, the manual's pages (docs/) and the model card: every one that mentions a specialisation figure.
# docs/measuring.md ("What the numbers mean") defines both, so it is always among them.
_CANDIDATES = {"README.md": ROOT / "README.md", "the demo model card": demo_model_path() / "README.md",
               **{f"docs/{page.relative_to(ROOT / 'docs')}": page for page in sorted((ROOT / "docs").rglob("*.md"))}}
DOCUMENTS = {name: path for name, path in _CANDIDATES.items()
             if "specialisation" in path.read_text().lower()}
assert "docs/measuring.md" in DOCUMENTS and "the demo model card" in DOCUMENTS


def bare_mentions(text: str) -> list[str]:
    """Each "specialisation" in `text` named neither kept-slot nor top-1 (identifiers and module paths,
    such as `specialisation_by_layer` or `moescope.demo.specialisation`, aside), with its line."""
    bare = []
    for match in re.finditer(r"specialisation", text, flags=re.IGNORECASE):
        before, after = text[:match.start()], text[match.end():]
        if re.search(r"(kept-slot|top-1)\s+$", before, flags=re.IGNORECASE) or before[-1:] in "_." or after[:1] in "_.":
            continue
        start = before.rfind("\n") + 1
        bare.append(text[start:text.find("\n", match.end())])
    return bare


@pytest.mark.parametrize("name", list(DOCUMENTS))
def test_documents_name_each_specialisation_and_explain_the_other(name):
    text = DOCUMENTS[name].read_text()
    assert bare_mentions(text) == []
    # Where one figure is given, the other is named beside it, so the two are not read as one.
    assert "kept-slot specialisation" in text.lower() and "top-1 specialisation" in text.lower()


def test_clusters_page_names_its_figure_and_tells_it_from_the_cards(monkeypatch, recorded):
    at = open_page(app_for(monkeypatch, recorded["root"]), "views/clusters.py")
    assert_clean(at)
    assert "Kept-slot specialisation" in [s.value for s in at.subheader]
    caption = next(c.value for c in at.caption if c.value.startswith("Kept-slot specialisation is"))
    assert "top-1 specialisation" in caption and "every top-k slot an expert kept" in caption
    assert bare_mentions(caption) == []
