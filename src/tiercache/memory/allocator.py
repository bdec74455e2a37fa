"""Page-aligned allocation of token slots."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import NoReturn

import numpy as np
import numpy.typing as npt
import torch

from tiercache._checks import check_count, check_positive
from tiercache.errors import DoubleFreeError, InvalidInputError

__all__ = [
    "PageAllocator",
    "cat_slots",
    "check_slot_indices",
    "check_slot_pages",
    "copy_slots",
    "one_page",
    "page_ids",
]


logger = logging.getLogger(__name__)

#: Up to this many slots, `check_slot_indices` checks them as Python ints.
_SMALL = 256

#: Whether `_int64_vector` has warned about a device tensor (once a process).
_warned_device_indices = False

#: Up to this many pages, a page listed twice is looked for with a set.
_FEW_PAGES = 64


def check_slot_indices(
    indices: object, page_size: int, num_slots: int, what: str = "indices"
) -> torch.Tensor:
    """Validate page-aligned slot indices and return them as a CPU int64 tensor.

    Slot indices are a 1-D ``int64`` tensor whose length is a multiple of
    ``page_size`` and whose every page is ``page_size`` consecutive slots
    starting at a multiple of ``page_size``: exactly what `PageAllocator.alloc`
    hands out.

    A tensor on a CUDA device is read on the host: the copy waits for the
    work queued on the calling thread's current stream (its values may be
    produced there), so the calling thread (the event loop, for a verb)
    waits for the GPU. Pass CPU tensors, as the allocators return, to keep
    the loop free; the first CUDA tensor logs a warning.

    Raises:
        InvalidInputError: wrong type, dtype, layout (sparse or meta: no
            values to read), shape, alignment or range.
    """
    return check_slot_pages(indices, page_size, num_slots, what)[0]


def check_slot_pages(
    indices: object, page_size: int, num_slots: int, what: str = "indices"
) -> tuple[torch.Tensor, npt.NDArray[np.int64]]:
    """`check_slot_indices`, plus the page id of each page of the slots, in order.

    The page ids come out of the check itself, so that a caller that needs
    them (allocation state, busy counts) does not read the slots again.

    Returns:
        The CPU int64 slots and a new int64 array of their page ids.

    Raises:
        InvalidInputError: as `check_slot_indices`.
    """
    cpu = _int64_vector(indices, page_size, what)
    if cpu.numel() <= _SMALL:
        # A few pages (every single operation): plain Python ints, one list
        # out of the tensor and one array back in, beat numpy's ~1 us a call.
        pages = _check_small_runs(cpu.tolist(), page_size, num_slots, what)
        return cpu, np.array(pages, dtype=np.int64)
    # numpy, not torch: each torch op costs several microseconds, numpy's about one.
    return cpu, _check_runs(cpu.numpy(), page_size, num_slots, what) // page_size


def one_page(indices: object, page_size: int, num_slots: int) -> int | None:
    """The page id of ``indices`` when they are one whole page of a pool of
    ``num_slots`` slots, as `check_slot_pages` accepts it (a plain CPU ``int64``
    1-D tensor); ``None`` otherwise, bad input included: the caller then takes
    the checked path, which says what is wrong.

    The one-page verbs' test (most operations): a few attribute reads and one
    list, where the full check builds a page-id array.
    """
    if (
        indices.__class__ is not torch.Tensor
        or indices.dtype is not torch.int64
        or not indices.is_cpu
        or indices.layout is not torch.strided
        or indices.dim() != 1
        or indices.numel() != page_size
    ):
        return None
    return _one_run(indices.tolist(), page_size, num_slots)


def _one_run(slots: list[int], page_size: int, num_slots: int) -> int | None:
    """The page id of ``slots`` (a page's worth, as ints) when they are one whole,
    aligned page in ``[0, num_slots)``; ``None`` otherwise."""
    first = slots[0]
    if first % page_size or first < 0 or first + page_size > num_slots:
        return None
    if page_size > 1 and slots != list(range(first, first + page_size)):
        return None
    return first // page_size


def copy_slots(slots: torch.Tensor) -> torch.Tensor:
    """A new CPU tensor holding ``slots`` (CPU ``int64``), made by numpy.

    Slot tensors are copied and joined by numpy on the event loop, never by
    torch: torch spreads a copy of 32k elements or more over an OpenMP team
    started on the calling thread, whose threads then spin for milliseconds
    at that thread's priority (the loop's), taking cores from the copy
    streams (measured on 2 cores: such a spinner took 7 ms of CPU a 64 MiB
    round trip, and the copies ran 1.5-2x slower). numpy copies on the caller.
    """
    return torch.from_numpy(slots.numpy().copy())


def cat_slots(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` (CPU ``int64`` slot tensors) end to end, in a new tensor (see `copy_slots`)."""
    if not parts:
        return torch.empty(0, dtype=torch.int64)
    return torch.from_numpy(np.concatenate([p.numpy() for p in parts]))


def page_ids(slots: torch.Tensor, page_size: int) -> npt.NDArray[np.int64]:
    """The page id of each page of ``slots`` (CPU slots already checked), in a new array."""
    return slots.numpy()[::page_size] // page_size


def _int64_vector(indices: object, page_size: int, what: str) -> torch.Tensor:
    """``indices`` on the CPU once it is a 1-D int64 tensor of whole pages."""
    if not isinstance(indices, torch.Tensor):
        raise InvalidInputError(
            f"{what} must be a torch.Tensor of int64, got {type(indices).__name__}"
        )
    if indices.dtype != torch.int64:
        raise InvalidInputError(f"{what} must have dtype int64, got {indices.dtype}")
    if indices.layout != torch.strided or indices.is_meta:
        # Neither holds values that can be read: a sparse layout or a meta tensor.
        raise InvalidInputError(
            f"{what} must be a dense tensor with values, got a {indices.layout} tensor "
            f"on {indices.device}"
        )
    if indices.dim() != 1:
        raise InvalidInputError(f"{what} must be 1-D, got shape {tuple(indices.shape)}")
    n = indices.numel()
    if n % page_size:
        raise InvalidInputError(f"{what} has {n} slots, not a multiple of page_size={page_size}")
    if indices.is_cpu:
        return indices
    global _warned_device_indices
    if not _warned_device_indices:
        _warned_device_indices = True
        logger.warning(
            "%s is a %s tensor: reading it waits for the GPU on the calling thread "
            "(the event loop, for a verb); pass CPU slot tensors",
            what,
            indices.device,
        )
    return indices.cpu()


def _misaligned(page_size: int, what: str) -> InvalidInputError:
    return InvalidInputError(f"{what} are not page-aligned runs of page_size={page_size} slots")


def _check_small_runs(slots: list[int], page_size: int, num_slots: int, what: str) -> list[int]:
    """Range and alignment of a few pages of slots, as Python ints; returns their page ids."""
    if not slots:
        return []
    if len(slots) == page_size:  # one page (most operations): one run to compare
        page = _one_run(slots, page_size, num_slots)
        if page is not None:
            return [page]
    lo, hi = min(slots), max(slots)
    if lo < 0 or hi >= num_slots:
        raise InvalidInputError(f"{what} out of range [0, {num_slots}): min {lo}, max {hi}")
    pages = []
    for start in range(0, len(slots), page_size):
        first = slots[start]
        if first % page_size or slots[start : start + page_size] != list(
            range(first, first + page_size)
        ):
            raise _misaligned(page_size, what)
        pages.append(first // page_size)
    return pages


def _check_runs(
    a: npt.NDArray[np.int64], page_size: int, num_slots: int, what: str
) -> npt.NDArray[np.int64]:
    """Range and alignment of many pages of slots, vectorised; returns each page's first slot.

    One pass over the slots, in chunks of whole pages: each chunk's steps
    must be 1 inside every page, and its pages' first slots are taken while
    the chunk is in cache (a list of slots evicted by a large copy is read
    from memory once, and the scratch stays in cache). Valid slots are runs,
    so the range is read off the first slots alone. Bad input takes the slow
    path, which says what is wrong.
    """
    first = np.empty(a.size // page_size, dtype=np.int64)
    chunk = max(page_size, _RUN_CHUNK - _RUN_CHUNK % page_size)
    steps = np.empty(min(chunk, a.size), dtype=np.int64)
    ones = np.empty(steps.size, dtype=np.bool_)
    for lo in range(0, a.size, chunk):
        part = a[lo : lo + chunk]
        if page_size > 1:
            m = part.size - 1
            np.subtract(part[1:], part[:-1], out=steps[:m])
            steps[page_size - 1 : m : page_size] = 1  # from one page to the next: anything
            if not np.equal(steps[:m], 1, out=ones[:m]).all():
                _explain(a, page_size, num_slots, what)
        np.copyto(first[lo // page_size : (lo + part.size) // page_size], part[::page_size])
    if page_size > 1 and (first % page_size).any():
        _explain(a, page_size, num_slots, what)
    lo, hi = int(first.min()), int(first.max()) + page_size - 1
    if lo < 0 or hi >= num_slots:
        _explain(a, page_size, num_slots, what)
    return first


#: At most this many recently freed pages are kept for one-page allocations.
_RECENT_PAGES = 256

#: Slots `_check_runs` takes at a time (its scratch: 512 KiB).
_RUN_CHUNK = 1 << 16


def _explain(a: npt.NDArray[np.int64], page_size: int, num_slots: int, what: str) -> NoReturn:
    """Raise the error that describes invalid slots ``a``: out of range, else misaligned."""
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= num_slots:
        raise InvalidInputError(f"{what} out of range [0, {num_slots}): min {lo}, max {hi}")
    raise _misaligned(page_size, what)


@functools.lru_cache(maxsize=16)
def _steps(page_size: int) -> npt.NDArray[np.int64]:
    """``[0, 1, ..., page_size - 1]`` (read-only, shared)."""
    steps = np.arange(page_size, dtype=np.int64)
    steps.flags.writeable = False
    return steps


#: Pages of steps in one chunk of `_tiled_steps`.
_TILE_PAGES = 4096


@functools.lru_cache(maxsize=16)
def _tiled_steps(page_size: int) -> npt.NDArray[np.int64]:
    """`_steps` repeated for `_TILE_PAGES` pages (read-only, shared)."""
    tiled = np.tile(_steps(page_size), _TILE_PAGES)
    tiled.flags.writeable = False
    return tiled


class PageAllocator:
    """Hands out page-aligned token slot indices of one pool.

    The free list is a numpy ``int64`` array of page ids, not a Python list:
    allocating k pages is one slice and one add whatever k is. A per-page
    ``bool`` array records what is allocated, so a double or foreign free is
    refused before any state changes. Freed pages are only counted; when the
    free list runs short, it is read afresh off that array (every page not
    allocated, in order), so that fresh allocations come out as long
    contiguous runs (which the copy engine moves with plain slice copies).
    A single page is taken first from the pages freed one or a few at a time
    since (the last freed first): their bytes are likely still in the CPU's
    caches, where the next page of the free list is cold.
    ``alloc_pages``, ``free_pages`` and ``pages_allocated`` take and give page
    ids, for callers that have them already (`check_slot_pages`). Not
    thread-safe: call it from one thread (the event loop's).

    Args:
        num_slots: token slots in the pool; must be a multiple of ``page_size``.
        page_size: slots per page.
    """

    def __init__(self, num_slots: int, page_size: int) -> None:
        page_size = check_positive(page_size, "page_size")
        num_slots = check_count(num_slots, "num_slots")
        if num_slots % page_size:
            raise InvalidInputError(
                f"num_slots={num_slots} is not a multiple of page_size={page_size}"
            )
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.reset()

    def reset(self) -> None:
        """Mark every slot free again (the owner guarantees no copy is in flight)."""
        # numpy inside, torch at the surface: an operation allocates or frees a
        # handful of pages, and each torch op costs several microseconds.
        self._free: npt.NDArray[np.int64] = np.arange(self.num_pages, dtype=np.int64)
        self._num_released = 0
        self._allocated: npt.NDArray[np.bool_] = np.zeros(self.num_pages, dtype=np.bool_)
        #: Pages freed a few at a time since the free list was last read
        #: afresh, the last freed last (none is on the free list: see alloc).
        self._recent: list[int] = []

    @property
    def available(self) -> int:
        """Free token slots."""
        return (self._free.size + self._num_released) * self.page_size

    @property
    def used(self) -> int:
        """Allocated token slots."""
        return self.num_slots - self.available

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Allocate ``num_tokens`` slots (a multiple of ``page_size``).

        Returns:
            A CPU ``int64`` tensor of slot indices, page-aligned, or ``None``
            when the pool has fewer free slots than asked (nothing is taken).

        Raises:
            InvalidInputError: ``num_tokens`` negative, not an int or not a
                multiple of the page size.
        """
        got = self.alloc_pages(num_tokens)
        return None if got is None else got[0]

    def alloc_pages(self, num_tokens: int) -> tuple[torch.Tensor, npt.NDArray[np.int64]] | None:
        """`alloc`, plus the page ids of the slots (a read-only array), or ``None``."""
        if num_tokens.__class__ is not int:
            num_tokens = check_count(num_tokens, "num_tokens")
        elif num_tokens < 0:
            check_count(num_tokens, "num_tokens")  # raises, saying why
        if num_tokens % self.page_size:
            raise InvalidInputError(
                f"num_tokens={num_tokens} is not a multiple of page_size={self.page_size}"
            )
        need = num_tokens // self.page_size
        if need == 1 and self._recent:
            one = np.array([self.alloc_one()], dtype=np.int64)  # the page freed last
            one.flags.writeable = False
            return self._slots(one, increasing=True), one
        if need > self._free.size:
            if need > self._free.size + self._num_released:
                return None
            self._merge_released()
        pages = self._free[:need]
        pages.flags.writeable = False  # a view of the free list, handed out
        self._free = self._free[need:]
        self._allocated[pages] = True
        return self._slots(pages, increasing=True), pages

    def alloc_one(self) -> int | None:
        """`alloc_pages` of one page: its page id (`page_slots` gives its slots), or ``None``."""
        if self._recent:
            page = self._recent.pop()
            self._num_released -= 1
        else:
            if not self._free.size:
                if not self._num_released:
                    return None
                self._merge_released()
            page = int(self._free[0])
            self._free = self._free[1:]
        self._allocated[page] = True
        return page

    def page_slots(self, page: int) -> torch.Tensor:
        """The slot indices of page ``page``: a new CPU ``int64`` tensor."""
        first = page * self.page_size
        return torch.from_numpy(np.arange(first, first + self.page_size, dtype=np.int64))

    def holds(self, page: int) -> bool:
        """Whether page ``page`` (a page id of this pool) is allocated."""
        return bool(self._allocated[page])

    def free(self, indices: torch.Tensor, *, checked: bool = False) -> None:
        """Return slots obtained from `alloc`.

        Args:
            indices: the slots.
            checked: the caller already validated ``indices`` with
                `check_slot_indices` against this pool (CPU int64, aligned, in
                range): skip that pass. Allocation state is always checked.

        Raises:
            InvalidInputError: not page-aligned int64 slot indices of this pool.
            DoubleFreeError: some page is not allocated, or listed twice.
        """
        if checked:
            self.free_pages(page_ids(indices, self.page_size))
        else:
            self.free_pages(check_slot_pages(indices, self.page_size, self.num_slots)[1])

    def free_pages(self, pages: npt.NDArray[np.int64]) -> None:
        """`free` by page ids of this pool (from `check_slot_pages` or `alloc_pages`).

        Raises:
            DoubleFreeError: some page is not allocated, or listed twice.
        """
        if pages.size == 0:
            return
        if pages.size <= _FEW_PAGES:
            self._free_few(pages.tolist())
            return
        held = self._allocated[pages]
        if not held.all():
            bad = pages[~held][:4].tolist()
            raise DoubleFreeError(f"freeing pages that are not allocated (first: {bad})")
        self._allocated[pages] = False
        if self._listed_twice(pages):
            self._allocated[pages] = True  # every one was allocated: nothing changed
            raise DoubleFreeError("the same page is listed twice in one free")
        self._num_released += pages.size

    def free_one(self, page: int) -> None:
        """`free_pages` of one page id.

        Raises:
            DoubleFreeError: the page is not allocated.
        """
        self._free_few([page])

    def _free_few(self, pages: list[int]) -> None:
        """`free_pages` of a few pages, as Python ints (numpy's per-call cost dominates there)."""
        allocated = self._allocated
        if len(pages) == 1:
            if not allocated[pages[0]]:
                raise DoubleFreeError(f"freeing pages that are not allocated (first: {pages})")
        else:
            bad = [p for p in pages if not allocated[p]]
            if bad:
                raise DoubleFreeError(f"freeing pages that are not allocated (first: {bad[:4]})")
            if len(set(pages)) != len(pages):
                raise DoubleFreeError("the same page is listed twice in one free")
        for p in pages:
            allocated[p] = False
        self._num_released += len(pages)
        recent = self._recent
        recent.extend(pages)
        if len(recent) > _RECENT_PAGES:
            del recent[: len(recent) - _RECENT_PAGES // 2]

    def _listed_twice(self, pages: npt.NDArray[np.int64]) -> bool:
        """Whether allocated ``pages``, just marked free, named a page twice.

        A few pages are compared as Python ints. Many are counted instead of
        sorted: the pool's pages still marked allocated must be exactly the
        ones allocated before, less one per page listed (a scan of one byte a
        page, where sorting or hashing the list costs a millisecond at 16k).
        """
        if pages.size <= _FEW_PAGES:
            return self.has_repeats(pages)
        used_before = self.num_pages - self._free.size - self._num_released
        return int(np.count_nonzero(self._allocated)) != used_before - pages.size

    def has_repeats(self, pages: npt.NDArray[np.int64]) -> bool:
        """Whether ``pages`` (page ids of this pool) name a page more than once.

        O(pages) plus one byte a pool page: no sort, no hash of the list.
        """
        if pages.size <= _FEW_PAGES:
            return len(set(pages.tolist())) != pages.size
        seen = np.zeros(self.num_pages, dtype=np.bool_)
        seen[pages] = True
        return int(np.count_nonzero(seen)) != pages.size

    def is_allocated(self, indices: torch.Tensor, *, checked: bool = False) -> bool:
        """Whether every page of ``indices`` is currently allocated (``checked``: as in `free`)."""
        if checked:
            return self.pages_allocated(page_ids(indices, self.page_size))
        return self.pages_allocated(check_slot_pages(indices, self.page_size, self.num_slots)[1])

    def pages_allocated(self, pages: npt.NDArray[np.int64]) -> bool:
        """Whether every page id in ``pages`` (of this pool) is currently allocated."""
        if pages.size == 1:
            return bool(self._allocated[pages[0]])
        if pages.size <= _FEW_PAGES:
            allocated = self._allocated
            return all(allocated[p] for p in pages.tolist())
        return bool(self._allocated[pages].all())

    def pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Page ids -> their slot indices, in order."""
        return self._slots(pages.numpy())

    def _slots(self, pages: npt.NDArray[np.int64], *, increasing: bool = False) -> torch.Tensor:
        """Page ids -> a new CPU int64 tensor of their slot indices, in order.

        ``increasing``: ``pages`` is strictly increasing (a slice of the free
        list), so when it spans as many ids as it holds, it is one run.
        """
        size = self.page_size
        if increasing and pages.size:
            first, last = int(pages[0]), int(pages[-1])
            if last - first == pages.size - 1:
                return torch.from_numpy(np.arange(first * size, (last + 1) * size, dtype=np.int64))
        if size == 1:
            return torch.from_numpy(pages.copy())
        if pages.size <= _FEW_PAGES:
            return torch.from_numpy((pages[:, None] * size + _steps(size)).reshape(-1))
        # Many pages: a broadcast add over rows of page_size runs a short inner
        # loop per page; repeating the starts and adding the steps in long
        # flat chunks is twice as fast.
        slots = np.repeat(pages * size, size)
        tile = _tiled_steps(size)
        for lo in range(0, slots.size, tile.size):
            chunk = slots[lo : lo + tile.size]
            chunk += tile[: chunk.size]
        return torch.from_numpy(slots)

    def _merge_released(self) -> None:
        # Every page not allocated is free, in order: one byte a pool page
        # to scan, where sorting the merged list took a millisecond at 16k.
        self._free = np.flatnonzero(~self._allocated).astype(np.int64, copy=False)
        self._num_released = 0
        self._recent.clear()  # every one of them is on the free list now

    def __repr__(self) -> str:
        return (
            f"PageAllocator(num_slots={self.num_slots}, page_size={self.page_size}, "
            f"available={self.available})"
        )
