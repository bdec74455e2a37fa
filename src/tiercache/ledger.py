"""`Ledger`: who owns every page of a pool while it is in flight, and what a copy must wait for.

One object per pool (`PoolLedger`) keeps, in numpy arrays indexed by page id:

- the page's **owner**: free, a caller (slots handed out by a verb), a
  request (`Request.alloc`), or the index (cached KV);
- its **leases**: copies and storage calls that read it, device<->host copies
  that fill it, storage prefetches that fill it. A leased page is never
  freed, and a page being filled is never read;
- whether its bytes are **spoiled**: a copy into it failed, so it holds
  something that is not the KV it was meant to hold (a load or a backup of
  it is refused until it is filled again or freed);
- on CUDA, two **fences** (opaque objects with a non-blocking ``query()``,
  as `torch.cuda.Event` has; ``None`` on a CPU pool):
  the *reader fence*, after the last kernels that read the page before it was
  freed (a copy that fills it again waits for it), and the *producer fence*,
  after the kernels that wrote its bytes (a copy out of it waits for it,
  until a copy out of it has landed).

The ledger is the only caller of `PageAllocator.alloc` / `free` in the
package: every page that changes hands changes them here, and every release
(a page freed, a lease ended) runs the release listeners, which is how the
tasks waiting for room wake: by construction, not by a call someone must
remember. A request's pages are listed under its key (`grant`,
`request_pages`, `free_request`).

The model is vLLM's block pool (one count per block, changed in two places).
Every method runs on the loop thread that owns the pools; none awaits.
"""

from __future__ import annotations

import enum
import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tiercache.errors import InvalidInputError, StateError
from tiercache.memory.allocator import PageAllocator, one_page

__all__ = ["Lease", "Ledger", "Owner", "PoolLedger", "live_fences"]

#: Page ids of a pool, one per page.
Pages = npt.NDArray[np.int64]

#: Updates of at most this many pages loop over Python ints (no index array).
_SMALL = 8


class Owner(enum.IntEnum):
    """Who holds a page. An engine that shares its device allocator holds pages
    the ledger sees as `FREE` (it allocates them itself): only pages the ledger
    handed out carry another owner."""

    FREE = 0
    CALLER = 1
    REQUEST = 2
    INDEX = 3


class Lease(enum.IntEnum):
    """What a copy or a storage call in flight does with a page."""

    #: A device->host copy or a storage backup reads it.
    READ = 0
    #: A device<->host copy fills it (a load on the device, a write on the host).
    FILL = 1
    #: A storage prefetch fills it (host pages only).
    FETCH = 2


def _pending(ev: object) -> bool:
    """Whether fence ``ev`` may still be unfinished (``query()`` false; no ``query``: assume so)."""
    query = getattr(ev, "query", None)
    return query is None or not query()


def live_fences(events: Iterable[object]) -> list[Any]:
    """The distinct, possibly unfinished fences of ``events`` (``None`` and finished ones dropped)."""
    out: list[Any] = []
    for ev in events:
        if ev is None or any(ev is e for e in out):
            continue
        if isinstance(ev, tuple):
            out.extend(e for e in ev if _pending(e) and not any(e is o for o in out))
        elif _pending(ev):
            out.append(ev)
    return out


def _merge(old: object, new: object) -> object:
    """One page's fence slot after adding ``new``: old fences still pending are kept with it.

    A slot holds ``None``, one fence or a tuple of fences. Finished fences are
    dropped as new ones come, so a slot holds at most the fences still
    queued on the GPU: it never grows without bound.
    """
    if old is None or old is new:
        return new
    kept = live_fences((old, new))
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else tuple(kept)


class PoolLedger:
    """The pages of one pool: owners, leases, spoiled bytes and fences (see the module).

    Args:
        name: ``"device"`` or ``"host"`` (used in messages).
        allocator: the pool's allocator; only this object allocates or frees through it.
        released: called after pages were freed or leases ended (room may have appeared).
    """

    def __init__(self, name: str, allocator: PageAllocator, released: Callable[[], None]) -> None:
        self.name = name
        self._allocator = allocator
        self.page_size = allocator.page_size
        self.num_pages = allocator.num_pages
        self._released = released
        n = self.num_pages
        self._owner = np.zeros(n, dtype=np.int8)
        self._leases = np.zeros((3, n), dtype=np.int32)
        self._busy = np.zeros(n, dtype=np.int32)  # every lease of a page, summed
        self._spoiled = np.zeros(n, dtype=np.bool_)
        self._readers = np.full(n, None, dtype=object)
        self._producers = np.full(n, None, dtype=object)
        # Reader fences of pages freed through the allocator directly (an
        # engine's own): every fill waits for them. Pruned as they finish.
        self._loose: list[Any] = []
        # Per request key: its number and the pages it was granted (those it
        # still holds are the ones whose owner is REQUEST and holder its number).
        self._requests: dict[object, tuple[int, list[Pages]]] = {}
        self._holder = np.zeros(n, dtype=np.int64)
        self._next_request = 1
        self._counts = [0, 0, 0, 0]  # pages per owner, FREE unused
        # Whether any page may be spoiled, or hold a reader or producer fence:
        # the common case (none, and never any on a CPU pool) skips the arrays.
        self._any_spoiled = False
        self._any_readers = False
        self._any_producers = False

    # -- reading --------------------------------------------------------------

    @property
    def allocator(self) -> PageAllocator:
        return self._allocator

    @property
    def available(self) -> int:
        """Free token slots of the pool."""
        return self._allocator.available

    @property
    def num_slots(self) -> int:
        return self._allocator.num_slots

    def pages(self, slots: torch.Tensor) -> Pages:
        """Page ids of page-aligned CPU ``int64`` slot indices (trusted: not checked)."""
        s = slots.numpy()
        return s[:: self.page_size] // self.page_size

    def slots(self, pages: Pages) -> torch.Tensor:
        """The slot indices of ``pages``, in order (a new tensor: where a copy needs one)."""
        return self._allocator.pages_to_slots(torch.from_numpy(np.ascontiguousarray(pages)))

    def allocated(self, pages: Pages) -> bool:
        return self._allocator.pages_allocated(pages)

    def owned(self, pages: Pages, owner: Owner) -> bool:
        """Whether any of ``pages`` is held by ``owner``."""
        return bool((self._owner[pages] == owner).any())

    def tokens_owned(self, owner: Owner) -> int:
        """Token slots held by ``owner``."""
        return self._counts[owner] * self.page_size

    def leased(self, pages: Pages, kind: Lease | None = None) -> bool:
        """Whether a lease (of ``kind``, or of any kind) is held on any of ``pages``."""
        counts = self._busy if kind is None else self._leases[kind]
        if pages.size == 1:
            return bool(counts[pages[0]])
        if pages.size > _SMALL:
            return bool(counts[pages].any())
        return any(counts[p] for p in pages.tolist())

    def spoiled(self, pages: Pages) -> bool:
        """Whether a failed copy left any of ``pages`` without the KV it was to hold."""
        return self._any_spoiled and bool(self._spoiled[pages].any())

    # -- owners -----------------------------------------------------------------

    def alloc(
        self, num_tokens: int, owner: Owner = Owner.CALLER
    ) -> tuple[torch.Tensor, Pages] | None:
        """Take ``num_tokens`` slots (a multiple of the page size) for ``owner``.

        Returns:
            The slots and their page ids, or ``None`` when the pool is short.
        """
        got = self._allocator.alloc_pages(num_tokens)
        if got is not None:
            self._set_owner(got[1], owner)
        return got

    def give(self, pages: Pages, owner: Owner) -> None:
        """Hand allocated ``pages`` to ``owner`` (a caller's pages to the index, say).

        Raises:
            InvalidInputError: some page is not allocated.
        """
        if pages.size and not self._allocator.pages_allocated(pages):
            raise InvalidInputError(f"{self.name} pages that are not allocated cannot change owner")
        self._set_owner(pages, owner)
        if owner is Owner.INDEX:
            self._released()  # the index may evict them: room may have appeared

    def _set_owner(self, pages: Pages, owner: Owner) -> None:
        if not pages.size:
            return
        counts, owners = self._counts, self._owner
        to = int(owner)  # a plain int: numpy converts an IntEnum slowly
        if pages.size == 1:  # one page (most operations)
            self._own_one(int(pages[0]), to)
            return
        if pages.size > _SMALL:
            for o, k in enumerate(np.bincount(owners[pages], minlength=4).tolist()):
                counts[o] -= k
            owners[pages] = to
        else:
            for p in pages.tolist():
                counts[int(owners[p])] -= 1
                owners[p] = to
        counts[to] += int(pages.size)
        counts[Owner.FREE] = 0

    def _own_one(self, page: int, to: int) -> None:
        """`_set_owner` of one page, ``to`` a plain int."""
        counts, owners = self._counts, self._owner
        counts[owners[page]] -= 1
        owners[page] = to
        counts[to] += 1
        counts[0] = 0  # FREE is not counted

    # -- one page by its id: the one-page verbs -----------------------------------

    def alloc_one(self) -> int | None:
        """`alloc` of one page for `Owner.CALLER`: its page id, or ``None`` when the pool is full."""
        page = self._allocator.alloc_one()
        if page is not None:
            self._own_one(page, 1)  # Owner.CALLER
        return page

    def page_slots(self, page: int) -> torch.Tensor:
        """The slots of page ``page`` (a new tensor)."""
        return self._allocator.page_slots(page)

    def readable(self, page: int) -> bool:
        """Whether page ``page`` is allocated, no copy or prefetch fills it, and its bytes are whole:
        what a copy out of it needs (the checked path says which one fails)."""
        return (
            self._allocator.holds(page)
            and not self._leases[1, page]  # Lease.FILL
            and not self._leases[2, page]  # Lease.FETCH
            and not (self._any_spoiled and self._spoiled[page])
        )

    def free_one(self, page: int) -> None:
        """`free` of one page id, with no fence.

        Raises:
            StateError / DoubleFreeError: as `free`.
        """
        if self._busy[page]:
            self.check_unleased(np.array([page]))  # raises
        self._allocator.free_one(page)
        self._own_one(page, 0)  # Owner.FREE
        if self._any_spoiled:
            self._spoiled[page] = False
        if self._any_producers:
            self._producers[page] = None
        self._released()

    def check_unleased(self, pages: Pages) -> None:
        """Refuse to free ``pages`` while a lease holds one of them.

        Raises:
            StateError: a copy or a storage call holds a lease on some page.
        """
        if self.leased(pages):
            raise StateError(
                f"{self.name} slots that a copy or a storage call still uses cannot be freed; "
                "await its ack or its end"
            )

    def free_if_one(self, given: object) -> bool:
        """`free_one` of ``given`` when it is the slots of one whole page (`one_page`);
        ``False`` (nothing done) otherwise: the caller takes the checked path.

        Raises:
            StateError / DoubleFreeError: as `free`.
        """
        page = one_page(given, self.page_size, self._allocator.num_slots)
        if page is None:
            return False
        self.free_one(page)
        return True

    def free(self, pages: Pages, *, fence: object = None) -> None:
        """Free ``pages``: refused while a lease holds one, checked before anything changes.

        Args:
            fence: the last readers of the pages (CUDA): the next copy that
                fills any of them waits for it. ``None``: nothing to wait for.

        Raises:
            StateError: a copy or a storage call holds a lease on some page.
            DoubleFreeError: some page is not allocated, or listed twice.
        """
        if not pages.size:
            return
        self.check_unleased(pages)
        self._allocator.free_pages(pages)  # refuses a double free before it changes anything
        self._set_owner(pages, Owner.FREE)
        if self._any_spoiled:
            self._spoiled[pages] = False
        if self._any_producers:
            self._producers[pages] = None
        if fence is not None:
            self.add_fence(pages, fence)
        self._released()

    def reset(self) -> None:
        """Free every page and forget every lease, request and fence (nothing is in flight)."""
        self._allocator.reset()
        self._owner[:] = Owner.FREE
        self._leases[:] = 0
        self._busy[:] = 0
        self._spoiled[:] = False
        self._readers[:] = None
        self._producers[:] = None
        self._loose = []
        self._requests.clear()
        self._counts = [0, 0, 0, 0]
        self._any_spoiled = self._any_readers = self._any_producers = False
        self._released()

    # -- requests ---------------------------------------------------------------

    def grant(self, key: object, num_tokens: int) -> torch.Tensor | None:
        """Allocate ``num_tokens`` slots for request ``key``; ``None`` when the pool is short."""
        got = self.alloc(num_tokens, Owner.REQUEST)
        if got is None:
            return None
        entry = self._requests.get(key)
        if entry is None:
            entry = self._requests[key] = (self._next_request, [])
            self._next_request += 1
        self._holder[got[1]] = entry[0]
        entry[1].append(got[1])
        return got[0]

    def request_pages(self, key: object) -> Pages:
        """The pages request ``key`` still holds, in the order it got them."""
        entry = self._requests.get(key)
        if entry is None:
            return np.zeros(0, dtype=np.int64)
        num, parts = entry
        held = [p[(self._owner[p] == Owner.REQUEST) & (self._holder[p] == num)] for p in parts]
        return np.concatenate(held) if len(held) > 1 else held[0]

    def free_request(self, key: object, *, fence: object = None) -> int:
        """Free the pages request ``key`` still holds (those it handed on are not); returns slots freed."""
        pages = self.request_pages(key)
        self._requests.pop(key, None)
        self.free(pages, fence=fence)
        return int(pages.size) * self.page_size

    # -- leases -----------------------------------------------------------------

    def lease(self, pages: Pages, kind: Lease) -> None:
        """Take a lease of ``kind`` on ``pages`` (end it with `end_lease`)."""
        row, busy = self._leases[kind], self._busy
        if pages.size > _SMALL:
            row[pages] += 1
            busy[pages] += 1
        else:
            for p in pages.tolist():
                row[p] += 1
                busy[p] += 1

    def end_lease(self, pages: Pages, kind: Lease, *, wake: bool = True) -> None:
        """End a lease `lease` took; wakes the release listeners unless ``wake`` is false
        (a caller ending several at once wakes them once, with `released`)."""
        row, busy = self._leases[kind], self._busy
        if pages.size > _SMALL:
            row[pages] -= 1
            busy[pages] -= 1
        else:
            for p in pages.tolist():
                row[p] -= 1
                busy[p] -= 1
        if wake:
            self._released()

    def released(self) -> None:
        """Run the release listeners (after several leases ended with ``wake=False``)."""
        self._released()

    # -- bytes and fences -------------------------------------------------------

    def spoil(self, pages: Pages) -> None:
        """A copy into ``pages`` failed: they hold no KV until refilled or freed."""
        self._spoiled[pages] = True
        self._any_spoiled = True

    def filled(self, pages: Pages | int, producer: object = None) -> None:
        """A copy into ``pages`` (or one page id) landed (``producer``: the event it
        landed at, on CUDA)."""
        if self._any_spoiled:
            self._spoiled[pages] = False
        if producer is not None:
            self.set_producer(np.asarray(pages).reshape(-1), producer)
        elif self._any_producers:
            self._producers[pages] = None

    def add_fence(self, pages: Pages | None, fence: object) -> None:
        """Order the next fill of ``pages`` (``None``: of every page) after ``fence``."""
        if fence is None:
            return
        if pages is None:
            self._loose = live_fences((*self._loose, fence))
            return
        readers = self._readers
        for p in pages.tolist():
            readers[p] = _merge(readers[p], fence)
        self._any_readers = True

    def take_fences(self, pages: Pages) -> list[Any]:
        """The reader fences a fill of ``pages`` must wait for; they leave the ledger.

        A fill that fails before its stream waited for them gives them back
        with `add_fence` (the pages' next fill waits instead).
        """
        if not self._any_readers:
            if not self._loose:
                return []
            taken, self._loose = live_fences(self._loose), []
            return taken
        taken = live_fences((*self._readers[pages].tolist(), *self._loose))
        self._readers[pages] = None
        self._loose = []
        return taken

    def set_producer(self, pages: Pages, producer: object) -> None:
        """The kernels that wrote ``pages``' bytes end at ``producer``: copies out of them wait for it."""
        if producer is None:
            return
        prods = self._producers
        for p in pages.tolist():
            prods[p] = _merge(prods[p], producer)
        self._any_producers = True

    def producers(self, pages: Pages) -> list[Any]:
        """The producer fences a copy out of ``pages`` must wait for."""
        if not self._any_producers:
            return []
        return live_fences(self._producers[pages].tolist())

    def copied_out(self, pages: Pages | int) -> None:
        """A copy out of ``pages`` (or of one page id) landed: their producers are done,
        nothing waits for them again."""
        if self._any_producers:
            self._producers[pages] = None

    def fence_count(self) -> int:
        """Fences held (reader and producer, loose ones included): bounded by what is queued."""
        n = len(self._loose)
        for arr in (self._readers, self._producers):
            for v in arr[arr != None].tolist():  # noqa: E711 (an elementwise test)
                n += len(v) if isinstance(v, tuple) else 1
        return n

    # -- checking -----------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise `AssertionError` if the books disagree with themselves or the allocator.

        A page with an owner is allocated; a free page holds no lease, no
        request and no producer; counts match the arrays; leases are not
        negative; every listed request page is owned by a request.
        """
        owned = np.flatnonzero(self._owner != Owner.FREE)
        if owned.size and not self._allocator.pages_allocated(owned):
            raise AssertionError(f"{self.name}: a page with an owner is not allocated")
        if (self._leases < 0).any():
            raise AssertionError(f"{self.name}: a negative lease count")
        if not np.array_equal(self._leases.sum(axis=0), self._busy):
            raise AssertionError(f"{self.name}: the lease total disagrees with the leases")
        if (self._spoiled.any() and not self._any_spoiled) or (
            (self._producers != None).any() and not self._any_producers  # noqa: E711
        ):
            raise AssertionError(f"{self.name}: a page flag is set but its summary is not")
        leased = np.flatnonzero((self._leases != 0).any(axis=0))
        if leased.size and not self._allocator.pages_allocated(leased):
            raise AssertionError(f"{self.name}: a lease on a page that is not allocated")
        for o in (Owner.CALLER, Owner.REQUEST, Owner.INDEX):
            if self._counts[o] != int(np.count_nonzero(self._owner == o)):
                raise AssertionError(f"{self.name}: the count of {o.name} pages is off")
        held = self.request_pages_all()
        if held.size and len(set(held.tolist())) != held.size:
            raise AssertionError(f"{self.name}: a page is listed under two requests")

    def request_pages_all(self) -> Pages:
        """The pages every open request still holds."""
        parts = [self.request_pages(k) for k in self._requests]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class Ledger:
    """The device and host `PoolLedger` of one controller, and their release listeners.

    Args:
        device_allocator, host_allocator: the pools' allocators.
    """

    def __init__(self, device_allocator: PageAllocator, host_allocator: PageAllocator) -> None:
        self._listeners: list[Callable[[], Callable[[], None] | None]] = []
        self.device = PoolLedger("device", device_allocator, self._release)
        self.host = PoolLedger("host", host_allocator, self._release)

    def on_release(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn()`` after every release (pages freed, leases ended); returns its remover.

        A bound method is held weakly: its object usually owns the ledger, and
        a strong reference back would make a cycle that keeps the pools alive
        until the garbage collector runs.
        """
        ref: Callable[[], Callable[[], None] | None]
        ref = weakref.WeakMethod(fn) if inspect.ismethod(fn) else (lambda: fn)
        self._listeners.append(ref)

        def remove() -> None:
            if ref in self._listeners:
                self._listeners.remove(ref)

        return remove

    def _release(self) -> None:
        for ref in self._listeners:
            fn = ref()
            if fn is not None:
                fn()

    def check_invariants(self) -> None:
        """Both pools' `PoolLedger.check_invariants`."""
        self.device.check_invariants()
        self.host.check_invariants()
