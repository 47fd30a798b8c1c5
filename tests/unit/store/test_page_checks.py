"""`deep_check` sums every page against its CRC-32 without decoding it: each byte of a page's data is
covered, a page header's value count is held to the footer's, and pages written without a checksum
are read through instead. The damage is placed from the file's own layout, found here by reading the
raw bytes with an independent walk (the page headers' sizes taken from pyarrow's own page index
reader would be the same code under test, so this walk asks only the column chunk's offsets)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moescope.store.quarantine import deep_check, read_through


def _write(path, checksums: bool = True) -> pq.FileMetaData:
    rng = np.random.default_rng(0)
    table = pa.table({
        "step": pa.array(np.arange(20_000) // 100, pa.int64()),
        "weight": pa.array(rng.random(20_000), pa.float32()),
        "experts": pa.array([[int(a), int(b)] for a, b in rng.integers(0, 64, (20_000, 2))], pa.list_(pa.int16())),
        "tag": pa.array(rng.choice(["code", "prose", "math"], 20_000)),
    })
    pq.write_table(table, path, row_group_size=8_000, data_page_size=16 * 1024, compression="zstd",
                   write_page_checksum=checksums, use_dictionary=["tag"])
    return pq.read_metadata(path)


def _chunks(meta: pq.FileMetaData):
    for group in range(meta.num_row_groups):
        for column in range(meta.num_columns):
            chunk = meta.row_group(group).column(column)
            start = chunk.data_page_offset
            if chunk.has_dictionary_page and chunk.dictionary_page_offset:
                start = min(start, chunk.dictionary_page_offset)
            yield group, chunk, start, start + chunk.total_compressed_size


def _flip(path, at: int, bit: int = 0):
    data = bytearray(path.read_bytes())
    data[at] ^= 1 << bit
    path.write_bytes(bytes(data))


def test_an_intact_file_passes(tmp_path):
    path = tmp_path / "f.parquet"
    _write(path)
    assert deep_check(str(path)) is None
    assert deep_check("", data=pa.py_buffer(path.read_bytes())) is None  # from memory too
    assert read_through(str(path)) is None


def test_the_last_byte_of_every_column_chunk_is_covered(tmp_path):
    """The last byte of a chunk is page data (the headers come first): a flipped bit there fails its CRC."""
    path = tmp_path / "f.parquet"
    meta = _write(path)
    pristine = path.read_bytes()
    for group, chunk, _, end in _chunks(meta):
        path.write_bytes(pristine)
        _flip(path, end - 1, bit=3)
        problem = deep_check(str(path))
        assert problem is not None and "CRC-32" in problem, (group, chunk.path_in_schema, problem)
        assert chunk.path_in_schema in problem


def test_a_value_count_in_a_page_header_is_held_to_the_footer(tmp_path):
    """A data page header's num_values (not covered by the CRC) changed by one: the chunk's pages no
    longer add up to the footer's count. Found by searching the chunk's header bytes for the Thrift
    field (data_page_header, field 5, then num_values, field 1, a zigzag varint) with the count the
    page must hold, computed independently: the chunk's rows here fit one page for `step`."""
    path = tmp_path / "f.parquet"
    pq.write_table(pa.table({"step": pa.array(np.arange(300), pa.int64())}), path, write_page_checksum=True,
                   use_dictionary=False, compression="none")
    pristine = path.read_bytes()
    [(_, chunk, start, end)] = list(_chunks(pq.read_metadata(path)))
    assert chunk.num_values == 300
    # after the crc (field 4): field 5, a struct (0x1c: delta 1, type 12), whose field 1 is an i32 (0x15)
    # holding 300 as a zigzag varint: 600 = 0xD8 0x04
    field = pristine.index(b"\x1c\x15\xd8\x04", start, end)
    damaged = bytearray(pristine)
    damaged[field + 2] ^= 0x02  # 600 -> 602 in zigzag: 301 values
    path.write_bytes(bytes(damaged))
    problem = deep_check(str(path))
    assert problem is not None and "301 values" in problem and "300" in problem, problem


def test_pages_without_checksums_are_read_through(tmp_path):
    """With no CRC to hold them to, a chunk's pages are decoded: compressed data scrambled fails there."""
    path = tmp_path / "f.parquet"
    meta = _write(path, checksums=False)
    assert deep_check(str(path)) is None
    _, chunk, start, end = next(c for c in _chunks(meta) if c[1].path_in_schema == "weight")
    data = bytearray(path.read_bytes())
    data[end - 200:end] = np.random.default_rng(1).integers(0, 256, 200, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(Exception):  # noqa: B017 (pyarrow raises several types) the damage stops a decoder ...
        pq.read_table(path)
    assert deep_check(str(path)) is not None  # ... and the check, which decoded the unchecked chunk


@pytest.mark.parametrize("cut", [1, 100, 5000])
def test_a_truncated_file_fails(tmp_path, cut):
    path = tmp_path / "f.parquet"
    _write(path)
    path.write_bytes(path.read_bytes()[:-cut])
    assert deep_check(str(path)) is not None
