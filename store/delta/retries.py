"""How long and how often the store's calls to object storage are tried again, and which of its
errors are worth another try.

A commit that failed for a reason delta-rs does not retry (the object store's own retries ran out:
503s, resets), an upload cut short and a table that could not be opened are tried again with
jittered backoff, at most `APP_RETRIES` more times and for at most `APP_RETRY_DEADLINE_S`.
"""

from __future__ import annotations

import random
import re
import time

__all__ = ["APP_RETRIES", "APP_RETRY_DEADLINE_S", "BACKOFF_S", "backoff", "transient"]

# Our retries around delta-rs's own: a commit that failed for a reason delta-rs does not retry (the object
# store's own retries ran out: 503s, resets) is tried again, with jittered backoff, this often and
# for at most this long.
APP_RETRIES = 8
APP_RETRY_DEADLINE_S = 300.0
BACKOFF_S = (0.05, 5.0)  # first and largest wait between our retries


def backoff(attempt: int) -> None:
    """Sleep before try `attempt` (1, 2, ...): a random time up to BACKOFF_S[0] * 2**attempt, at most BACKOFF_S[1]."""
    low, high = BACKOFF_S
    time.sleep(random.uniform(0, min(high, low * 2 ** attempt)))  # full jitter: writers spread out


_TRANSIENT = ("slowdown", "slow down", "reset", "timed out", "timeout", "connection", "sending request", "broken pipe",
              "temporar", "internalerror", "service unavailable", "eof")
_PERMANENT = ("forbidden", "access denied", "accessdenied", "signature", "invalidaccesskey", "nosuchbucket",
              "no_such_bucket", "lacked the necessary privileges", "404 not found")
# HTTP statuses are whole numbers in the text: the message also carries the request's URL, whose port or
# random prefix may hold "403" or "503" (port 40359 once made a connection reset look like a refusal).
_TRANSIENT_STATUS = re.compile(r"(?<![\w.:/-])(500|502|503|504)(?![\w.:/-])")
_PERMANENT_STATUS = re.compile(r"(?<![\w.:/-])403(?![\w.:/-])")


def transient(error: BaseException) -> bool:
    """Whether an object-storage error may pass if tried again (a reset, a 5xx, SlowDown, a timeout),
    as opposed to an answer that will not change (refused credentials, a missing bucket)."""
    text = str(error).lower()
    if _PERMANENT_STATUS.search(text) or any(word in text for word in _PERMANENT):
        return False
    return bool(_TRANSIENT_STATUS.search(text)) or any(word in text for word in _TRANSIENT)
