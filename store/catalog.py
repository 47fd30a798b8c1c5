"""Which files a reader should read now: listed, checked, compaction-resolved.

`Catalog.snapshot()` lists every table, checks each file it has not seen before (its footer, then
every page against its checksum: bad ones go to quarantine, or are skipped where they cannot be
moved), and leaves out every file that a present compacted file replaces.
If a listed file vanished while it was being checked, the listing may predate a compaction that
has since finished, so the whole listing is taken again: a snapshot never mixes the two sides of
a swap. `compact` waits a grace period between publishing a merged file and deleting its sources,
long enough for any listing that saw neither to finish first.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pyarrow.parquet as pq

from moescope.store.layout import decode_replaces, list_parts
from moescope.store.quarantine import deep_check, quarantine
from moescope.store.schema import TABLES


@dataclass(frozen=True)
class FileInfo:
    path: str
    rows: int
    columns: tuple[str, ...]
    replaces: tuple[str, ...]  # basenames in the same folder, for compacted files


class Vanished(Exception):
    """A listed file disappeared before it could be checked: the listing is stale."""


class Catalog:
    """Checked files of one store, cached by (path, size, mtime): each file is checked once per reader.

    verify=False checks footers only (no read through the pages): faster on a large store, but a
    damaged page is then found only if it makes a query fail, and bit rot can read as other values.
    """

    def __init__(self, root: str | os.PathLike, quarantine_bad: bool = True, verify: bool = True):
        self.root = os.fspath(root)
        self.quarantine_bad = quarantine_bad
        self.verify = verify
        self._checked: dict[tuple[str, int, int], FileInfo] = {}  # (path, size, mtime) -> footer
        self._bad: dict[tuple[str, int, int], str] = {}  # files found bad that are still in place -> why
        self.quarantined_now: list[str] = []

    def _info(self, path: str) -> FileInfo | None:
        """The file's footer, cached; None if it was bad (moved to quarantine, or skipped)."""
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            raise Vanished(path) from None
        key = (path, stat.st_size, stat.st_mtime_ns)
        if key in self._checked:
            return self._checked[key]
        if key in self._bad:
            return None
        try:
            meta = pq.read_metadata(path)
            info = FileInfo(path, meta.num_rows, tuple(meta.schema.to_arrow_schema().names),
                            tuple(decode_replaces(meta.metadata)))
        except FileNotFoundError:
            raise Vanished(path) from None
        except Exception as e:  # a truncated or foreign file: pyarrow raises several types
            self.reject(path, f"unreadable footer: {type(e).__name__}: {e}", key)
            return None
        if self.verify and (problem := deep_check(path)) is not None:
            self.reject(path, f"damaged data: {problem}", key)
            return None
        if not os.path.exists(path):
            raise Vanished(path)  # deep_check reads a vanished file as "not bad": the listing is stale
        self._checked[key] = info
        return info

    def reject(self, path: str, reason: str, key: tuple[str, int, int] | None = None) -> None:
        """Take a bad file out of this reader's listings: to quarantine, or skipped where it cannot move."""
        if key is None:
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                return
            key = (path, stat.st_size, stat.st_mtime_ns)
        self._checked.pop(key, None)
        moved = quarantine(self.root, path, reason) if self.quarantine_bad else None
        if moved:
            self.quarantined_now.append(moved)
        else:
            self._bad[key] = reason

    def live_files(self, table: str, run_id: str | None = None) -> list[FileInfo]:
        """Files of a table that hold live rows (raises Vanished when the listing went stale)."""
        infos = [info for path in list_parts(self.root, table, run_id) if (info := self._info(path))]
        replaced = {os.path.join(os.path.dirname(i.path), name) for i in infos for name in i.replaces}
        return [i for i in infos if i.path not in replaced]

    def snapshot(self, tables: tuple[str, ...] = TABLES, attempts: int = 20) -> dict[str, list[FileInfo]]:
        """Live files of every table, from one consistent listing per table."""
        result: dict[str, list[FileInfo]] = {}
        for table in tables:
            for attempt in range(attempts):
                try:
                    result[table] = self.live_files(table)
                    break
                except Vanished:
                    time.sleep(0.01 * attempt)
            else:
                raise RuntimeError(f"files of {table!r} kept vanishing while listing {self.root!r}")
        return result

    def forget_missing(self) -> None:
        self._checked = {k: v for k, v in self._checked.items() if os.path.exists(k[0])}
        self._bad = {k: v for k, v in self._bad.items() if os.path.exists(k[0])}
