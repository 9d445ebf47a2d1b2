"""A Parquet file whose footer lies: its uncompressed sizes rewritten in place (a hostile
`runs import` archive's samples). The footer is Thrift's compact protocol; each size is a
varint, rewritten to a smaller value in the same number of bytes (a varint padded with
continuation bytes, which readers accept), so no offset moves."""

from __future__ import annotations

import struct

# parquet.thrift: FileMetaData.row_groups (4) -> RowGroup.total_byte_size (2), and
# RowGroup.columns (1) -> ColumnChunk.meta_data (3) -> ColumnMetaData.total_uncompressed_size (6).
UNCOMPRESSED_SIZES = ((4, 2), (4, 1, 3, 6))
_STRUCT, _LIST, _SET, _MAP = 12, 9, 10, 11
_FIXED = {1: 0, 2: 0, 3: 1, 7: 8}  # bool true/false (in the header), byte, double


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _skip(data: bytes, pos: int, kind: int, path: tuple[int, ...], found: list) -> int:
    """Past one value of `kind` at `pos`; each integer's (path, start, end) into `found`."""
    if kind in _FIXED:
        return pos + _FIXED[kind]
    if kind in (4, 5, 6):  # i16, i32, i64: zigzag varints
        end = _varint(data, pos)[1]
        found.append((path, pos, end))
        return end
    if kind == 8:  # binary
        size, pos = _varint(data, pos)
        return pos + size
    if kind in (_LIST, _SET):
        header = data[pos]
        pos += 1
        size, element = header >> 4, header & 0x0F
        if size == 15:
            size, pos = _varint(data, pos)
        for _ in range(size):
            pos = 1 + pos if element in (1, 2) else _skip(data, pos, element, path, found)
        return pos
    if kind == _MAP:
        size, pos = _varint(data, pos)
        if size:
            types = data[pos]
            pos += 1
            for _ in range(size):
                pos = _skip(data, pos, types >> 4, path, found)
                pos = _skip(data, pos, types & 0x0F, path, found)
        return pos
    if kind == _STRUCT:
        field = 0
        while True:
            header = data[pos]
            pos += 1
            if header == 0:
                return pos
            delta, element = header >> 4, header & 0x0F
            if delta:
                field += delta
            else:
                zigzag, pos = _varint(data, pos)
                field = (zigzag >> 1) ^ -(zigzag & 1)
            pos = _skip(data, pos, element, (*path, field), found)
    raise ValueError(f"unknown compact type {kind}")


def understate_sizes(parquet: bytes, to: int = 1) -> bytes:
    """`parquet` with the footer's uncompressed sizes (each row group's and each column
    chunk's) all said to be `to` bytes; the pages, and so the data, unchanged."""
    length = struct.unpack_from("<I", parquet, len(parquet) - 8)[0]
    start = len(parquet) - 8 - length
    found: list = []
    _skip(parquet, start, _STRUCT, (), found)
    out = bytearray(parquet)
    rewritten = 0
    for path, begin, end in found:
        if path in UNCOMPRESSED_SIZES:
            zigzag = to << 1
            for i in range(begin, end - 1):
                out[i] = (zigzag & 0x7F) | 0x80
                zigzag >>= 7
            out[end - 1] = zigzag
            rewritten += 1
    if not rewritten:
        raise ValueError("no uncompressed size found in the footer")
    return bytes(out)
