"""Keeping an arena across a server restart: an index of its pages, checked on the way back.

With ``keep_arena``, a server that shuts down cleanly leaves its arena file
in place and writes beside it an *index*: one record per ready page, the
page's header in today's checksummed page format
(`tiercache.storage.format.encode_header`: key, page format, length, XXH3 of
the payload, and a checksum of the header itself) followed by the arena
blocks that hold it. A server started on the same arena with ``keep_arena``
reads the index, deletes it at once (from then on the arena changes and the
index would lie), and adopts each page whose header decodes, whose blocks
are in range, of the right count and no other page's, and whose payload
still has the checksum the header recorded. Anything else is dropped and
counted. A server that did not shut down cleanly (``kill -9``) leaves no
index, so the next one starts empty: only a clean stop vouches for the bytes.

The checksums are computed once at shutdown and once at start-up, never on
the request path. Everything here is blocking (file I/O, hashing): run it in
a worker thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import msgpack

from tiercache.errors import StorageCorruptionError
from tiercache.serve.arena import Arena, extents_of
from tiercache.storage.format import decode_header, encode_header, page_checksum

__all__ = ["KeptPage", "index_path", "load_index", "save_index"]

logger = logging.getLogger(__name__)

_VERSION = 1


@dataclass(frozen=True, slots=True)
class KeptPage:
    """A ready page as the index records it."""

    key: str
    blocks: tuple[int, ...]
    nbytes: int
    format: str


def index_path(arena_path: str) -> str:
    """Where the index of the arena at ``arena_path`` is kept."""
    return arena_path + ".index"


def save_index(arena: Arena, block_bytes: int, pages: list[KeptPage]) -> int:
    """Write the index of ``pages`` beside ``arena`` (atomically, mode 0600); returns its length."""
    records = []
    for p in pages:
        page = arena.page(extents_of(p.blocks, block_bytes, p.nbytes), p.format)
        header = encode_header(p.key, p.format, p.nbytes, page_checksum(page))
        records.append([header, list(p.blocks)])
    data = msgpack.packb(
        {
            "version": _VERSION,
            "arena_bytes": arena.nbytes,
            "block_bytes": block_bytes,
            "pages": records,
        },
        use_bin_type=True,
    )
    path = index_path(arena.path)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return len(records)


def load_index(arena: Arena, block_bytes: int) -> tuple[list[KeptPage], int]:
    """Read and delete the index beside ``arena``; returns the intact pages and how many were dropped.

    An index that is missing, unreadable or made for another arena size or
    block size gives no pages.
    """
    path = index_path(arena.path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return [], 0
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    try:
        doc = msgpack.unpackb(raw, raw=False)
        ok = (
            isinstance(doc, dict)
            and doc.get("version") == _VERSION
            and doc.get("arena_bytes") == arena.nbytes
            and doc.get("block_bytes") == block_bytes
            and isinstance(doc.get("pages"), list)
        )
    except (ValueError, msgpack.ExtraData, msgpack.StackError) as e:
        logger.warning("arena index %s is unreadable (%r): starting empty", path, e)
        return [], 0
    if not ok:
        logger.warning("arena index %s is of another arena: starting empty", path)
        return [], 0
    kept: list[KeptPage] = []
    taken: set[int] = set()
    dropped = 0
    for record in doc["pages"]:
        page = _check(arena, block_bytes, record, taken)
        if page is None:
            dropped += 1
        else:
            kept.append(page)
            taken.update(page.blocks)
    return kept, dropped


def _check(arena: Arena, block_bytes: int, record: object, taken: set[int]) -> KeptPage | None:
    """The page ``record`` describes, if its header, blocks and payload checksum hold."""
    if not (isinstance(record, list) and len(record) == 2 and isinstance(record[0], bytes)):
        return None
    header, blocks = record
    try:
        h = decode_header(header)
    except StorageCorruptionError:
        return None
    nblocks = arena.nbytes // block_bytes
    if not (
        isinstance(blocks, list)
        and len(blocks) == max(1, -(-h.payload_len // block_bytes))
        and all(isinstance(b, int) and 0 <= b < nblocks and b not in taken for b in blocks)
        and len(set(blocks)) == len(blocks)
    ):
        return None
    page = arena.page(extents_of(blocks, block_bytes, h.payload_len), h.format)
    if page_checksum(page) != h.payload_sum:
        return None
    return KeptPage(h.key, tuple(blocks), h.payload_len, h.format)
