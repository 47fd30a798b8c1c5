"""Bad files: detected, copied aside with the reason, taken out of their table, counted; never deleted.

A Parquet file can be bad because a disk or a bucket damaged it after it was written (bit rot), or
because something wrote over it by hand. Readers check every file before they first read it: its
footer, then every page against the CRC-32 checksum the writer stored (`deep_check`: the pages'
bytes are read and summed, not decoded), once per file per reader. A file that still makes a query
fail is read through (`read_through`: every value decoded), by DuckDB too.

A bad file is copied to `<store>/_quarantine/<table>/run_id=<id>/<name>` with a `<name>.reason.json`
beside it, a warning (`BadFileWarning`) names both, and the file is taken out of its table by a
Delta commit that removes it (`moescope.store.catalog.Catalog.reject`); its rows are counted as lost in
`probe_stats` (reason `quarantined`). The original stays in the table's folder until `vacuum`
deletes it with the other removed files: readers of older snapshots are never cut off. Where the
copy cannot be made (a full or read-only disk), nothing is removed: the file stays in its table,
this reader skips it with a warning, and the next reader tries again. The user decides what to do
with what is in quarantine; nothing here deletes it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import warnings
import zlib
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from moescope.store.location import StoreLocation
from moescope.store.naming import QUARANTINE_DIR

log = logging.getLogger(__name__)
REASON_SUFFIX = ".reason.json"


class BadFileWarning(UserWarning):
    """A Parquet file in the store was unreadable and has been copied to quarantine (or is skipped).

    A UserWarning, issued by `Store` when it meets the file; `Store.quarantined()` lists such files.
    """


@dataclass(frozen=True)
class QuarantinedFile:
    """A file copied aside as unreadable (`Store.quarantined()`).

    Attributes:
        path: where the copy is, under `<store>/_quarantine` (a local path, or a URL).
        original_path: where the file was in its table (a local path, or a URL).
        reason: why it was taken out.
        moved_at: when, as an ISO time in UTC.
    """
    path: str  # where the copy is, under <store>/_quarantine (a local path, or a URL)
    original_path: str  # where the file was in its table (a local path, or a URL)
    reason: str
    moved_at: str  # ISO time, UTC


def deep_check(path: str, filesystem: Any = None, data: pa.Buffer | None = None) -> str | None:
    """Check every page of a file against its checksum; the error text, or None if it holds.

    `path` is a local path, or a path of `filesystem` (a pyarrow filesystem: object storage). The
    footer is parsed, then each column chunk's bytes are walked page by page: every page header must
    parse, its page must lie inside the chunk and match the CRC-32 the writer stored, and the chunk's
    data pages must hold as many values as the footer says (the checksum covers a page's data, not
    its header: a damaged value count would make a reader return fewer values without an error).
    Nothing is decompressed or decoded, so a file is checked at the speed its bytes are read. Chunks
    whose pages carry no checksum (other writers) are read through instead (`read_through`): they can
    be read but not checked. A damaged header field that the checksum does not cover and the count
    does not see (a page's encoding, its uncompressed size) makes a reader fail rather than read other
    values: `moescope.store.Store` reads such a file through (`read_through`) when a query fails on it.
    A file that is not there is not bad (None): a snapshot's files are only gone once vacuumed.
    `data`: the file's bytes, when the caller holds them (checked from memory, nothing read).
    """
    try:
        with (pa.BufferReader(data) if data is not None else _open_input(path, filesystem)) as source:
            meta = pq.ParquetFile(source).metadata
            unchecked: list[tuple[int, str]] = []
            for group in range(meta.num_row_groups):
                row_group = meta.row_group(group)
                for index in range(row_group.num_columns):
                    chunk = row_group.column(index)
                    start = chunk.data_page_offset
                    first = chunk.dictionary_page_offset if chunk.has_dictionary_page else None
                    if first is not None and 0 < first < start:
                        start = first
                    source.seek(start)
                    problem, checked = _check_pages(source.read(chunk.total_compressed_size), chunk.num_values,
                                                    row_group.num_rows)
                    if problem is not None:
                        return f"column {chunk.path_in_schema!r} of row group {group}: {problem}"
                    if not checked:
                        unchecked.append((group, chunk.path_in_schema.split(".", 1)[0]))
            if unchecked:
                source.seek(0)
                return _read_through(pq.ParquetFile(source, page_checksum_verification=True), unchecked)
    except FileNotFoundError:
        return None
    except Exception as e:  # pyarrow raises several types for a damaged file
        return f"{type(e).__name__}: {e}"
    return None


def read_through(path: str, filesystem: Any = None, data: pa.Buffer | None = None) -> str | None:
    """Read a file through, every page decoded (and checked against its checksum where it has one);
    the error text, or None if it reads. Each column of each row group must read back as many rows as
    the footer says. Slower than `deep_check` (it decompresses and decodes every value), and it
    also fails on damage the checksums do not cover that stops a decoder. Arguments as `deep_check`'s."""
    try:
        with (pa.BufferReader(data) if data is not None else _open_input(path, filesystem)) as source:
            file = pq.ParquetFile(source, page_checksum_verification=True)
            everything = [(group, column) for group in range(file.metadata.num_row_groups)
                          for column in file.schema_arrow.names]
            return _read_through(file, everything)
    except FileNotFoundError:
        return None
    except Exception as e:  # pyarrow raises several types for a damaged file
        return f"{type(e).__name__}: {e}"


def _read_through(file: pq.ParquetFile, chunks: list[tuple[int, str]]) -> str | None:
    """Read the given (row group, top-level column) pairs through in batches (a wide row group is never
    held whole); the error text of a column that holds other rows than its footer says, or None."""
    for group, column in dict.fromkeys(chunks):
        expected = file.metadata.row_group(group).num_rows
        rows = sum(batch.num_rows for batch in file.iter_batches(batch_size=64 * 1024, row_groups=[group],
                                                                  columns=[column]))
        if rows != expected:
            return f"column {column!r} of row group {group} holds {rows} rows, its footer says {expected}"
    return None


# Parquet's page types (parquet.thrift PageType) and the PageHeader fields `_check_pages` reads.
_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 2, 3


def _check_pages(chunk: bytes, num_values: int, num_rows: int) -> tuple[str | None, bool]:
    """Walk one column chunk's pages: (the problem, or None; whether every page had a checksum).

    Each page header is read with `_ThriftReader` (Thrift's compact protocol, as parquet.thrift
    defines PageHeader); the page's bytes after it are checked against the header's crc (CRC-32 of
    the page as stored, compressed). The data pages' value counts (and, for v2 pages, row counts) must
    add up to the footer's, and the pages must fill the chunk exactly."""
    view = memoryview(chunk)
    at, values, rows, every_crc, rows_known = 0, 0, 0, True, True
    while at < len(view):
        header = _ThriftReader(view, at)
        fields = header.page_header()
        at = header.at
        size = fields.get(3)
        if not isinstance(size, int) or size < 0 or at + size > len(view):
            return f"a page at byte {at} of its chunk overruns it", every_crc
        crc = fields.get(4)
        if crc is None:
            every_crc = False
        elif zlib.crc32(view[at:at + size]) != crc & 0xFFFFFFFF:
            return "a page fails its CRC-32 checksum", every_crc
        kind = fields.get(1)
        if kind == _DATA_PAGE:
            values += fields.get(5, {}).get(1, 0)
            rows_known = False
        elif kind == _DATA_PAGE_V2:
            v2 = fields.get(8, {})
            values += v2.get(1, 0)
            rows += v2.get(3, 0)
        elif kind != _DICTIONARY_PAGE:
            return f"a page of unknown type {kind!r}", every_crc
        at += size
    if values != num_values:
        return f"its pages hold {values} values, its footer says {num_values}", every_crc
    if rows_known and values and rows != num_rows:
        return f"its pages hold {rows} rows, its footer says {num_rows}", every_crc
    return None, every_crc


class _ThriftReader:
    """Just enough of Thrift's compact protocol to read a Parquet PageHeader: the header's top-level
    integer fields, and the integer fields of its page-type structs (5, 7, 8); everything else skipped."""

    def __init__(self, data: memoryview, at: int):
        self.data, self.at = data, at

    def page_header(self) -> dict:
        return self._struct(depth=0)

    def _byte(self) -> int:
        if self.at >= len(self.data):
            raise ValueError("a page header runs past its column chunk")
        value = self.data[self.at]
        self.at += 1
        return value

    def _varint(self) -> int:
        shift = result = 0
        while True:
            byte = self._byte()
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise ValueError("a page header holds an integer too long")

    def _zigzag(self) -> int:
        value = self._varint()
        return (value >> 1) ^ -(value & 1)

    def _struct(self, depth: int) -> dict:
        if depth > 8:
            raise ValueError("a page header nests too deep")
        fields: dict = {}
        field = 0
        while True:
            byte = self._byte()
            kind = byte & 0x0F
            if kind == 0:  # STOP
                return fields
            field = field + (byte >> 4) if byte >> 4 else self._zigzag()
            if kind in (1, 2):  # a bool, its value in the type
                fields[field] = kind == 1
            elif kind in (3, 4, 5, 6):  # byte, i16, i32, i64
                fields[field] = self._byte() if kind == 3 else self._zigzag()
            elif kind == 12:  # a struct: the page-type headers are kept (their counts), the rest skipped
                inner = self._struct(depth + 1)
                if depth == 0:
                    fields[field] = inner
            else:
                self._skip(kind, depth)

    def _skip(self, kind: int, depth: int) -> None:
        if kind in (1, 2):
            return
        if kind == 3:
            self._byte()
        elif kind in (4, 5, 6):
            self._varint()
        elif kind == 7:  # double
            self._advance(8)
        elif kind == 8:  # binary
            self._advance(self._varint())
        elif kind in (9, 10):  # list, set
            head = self._byte()
            size = head >> 4 if head >> 4 != 15 else self._varint()
            for _ in range(size):
                self._skip_element(head & 0x0F, depth)
        elif kind == 11:  # map
            size = self._varint()
            if size:
                types = self._byte()
                for _ in range(size):
                    self._skip_element(types >> 4, depth)
                    self._skip_element(types & 0x0F, depth)
        elif kind == 12:
            self._struct(depth + 1)
        else:
            raise ValueError(f"a page header holds an unknown Thrift type {kind}")

    def _skip_element(self, kind: int, depth: int) -> None:
        if kind in (1, 2):  # a bool in a collection takes a byte
            self._byte()
        else:
            self._skip(kind, depth)

    def _advance(self, count: int) -> None:
        if self.at + count > len(self.data):
            raise ValueError("a page header runs past its column chunk")
        self.at += count


def read_checked(path: str, filesystem: Any = None) -> tuple[pa.Table | None, str | None]:
    """Read a whole file, checked as `deep_check` checks it: every page against its checksum, and
    each column of each row group read on its own must hold the rows the footer says. Returns
    (its rows, None), (None, the error text) for a bad file, or (None, None) when it is not there.
    For a caller that holds the file's rows anyway (compaction's merge): the check and the read are
    one pass through the file, not two.

    A file on object storage is fetched whole (one GET) and parsed from memory: read column by
    column from the bucket, each column chunk would be a ranged GET of its own (a 256 Ki-row routes
    file: about 25), which is most of a compaction's time through S3. The file's rows are held in
    memory anyway, and its compressed bytes are a fraction of them."""
    try:
        if filesystem is None:
            source = pa.OSFile(path)
        else:
            with filesystem.open_input_file(path) as remote:
                source = pa.BufferReader(remote.read_buffer())
        with source:
            file = pq.ParquetFile(source, page_checksum_verification=True)
            schema = file.schema_arrow
            groups = []
            for group in range(file.metadata.num_row_groups):
                expected = file.metadata.row_group(group).num_rows
                columns = []
                for column in schema.names:
                    data = file.read_row_group(group, columns=[column], use_threads=False).column(0)
                    if len(data) != expected:
                        return None, (f"column {column!r} of row group {group} holds {len(data)} rows, its footer "
                                      f"says {expected}")
                    columns.append(data)
                groups.append(pa.Table.from_arrays(columns, schema=schema))
            return (pa.concat_tables(groups) if groups else schema.empty_table()), None
    except FileNotFoundError:
        return None, None
    except Exception as e:  # pyarrow raises several types for a damaged file
        return None, f"{type(e).__name__}: {e}"


def _open_input(path: str, filesystem: Any) -> Any:
    if filesystem is None:
        return open(path, "rb")
    return filesystem.open_input_file(path)


def quarantine_path(location: StoreLocation, table: str, relative: str) -> str:
    """Where a table's file `relative` (`run_id=<id>/<name>`) is copied: a path of `location.filesystem()`."""
    return location.join(QUARANTINE_DIR, table, *relative.split("/"))


def display(location: StoreLocation, path: str) -> str:
    """A path of the location's filesystem as messages show it: local as is, object storage as a URL."""
    return path if location.is_local else f"{location.scheme}://{path}"


def copy_to_quarantine(location: StoreLocation, filesystem: Any, table: str, relative: str,
                       reason: str) -> str | None:
    """Copy a table's file into the quarantine folder with its reason; the copy's path (as messages
    show it), or None when it could not be copied (then the caller must leave the file in its table).

    Never raises for the storage: a file that is gone (vacuumed meanwhile) is left alone; one that
    cannot be copied (full or read-only disk, refused request) gets a warning saying it is skipped.
    A reason that cannot be saved beside a copy is in the warning only; no partial reason file is
    left behind. A copy already there (another reader found the file first) is kept, not doubled.
    """
    source = location.join(table, *relative.split("/"))
    target = quarantine_path(location, table, relative)
    shown = display(location, source)
    try:
        if location.is_local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
        if not _exists(filesystem, target):
            _copy(location, filesystem, source, target)
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn(f"moescope store: unreadable file {shown} could not be moved to quarantine ({e}); it stays in its "
              f"table and readers skip it ({reason}). Free space on the disk (or make the store writable) and open "
              f"the store again to move it.")
        return None
    moved_at = dt.datetime.now(dt.timezone.utc).isoformat()
    saved = _write_reason(filesystem, target, {"original_path": shown, "reason": reason, "moved_at": moved_at})
    copy = display(location, target)
    _warn(f"moescope store: unreadable file {shown} moved to {copy} ({reason}); it is out of its table and its rows "
          f"are counted as lost in probe_stats (reason 'quarantined')"
          + ("" if saved is None else f"; the reason could not be saved beside it: {saved}"))
    return copy


def _exists(filesystem: Any, path: str) -> bool:
    from pyarrow import fs as pafs

    return filesystem.get_file_info(path).type != pafs.FileType.NotFound


def _copy(location: StoreLocation, filesystem: Any, source: str, target: str) -> None:
    """Copy `source` to `target`. On a local disk a hard link (no space needed, so a full disk can
    still quarantine; the data stay when vacuum deletes the table's name), else a copy through a
    temporary name, so a crash leaves no half copy under the final name. Object storage writes an
    object whole or not at all."""
    if not location.is_local:
        filesystem.copy_file(source, target)
        return
    try:
        os.link(source, target)
        return
    except FileExistsError:
        return
    except FileNotFoundError:
        raise
    except OSError:
        pass  # a file system without hard links
    tmp = os.path.join(os.path.dirname(target), "." + os.path.basename(target) + ".inprogress")
    try:
        with open(source, "rb") as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _write_reason(filesystem: Any, target: str, reason: dict) -> OSError | None:
    """Write `<target>.reason.json` whole; the error, or None when it was written."""
    final = target + REASON_SUFFIX
    data = json.dumps(reason).encode()
    if isinstance(filesystem, _local_type()):
        tmp = os.path.join(os.path.dirname(target), "." + os.path.basename(final) + ".inprogress")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, final)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            return e
        return None
    try:
        with filesystem.open_output_stream(final) as f:
            f.write(data)
    except OSError as e:
        return e
    return None


def _local_type() -> type:
    from pyarrow import fs as pafs

    return pafs.LocalFileSystem


def _warn(message: str) -> None:
    log.warning(message)
    warnings.warn(message, BadFileWarning, stacklevel=4)


def quarantined(location: StoreLocation, filesystem: Any = None) -> list[QuarantinedFile]:
    """Every file in the store's quarantine folder, with why and when it was put there."""
    from pyarrow import fs as pafs

    filesystem = filesystem if filesystem is not None else location.filesystem()
    base = location.join(QUARANTINE_DIR)
    try:
        infos = filesystem.get_file_info(pafs.FileSelector(base, allow_not_found=True, recursive=True))
    except OSError as e:
        log.warning("moescope store: cannot list the quarantine folder %s: %s", display(location, base), e)
        return []
    names = {info.path for info in infos if info.type == pafs.FileType.File}
    found = []
    for path in sorted(names):
        name = path.rsplit("/", 1)[-1]
        if name.endswith(REASON_SUFFIX) or name.startswith("."):
            continue
        info: dict = {"original_path": "", "reason": "unknown (not saved: the disk may have been full)",
                      "moved_at": ""}
        if path + REASON_SUFFIX in names:
            try:
                with filesystem.open_input_stream(path + REASON_SUFFIX) as f:
                    info = json.loads(f.read())
            except (OSError, ValueError):
                pass
        found.append(QuarantinedFile(path=display(location, path), original_path=info.get("original_path", ""),
                                     reason=info.get("reason", ""), moved_at=info.get("moved_at", "")))
    return sorted(found, key=lambda q: q.path)
