"""What the `--format json` tests share: a parsed document against a report's values, and its keys against
the documented list (`moescope.cli.output.DOCUMENTS`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from moescope.cli.output import DOCUMENTS, SCHEMA_VERSION, document_keys


def same(got: Any, want: Any) -> None:
    """`got` (parsed JSON) is `want` (a report's value): exactly equal numbers, null where the report has
    no value (NaN, infinity, None, NA), lists for arrays and tuples."""
    if want is None or want is pd.NA or (isinstance(want, (float, np.floating)) and not math.isfinite(want)):
        assert got is None, (got, want)
    elif isinstance(want, (np.ndarray, list, tuple)):
        assert isinstance(got, list) and len(got) == len(want), (got, want)
        for g, w in zip(got, list(want)):
            same(g, w)
    elif isinstance(want, (bool, np.bool_)):
        assert got is bool(want), (got, want)
    elif isinstance(want, (int, np.integer, float, np.floating)):
        assert isinstance(got, (int, float)) and not isinstance(got, bool) and got == want, (got, want)
    else:
        assert got == want, (got, want)


def same_rows(got: list[dict], frame: pd.DataFrame, columns) -> None:
    """Each row of `got` has exactly `columns`, in order, and their values are `frame`'s row by row."""
    assert len(got) == len(frame), (len(got), len(frame))
    for row, want in zip(got, frame.to_dict("records")):
        assert list(row) == list(columns)
        for column in columns:
            same(row[column], want[column])


def _value(doc: Any, path: str) -> Any:
    """The value at `path` of a row-free prefix, or [] where a list of rows lies on the way."""
    for part in path.split("."):
        if isinstance(doc, list) or doc is None:
            return doc
        doc = doc.get(part.removesuffix("[]"))
    return doc


def check_keys(doc: dict) -> None:
    """The document's keys are its command's documented keys in their order, none more; a documented key
    is missing only under an empty list of rows or an object that is null; its units are the documented."""
    spec = DOCUMENTS[doc["command"]]
    assert doc["schema_version"] == SCHEMA_VERSION
    emitted = document_keys(doc)
    assert emitted == [key for key in spec.keys if key in set(emitted)], (emitted, spec.keys)
    for key in spec.keys:
        if key not in emitted:
            parent = key.rsplit(".", 1)[0]
            assert _value(doc, parent) in ([], None), f"{key} is documented but not in the document"
    assert doc["units"] == spec.units()
