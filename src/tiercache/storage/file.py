"""`FileBackend`: one file per page in a sharded directory tree.

Layout on disk::

    root/
      3f/<key>.page           a page: format.py header, zero-padded to 4 KiB,
                              then the payload
      3f/.<key>.<pid>.<random>.tmp
                              a write in progress, where O_TMPFILE is missing
                              (or left by a crash)

The shard is the first two hex digits of the page-hash part of the key (the
part after the last ``-``): 256 directories share the pages evenly (a
million pages is about 4,000 files a directory, which ext4 and xfs index by
name). All 256 are created when the backend starts, so a write never pays
for a ``mkdir`` (a fresh two-level tree of 65,536 directories used to cost
more than the page's own bytes). Format version 1 stored pages two levels
deep (``3f/9a/<key>.page``); the scan at start removes those files (they are
stale, see `tiercache.storage.format`) and their empty directories. Keys pass `validate_key`
first, so a key can never name a path outside its shard.

**Atomic writes.** A page is written to an unnamed file in its final
directory (``O_TMPFILE``; optionally fsynced), then published with
``linkat`` to its final name, which fails if the name exists: of two writers
racing on one key (threads or processes), exactly one publishes and the other
sees ``FileExistsError`` and reports the key as stored. The key's first value
is never replaced, and a crash never leaves a torn file under a real name: a
reader sees either no file or a complete one, and a writer killed midway
leaves nothing behind. Where ``O_TMPFILE`` or ``/proc`` is missing (checked
once when the backend starts), the page goes to a named temporary file
``.<key>.<pid>.<random>.tmp`` that is hard-linked, then removed; where the
filesystem refuses hard links, ``os.replace`` is the fallback, and there the
race is last-writer-wins, harmless because two writers of one key store the
same tokens' KV. An existence check (``lstat``) before writing skips the work
for pages already stored. Leftover temporary files are never read as pages;
opening the backend removes those older than ten minutes.

**Damaged entries heal.** Anything other than a regular file standing where a
page file should be (a directory, a fifo, a symbolic link, a socket) is a
miss: a read removes it, counted as a corrupt page, a write removes it
and publishes the page in its place, and ``delete`` and ``clear`` remove it
(no page deleted). Page files are opened with ``O_NOFOLLOW | O_NONBLOCK``,
so a link is never followed and a fifo never blocks a thread.

**A store that cannot remove files** (a read-only mount, another user's
files) still opens and serves what it holds. Removal is best effort where
it is housekeeping: leftovers the scan cannot remove stay, a damaged entry
that cannot be removed is still a miss counted in ``stats.corrupt_pages``
(its warning says it stays), and a file an eviction cannot remove stays on
disk, no longer counted. `delete` and `clear` raise `StorageError`; writes
fail page by page (``False``, counted in ``stats.errors``).

**Reads land once and are checked in place.** A read opens the file, checks
its size with ``fstat``, reads and verifies the small header (key, format,
length, header checksum), then reads the payload with ``preadv`` straight
into the destination page's segments and verifies its XXH3-64 checksum there
(see `tiercache.storage.format`). No scratch buffer, no second copy. The
header is padded to 4 KiB so that the payload starts on a page-cache page: the
kernel then copies it into the page-aligned host page with source and
destination equally aligned, which makes the same ``preadv`` about a third
cheaper than from an odd offset. A file
whose header is damaged (truncated, bad checksum, another key: a swapped
file) never touches the page. A payload whose checksum fails was already read
into the page: the page is reported as not arrived, so its slot is never
published (the storage tier frees it). Either way the file is a miss, logged
as a warning, counted in ``stats.corrupt_pages`` and removed. A file whose
intact header is of another format or length than the target is a good page
read into the wrong buffer: ``batch_get`` raises `InvalidInputError`, the
target is not touched and the file stays. A page of an
older format version is a plain miss (removed, logged at debug level): the
next write stores it anew. A page of a newer version (an upgraded process
sharing the root) is a miss that stays: not damage, and not this version's
to replace. Writes are zero-copy: the header and the page's
segments go to one ``writev`` with no join.

**Threads.** A batch runs on the backend's own threads (``max_concurrency``
of them, named ``tiercache-file``; by default as many as the CPUs this
process may use, at least 2 and at most 16: reads from the page cache and
checksums are CPU work, so more threads than cores only contend). Each
worker takes the batch's next page until none is left, doing that page's
blocking work (open, read/write, checksum, fsync, link, unlink) whole, so a
batch costs one executor hop per worker rather than one per page or per
system call. A page job that has started always finishes, which is what
makes cancellation safe: a cancelled ``batch_get`` or ``batch_set`` starts
no further page and returns only once the started ones are done, so no
thread touches the caller's pages after it regains control. The pages a
cancelled ``batch_set`` did write are indexed and counted like any other
(the capacity bounds them).

**The index.** The backend keeps, on the event loop thread, an ``OrderedDict``
of key to file size in least-recently-used order: the scan at open fills it
from the tree (ordered by file mtime, so LRU survives a restart: with
``capacity_bytes`` a read sets its file's mtime to now), writes, reads and
``batch_exists`` keep it current. It is built on a worker thread in steps
the interpreter may switch between, so opening (or attaching at run time) a
store of a million pages does not hold the event loop. It is a positive cache:
``batch_exists`` counts indexed keys without IO and stats the first key it
does not know (which adopts pages written by another process); a page deleted
by another process stays in the index until a read misses it, and a miss in
``batch_get`` is the truth. A read or a stat that found a file which this
backend deleted, evicted or cleared before the lookup reported back, or is
removing as it reports back, does not index the key again (the read is still a hit: it had the whole file open). With ``capacity_bytes`` it is also the accounting:
a write reserves its size first and evicts least-recently-used files until
the total fits, so the tree stays under the bound even with writes in flight
(a page that does not fit beside the writes in flight, those of its own
batch included, is not stored).
The bound is per open backend, over the pages its index holds: backends in
other processes sharing the root write pages this one does not count, so
two processes with ``capacity_bytes=C`` each may fill up to ``2 * C``
(give each its share of the disk).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import hashlib
import heapq
import itertools
import logging
import os
import secrets
import shutil
import stat
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar
from urllib.parse import unquote, urlsplit

import aiofiles
import aiofiles.os

from tiercache._aio import finish
from tiercache.errors import ConfigError, InvalidInputError, StorageCorruptionError, StorageError
from tiercache.storage.base import BackendState, BackendStats, PageBuffer, PageKey, StorageBackend
from tiercache.storage.format import (
    check_header,
    decode_header,
    header_size,
    is_newer_version,
    is_older_version,
    pack_page,
    verify_in_place,
)
from tiercache.storage.keys import check_batch, validate_key
from tiercache.storage.registry import option_bool, option_int, reject_unknown, url_options

__all__ = ["FileBackend", "default_concurrency"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_SUFFIX = ".page"
_TMP_SUFFIX = ".tmp"
#: A temporary file older than this is a crash leftover, removed on open.
_STALE_TMP_S = 600.0
#: Removals remembered for overlapping lookups before the older ones are pruned.
_REMOVALS_KEPT = 4096
#: writev takes at most IOV_MAX (1024 on Linux) buffers a call.
_IOV_CHUNK = 512
_HEX = frozenset("0123456789abcdef")
_NO_LINK_ERRNOS = {
    errno.EPERM,
    errno.EOPNOTSUPP,
    errno.ENOTSUP,
    errno.EXDEV,
    errno.EMLINK,
    errno.ENOSYS,
}
_OPTIONS = frozenset(
    {"capacity_bytes", "fsync", "max_concurrency", "scan", "dir_mode", "file_mode"}
)


def shard_dir(key: str) -> str:
    """The shard directory name of a key: from its page-hash part, else a hash of it."""
    tail = key.rpartition("-")[2]
    if len(tail) < 2 or not _HEX.issuperset(tail[:2]):
        tail = hashlib.sha256(key.encode()).hexdigest()
    return tail[:2]


#: Every shard directory name, created when a backend starts.
_SHARDS = tuple(f"{i:02x}" for i in range(256))


#: Page files pad their header to this, so the payload starts on a page-cache page.
_ALIGN = 4096


def _stored_size(key: str, page: PageBuffer) -> int:
    return header_size(key, page.format, _ALIGN) + page.nbytes


def default_concurrency() -> int:
    """Threads a backend uses by default: the CPUs this process may use, clamped to [2, 16]."""
    if hasattr(os, "sched_getaffinity"):
        cpus = len(os.sched_getaffinity(0))
    else:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(2, min(16, cpus))


_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_ENTRY_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a fifo"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    for test, name in _ENTRY_KINDS:
        if test(mode):
            return name
    return "not a regular file"


def _octal(name: str, value: Any) -> int:
    if isinstance(value, str):
        try:
            value = int(value.removeprefix("0o"), 8)
        except ValueError as e:
            raise ConfigError(
                f"option {name} must be an octal mode like 0o700, got {value!r}"
            ) from e
    mode = option_int(name, value, minimum=0)
    if mode > 0o777:
        raise ConfigError(f"option {name} must be a permission mode <= 0o777, got {oct(mode)}")
    return mode


@dataclass(slots=True)
class _Result:
    """What one page job reports back to the loop."""

    #: "hit", "miss", "stale", "newer", "corrupt", "refused", "error", "written", "exists"
    status: str
    size: int = 0
    detail: str = ""
    #: A stale or damaged entry: whether it could be removed (a read-only store keeps it).
    removed: bool = True


class FileBackend(StorageBackend):
    """Pages as files under ``root`` (see the module docstring for the design).

    Args:
        root: directory of the store; created (mode ``dir_mode``) when missing.
        capacity_bytes: the most bytes of page files this backend keeps
            (``None``: unbounded); needs ``scan``. Per backend: processes
            sharing ``root`` each bound the pages they know of.
        fsync: fsync each page file and its directory before publishing it
            (durable across power loss; much slower).
        max_concurrency: page jobs run at once (threads of this backend);
            ``None``: `default_concurrency` (the CPUs, clamped to [2, 16]).
        scan: index the existing tree and remove stale temporary files when
            the backend starts.
        dir_mode: permissions of created directories (private by default).
        file_mode: permissions of created files (private by default).

    Raises:
        ConfigError: bad options.

    Construct and use it from one event loop. `open` (or ``from_url``)
    constructs and starts it; a backend constructed directly starts on its
    first call.
    """

    name = "file"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        capacity_bytes: int | None = None,
        fsync: bool = False,
        max_concurrency: int | None = None,
        scan: bool = True,
        dir_mode: int = 0o700,
        file_mode: int = 0o600,
    ) -> None:
        super().__init__()
        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
            raise ConfigError(f"root must be a directory path, got {root!r}")
        self.root = Path(root)
        self._root_str = os.fspath(self.root)
        self.capacity_bytes = (
            None
            if capacity_bytes is None
            else option_int("capacity_bytes", capacity_bytes, minimum=1)
        )
        self.fsync = option_bool("fsync", fsync)
        self.max_concurrency = (
            default_concurrency()
            if max_concurrency is None
            else option_int("max_concurrency", max_concurrency, minimum=1)
        )
        self.scan = option_bool("scan", scan)
        self.dir_mode = _octal("dir_mode", dir_mode)
        self.file_mode = _octal("file_mode", file_mode)
        if self.capacity_bytes is not None and not self.scan:
            raise ConfigError(
                "capacity_bytes needs scan=True: the bound counts the pages already on disk"
            )
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self.max_concurrency, thread_name_prefix="tiercache-file"
        )
        self._index: OrderedDict[str, int] = OrderedDict()
        self._used = 0  # bytes of the indexed pages and of the writes in flight
        self._in_flight = 0  # bytes reserved by writes in flight (bounded backends)
        # Removals (delete, eviction, clear) that lookups in flight must not undo: a
        # read or stat that found a file before it was removed reports it after.
        self._removals = 0  # removal generation, +1 a removal
        self._cleared_at = 0  # the generation of the last clear
        self._removed_at: dict[str, int] = {}  # key -> its generation, while lookups run
        self._lookups: Counter[int] = Counter()  # generations at which lookups in flight began
        self._removing: Counter[str] = Counter()  # keys whose files are being removed now
        self._clearing = 0  # clears running now
        self._started = False
        self._start_lock = asyncio.Lock()
        #: Whether unnamed temporary files (O_TMPFILE + linkat) work under root; set by start.
        self._tmpfile = False
        #: An open fd of the root directory (start to aclose): ``linkat`` needs a directory fd.
        self._root_fd: int | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    @classmethod
    async def open(cls, root: str | os.PathLike[str], **options: Any) -> Self:
        """Construct and start a backend (creates ``root``, scans the tree).

        Raises:
            ConfigError: bad options.
            StorageError: ``root`` cannot be created or read.
        """
        backend = cls(root, **options)
        try:
            await backend.start()
        except BaseException:
            await backend.aclose()
            raise
        return backend

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> Self:
        """Open ``file:///abs/path`` or ``file:relative/path``; query parameters are options.

        Raises:
            ConfigError: a URL with a remote host or no path, or bad options.
        """
        base, opts = url_options(url, options)
        parts = urlsplit(base)
        if parts.scheme != "file":
            raise ConfigError(f"not a file URL: {url!r}")
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(
                f"file URL {url!r} names host {parts.netloc!r}: use file:///abs/path or file:relative/path"
            )
        path = unquote(parts.path)
        if not path:
            raise ConfigError(f"file URL {url!r} has no path")
        reject_unknown(cls.name, opts, _OPTIONS)
        if opts.get("capacity_bytes") in ("", None):
            opts.pop("capacity_bytes", None)
        return await cls.open(path, **opts)

    async def start(self) -> None:
        """Create the root and (with ``scan``) index the tree. Idempotent.

        Raises:
            StorageError: the root cannot be created or read.
        """
        self._check_open()
        if self._started:
            return
        async with self._start_lock:
            if self._started:
                return
            loop = asyncio.get_running_loop()
            try:
                # The index is built (and trimmed to the capacity) on a thread: a
                # million pages would hold the event loop for a second.
                found, removed = await loop.run_in_executor(self._pool, self._scan_job)
                victims = await loop.run_in_executor(self._pool, _trim, found, self.capacity_bytes)
                self._root_fd = await loop.run_in_executor(self._pool, self._open_root)
                self._tmpfile = await loop.run_in_executor(self._pool, self._probe_tmpfile)
            except OSError as e:
                raise StorageError(f"file backend: cannot open {self.root}: {e}") from e
            self._index, self._used = found.pages, found.used
            self._stats.evictions += len(victims)
            self._started = True
            logger.debug(
                "file backend %s: %d pages, %d bytes, %d stale temporary files removed",
                self.root, len(found.pages), self._used, removed,
            )  # fmt: skip
            if victims:
                await self._run([self._evict_job(victims)])

    async def aclose(self) -> None:
        """Close: no new calls, wait for the threads to finish. Idempotent."""
        if self.state is BackendState.CLOSED:
            return
        self.state = BackendState.CLOSED
        self._index.clear()
        await finish(asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True))
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None

    @property
    def publishes_unnamed(self) -> bool:
        """Whether writes go to unnamed ``O_TMPFILE`` files before ``linkat`` publishes them.

        ``False`` before the backend has started, and where the filesystem or
        ``/proc`` lacks them: writes then go to named temporary files.
        """
        return self._tmpfile

    # --- the backend interface ---------------------------------------------------------------

    async def batch_exists(self, keys: Sequence[PageKey]) -> int:
        ks = check_batch(keys)
        await self._ready()
        self._stats.exists_calls += 1
        n = 0
        while n < len(ks) and ks[n] in self._index:
            n += 1
        if n == len(ks):
            return n
        since = self._begin_lookup()
        try:
            (found,) = await self._run([lambda: self._exists_job(ks[n:])])
            for k, size in found:
                if not self._removed_since(k, since):
                    self._adopt(k, size)
        except OSError as e:
            self._stats.errors += 1
            raise StorageError(f"file backend: cannot check {self.root}: {e}") from e
        finally:
            self._end_lookup(since)
        return n + len(found)

    async def batch_get(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        """Read each page file into its target, checked in place (see the module docstring).

        Raises:
            InvalidInputError: a bad key or target (`check_batch`), or a page
                file whose intact header is of another format or length than
                its target (`check_header`): that file stays, its target is
                untouched. The other pages of the batch are read as usual,
                but the call reports none of them.
            StorageError: the backend is closed or cannot start.
        """
        ks = check_batch(keys, pages, targets=True)
        await self._ready()
        since = self._begin_lookup()
        try:
            results = await self._run_each(lambda i: self._read_job(ks[i], pages[i]), len(ks))
            self._check_open()
            failed: list[tuple[str, str]] = []
            out = [
                self._account_read(k, p.nbytes, r, failed, since)
                for k, p, r in zip(ks, pages, results, strict=True)
            ]
        finally:
            self._end_lookup(since)
        self._log_failures("read", failed, len(ks))
        self._stats.get_pages += len(ks)
        refused = next((r for r in results if r.status == "refused"), None)
        if refused is not None:
            raise InvalidInputError(refused.detail)
        return out

    async def batch_set(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        ks = check_batch(keys, pages)
        await self._ready()
        out = [False] * len(ks)
        todo, victims = self._plan_writes(ks, pages, out)
        # Filled as pages finish: a cancelled batch still indexes the pages it wrote.
        results: list[_Result | None] = [None] * len(todo)
        failed: list[tuple[str, str]] = []
        try:
            if victims:
                await self._removing_keys(victims, self._evict_job(victims))
            await self._run_each(
                lambda j: self._write_job(ks[todo[j][0]], pages[todo[j][0]]), len(todo), results
            )
        finally:
            for (i, reserved), r in zip(todo, results, strict=True):
                self._release(reserved)
                if r is not None:
                    out[i] = self._account_write(ks[i], pages[i].nbytes, reserved, r, failed)
            self._log_failures("write", failed, len(ks))
        self._stats.set_pages += len(ks)
        return out

    async def delete(self, keys: Sequence[PageKey]) -> int:
        ks = check_batch(keys)
        await self._ready()
        for k in ks:
            self._forget(k)
        try:
            (n,) = await self._removing_keys(
                ks, lambda: sum(_delete_entry(self._path(k)) for k in dict.fromkeys(ks))
            )
        except OSError as e:
            self._stats.errors += 1
            raise StorageError(f"file backend: cannot delete from {self.root}: {e}") from e
        return n

    async def clear(self) -> None:
        await self._ready()
        self._index.clear()
        self._used = 0
        self._note_cleared()
        self._clearing += 1
        try:
            await self._run([self._clear_job])
        except OSError as e:
            self._stats.errors += 1
            raise StorageError(f"file backend: cannot clear {self.root}: {e}") from e
        finally:
            self._clearing -= 1
            self._note_cleared()  # lookups that began while the files were being removed

    # --- raw access (tools and fault injection; not a hot path) ----------------------------

    async def read_raw(self, key: PageKey) -> bytes | None:
        """The stored file of ``key`` exactly as it is on disk (header included), or ``None``.

        For tools and for `FaultyBackend.corrupt_stored`: nothing is checked.
        Uses aiofiles, one whole-file read.
        """
        k = validate_key(key)
        await self._ready()
        try:
            async with aiofiles.open(self._path(k), "rb") as f:
                return await f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageError(f"file backend: cannot read {k}: {e}") from e

    async def write_raw(self, key: PageKey, data: bytes) -> None:
        """Replace the stored file of ``key`` with ``data`` verbatim (no header, no checks).

        Meant for damaging a page on purpose in tests; a real write goes
        through `batch_set`. Written in place (not atomically), as damage at
        rest would be.
        """
        k = validate_key(key)
        await self._ready()
        path = self._path(k)
        try:
            await aiofiles.os.makedirs(os.path.dirname(path), mode=self.dir_mode, exist_ok=True)
            mode = self.file_mode
            async with aiofiles.open(path, "wb", opener=lambda p, fl: os.open(p, fl, mode)) as f:
                await f.write(data)
        except OSError as e:
            raise StorageError(f"file backend: cannot write {k}: {e}") from e
        self._forget(k)
        self._adopt(k, len(data))

    async def stats(self) -> BackendStats:
        s = await super().stats()
        s.extra.update(pages=len(self._index), bytes=self._used)
        return s

    def __repr__(self) -> str:
        return (
            f"FileBackend({str(self.root)!r}, pages={len(self._index)}, bytes={self._used}, "
            f"capacity_bytes={self.capacity_bytes}, state={self.state.value})"
        )

    # --- loop-side helpers -------------------------------------------------------------------

    async def _ready(self) -> None:
        self._check_open()
        if not self._started:
            await self.start()

    def _path(self, key: str) -> str:
        # Plain strings: pathlib's joins cost more than the open() they feed.
        return f"{self._root_str}/{shard_dir(key)}/{key}{_SUFFIX}"

    def _adopt(self, key: str, size: int) -> None:
        if key not in self._index:
            self._index[key] = size
            self._used += size

    def _forget(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size

    def _pick_victims(self, incoming: int) -> list[str]:
        """Drop least-recently-used keys from the index until ``incoming`` more bytes fit."""
        assert self.capacity_bytes is not None
        victims: list[str] = []
        while self._index and self._used + incoming > self.capacity_bytes:
            k, size = self._index.popitem(last=False)
            self._used -= size
            self._stats.evictions += 1
            victims.append(k)
        return victims

    def _begin_lookup(self) -> int:
        """Note a read or stat starting now; returns the generation to give `_end_lookup`."""
        self._lookups[self._removals] += 1
        return self._removals

    def _end_lookup(self, since: int) -> None:
        self._lookups[since] -= 1
        if not self._lookups[since]:
            del self._lookups[since]
        if not self._lookups:
            self._removed_at.clear()
        elif len(self._removed_at) > _REMOVALS_KEPT:  # lookups overlap without a pause
            oldest = min(self._lookups)
            self._removed_at = {k: g for k, g in self._removed_at.items() if g > oldest}

    async def _removing_keys(self, keys: Sequence[str], job: Callable[[], _T]) -> list[_T]:
        """Run ``job``, which removes the files of ``keys``, so that no lookup re-indexes them.

        A lookup that ends while the job runs, or that began before it ended,
        found a file that is going or gone (see `_removed_since`).
        """
        for k in keys:
            self._note_removed(k)
        self._removing.update(keys)
        try:
            return await self._run([job])
        finally:
            self._removing.subtract(keys)
            for k in keys:
                if self._removing[k] <= 0:
                    del self._removing[k]
                self._note_removed(k)

    def _note_removed(self, key: str) -> None:
        """``key``'s file is being removed: lookups in flight must not re-index it."""
        self._removals += 1
        if self._lookups:
            self._removed_at[key] = self._removals

    def _note_cleared(self) -> None:
        self._removals += 1
        self._cleared_at = self._removals

    def _removed_since(self, key: str, since: int) -> bool:
        """Whether ``key`` was deleted, evicted or cleared after generation ``since``, or is now."""
        return (
            self._clearing > 0
            or key in self._removing
            or self._cleared_at > since
            or self._removed_at.get(key, 0) > since
        )

    def _account_read(
        self, key: str, nbytes: int, r: _Result, failed: list[tuple[str, str]], since: int
    ) -> bool:
        """Fold one page read into the index and the stats; whether the page arrived.

        A hit on a file removed (deleted, evicted) since generation ``since``,
        when the read began, is still a hit (it was read whole), but the key
        is not indexed again: its file is gone.

        ``stats.bytes_read`` counts the page's ``nbytes``, as every backend
        does (not the file's header); the index keeps the file's size.

        A read that failed (not a miss, not damage) is added to ``failed``.
        """
        if r.status == "hit":
            if key in self._index or not self._removed_since(key, since):
                self._adopt(key, r.size)
                self._index.move_to_end(key)
            self._stats.get_hits += 1
            self._stats.bytes_read += nbytes
            return True
        if r.status == "refused":  # the target was wrong; the file is still there
            return False
        if r.status == "newer":  # an upgraded process's page: not ours to read or remove
            self._forget(key)
            logger.debug("file backend %s: page %s: %s", self.root, key, r.detail)
            return False
        self._forget(key)
        fate = "was removed" if r.removed else "could not be removed (it stays a miss)"
        if r.status == "stale":
            logger.debug("file backend %s: page %s: %s, %s", self.root, key, r.detail, fate)
        elif r.status == "corrupt":
            self._stats.corrupt_pages += 1
            logger.warning(
                "file backend %s: page %s failed its checks and %s: %s",
                self.root, key, fate, r.detail,
            )  # fmt: skip
        elif r.status == "error":
            self._stats.errors += 1
            failed.append((key, r.detail))
        return False

    def _plan_writes(
        self, keys: Sequence[str], pages: Sequence[PageBuffer], out: list[bool]
    ) -> tuple[list[tuple[int, int]], list[str]]:
        """Which positions of a batch to write, with the bytes reserved for each; the victims.

        Keys already stored (or repeated in the batch) are marked ``True`` in
        ``out`` (first writer wins). With a capacity, each write reserves its
        size now and least-recently-used keys are dropped from the index until
        the total fits; the returned victims' files are for the caller to remove.
        """
        todo: list[tuple[int, int]] = []  # (position, reserved bytes)
        victims: list[str] = []
        seen: set[str] = set()
        for i, (k, page) in enumerate(zip(keys, pages, strict=True)):
            if k in self._index or k in seen:
                out[i] = True
                continue
            size = _stored_size(k, page)
            if self.capacity_bytes is not None:
                if size > self.capacity_bytes:
                    logger.debug("file backend: page %s (%d bytes) exceeds the capacity", k, size)
                    continue
                if self._in_flight + size > self.capacity_bytes:
                    # Writes in flight (this batch's earlier pages included) hold the
                    # rest, and they cannot be evicted: this page is not stored.
                    logger.debug("file backend: no room for page %s beside writes in flight", k)
                    continue
                self._used += size
                self._in_flight += size
                victims += self._pick_victims(0)
            seen.add(k)
            todo.append((i, size))
        return todo, victims

    def _release(self, reserved: int) -> None:
        """Give back bytes that `_plan_writes` reserved (only a bounded backend reserves)."""
        if self.capacity_bytes is not None:
            self._used -= reserved
            self._in_flight -= reserved

    def _account_write(
        self, key: str, nbytes: int, reserved: int, r: _Result, failed: list[tuple[str, str]]
    ) -> bool:
        """Fold one page write into the index and the stats; whether the key is stored.

        ``stats.bytes_written`` counts the page's ``nbytes`` (see `_account_read`).

        A write that failed is added to ``failed``.
        """
        if r.status not in ("written", "exists"):
            self._stats.errors += 1
            failed.append((key, r.detail))
            return False
        self._adopt(key, r.size or reserved)
        if r.status == "written":
            self._stats.set_written += 1
            self._stats.bytes_written += nbytes
        return True

    def _log_failures(self, verb: str, failed: Sequence[tuple[str, str]], n: int) -> None:
        """One warning for a batch's failed reads or writes, however many.

        A full disk or a read-only store fails every page of a batch: one line
        per page would flood the log (and hold the event loop while it does).
        """
        if failed:
            key, detail = failed[0]
            logger.warning(
                "file backend %s: cannot %s %d of %d pages (first: %s: %s)",
                self.root, verb, len(failed), n, key, detail,
            )  # fmt: skip

    async def _run(self, jobs: Sequence[Callable[[], _T]]) -> list[_T]:
        """Run blocking jobs on the backend's threads; all or none, even when cancelled.

        If the calling task is cancelled, jobs not yet started are cancelled
        and those running are waited for before `CancelledError` propagates.
        """
        if not jobs:
            return []
        cfs = [self._pool.submit(job) for job in jobs]
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(cf) for cf in cfs)))
        except asyncio.CancelledError:
            for cf in cfs:
                cf.cancel()
            running = [cf for cf in cfs if not cf.done()]
            if running:
                await finish(
                    asyncio.get_running_loop().run_in_executor(
                        None, concurrent.futures.wait, running
                    )
                )
            raise

    async def _run_each(
        self, job: Callable[[int], _T], n: int, into: list[_T | None] | None = None
    ) -> list[_T]:
        """``[job(0), ..., job(n - 1)]``, run on the backend's threads; all started ones finish.

        At most ``max_concurrency`` workers each take the next index until
        none is left: one executor hop per worker, not per page. Once the
        calling task is cancelled (the moment ``cancel()`` is called) or a job
        raises, no further index starts, and the running ones are waited for
        before the exception propagates. ``into`` (``n`` long), when given,
        receives each result as its job returns, so a caller that is
        cancelled still sees which jobs ran (the others stay ``None``).
        """
        if n == 0:
            return []
        loop = asyncio.get_running_loop()
        batch = _Batch(loop=loop)
        finished: asyncio.Future[None] = loop.create_future()
        results: list[_T | None] = [None] * n if into is None else into
        counter = itertools.count()
        workers = min(self.max_concurrency, n)
        left = [workers]
        errors: list[BaseException] = []
        lock = threading.Lock()

        def worker() -> None:
            try:
                while not batch.stopped:
                    i = next(counter)  # atomic under the GIL: each index runs once
                    if i >= n:
                        break
                    results[i] = job(i)
            except BaseException as e:
                batch.stopped = True
                errors.append(e)
            finally:
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    loop.call_soon_threadsafe(_settle, batch, finished, errors)

        for _ in range(workers):
            self._pool.submit(worker)
        try:
            await batch
        except asyncio.CancelledError:
            await finish(finished)
            raise
        return results  # type: ignore[return-value]  # every index ran

    def _evict_job(self, victims: list[str]) -> Callable[[], Any]:
        return lambda: [_discard(self._path(k)) for k in victims]

    # --- jobs: run on the backend's threads, never touch loop state -------------------------

    def _read_job(self, key: str, page: PageBuffer) -> _Result:
        path = self._path(key)
        try:
            try:
                fd = os.open(path, _READ_FLAGS)
            except (FileNotFoundError, NotADirectoryError):
                return _Result("miss")
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                return _Result(  # O_NOFOLLOW met a symbolic link
                    "corrupt",
                    detail="a symbolic link stands where the page should be",
                    removed=_remove_entry(path),
                )
            try:
                result = self._read_fd(fd, key, page)
                if result.status == "hit" and self.capacity_bytes is not None:
                    _touch(fd)
            except StorageCorruptionError as e:
                result = _Result("corrupt", detail=str(e))
            except InvalidInputError as e:  # a good file, the wrong target: keep the file
                result = _Result("refused", detail=str(e))
            finally:
                os.close(fd)
            if result.status not in ("hit", "refused", "newer"):
                result.removed = _remove_entry(path)
            return result
        except OSError as e:
            return _Result("error", detail=f"{type(e).__name__}: {e}")

    @staticmethod
    def _read_fd(fd: int, key: str, page: PageBuffer) -> _Result:
        """Read and verify one page file into ``page``: a hit with the file's size, or why not.

        Five system calls a page (``open``, ``fstat``, ``pread`` of the
        header, one ``preadv`` of the payload into the page, ``close``), the
        same as a plain ``open``/``readinto``/``close``; the payload is then
        hashed where it landed. Nothing reaches ``page`` before the header
        and the file's size have passed their checks.

        Raises:
            StorageCorruptionError: the header or the payload checksum is wrong.
            InvalidInputError: the header is intact but ``page`` has another
                format or length (nothing was read into it).
            OSError: the read failed.
        """
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return _Result("corrupt", detail=f"{_kind(st.st_mode)} stands where the page should be")
        # As long as this backend's own headers (a file with more padding fails its checks).
        head = os.pread(fd, header_size(key, page.format, _ALIGN), 0)
        if is_older_version(head):
            return _Result("stale", detail="a page of an older format version")
        if is_newer_version(head):
            return _Result("newer", detail="a page of a newer format version, kept")
        # Decode what is there first: a wrong key or format says more than a size.
        h = decode_header(head)
        check_header(h, key, page)
        hlen = h.header_len  # any padding is read; this backend writes 4 KiB headers
        if st.st_size != hlen + page.nbytes:
            return _Result(
                "corrupt", detail=f"file is {st.st_size} bytes, expected {hlen + page.nbytes}"
            )
        if _preadv_all(fd, page.segments, hlen) != page.nbytes:
            return _Result("corrupt", detail="file shrank while it was read")
        verify_in_place(key, h, page)
        return _Result("hit", st.st_size)

    def _mkdirs(self, directory: str) -> None:
        for d in (self._root_str, directory):
            try:
                os.mkdir(d, self.dir_mode)
            except FileExistsError:
                pass
            except FileNotFoundError:
                os.makedirs(os.path.dirname(d), exist_ok=True)
                os.makedirs(d, self.dir_mode, exist_ok=True)

    def _write_job(self, key: str, page: PageBuffer) -> _Result:
        path = self._path(key)
        try:
            if _is_page_file(path):
                return _Result("exists")
            parts = pack_page(key, page, _ALIGN)
            size = sum(memoryview(p).nbytes for p in parts)
            if self._tmpfile:
                return self._publish_unnamed(path, parts, size)
            return self._publish_named(path, parts, size)
        except OSError as e:
            return _Result("error", detail=f"{type(e).__name__}: {e}")

    def _open_in(self, directory: str, open_fn: Callable[[], int]) -> int:
        try:
            return open_fn()
        except FileNotFoundError:
            self._mkdirs(directory)
            return open_fn()

    def _publish_unnamed(
        self, path: str, parts: Sequence[bytes | memoryview], size: int
    ) -> _Result:
        """Write to an ``O_TMPFILE`` file in ``path``'s directory, then ``linkat`` it in place."""
        flags = os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC
        directory = os.path.dirname(path)
        fd = self._open_in(directory, lambda: os.open(directory, flags, self.file_mode))
        try:
            _writev_all(fd, parts)
            if self.fsync:
                os.fsync(fd)
            # An absolute source with a directory fd: linkat(..., AT_SYMLINK_FOLLOW),
            # which links the open file itself (plain link() would refuse /proc links).
            published = _link_first(
                f"/proc/self/fd/{fd}", path, src_dir_fd=self._root_fd, follow=True
            )
        finally:
            os.close(fd)
        if not published:
            return _Result("exists", size)
        if self.fsync:
            _fsync_dir(directory)
        return _Result("written", size)

    def _publish_named(self, path: str, parts: Sequence[bytes | memoryview], size: int) -> _Result:
        """Write to a named temporary file, then hard-link it in place (or rename it)."""
        directory, name = os.path.split(path)
        key = name[: -len(_SUFFIX)]
        tmp = f"{directory}/.{key}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = self._open_in(directory, lambda: os.open(tmp, flags, self.file_mode))
        try:
            try:
                _writev_all(fd, parts)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                if not _link_first(tmp, path):
                    return _Result("exists", size)
            except OSError as e:
                if e.errno not in _NO_LINK_ERRNOS:
                    raise
                os.replace(tmp, path)
            if self.fsync:
                _fsync_dir(directory)
            return _Result("written", size)
        finally:
            _unlink(tmp)

    def _open_root(self) -> int | None:
        try:
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None

    def _probe_tmpfile(self) -> bool:
        """Whether ``O_TMPFILE`` plus ``linkat`` through ``/proc`` work under the root."""
        if not hasattr(os, "O_TMPFILE") or self._root_fd is None:
            return False
        probe = self.root / f".probe.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
        try:
            fd = os.open(self.root, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, self.file_mode)
            try:
                os.link(f"/proc/self/fd/{fd}", probe, src_dir_fd=self._root_fd)
            finally:
                os.close(fd)
        except OSError:
            return False
        return _discard(probe)  # a store that cannot remove files writes named ones

    def _exists_job(self, keys: Sequence[str]) -> list[tuple[str, int]]:
        found: list[tuple[str, int]] = []
        for k in keys:
            try:
                st = os.lstat(self._path(k))
            except (FileNotFoundError, NotADirectoryError):
                break
            if not stat.S_ISREG(st.st_mode):
                break  # a damaged entry is a miss (a read or a write heals it)
            found.append((k, st.st_size))
        return found

    def _shards(self) -> list[Path]:
        return [Path(e.path) for e in _list_dirs(self.root)]

    def _make_shards(self) -> None:
        """Create the root and any of the 256 shard directories that are missing."""
        if not self.root.exists():
            os.makedirs(self.root.parent, exist_ok=True)
            try:
                os.mkdir(self.root, self.dir_mode)
            except FileExistsError:
                pass
        have = {e.name for e in _list_dirs(self.root)}
        for name in _SHARDS:
            if name not in have:
                try:
                    os.mkdir(os.path.join(self.root, name), self.dir_mode)
                except FileExistsError:
                    pass  # another process made it, or a file stands there (writes report it)
                except OSError as e:  # a read-only store: it holds no page there anyway
                    logger.debug("file backend %s: cannot make shard %s: %s", self.root, name, e)

    def _scan_job(self) -> tuple[_Index, int]:
        """Make the shards; index ``*.page`` files oldest first; remove stale files.

        Stale: temporary files older than ten minutes, and format version 1
        pages in the old two-level tree (``ab/cd/<key>.page``).
        """
        self._make_shards()
        if not self.scan:
            return _index_of(()), 0
        # One sorted run a shard, merged: no single sort of the whole tree, which
        # would hold the GIL (and so the event loop) for as long as it takes.
        runs: list[list[tuple[float, str, int]]] = []
        removed = 0
        stale_before = time.time() - _STALE_TMP_S
        for shard in self._shards():
            pages: list[tuple[float, str, int]] = []
            runs.append(pages)
            with os.scandir(shard) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if e.name.startswith(".") and e.name.endswith(_TMP_SUFFIX):
                        if st.st_mtime < stale_before:
                            removed += _discard(e.path)
                    elif e.name.endswith(_SUFFIX) and stat.S_ISREG(st.st_mode):
                        pages.append((st.st_mtime, e.name[: -len(_SUFFIX)], st.st_size))
            pages.sort()
            for old in _list_dirs(shard):  # the version 1 layout
                removed += _remove_page_files(Path(old.path), rmdir=True, strict=False)
        return _index_of((k, size) for _, k, size in heapq.merge(*runs)), removed

    def _clear_job(self) -> None:
        # The shard directories stay: the next writes need them.
        for shard in self._shards():
            _remove_page_files(shard, rmdir=False, strict=True)
            for old in _list_dirs(shard):
                _remove_page_files(Path(old.path), rmdir=True, strict=True)


@dataclass(slots=True)
class _Index:
    """An index built off the loop: key to file size, least recently used first."""

    pages: OrderedDict[str, int]
    used: int


def _index_of(pages: Iterable[tuple[str, int]]) -> _Index:
    """The index of ``(key, file size)`` pairs, least recently used first.

    A Python loop, not one ``OrderedDict(pages)`` call: the interpreter can
    switch threads between its steps, so the event loop keeps turning while a
    worker thread indexes a million pages.
    """
    index: OrderedDict[str, int] = OrderedDict()
    used = 0
    for k, size in pages:
        index[k] = size
        used += size
    return _Index(index, used)


def _trim(index: _Index, capacity: int | None) -> list[str]:
    """Drop least-recently-used keys from ``index`` until it fits ``capacity``; the dropped keys."""
    victims: list[str] = []
    while capacity is not None and index.pages and index.used > capacity:
        k, size = index.pages.popitem(last=False)
        index.used -= size
        victims.append(k)
    return victims


def _touch(fd: int) -> None:
    """Set an open page file's mtime to now: the scan at open orders pages by it (LRU).

    Best effort: a file this process may not change (another user's, a
    read-only mount) keeps its time, and the read still counts as a hit.
    """
    try:
        os.utime(fd)
    except OSError:
        pass


def _unlink(path: str | Path) -> bool:
    """Remove the file at ``path``; ``False`` if it was already gone (or its shard is no directory).

    Raises:
        OSError: the file is there and cannot be removed (a read-only store,
            another user's directory).
    """
    try:
        os.unlink(path)
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False


def _discard(path: str | Path) -> bool:
    """`_unlink`, best effort: a file that cannot be removed stays (logged); ``False`` then."""
    try:
        return _unlink(path)
    except OSError as e:
        logger.debug("file backend: cannot remove %s: %s", path, e)
        return False


def _remove_page_files(directory: Path, *, rmdir: bool, strict: bool) -> int:
    """Unlink the ``*.page`` and ``*.tmp`` files of ``directory`` (then the directory if empty).

    A damaged entry under such a name (a directory, a link, a fifo) is
    removed too, best effort, and not counted. ``strict``: a file that cannot
    be removed raises `OSError`; otherwise it stays (the scan at start cleans
    up best effort: a read-only store still opens).
    """
    try:
        with os.scandir(directory) as it:
            entries = [
                (e.path, e.is_file(follow_symlinks=False))
                for e in it
                if e.name.endswith((_SUFFIX, _TMP_SUFFIX))
            ]
    except (FileNotFoundError, NotADirectoryError):
        return 0
    n = 0
    for path, regular in entries:
        if regular:
            n += (_unlink if strict else _discard)(path)
        else:
            _remove_entry(path)
    if rmdir:
        try:
            os.rmdir(directory)
        except OSError:
            pass  # not empty: something else lives there
    return n


def _list_dirs(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return [
                e
                for e in it
                if len(e.name) == 2 and _HEX.issuperset(e.name) and e.is_dir(follow_symlinks=False)
            ]
    except FileNotFoundError:
        return []


class _Batch(asyncio.Future[None]):
    """Done when every worker of a batch has returned; cancelling it stops the batch at once.

    ``Task.cancel`` calls the awaited future's ``cancel`` synchronously, so
    ``stopped`` is set before the loop runs anything else: no worker takes a
    further page after the caller was cancelled.
    """

    stopped = False

    def cancel(self, msg: Any | None = None) -> bool:
        self.stopped = True
        return super().cancel(msg)


def _settle(batch: _Batch, finished: asyncio.Future[None], errors: list[BaseException]) -> None:
    """On the loop: every worker of ``batch`` has returned."""
    finished.set_result(None)
    if not batch.done():
        if errors:
            batch.set_exception(errors[0])
        else:
            batch.set_result(None)


def _is_page_file(path: str | Path) -> bool:
    """Whether a regular file stands at ``path``; anything else found there is removed."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    if stat.S_ISREG(st.st_mode):
        return True
    _remove_entry(path)
    return False


def _delete_entry(path: str) -> bool:
    """Remove the page file at ``path``: whether one was there.

    A damaged entry there (a directory, a link, a fifo) is removed too, best
    effort, and is no page.

    Raises:
        OSError: a page file is there and cannot be removed.
    """
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    if stat.S_ISREG(st.st_mode):
        return _unlink(path)
    _remove_entry(path)
    return False


def _remove_entry(path: str | Path) -> bool:
    """Remove whatever stands at ``path`` (file, link, fifo, directory tree); never follows links.

    Best effort: ``False`` when it is still there (a read-only store), ``True``
    when it is gone.
    """
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    if not stat.S_ISDIR(st.st_mode):
        return _discard(path) or not os.path.lexists(path)
    shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: links inside are not followed
    return not os.path.lexists(path)


def _link_first(
    src: str, path: str | Path, *, src_dir_fd: int | None = None, follow: bool = False
) -> bool:
    """Hard-link ``src`` at ``path``; ``False`` if a page file is already there (first writer wins).

    A damaged entry (not a regular file) in the way is removed and the link
    tried once more.

    Raises:
        OSError: the link failed, or the entry came back.
    """
    for attempt in range(2):
        try:
            if follow:
                os.link(src, path, src_dir_fd=src_dir_fd, follow_symlinks=True)
            else:
                os.link(src, path)
            return True
        except FileExistsError:
            if _is_page_file(path):
                return False
            if attempt:
                raise
    return False  # pragma: no cover - the loop returns or raises


def _preadv_all(fd: int, segments: Sequence[memoryview], offset: int) -> int:
    """Read into ``segments`` from ``offset`` with ``preadv``; returns bytes read (short at EOF)."""
    bufs = list(segments)
    total = 0
    while bufs:
        n = os.preadv(fd, bufs[:_IOV_CHUNK], offset + total)
        if n == 0:
            break
        total += n
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]
    return total


def _writev_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    """Write every part, in order, with as few ``writev`` calls as the kernel allows."""
    bufs = [memoryview(p).cast("B") for p in parts]
    while bufs:
        n = os.writev(fd, bufs[:_IOV_CHUNK])
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]


def _fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
