"""Every dotted moescope name quoted in backticks resolves: the docs, the docstrings, the comments and the
strings the product shows (a page's caption) never send a reader to a module that moved or never was.

The rule: a backticked name that starts with `moescope.` (`moescope.metrics.signals.rank_imbalance`), or
with one of the namespace's rooms (`probe.cooldown`, `alerts.signals.x`: the short form these files used
before everything installed under one namespace), names `moescope.<...>`; it must import as a module or
resolve as an attribute of one (an instance attribute a class assigns in its methods, or a dataclass
field, counts). Only the leading dotted part of a backticked text is read (`moescope.attach(model)` names
`moescope.attach`). A short form that is not meant as a module (`store.query()` on a variable called
`store`) reads as one: write it with its class (`Store.query`).

Scanned: every string literal and comment of the package's sources and bench/ (docstrings, help texts, a
page's captions), every page of docs/, and README.md. Every failure is reported at once, file:line.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import io
import os
import re
import tokenize
import types
from collections.abc import Iterator
from functools import cache

from tests.support.paths import REPO

SOURCE_FOLDERS = ("moescope", "probe", "store", "alerts", "dashboard", "bench")
DOCS = ("docs", "README.md")
# the namespace's packages: a backticked `store.x` is `moescope.store.x`
ROOMS = ("core", "probe", "store", "metrics", "ingest", "alerts", "analyses", "prometheus", "dashboard",
         "training", "cli", "demo")
QUOTED = re.compile(r"`([^`\n]+)`")
# a dotted name, then the end of the quote or what may follow a name in code: a call, an index, an argument
DOTTED = re.compile(rf"((?:moescope|{'|'.join(ROOMS)})(?:\.[A-Za-z_]\w*)+)(?:$|[(\[,;:= ])")
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "toml", "txt", "parquet", "csv", "html", "png"}  # `store.py`
NOT_PYTHON = {
    "moescope.replaces",  # a key moescope writes in a compacted Parquet file's footer
}



def quoted_names(text: str) -> Iterator[tuple[int, str]]:
    """(line offset in `text`, dotted name) for every backticked text that starts with a moescope name."""
    for match in QUOTED.finditer(text):
        name = DOTTED.match(match.group(1))
        if name is not None and name.group(1).rsplit(".", 1)[1] not in FILE_SUFFIXES \
                and name.group(1) not in NOT_PYTHON:
            yield text.count("\n", 0, match.start()), name.group(1)


def source_texts(path: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of every string literal and comment of a Python file."""
    with open(path, encoding="utf-8") as fh:
        tokens = list(tokenize.generate_tokens(io.StringIO(fh.read()).readline))
    texts = {tokenize.COMMENT, tokenize.STRING}
    texts |= {getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}  # Python 3.12 splits f-strings
    for token in tokens:
        if token.type in texts:
            yield token.start[0], token.string


def scanned() -> Iterator[tuple[str, int, str]]:
    """(file relative to the repository, line, name) for every quoted name."""
    for folder in SOURCE_FOLDERS:
        for root, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = sorted(d for d in dirs if d not in {"__pycache__", "model"})
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(root, name)
                relative = os.path.relpath(path, REPO).replace(os.sep, "/")
                for line, text in source_texts(path):
                    for offset, quoted in quoted_names(text):
                        yield relative, line + offset, quoted
    for entry in DOCS:
        paths = [os.path.join(REPO, entry)] if entry.endswith(".md") else sorted(
            os.path.join(root, f) for root, _, files in os.walk(os.path.join(REPO, entry)) for f in files
            if f.endswith(".md"))
        for path in paths:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
            relative = os.path.relpath(path, REPO).replace(os.sep, "/")
            for offset, quoted in quoted_names(text):
                yield relative, 1 + offset, quoted


def _assigned_on_self(cls: type) -> set[str]:
    """The attributes a class's methods assign on `self` (an instance attribute exists too)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        names |= set(re.findall(r"\bself\.([A-Za-z_]\w*)\s*(?::[^=\n]+)?=(?!=)", source))
    return names


def _member(owner: object, name: str) -> tuple[bool, object]:
    if hasattr(owner, name):
        return True, getattr(owner, name)
    if isinstance(owner, type):
        fields = {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else set()
        annotated = {n for klass in owner.__mro__ for n in getattr(klass, "__annotations__", {})}
        if name in fields | annotated | _assigned_on_self(owner):
            return True, None  # an instance attribute: nothing further to follow
    return False, None


@cache
def resolve(name: str) -> str | None:
    """None when `name` (`moescope.a.b`) is a module or an attribute that exists, else what is wrong."""
    parts = name.split(".")
    obj: object = importlib.import_module(parts[0])
    for depth, part in enumerate(parts[1:], start=1):
        here = ".".join(parts[:depth])
        if obj is None:
            return None  # inside an instance attribute: its type is not known here
        found, value = _member(obj, part)
        if found:
            obj = value
            continue
        if isinstance(obj, types.ModuleType) and hasattr(obj, "__path__"):
            child = f"{here}.{part}"
            if getattr(obj, "__file__", None) is None:  # a folder of scripts (the dashboard's pages): never run one
                return None if importlib.util.find_spec(child) is not None else f"no module {child}"
            if importlib.util.find_spec(child) is not None:
                obj = importlib.import_module(child)
                continue
        return f"{here} has no {part!r}"
    return None


def full_name(quoted: str) -> str:
    return quoted if quoted.startswith("moescope.") else f"moescope.{quoted}"


def test_every_quoted_moescope_name_resolves():
    failures = []
    for path, line, quoted in scanned():
        problem = resolve(full_name(quoted))
        if problem is not None:
            failures.append(f"{path}:{line}: `{quoted}`: {problem}")
    assert not failures, f"{len(failures)} quoted names do not resolve:\n" + "\n".join(failures)


def test_the_scan_reads_docstrings_comments_captions_and_pages(tmp_path):
    """The scan sees each kind of text it promises to (a scan that read nothing would pass)."""
    page = tmp_path / "page.py"
    page.write_text('''"""A page (`moescope.a`)."""
import streamlit as st

# drawn by `probe.b`
st.caption(f"from `alerts.c.d` over {3} layers; see `store.py`")
''')
    found = [(line + offset, quoted) for line, text in source_texts(str(page)) for offset, quoted in quoted_names(text)]
    assert found == [(1, "moescope.a"), (4, "probe.b"), (5, "alerts.c.d")]
    assert list(quoted_names("`moescope.attach(model)` and\n`moescope.y`, not `moescope.alert/v1`")) \
        == [(0, "moescope.attach"), (1, "moescope.y")]
    files = {path for path, _, _ in scanned()}
    assert {"moescope/__init__.py", "README.md", "docs/attach.md"} <= files


def test_a_name_that_moved_is_reported():
    assert resolve("moescope.metrics.signals") is None
    assert resolve("moescope.store.Store.runs") is None
    assert resolve("moescope.core.records.LayerStep.expert_load") is None  # a dataclass field
    assert resolve("moescope.alerts.signals.specialisation_by_layer") == "moescope.alerts has no 'signals'"
    assert resolve("moescope.probe.cooldown") == "moescope.probe has no 'cooldown'"
