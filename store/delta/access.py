"""Is the store usable? One cheap check per process: on object storage, that the bucket exists, the
credentials are accepted and the endpoint answers; on a local folder, that it holds no table of the
release before Delta tables (`legacy_tables`: Parquet folders without a log, which `moescope store
upgrade` converts).
"""

from __future__ import annotations

import os

from moescope.store.delta.errors import LegacyStoreError, StoreAccessError, clean
from moescope.store.delta.filesystems import filesystem
from moescope.store.delta.parts import PARTITION_COLUMN
from moescope.store.location import StoreLocation, open_location
from moescope.store.naming import is_valid_name

__all__ = ["check_store", "legacy_tables", "table_folders"]

_CHECKED: set[tuple[str, tuple]] = set()  # stores checked in this process


def check_store(loc: StoreLocation | str | os.PathLike) -> None:
    """Check once per process, cheaply, that the store can be used: on object storage one listing
    under the root (the bucket exists, the credentials are accepted, the endpoint answers); on a local
    folder, that it holds no table of the previous release. A writer calls this when it opens, so a
    wrong URL or credentials fail at attach, not at the first flush.

    Raises:
        StoreAccessError: the store is a file, its bucket is missing, the credentials were refused,
            or it cannot be reached; the message says what to check.
        LegacyStoreError: a local store of the previous release; the message names the upgrade.
    """
    loc = open_location(loc)
    key = (loc.url, tuple(sorted(loc.storage_options.items())))
    if key in _CHECKED:
        return
    if loc.is_local:
        if os.path.isfile(loc.url) or os.path.isfile(os.path.dirname(loc.url.rstrip(os.sep)) or "."):
            raise StoreAccessError(f"moescope: the store {loc.redacted!r} is a file (or inside one), not a folder: "
                                   f"give a folder to record into, e.g. store='runs/'")
        legacy = legacy_tables(loc)
        if legacy:
            raise LegacyStoreError(
                f"moescope: the store {loc.redacted} was written by an earlier moescope release (tables "
                f"{', '.join(legacy)} are Parquet folders without a Delta log): convert it once with "
                f"`moescope store upgrade {loc.redacted}` (query answers stay the same), then use it again")
    else:
        _check_reachable(loc)
    _CHECKED.add(key)


def legacy_tables(loc: StoreLocation | str | os.PathLike) -> list[str]:
    """Tables of a local store that the previous release wrote: a table folder holding run folders
    (`run_id=...`) but no `_delta_log`. A writer creates a table's log before its first file, so a
    Delta store never looks like this. A folder whose name is not a valid table name (`bad table`)
    is not a table, as the previous release's readers skipped it too.

    Returns:
        Their names, sorted; [] for object storage (the previous release never wrote there) and for
        a folder that does not exist.
    """
    loc = open_location(loc)
    if not loc.is_local:
        return []
    try:
        entries = sorted(os.scandir(loc.url), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    legacy = []
    for entry in entries:
        if not is_valid_name(entry.name, "table") or not entry.is_dir():
            continue
        if os.path.exists(os.path.join(entry.path, "_delta_log")):
            continue
        try:
            if any(name.startswith(f"{PARTITION_COLUMN}=") for name in os.listdir(entry.path)):
                legacy.append(entry.name)
        except OSError:
            continue
    return legacy


def table_folders(loc: StoreLocation | str | os.PathLike) -> set[str] | None:
    """The names of the folders directly under a store's root (a table has one once its log is
    created): one listing on object storage, where opening a table that is not there costs requests
    of its own (delta-rs lists its log). None when the root cannot be listed (the caller then opens
    every table); an empty set for a store with nothing in it yet. A table created after the listing
    is not in it: a caller that must see every table lists again."""
    from pyarrow import fs as pafs

    loc = open_location(loc)
    if loc.is_local:
        try:
            return {entry.name for entry in os.scandir(loc.url) if entry.is_dir()}
        except (FileNotFoundError, NotADirectoryError):
            return set()
        except OSError:
            return None
    try:
        infos = filesystem(loc).get_file_info(pafs.FileSelector(loc.join(), allow_not_found=True, recursive=False))
    except OSError:
        return None
    return {info.base_name for info in infos if info.type == pafs.FileType.Directory}


def _check_reachable(loc: StoreLocation) -> None:
    """Raise StoreAccessError, saying what to check, unless one listing under the root answers."""
    from pyarrow import fs as pafs

    try:
        filesystem(loc).get_file_info(pafs.FileSelector(loc.join(), allow_not_found=False, recursive=False))
        return
    except FileNotFoundError:
        return  # nothing under the prefix yet: a new store
    except OSError as e:
        text = str(e)
        upper = text.upper()
        if "NO_SUCH_BUCKET" in upper or "NOSUCHBUCKET" in upper or "BUCKET DOES NOT EXIST" in upper:
            what = ("its bucket does not exist: create the bucket, or fix the URL (a fleet's processes need "
                    "the bucket made beforehand; moescope never creates one)")
        elif any(word in upper for word in ("ACCESS_DENIED", "ACCESSDENIED", "SIGNATURE", "INVALIDACCESSKEY",
                                            "INVALID_ACCESS_KEY", "FORBIDDEN", "403", "EXPIRED", "CREDENTIALS")):
            what = ("the credentials were refused: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or "
                    "AWS_PROFILE, the instance role) in this process's environment, and that they may list "
                    "and write under the prefix")
        else:
            what = ("it could not be reached: check the endpoint and region (--storage-option endpoint=..., "
                    "region=...) and the network")
        raise StoreAccessError(f"moescope: cannot use the store {loc.redacted}: {what} ({clean(e)})") from e
