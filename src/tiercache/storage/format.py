"""The stored form of one page: a small self-describing header, then the bytes.

Every backend that keeps bytes outside this process (file, redis) stores a page
as ``header + payload`` so that what comes back can be checked before it is
trusted::

    offset    size  field
    0         4     magic  b"TCKV"
    4         2     format version (3)
    6         2     length of the page format string   (F)
    8         2     length of the page key             (K)
    10        2     padding after the key              (P)
    12        8     payload length in bytes
    20        8     XXH3-64 of the payload
    28        8     XXH3-64 of bytes 0..27 plus format, key and padding
    36        F     page format (layout, dtype, shape, host layout; UTF-8)
    36+F      K     page key (UTF-8)
    36+F+K    P     zeros
    36+F+K+P  ...   payload

The padding lets a backend start the payload where it likes: the file backend
pads the header to 4 KiB (``align=4096``), so that the payload of a page file
sits on page-cache page boundaries and a read copies it into a page-aligned
host page with source and destination equally aligned (with the payload at an
odd offset the same ``preadv`` costs about 1.5x as much); the Redis backend
stores no padding (``align=1``). The header checksum covers the padding too,
so that every stored byte is checked.

The key inside the header means a file renamed or swapped under another key
is detected; the format means a page of another model, dtype or layout is
never read into this pool; the checksums catch torn and flipped bytes.

The checksum is XXH3-64 from the ``xxhash`` package: about 30 GB/s on one
core (CRC-32 from ``zlib`` does about 2 GB/s, hardware CRC32C 5-8 GB/s on the
same machine), it releases the GIL, and it hashes a page's segments in place,
so verifying a page costs a small fraction of reading it. Pages of versions 1
(CRC-32) and 2 (no padding field) are not read: `is_older_version` tells them
apart so that a backend can drop them as plain misses; the next write of the
same key stores it anew. A page of a later version (written by an upgraded
process sharing the store, during a rolling upgrade) is a miss too, but
`is_newer_version` lets a backend keep it: it is no damage, and the upgraded
processes still read it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from tiercache.errors import InvalidInputError, StorageCorruptionError
from tiercache.memory.pages import PageBuffer

__all__ = [
    "HEADER_FIXED",
    "MAGIC",
    "VERSION",
    "PageHeader",
    "decode_header",
    "encode_header",
    "header_size",
    "is_newer_version",
    "is_older_version",
    "page_checksum",
    "check_header",
    "check_target",
    "pack_page",
    "unpack_page",
    "verify_in_place",
]

MAGIC = b"TCKV"
VERSION = 3
_FIXED = struct.Struct("<4sHHHHQQ")  # magic, version, F, K, P, payload len, payload sum
_SUM = struct.Struct("<Q")
HEADER_FIXED = _FIXED.size + _SUM.size  # + header checksum


@dataclass(frozen=True, slots=True)
class PageHeader:
    key: str
    format: str
    payload_len: int
    payload_sum: int
    header_len: int


def page_checksum(page: PageBuffer) -> int:
    """XXH3-64 of a page's bytes, segment by segment, in place (no join, no copy).

    Releases the GIL while it hashes: safe to call from worker threads.
    """
    if len(page.segments) == 1:
        return int(xxhash.xxh3_64_intdigest(page.segments[0]))
    h = xxhash.xxh3_64()
    for seg in page.segments:
        h.update(seg)
    return int(h.intdigest())


def _header_sum(
    fixed: bytes | memoryview, fmt_b: bytes, key_b: bytes, padding: bytes | memoryview
) -> int:
    h = xxhash.xxh3_64(fixed)
    h.update(fmt_b)
    h.update(key_b)
    h.update(padding)
    return int(h.intdigest())


def header_size(key: str, format: str, align: int = 1) -> int:
    """Bytes of the header that `encode_header` writes for ``key``, ``format`` and ``align``.

    This is also the offset of the payload: the header's length rounded up
    to a multiple of ``align``.
    """
    return _padded(HEADER_FIXED + len(format.encode()) + len(key.encode()), align)


def _padded(n: int, align: int) -> int:
    return -(-n // align) * align


def encode_header(
    key: str, format: str, payload_len: int, payload_sum: int, align: int = 1
) -> bytes:
    """The header of a page, zero-padded to a multiple of ``align`` bytes.

    Raises:
        ValueError: the format or key is longer than 65,535 bytes, or the
            padding ``align`` asks for is (``align`` above 65,536).
    """
    fmt_b, key_b = format.encode(), key.encode()
    if len(fmt_b) > 0xFFFF or len(key_b) > 0xFFFF:
        raise ValueError("page format or key too long for the header")
    end = HEADER_FIXED + len(fmt_b) + len(key_b)
    pad = _padded(end, align) - end
    if pad > 0xFFFF:
        raise ValueError(f"cannot pad a page header to a multiple of {align} bytes")
    fixed = _FIXED.pack(MAGIC, VERSION, len(fmt_b), len(key_b), pad, payload_len, payload_sum)
    padding = bytes(pad)
    return fixed + _SUM.pack(_header_sum(fixed, fmt_b, key_b, padding)) + fmt_b + key_b + padding


def _version(data: bytes | bytearray | memoryview) -> int:
    """The format version ``data`` starts with; 0 when it does not start like a page."""
    mv = memoryview(data)
    if mv.nbytes < 6 or bytes(mv[:4]) != MAGIC:
        return 0
    (version,) = struct.unpack_from("<H", mv, 4)
    return int(version)


def is_older_version(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` starts like a page of an earlier format version (stale, not damaged)."""
    return 0 < _version(data) < VERSION


def is_newer_version(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` starts like a page of a later format version (unreadable here, not damaged)."""
    return _version(data) > VERSION


def decode_header(data: bytes | bytearray | memoryview) -> PageHeader:
    """Parse and verify a header at the start of ``data``.

    ``data`` needs to hold the whole header, padding included (the header
    checksum covers it). The result's ``header_len`` is the payload's offset.

    Raises:
        StorageCorruptionError: bad magic, version, lengths or header checksum,
            or ``data`` shorter than the header it announces.
    """
    mv = memoryview(data)
    if mv.nbytes < HEADER_FIXED:
        raise StorageCorruptionError(f"page header truncated ({mv.nbytes} bytes)")
    magic, version, flen, klen, pad, plen, psum = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise StorageCorruptionError("not a tiercache page (bad magic)")
    if version != VERSION:
        raise StorageCorruptionError(f"unsupported page format version {version}")
    (hsum,) = _SUM.unpack_from(mv, _FIXED.size)
    end = HEADER_FIXED + flen + klen
    if mv.nbytes < end + pad:
        raise StorageCorruptionError("page header truncated")
    # The sum covers the fixed fields, then format, key and padding: the two
    # runs either side of the stored sum, hashed in place.
    h = xxhash.xxh3_64(mv[: _FIXED.size])
    h.update(mv[HEADER_FIXED : end + pad])
    if h.intdigest() != hsum:
        raise StorageCorruptionError("page header checksum mismatch")
    fmt_b = bytes(mv[HEADER_FIXED : HEADER_FIXED + flen])
    key_b = bytes(mv[HEADER_FIXED + flen : end])
    try:
        return PageHeader(key_b.decode(), fmt_b.decode(), plen, psum, end + pad)
    except UnicodeDecodeError as e:
        raise StorageCorruptionError("page header is not valid UTF-8") from e


def pack_page(key: str, page: PageBuffer, align: int = 1) -> list[bytes | memoryview]:
    """``[header, *segments]``: what to write, in order, to store ``page`` under ``key``.

    The header is padded to a multiple of ``align`` bytes (see `encode_header`).
    """
    header = encode_header(key, page.format, page.nbytes, page_checksum(page), align)
    return [header, *page.segments]


def unpack_page(key: str, data: bytes | bytearray | memoryview, page: PageBuffer) -> None:
    """Verify a stored blob against ``key`` and ``page`` and copy its payload into ``page``.

    ``page`` is written only after every check has passed.

    Raises:
        StorageCorruptionError: the blob is damaged: bad header, another
            key, a payload of another length than its header says, or a bad
            checksum.
        InvalidInputError: the blob is ``key``'s intact page, but of another
            format or length than ``page`` (see `check_header`).
    """
    mv = memoryview(data).cast("B")
    h = decode_header(mv)
    check_header(h, key, page)
    payload = mv[h.header_len :]
    if payload.nbytes != h.payload_len:
        raise StorageCorruptionError(
            f"page {key}: payload is {payload.nbytes} bytes, header says {h.payload_len}"
        )
    if xxhash.xxh3_64_intdigest(payload) != h.payload_sum:
        raise StorageCorruptionError(f"page {key}: payload checksum mismatch")
    page.write(payload)


def verify_in_place(key: str, h: PageHeader, page: PageBuffer) -> None:
    """Check a payload already read into ``page`` against its header's checksum.

    For backends that read straight into the destination: the caller must
    treat ``page`` as garbage (never publish it) when this raises.

    Raises:
        StorageCorruptionError: the payload checksum differs.
    """
    if page_checksum(page) != h.payload_sum:
        raise StorageCorruptionError(f"page {key}: payload checksum mismatch")


def check_header(h: PageHeader, key: str, page: PageBuffer) -> None:
    """Check that ``h``, a header that passed `decode_header`, is ``key``'s page in ``page``'s format.

    The two failures differ in whose they are. A header of another key is
    damage in the store (a file swapped, a value copied). An intact header
    of ``key`` whose format or length differ from ``page``'s is a good page
    read into the wrong buffer (another model shape, dtype, host layout or
    page size; keys carry all of them, so the store holds the right page):
    the caller's mistake, and the page must stay stored.

    Raises:
        StorageCorruptionError: ``h`` is the header of another key.
        InvalidInputError: ``h`` is ``key``'s, but ``page`` has another
            format or length.
    """
    if h.key != key:
        raise StorageCorruptionError(f"stored page is {h.key!r}, expected {key!r} (file swapped?)")
    check_target(key, h.format, h.payload_len, page)


def check_target(key: str, stored_format: str, stored_nbytes: int, page: PageBuffer) -> None:
    """Check that ``page`` can take ``key``'s stored page of that format and length.

    Raises:
        InvalidInputError: ``page`` has another format or length (the
            caller's mistake: nothing is wrong with the stored page).
    """
    if stored_format != page.format or stored_nbytes != page.nbytes:
        raise InvalidInputError(
            f"page {key} is stored as {stored_format!r} ({stored_nbytes} bytes) but the target "
            f"is {page.format!r} ({page.nbytes} bytes): read it into a buffer of its format"
        )
