"""This process's pyarrow filesystem per store location, made once (making one for object storage
reads credentials and may start a client) and made afresh in a forked child.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moescope.core import forking
from moescope.store.location import StoreLocation

if TYPE_CHECKING:
    from pyarrow.fs import FileSystem

__all__ = ["filesystem"]

_FILESYSTEMS: dict[tuple[str, tuple], FileSystem] = {}


def filesystem(loc: StoreLocation) -> FileSystem:
    """The pyarrow filesystem of `loc` (`StoreLocation.filesystem()`), cached per URL and storage options."""
    key = (loc.url, tuple(sorted(loc.storage_options.items())))
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        fs = _FILESYSTEMS[key] = loc.filesystem()
    return fs


def _reset_in_child() -> None:
    """In a forked child: forget the parent's filesystems (their clients' connections are the parent's)."""
    global _FILESYSTEMS
    _FILESYSTEMS = {}


forking.join_module(_reset_in_child)
