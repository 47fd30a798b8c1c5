"""Step tags from a request's headers: `x-router-version: v2` becomes `router_version=v2`, and
`x-moescope-tag-<key>: <value>` becomes `<key>=<value>`.

A header whose tag `check_tags` refuses (a bad key, a value too long or holding control characters)
is left out, so a client's odd header never costs it its response.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from email.message import Message

from moescope.ingest.importers.tables import check_tags

__all__ = ["ROUTER_VERSION_HEADER", "TAG_HEADER_PREFIX", "request_tags"]

log = logging.getLogger(__name__)

TAG_HEADER_PREFIX = "x-moescope-tag-"
ROUTER_VERSION_HEADER = "x-router-version"


def request_tags(headers: Message | Mapping[str, str]) -> dict[str, str]:
    """The step tags a request's headers carry.

    Args:
        headers: the request's headers (http.server's message, or a mapping of name to value).

    Returns:
        Tag key to value; headers that make no valid tag are left out.
    """
    tags = {}
    for name, value in headers.items():
        lower = name.lower()
        if lower == ROUTER_VERSION_HEADER:
            tags["router_version"] = value.strip()
        elif lower.startswith(TAG_HEADER_PREFIX) and len(lower) > len(TAG_HEADER_PREFIX):
            tags[lower[len(TAG_HEADER_PREFIX):]] = value.strip()
    valid = {}
    for key, value in tags.items():
        try:
            valid.update(check_tags({key: value}))
        except ValueError as e:
            log.debug("moescope proxy: a tag header is left out: %s", e)
    return valid
