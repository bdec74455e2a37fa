"""The stored form of one page: a small self-describing header, then the bytes.

Every backend that keeps bytes outside this process (file, redis) stores a page
as ``header + payload`` so that what comes back can be checked before it is
trusted::

    offset  size  field
    0       4     magic  b"TCKV"
    4       2     format version (1)
    6       2     length of the page format string   (F)
    8       2     length of the page key             (K)
    10      2     reserved (0)
    12      8     payload length in bytes
    20      4     CRC-32 of the payload
    24      4     CRC-32 of bytes 0..23 plus format and key
    28      F     page format (layout, dtype, shape, host layout; UTF-8)
    28+F    K     page key (UTF-8)
    28+F+K  ...   payload

The key inside the header means a file renamed or swapped under another key
is detected; the format means a page of another model, dtype or layout is
never read into this pool; the checksums catch torn and flipped bytes.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from tiercache.errors import StorageCorruptionError
from tiercache.memory.pages import PageBuffer

__all__ = [
    "HEADER_FIXED",
    "MAGIC",
    "VERSION",
    "PageHeader",
    "decode_header",
    "encode_header",
    "page_crc32",
    "check_header",
    "pack_page",
    "unpack_page",
]

MAGIC = b"TCKV"
VERSION = 1
_FIXED = struct.Struct("<4sHHHHQI")  # magic, version, F, K, reserved, payload len, payload crc
HEADER_FIXED = _FIXED.size + 4  # + header crc


@dataclass(frozen=True, slots=True)
class PageHeader:
    key: str
    format: str
    payload_len: int
    payload_crc: int
    header_len: int


def page_crc32(page: PageBuffer) -> int:
    """CRC-32 of a page's bytes, segment by segment (no join)."""
    crc = 0
    for seg in page.segments:
        crc = zlib.crc32(seg, crc)
    return crc


def encode_header(key: str, format: str, payload_len: int, payload_crc: int) -> bytes:
    fmt_b, key_b = format.encode(), key.encode()
    if len(fmt_b) > 0xFFFF or len(key_b) > 0xFFFF:
        raise ValueError("page format or key too long for the header")
    fixed = _FIXED.pack(MAGIC, VERSION, len(fmt_b), len(key_b), 0, payload_len, payload_crc)
    hcrc = zlib.crc32(key_b, zlib.crc32(fmt_b, zlib.crc32(fixed)))
    return fixed + struct.pack("<I", hcrc) + fmt_b + key_b


def decode_header(data: bytes | bytearray | memoryview) -> PageHeader:
    """Parse and verify a header at the start of ``data``.

    Raises:
        StorageCorruptionError: bad magic, version, lengths or header checksum,
            or ``data`` shorter than the header it announces.
    """
    mv = memoryview(data)
    if mv.nbytes < HEADER_FIXED:
        raise StorageCorruptionError(f"page header truncated ({mv.nbytes} bytes)")
    magic, version, flen, klen, _, plen, pcrc = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise StorageCorruptionError("not a tiercache page (bad magic)")
    if version != VERSION:
        raise StorageCorruptionError(f"unsupported page format version {version}")
    (hcrc,) = struct.unpack_from("<I", mv, _FIXED.size)
    end = HEADER_FIXED + flen + klen
    if mv.nbytes < end:
        raise StorageCorruptionError("page header truncated")
    fmt_b = bytes(mv[HEADER_FIXED : HEADER_FIXED + flen])
    key_b = bytes(mv[HEADER_FIXED + flen : end])
    if zlib.crc32(key_b, zlib.crc32(fmt_b, zlib.crc32(mv[: _FIXED.size]))) != hcrc:
        raise StorageCorruptionError("page header checksum mismatch")
    try:
        return PageHeader(key_b.decode(), fmt_b.decode(), plen, pcrc, end)
    except UnicodeDecodeError as e:
        raise StorageCorruptionError("page header is not valid UTF-8") from e


def pack_page(key: str, page: PageBuffer) -> list[bytes | memoryview]:
    """``[header, *segments]``: what to write, in order, to store ``page`` under ``key``."""
    return [encode_header(key, page.format, page.nbytes, page_crc32(page)), *page.segments]


def unpack_page(key: str, data: bytes | bytearray | memoryview, page: PageBuffer) -> None:
    """Verify a stored blob against ``key`` and ``page`` and copy its payload into ``page``.

    ``page`` is written only after every check has passed.

    Raises:
        StorageCorruptionError: wrong key, format or length, or bad checksum.
    """
    mv = memoryview(data).cast("B")
    h = decode_header(mv)
    check_header(h, key, page)
    payload = mv[h.header_len :]
    if payload.nbytes != h.payload_len:
        raise StorageCorruptionError(
            f"page {key}: payload is {payload.nbytes} bytes, header says {h.payload_len}"
        )
    if zlib.crc32(payload) != h.payload_crc:
        raise StorageCorruptionError(f"page {key}: payload checksum mismatch")
    page.write(payload)


def check_header(h: PageHeader, key: str, page: PageBuffer) -> None:
    """Raise `StorageCorruptionError` unless ``h`` describes ``key`` in ``page``'s format."""
    if h.key != key:
        raise StorageCorruptionError(f"stored page is {h.key!r}, expected {key!r} (file swapped?)")
    if h.format != page.format:
        raise StorageCorruptionError(
            f"page {key}: stored format {h.format!r} differs from {page.format!r}"
        )
    if h.payload_len != page.nbytes:
        raise StorageCorruptionError(
            f"page {key}: stored {h.payload_len} bytes, page holds {page.nbytes}"
        )
