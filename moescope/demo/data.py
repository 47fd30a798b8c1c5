"""The demo model's text domains and how to load the demo model.

Every text here ships with Python itself, so the demo runs offline and anyone can rebuild the
checkpoint. Three domains, chosen to be easy to tell apart and therefore easy for a router to
specialise on:

- ``code``: the standard library's own top-level ``*.py`` modules, in sorted order;
- ``prose``: the reference-manual topics of ``pydoc_data.topics`` (what ``help("with")`` shows);
- ``math``: generated arithmetic lines such as ``37 + 58 = 95``.

Each domain is split the same way: every fifth item (file, topic, or operand pair) is held out.
Training reads only the ``"train"`` split; :func:`domain_texts` samples only the ``"held_out"``
split, so the traffic a demo plays to the model is text it has never seen.

The exact texts depend on the Python version that provides them (the standard library changes
between releases); the split rule does not.
"""

from __future__ import annotations

import pathlib
import random
import sysconfig
import zlib
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import MixtralForCausalLM, PreTrainedTokenizerFast

DOMAINS: tuple[str, ...] = ("code", "prose", "math")
SPLITS: tuple[str, ...] = ("train", "held_out")

# One item in HELD_OUT_EVERY goes to the held-out split, in every domain.
HELD_OUT_EVERY = 5
# Operands of the generated arithmetic run from 0 to MATH_OPERAND_MAX inclusive.
MATH_OPERAND_MAX = 99
_MATH_OPERATORS = ("+", "-", "*")
# Lines per generated math "document" in the training corpus.
_MATH_LINES_PER_DOCUMENT = 32


def _check_domain(domain: str) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; choose one of {DOMAINS}")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")


def _in_split(index: int, split: str) -> bool:
    return (index % HELD_OUT_EVERY == 0) == (split == "held_out")


def stdlib_source_files() -> list[pathlib.Path]:
    """The standard library's top-level ``*.py`` files, sorted by name.

    Only the top level is used: sub-packages would bring in ``site-packages`` and test suites,
    which differ from one installation to another.

    Raises:
        FileNotFoundError: the interpreter's standard library has no Python sources (some
            embedded builds ship only bytecode).
    """
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"), key=lambda path: path.name)
    if not files:
        raise FileNotFoundError(
            f"no *.py files in the standard library at {stdlib}; the demo corpus needs a Python "
            "installation that ships its library sources")
    return files


@cache
def _code_documents(split: str) -> tuple[str, ...]:
    files = stdlib_source_files()
    return tuple(path.read_text(encoding="utf-8", errors="replace")
                 for index, path in enumerate(files) if _in_split(index, split))


@cache
def _prose_documents(split: str) -> tuple[str, ...]:
    from pydoc_data.topics import topics

    documents = tuple(topics[name] for index, name in enumerate(sorted(topics)) if _in_split(index, split))
    if split == "held_out":
        # Some topics are aliases with the same text ("if" and "else"); one that is also a
        # training topic is not held out.
        training = set(_prose_documents("train"))
        documents = tuple(document for document in documents if document not in training)
    return documents


def math_line(rng: random.Random, split: str) -> str:
    """One arithmetic line such as ``"37 + 58 = 95"``, drawn from `rng`.

    The operand pair decides the split, so held-out lines never occur in training whatever seed
    either side uses. The pair goes through CRC-32 first: a plain index such as ``a * 100 + b``
    modulo 5 would hold out exactly the right operands that end in 0 or 5, a skewed sample.
    """
    _check_split(split)
    while True:
        left = rng.randint(0, MATH_OPERAND_MAX)
        right = rng.randint(0, MATH_OPERAND_MAX)
        if _in_split(zlib.crc32(f"{left},{right}".encode()), split):
            break
    operator = rng.choice(_MATH_OPERATORS)
    result = {"+": left + right, "-": left - right, "*": left * right}[operator]
    return f"{left} {operator} {right} = {result}"


def domain_documents(domain: str, split: str = "train", seed: int = 0,
                     math_documents: int = 2000) -> list[str]:
    """The whole documents of one domain's split, in a fixed order.

    ``code`` gives one document per source file, ``prose`` one per pydoc topic; both ignore
    `seed`. ``math`` gives `math_documents` documents of generated lines drawn from `seed`.

    Raises:
        ValueError: unknown domain or split.
    """
    _check_domain(domain)
    _check_split(split)
    if domain == "code":
        return list(_code_documents(split))
    if domain == "prose":
        return list(_prose_documents(split))
    rng = random.Random(f"math/{split}/{seed}")
    return ["\n".join(math_line(rng, split) for _ in range(_MATH_LINES_PER_DOCUMENT)) + "\n"
            for _ in range(math_documents)]


def _window(document: str, rng: random.Random, max_chars: int) -> str:
    """A run of whole lines from `document`, starting at a random line, at most `max_chars` long."""
    lines = document.splitlines(keepends=True)
    # Windows start at non-blank lines so no sample is only whitespace.
    starts = [i for i, line in enumerate(lines) if line.strip()]
    start = rng.choice(starts)
    window = ""
    for line in lines[start:]:
        if window and len(window) + len(line) > max_chars:
            break
        window += line
    return window[:max_chars]


def domain_texts(domain: str, n: int, seed: int = 0, max_chars: int = 400) -> list[str]:
    """`n` held-out sample texts of `domain`, each at most `max_chars` characters.

    Code and prose samples are runs of whole lines from held-out files and topics (a line longer
    than `max_chars` is cut); math samples are held-out arithmetic lines. The same arguments
    always give the same texts. None of them was in the demo model's training data.

    Raises:
        ValueError: unknown domain, `n` negative, or `max_chars` under 20.
    """
    _check_domain(domain)
    if n < 0:
        raise ValueError(f"n must be zero or more, got {n}")
    if max_chars < 20:
        raise ValueError(f"max_chars must be at least 20 so a sample holds a whole line, got {max_chars}")
    rng = random.Random(f"{domain}/held_out/{seed}")
    if domain == "math":
        texts = []
        for _ in range(n):
            text = ""
            while True:
                line = math_line(rng, "held_out") + "\n"
                if text and len(text) + len(line) > max_chars:
                    break
                text += line
            texts.append(text)
        return texts
    documents = [doc for doc in domain_documents(domain, "held_out") if doc.strip()]
    return [_window(rng.choice(documents), rng, max_chars) for _ in range(n)]


def domain_windows(tokenizer, domain: str, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` held-out inputs of `domain`, each exactly `length` tokens: the first `length` tokens of
    the held-out texts (:func:`domain_texts`, long enough samples) that have that many.

    Inputs of one length need no padding, so every position of every row is a real token; the
    demo plays them and the model card measures the active fraction by position on them.

    Raises:
        ValueError: unknown domain, `n` or `length` below 1, or too few held-out texts that long.
    """
    if n < 1 or length < 1:
        raise ValueError(f"n and length must be at least 1, got n={n}, length={length}")
    texts = domain_texts(domain, 4 * n, seed=seed, max_chars=max(400, 8 * length))
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    rows = [ids[:length] for ids in encoded if len(ids) >= length][:n]
    if len(rows) < n:
        raise ValueError(f"only {len(rows)} held-out {domain} texts reach {length} tokens, {n} asked for; "
                         "ask for fewer or shorter inputs")
    return rows


def demo_model_path() -> pathlib.Path:
    """The folder holding the committed demo checkpoint (``moescope/demo/model``)."""
    return pathlib.Path(__file__).resolve().parent / "model"


def load_demo_model(path: str | pathlib.Path | None = None
                    ) -> tuple[MixtralForCausalLM, PreTrainedTokenizerFast]:
    """The trained demo model (eval mode, CPU, float32) and its tokenizer, read from disk only.

    `path` defaults to :func:`demo_model_path`. Nothing is downloaded. A checkpoint whose config
    records ``capacity_factor`` gets its expert capacity installed
    (:func:`moescope.demo.capacity.install_capacity`); plain ``from_pretrained`` would run it dropless.

    Raises:
        FileNotFoundError: no checkpoint at the path; build one with ``moescope train-demo``
            (or ``python -m moescope.demo.train``).
    """
    from transformers import MixtralForCausalLM, PreTrainedTokenizerFast

    folder = pathlib.Path(path) if path is not None else demo_model_path()
    if not (folder / "config.json").is_file() or not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no demo checkpoint in {folder}; build one with `moescope train-demo --out {folder}` "
            "(or `python -m moescope.demo.train --out ...`)")
    model = MixtralForCausalLM.from_pretrained(folder, local_files_only=True, dtype="float32")
    if getattr(model.config, "capacity_factor", None) is not None:
        # Trained with an expert capacity (see the model card): run it the way it was trained.
        from moescope.demo.capacity import install_capacity

        install_capacity(model)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    return model.eval(), tokenizer
