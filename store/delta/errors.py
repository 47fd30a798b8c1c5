"""What goes wrong with a store's Delta tables, in the store's own exceptions, and error text that is
safe to show: one line, no colours, no URL signatures, no secret a library echoed back.
"""

from __future__ import annotations

import os
import re

from moescope.store.errors import StoreError

__all__ = ["CommitConflictError", "CommitError", "LegacyStoreError", "StoreAccessError", "clean", "message"]


class CommitError(StoreError):
    """A commit to a table failed after every retry (a StoreError).

    The message names the table (redacted) and why.
    """


class CommitConflictError(CommitError):
    """A commit that removes files was refused because one of them is no longer in the table (another
    commit removed it since it was read: a compaction, a prune, a quarantine). Nothing was committed;
    read a new snapshot and decide again."""


class StoreAccessError(StoreError):
    """The store's bucket does not exist, the credentials were refused, or it cannot be reached.

    A StoreError; the message names the location (redacted, never a secret) and what to check.
    """


class LegacyStoreError(StoreError):
    """The store was written by a release before Delta tables (Parquet folders without a log).

    A StoreError; the message names `moescope store upgrade PATH`, which converts it.
    """



_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AZURE_STORAGE_ACCOUNT_KEY",
               "AZURE_STORAGE_SAS_TOKEN", "AZURE_CLIENT_SECRET", "GOOGLE_SERVICE_ACCOUNT_KEY")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_QUERY = re.compile(r"(https?://[^\s?\"']+)\?[^\s\"']*")


def clean(error: BaseException | None) -> str:
    """An error's text on one line: colours and arrows dropped, URLs' queries cut (they may carry
    signatures), at most 600 characters."""
    if error is None:
        return "unknown error"
    text = _ANSI.sub("", str(error)).replace("↳", "")
    for name in _SECRET_ENV:  # a library that echoed a secret back: never pass it on
        secret = os.environ.get(name)
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    text = _QUERY.sub(r"\1?...", text)
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("<")]
    text = " | ".join(lines) or type(error).__name__
    return f"{type(error).__name__}: {text[:600]}"


def message(what: str, error: BaseException | None) -> str:
    """'moescope: <what>: <the error, cleaned>', the text of the errors this package raises."""
    return f"moescope: {what}: {clean(error)}"

