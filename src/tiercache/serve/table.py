"""`PageTable`: which key lives where in the arena, and who holds which page.

Synchronous and loop-free (the server calls it from its event loop and never
awaits halfway through an update).
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tiercache.errors import InvalidInputError, StateError

__all__ = ["Hold", "Outcome", "PageTable", "TableStats"]


class _State(enum.Enum):
    WRITING = "writing"  # reserved: blocks taken, bytes arriving, invisible
    READY = "ready"  # committed: visible to exists and lease


@dataclass(slots=True, eq=False)
class _Page:
    key: str
    blocks: list[int]
    nbytes: int
    format: str
    state: _State
    leases: int = 0
    #: ``(offset, length)`` runs of the page in the arena, computed once.
    extents: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class _Holder:
    reservations: dict[int, _Page] = field(default_factory=dict)
    leases: dict[int, _Page] = field(default_factory=dict)


class Outcome(enum.Enum):
    """What `PageTable.reserve` and `PageTable.lease` did."""

    NEW = "new"  # reserve: blocks reserved for the writer
    HAVE = "have"  # reserve: the key is held already (first writer wins)
    BUSY = "busy"  # reserve: another holder is writing the key now
    FULL = "full"  # reserve: no room, every evictable page is leased
    HIT = "hit"  # lease: the page is leased to the caller
    MISS = "miss"  # lease: not held (or still being written)
    MISMATCH = "mismatch"  # lease: held, but of another format or length


@dataclass(frozen=True, slots=True)
class Hold:
    """The answer of `PageTable.reserve` / `PageTable.lease` for one page.

    ``ident`` is the reservation or lease id (``NEW`` / ``HIT``), ``blocks``
    the page's blocks in order and ``extents`` the byte runs they make
    (adjacent blocks merged); for ``MISMATCH``, ``format`` and ``nbytes`` are
    the held page's.
    """

    outcome: Outcome
    ident: int = 0
    blocks: tuple[int, ...] = ()
    extents: tuple[tuple[int, int], ...] = ()
    format: str = ""
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class TableStats:
    blocks: int
    free_blocks: int
    pages: int
    writing: int
    leases: int
    leased_pages: int
    evictions: int
    holders: int


class PageTable:
    """The arena's index and its lease table.

    Every page is in exactly one state: **free blocks** (on the free list),
    **writing** (reserved by one holder: taken, invisible, reclaimed if the
    holder goes), or **ready** (in the index, visible). A ready page has a
    count of read leases; with none it sits in the LRU and may be evicted to
    make room, with one or more it may not. A *holder* is one client
    connection (or the server's own write-behind and read-through work);
    everything it holds is listed under it, so `drop_holder` gives all of it
    back in one call whatever the holder was doing.

    The index is a dict from key to page; the LRU an ``OrderedDict`` of the
    unleased ready pages (a release is ``move_to_end``, an eviction
    ``popitem(last=False)``, both O(1)); the free list a stack of block
    numbers, pushed in descending order so that a fresh arena hands out
    ascending, adjacent blocks (one extent per page).

    Only the owner of a reservation or lease may end it: `commit`, `abort`
    and `release` check every id of a call before they change anything
    (`InvalidInputError`), so a refused call leaves the table as it was.

    Args:
        blocks: how many blocks the arena has.
        block_bytes: the size of one block.
    """

    def __init__(self, blocks: int, block_bytes: int) -> None:
        if blocks < 1 or block_bytes < 1:
            raise InvalidInputError(f"an arena needs blocks >= 1, got {blocks} of {block_bytes}")
        self.blocks = blocks
        self.block_bytes = block_bytes
        self._free: list[int] = list(range(blocks - 1, -1, -1))
        self._index: dict[str, _Page] = {}
        self._lru: OrderedDict[str, _Page] = OrderedDict()
        self._holders: dict[int, _Holder] = {}
        self._ids = itertools.count(1)
        self._leases = 0
        self._leased_pages = 0
        self._writing = 0
        self.evictions = 0

    # -- holders -------------------------------------------------------------

    def add_holder(self) -> int:
        """A new holder id (a client connection, or the server's own work)."""
        hid = next(self._ids)
        self._holders[hid] = _Holder()
        return hid

    def drop_holder(self, holder: int) -> tuple[int, int]:
        """Give back everything ``holder`` holds; returns ``(reservations, leases)`` reclaimed.

        Reserved pages are freed (they were never visible); leases are
        released (the pages stay, evictable again when no one else leases them).
        """
        h = self._holders.pop(holder, None)
        if h is None:
            return 0, 0
        for page in h.reservations.values():
            del self._index[page.key]
            self._free_page(page)
            self._writing -= 1
        for page in h.leases.values():
            self._unlease(page)
        return len(h.reservations), len(h.leases)

    def _holder(self, holder: int) -> _Holder:
        h = self._holders.get(holder)
        if h is None:
            raise InvalidInputError(f"holder {holder} is not known")
        return h

    # -- lookups -------------------------------------------------------------

    def exists(self, keys: list[str]) -> int:
        """How many of ``keys``, counted from the first, are ready (not a use: LRU unchanged)."""
        n = 0
        for k in keys:
            p = self._index.get(k)
            if p is None or p.state is not _State.READY:
                break
            n += 1
        return n

    def shape(self, key: str) -> tuple[int, str]:
        """``(nbytes, format)`` of ``key``'s page (reserved or ready).

        Raises:
            KeyError: the key is not held.
        """
        p = self._index[key]
        return p.nbytes, p.format

    def blocks_for(self, nbytes: int) -> int:
        """Blocks a page of ``nbytes`` takes."""
        return max(1, -(-nbytes // self.block_bytes))

    # -- writing -------------------------------------------------------------

    def reserve(self, holder: int, key: str, nbytes: int, format: str) -> Hold:
        """Reserve room for ``key``'s page, evicting unleased pages least recently used first.

        Returns:
            ``NEW`` with the reservation id and blocks; ``HAVE`` when the key
            is ready already; ``BUSY`` while another holder writes it;
            ``FULL`` when no room can be made (every evictable page is
            leased or being written).

        Raises:
            InvalidInputError: an unknown holder, or a page larger than the arena.
        """
        h = self._holder(holder)
        need = self.blocks_for(nbytes)
        if need > self.blocks:
            raise InvalidInputError(
                f"a page of {nbytes} bytes is larger than the arena "
                f"({self.blocks} blocks of {self.block_bytes})"
            )
        p = self._index.get(key)
        if p is not None:
            return Hold(Outcome.HAVE if p.state is _State.READY else Outcome.BUSY)
        while len(self._free) < need and self._lru:
            _, victim = self._lru.popitem(last=False)
            del self._index[victim.key]
            self._free_page(victim)
            self.evictions += 1
        if len(self._free) < need:
            return Hold(Outcome.FULL)
        blocks = [self._free.pop() for _ in range(need)]
        page = _Page(key, blocks, nbytes, format, _State.WRITING)
        page.extents = self._extents(blocks, nbytes)
        rid = next(self._ids)
        h.reservations[rid] = page
        self._index[key] = page
        self._writing += 1
        return Hold(Outcome.NEW, rid, tuple(blocks), page.extents)

    def commit(self, holder: int, rids: list[int]) -> list[str]:
        """Make reserved pages visible; returns their keys.

        Raises:
            InvalidInputError: an id ``holder`` does not hold (nothing changed).
        """
        h = self._holder(holder)
        self._check_held(h.reservations, rids, "reservation")
        keys = []
        for rid in rids:
            page = h.reservations.pop(rid)
            page.state = _State.READY
            self._writing -= 1
            self._lru[page.key] = page
            keys.append(page.key)
        return keys

    def abort(self, holder: int, rids: list[int]) -> None:
        """Drop reservations: their blocks are free again, their keys unknown.

        Raises:
            InvalidInputError: an id ``holder`` does not hold (nothing changed).
        """
        h = self._holder(holder)
        self._check_held(h.reservations, rids, "reservation")
        for rid in rids:
            page = h.reservations.pop(rid)
            del self._index[page.key]
            self._free_page(page)
            self._writing -= 1

    # -- reading -------------------------------------------------------------

    def lease(self, holder: int, key: str, nbytes: int, format: str) -> Hold:
        """Lease ``key``'s page for reading: it is neither evicted nor reused until released.

        Returns:
            ``HIT`` with the lease id and blocks; ``MISS`` when the key is
            not ready; ``MISMATCH`` when it is held in another format or length.

        Raises:
            InvalidInputError: an unknown holder.
        """
        h = self._holder(holder)
        p = self._index.get(key)
        if p is None or p.state is not _State.READY:
            return Hold(Outcome.MISS)
        if p.format != format or p.nbytes != nbytes:
            return Hold(Outcome.MISMATCH, format=p.format, nbytes=p.nbytes)
        if p.leases == 0:
            del self._lru[key]
            self._leased_pages += 1
        p.leases += 1
        self._leases += 1
        lid = next(self._ids)
        h.leases[lid] = p
        return Hold(Outcome.HIT, lid, tuple(p.blocks), p.extents)

    def release(self, holder: int, lids: list[int]) -> None:
        """End read leases; a page no one leases becomes the most recently used.

        Raises:
            InvalidInputError: an id ``holder`` does not hold (nothing changed).
        """
        h = self._holder(holder)
        self._check_held(h.leases, lids, "lease")
        for lid in lids:
            self._unlease(h.leases.pop(lid))

    # -- removal -------------------------------------------------------------

    def delete(self, keys: list[str]) -> int:
        """Remove the ready, unleased pages of ``keys``; returns how many."""
        n = 0
        for k in keys:
            p = self._lru.pop(k, None)
            if p is not None:
                del self._index[k]
                self._free_page(p)
                n += 1
        return n

    def clear(self) -> int:
        """Remove every ready, unleased page; returns how many."""
        return self.delete(list(self._lru))

    def ready_pages(self) -> list[tuple[str, tuple[int, ...], int, str]]:
        """``(key, blocks, nbytes, format)`` of every ready page, least recently used first."""
        leased = [p for p in self._index.values() if p.state is _State.READY and p.leases]
        return [
            (p.key, tuple(p.blocks), p.nbytes, p.format) for p in (*leased, *self._lru.values())
        ]

    def restore(self, pages: list[tuple[str, tuple[int, ...], int, str]]) -> None:
        """Adopt ready pages into an empty table (a restarted server's arena), oldest first.

        Raises:
            StateError: the table already holds pages.
            InvalidInputError: a key twice, a block twice or out of range, or
                blocks too few for a page (nothing is adopted).
        """
        if self._index:
            raise StateError("pages can only be restored into an empty table")
        seen: set[int] = set()
        keys: set[str] = set()
        for key, blocks, nbytes, _ in pages:
            if key in keys or len(blocks) != self.blocks_for(nbytes):
                raise InvalidInputError(f"page {key}: a key twice or the wrong block count")
            for b in blocks:
                if not 0 <= b < self.blocks or b in seen:
                    raise InvalidInputError(f"page {key}: block {b} is out of range or taken")
                seen.add(b)
            keys.add(key)
        for key, blocks, nbytes, fmt in pages:
            page = _Page(key, list(blocks), nbytes, fmt, _State.READY)
            page.extents = self._extents(blocks, nbytes)
            self._index[key] = page
            self._lru[key] = page
        self._free = [b for b in range(self.blocks - 1, -1, -1) if b not in seen]

    def stats(self) -> TableStats:
        ready = len(self._index) - self._writing
        return TableStats(
            blocks=self.blocks,
            free_blocks=len(self._free),
            pages=ready,
            writing=self._writing,
            leases=self._leases,
            leased_pages=self._leased_pages,
            evictions=self.evictions,
            holders=len(self._holders),
        )

    # -- internals -----------------------------------------------------------

    def _extents(self, blocks: Sequence[int], nbytes: int) -> tuple[tuple[int, int], ...]:
        """The byte runs of a page of ``nbytes`` in ``blocks``, adjacent blocks merged."""
        bb = self.block_bytes
        runs: list[tuple[int, int]] = []
        start = prev = blocks[0]
        for b in blocks[1:]:
            if b != prev + 1:
                runs.append((start * bb, (prev - start + 1) * bb))
                start = b
            prev = b
        runs.append((start * bb, (prev - start + 1) * bb))
        cut = len(blocks) * bb - nbytes  # the last block is partly used
        off, n = runs[-1]
        runs[-1] = (off, n - cut)
        return tuple(runs)

    @staticmethod
    def _check_held(held: dict[int, _Page], ids: list[int], what: str) -> None:
        if len(set(ids)) != len(ids):
            raise InvalidInputError(f"a {what} id appears twice in one request")
        for i in ids:
            if i not in held:
                raise InvalidInputError(f"{what} {i} is not held by this client")

    def _unlease(self, page: _Page) -> None:
        page.leases -= 1
        self._leases -= 1
        if page.leases == 0:
            self._leased_pages -= 1
            self._lru[page.key] = page  # most recently used

    def _free_page(self, page: _Page) -> None:
        self._free.extend(reversed(page.blocks))
        page.blocks = []
