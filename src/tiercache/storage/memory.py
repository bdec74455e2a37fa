"""`MemoryBackend`: an in-process, bounded L3 store, and the test double of the others."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self
from urllib.parse import urlsplit

from tiercache._aio import finish
from tiercache.errors import ConfigError
from tiercache.storage.base import BackendState, BackendStats, PageBuffer, PageKey, StorageBackend
from tiercache.storage.format import check_target
from tiercache.storage.keys import check_batch
from tiercache.storage.registry import option_int, reject_unknown, url_options

__all__ = ["MemoryBackend"]

logger = logging.getLogger(__name__)

#: Batches moving more bytes than this copy in an executor, not on the loop.
_OFFLOAD_BYTES = 1 << 20


@dataclass(slots=True)
class _Entry:
    data: bytes
    format: str


class MemoryBackend(StorageBackend):
    """Pages kept as ``bytes`` in this process, evicted least recently used first.

    The store is an ``OrderedDict`` from key to ``(bytes, format)`` in LRU
    order: a hit is ``move_to_end`` and an eviction ``popitem(last=False)``,
    both O(1), with no separate list to keep in step. Only the event loop
    thread touches it, so it needs no lock. ``batch_exists`` does not count as
    a use (a prefetch probe should not keep a page alive); ``batch_get`` does.

    Pages are copied in and out (a stored page must not change when the host
    pool reuses the slot). Batches over 1 MiB copy in the default executor so
    that the loop stays responsive; a cancelled ``batch_get`` returns only after
    that copy has finished.

    Args:
        capacity_bytes: the most payload bytes kept (``None``: unbounded).
        capacity_pages: the most pages kept (``None``: unbounded).

    Raises:
        ConfigError: a capacity that is not a positive int.
    """

    name = "memory"

    def __init__(
        self, *, capacity_bytes: int | None = None, capacity_pages: int | None = None
    ) -> None:
        super().__init__()
        self.capacity_bytes = (
            None
            if capacity_bytes is None
            else option_int("capacity_bytes", capacity_bytes, minimum=1)
        )
        self.capacity_pages = (
            None
            if capacity_pages is None
            else option_int("capacity_pages", capacity_pages, minimum=1)
        )
        self._store: OrderedDict[str, _Entry] = OrderedDict()
        self._used = 0

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> Self:
        """Open ``memory://`` (query or keyword options: ``capacity_bytes``, ``capacity_pages``).

        Raises:
            ConfigError: a URL with a host or path, or unknown / bad options.
        """
        base, opts = url_options(url, options)
        parts = urlsplit(base)
        if parts.scheme != "memory" or parts.netloc or parts.path:
            raise ConfigError(f"a memory backend URL is 'memory://' with options only, got {url!r}")
        reject_unknown(cls.name, opts, {"capacity_bytes", "capacity_pages"})
        cap_b, cap_p = opts.get("capacity_bytes"), opts.get("capacity_pages")
        return cls(
            capacity_bytes=None
            if cap_b in (None, "")
            else option_int("capacity_bytes", cap_b, minimum=1),
            capacity_pages=None
            if cap_p in (None, "")
            else option_int("capacity_pages", cap_p, minimum=1),
        )

    @property
    def used_bytes(self) -> int:
        """Payload bytes held now."""
        return self._used

    def __len__(self) -> int:
        return len(self._store)

    async def batch_exists(self, keys: Sequence[PageKey]) -> int:
        self._check_open()
        ks = check_batch(keys)
        self._stats.exists_calls += 1
        n = 0
        for k in ks:
            if k not in self._store:
                break
            n += 1
        return n

    async def batch_get(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        """Copy each stored page into its target.

        Raises:
            InvalidInputError: a bad key or target (`check_batch`), or a
                stored page of another format or length than its target
                (`check_target`): nothing is copied, the pages stay stored.
        """
        self._check_open()
        ks = check_batch(keys, pages, targets=True)
        entries = [self._store.get(k) for k in ks]
        for k, e, page in zip(ks, entries, pages, strict=True):
            if e is not None:
                check_target(k, e.format, len(e.data), page)
        found: list[bool] = []
        copies: list[tuple[bytes, PageBuffer]] = []
        for k, e, page in zip(ks, entries, pages, strict=True):
            if e is None:
                found.append(False)
                continue
            self._store.move_to_end(k)
            copies.append((e.data, page))
            found.append(True)
        nbytes = sum(len(d) for d, _ in copies)
        if nbytes > _OFFLOAD_BYTES:
            await finish(asyncio.get_running_loop().run_in_executor(None, _copy_out, copies))
        else:
            _copy_out(copies)
        self._stats.get_pages += len(ks)
        self._stats.get_hits += len(copies)
        self._stats.bytes_read += nbytes
        return found

    async def batch_set(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        self._check_open()
        ks = check_batch(keys, pages)
        result = [False] * len(ks)
        todo: list[int] = []
        seen: set[str] = set()
        for i, (k, page) in enumerate(zip(ks, pages, strict=True)):
            if k in self._store or k in seen:
                result[i] = True  # first writer wins
            elif self.capacity_bytes is not None and page.nbytes > self.capacity_bytes:
                logger.debug(
                    "memory backend: page %s (%d bytes) exceeds the capacity", k, page.nbytes
                )
            else:
                todo.append(i)
                seen.add(k)
        snap: Callable[[], list[bytes]] = lambda: [pages[i].tobytes() for i in todo]  # noqa: E731
        if sum(pages[i].nbytes for i in todo) > _OFFLOAD_BYTES:
            # Cancelled: nothing is stored, and the caller gets its pages back
            # only once the snapshot stopped reading them.
            datas = await finish(asyncio.get_running_loop().run_in_executor(None, snap))
            self._check_open()
        else:
            datas = snap()
        written = 0
        for i, data in zip(todo, datas, strict=True):
            k = ks[i]
            result[i] = True
            if k in self._store:  # written meanwhile by a concurrent batch
                continue
            self._make_room(len(data))
            self._store[k] = _Entry(data, pages[i].format)
            self._used += len(data)
            written += 1
            self._stats.bytes_written += len(data)
        self._stats.set_pages += len(ks)
        self._stats.set_written += written
        return result

    def _make_room(self, nbytes: int) -> None:
        while self._store and (
            (self.capacity_bytes is not None and self._used + nbytes > self.capacity_bytes)
            or (self.capacity_pages is not None and len(self._store) + 1 > self.capacity_pages)
        ):
            k, e = self._store.popitem(last=False)
            self._used -= len(e.data)
            self._stats.evictions += 1
            logger.debug("memory backend: evicted %s", k)

    def _remove(self, key: str) -> bool:
        e = self._store.pop(key, None)
        if e is None:
            return False
        self._used -= len(e.data)
        return True

    async def delete(self, keys: Sequence[PageKey]) -> int:
        self._check_open()
        return sum(self._remove(k) for k in check_batch(keys))

    async def clear(self) -> None:
        self._check_open()
        self._store.clear()
        self._used = 0

    async def stats(self) -> BackendStats:
        s = await super().stats()
        s.extra.update(pages=len(self._store), bytes=self._used)
        return s

    async def aclose(self) -> None:
        if self.state is BackendState.CLOSED:
            return
        self.state = BackendState.CLOSED
        self._store.clear()
        self._used = 0

    def __repr__(self) -> str:
        return (
            f"MemoryBackend(pages={len(self._store)}, bytes={self._used}, "
            f"capacity_bytes={self.capacity_bytes}, capacity_pages={self.capacity_pages}, state={self.state.value})"
        )


def _copy_out(copies: list[tuple[bytes, PageBuffer]]) -> None:
    for data, page in copies:
        page.write(data)
