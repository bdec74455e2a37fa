"""`StorageBackend`: the async interface of every L3 storage tier."""

from __future__ import annotations

import enum
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

from tiercache._resource import AsyncResource
from tiercache.errors import BackendUnavailableError
from tiercache.memory.pages import PageBuffer

__all__ = ["BackendState", "BackendStats", "PageBuffer", "PageKey", "StorageBackend"]

#: A storage key: the identity namespace and the page's hash chain value,
#: e.g. ``"3f9a0c1d2b4e5f60-cf97adee...b72"``. Only ``[0-9A-Za-z_.-]``, at most 200
#: characters, never starting with ``.`` (`tiercache.storage.keys.validate_key`).
PageKey = NewType("PageKey", str)


class BackendState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


@dataclass(slots=True)
class BackendStats:
    """Counters every backend keeps (a backend may add its own in ``extra``).

    ``evictions`` counts the pages a backend dropped to stay within its own
    capacity: never the ones ``delete`` or ``clear`` removed, nor damaged
    pages dropped on read (those are ``corrupt_pages``).
    """

    exists_calls: int = 0
    get_pages: int = 0
    get_hits: int = 0
    set_pages: int = 0
    set_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    corrupt_pages: int = 0
    evictions: int = 0
    errors: int = 0
    extra: dict[str, int | float | str] = field(default_factory=dict)


class StorageBackend(AsyncResource):
    """An async map from page key to one page's bytes.

    Every method is a coroutine called from the event loop that owns the
    backend; blocking work (disk, sockets, checksums of large pages) runs off
    the loop. A backend is an async resource: ``async with backend:`` closes it
    on exit, ``aclose()`` is idempotent, any call after close raises
    `BackendUnavailableError`.

    Every call checks its keys with `tiercache.storage.keys.check_batch`
    before any I/O, so a key one backend refuses (`InvalidInputError`) every
    backend refuses.

    Failures raise `StorageError` subclasses, which callers treat as a miss.
    A page that fails its own checks when read (corrupt, truncated, another
    key's) is a miss: ``batch_get`` reports it as not arrived and the backend
    removes it. A missing page, or one whose header fails, leaves the target
    untouched; a backend that reads straight into the target (the file
    backend) may have written a page whose payload checksum then failed, so a
    caller never uses a target reported as not arrived.

    A target that cannot take the stored page is the caller's mistake, not
    damage: a read-only target, one whose segments do not add up to its
    ``nbytes`` (refused before any I/O), or one of another format or length
    than the intact page stored under its key (another dtype, layout or page
    size). ``batch_get`` raises `InvalidInputError`, that target is not
    written and every stored page stays; a call that raises reports no page
    of its batch as arrived.

    The cache checks the shape of every answer: ``batch_exists`` must return
    an int, ``batch_get`` and ``batch_set`` a list of one flag per page; any
    other answer is a failed call (a miss, a skipped backup). It cannot check
    the bytes: a ``True`` from ``batch_get`` promises that the buffer holds
    exactly what was stored under the key, and the cache uses it as is, so a
    backend verifies its pages before it says so (the built-in ones store a
    header with checksums, `tiercache.storage.format`). A call past the
    deadline is cancelled and awaited to its end before its buffers are
    reused: a backend must let cancellation through, or the caller waits.
    """

    #: URL scheme / registry name of the backend class, e.g. ``"file"``.
    name: str = "abstract"

    def __init__(self) -> None:
        self.state = BackendState.OPEN
        self._stats = BackendStats()

    @abstractmethod
    async def batch_exists(self, keys: Sequence[PageKey]) -> int:
        """How many of ``keys``, counted from the first, are stored (stops at the first miss)."""

    @abstractmethod
    async def batch_get(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        """Read each key's bytes into the matching page buffer.

        Returns:
            Per page, whether it arrived. The buffer of a page that did not
            arrive must not be used: a missing page or a failed header leaves
            it untouched, a failed payload checksum may have overwritten it.

        Raises:
            InvalidInputError: a bad key, or a target that cannot take its
                page (see the class docstring): nothing stored is removed.
        """

    @abstractmethod
    async def batch_set(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        """Store each page under its key; an existing key keeps its first value.

        Returns:
            Per page, whether the key now holds the page (``True`` too when it
            already existed).
        """

    @abstractmethod
    async def delete(self, keys: Sequence[PageKey]) -> int:
        """Remove the keys; returns how many existed."""

    @abstractmethod
    async def clear(self) -> None:
        """Remove every page this backend holds (in its namespace / prefix)."""

    async def stats(self) -> BackendStats:
        """A snapshot of the counters."""
        s = self._stats
        return BackendStats(
            **{f: getattr(s, f) for f in s.__dataclass_fields__ if f != "extra"},
            extra=dict(s.extra),
        )

    async def aclose(self) -> None:
        """Release resources. Idempotent."""
        self.state = BackendState.CLOSED

    def _check_open(self) -> None:
        if self.state is BackendState.CLOSED:
            raise BackendUnavailableError(f"the {self.name} backend is closed")

    async def _aenter(self) -> None:
        self._check_open()
