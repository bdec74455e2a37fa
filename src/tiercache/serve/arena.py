"""The page arena: one shared-memory file that the server and its clients map.

The arena is a file under ``/dev/shm`` (POSIX shared memory by another
name: tmpfs pages, no disk), cut into fixed-size *blocks*. A page takes as
many blocks as its bytes need, not necessarily adjacent: its place in the
arena is a short list of *extents* ``(offset, length)``, adjacent blocks
merged, so pages of any size (any model, dtype, page size) share one arena
without external fragmentation, at the cost of at most one partly used block
per page. `copy_into` and `copy_out_of` move a page's bytes between a
`PageBuffer`'s segments and extents in one pass, whatever their boundaries.

Access is the file's mode: ``0600`` (the server's user only) by default,
``0660`` and the given group with ``group``. Every process that can map the
arena can read every page in it: one arena per trust domain.

Nothing here touches an event loop; creating and mapping do a few syscalls
on tmpfs (no device I/O).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Sequence

import numpy as np

from tiercache.memory.pages import PageBuffer

__all__ = ["Arena", "ArenaInUseError", "Extent", "copy_into", "copy_out_of", "extents_of"]

#: ``(offset, length)`` of one run of the arena.
Extent = tuple[int, int]


def extents_of(blocks: Sequence[int], block_bytes: int, nbytes: int) -> list[Extent]:
    """The extents of a page of ``nbytes`` held in ``blocks`` (in order), adjacent runs merged."""
    out: list[list[int]] = []
    left = nbytes
    for b in blocks:
        n = min(block_bytes, left)
        off = b * block_bytes
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += n
        else:
            out.append([off, n])
        left -= n
    assert left == 0, "blocks too few for the page"
    return [(o, n) for o, n in out]


def _scatter(srcs: Sequence[memoryview], dsts: Sequence[memoryview]) -> None:
    """Copy the concatenation of ``srcs`` into the concatenation of ``dsts`` (equal totals).

    The copies are numpy's, which release the GIL (a memoryview slice
    assignment holds it), so that copies of several pages run in parallel
    threads.
    """
    si = di = so = do = 0
    src_arrays = [np.frombuffer(m, dtype=np.uint8) for m in srcs]
    dst_arrays = [np.frombuffer(m, dtype=np.uint8) for m in dsts]
    while si < len(srcs) and di < len(dsts):
        s, d = src_arrays[si], dst_arrays[di]
        n = min(s.nbytes - so, d.nbytes - do)
        np.copyto(d[do : do + n], s[so : so + n])
        so += n
        do += n
        if so == s.nbytes:
            si, so = si + 1, 0
        if do == d.nbytes:
            di, do = di + 1, 0


class ArenaInUseError(OSError):
    """Another live server holds this arena (its lock is taken)."""


class Arena:
    """A shared-memory file of ``nbytes``, mapped read-write into this process.

    The server *owns* its arena: it holds an exclusive ``flock`` on the file
    for as long as it runs, so that a second server pointed at the same file
    (by mistake, with another socket) is refused instead of wiping the pages
    of the first. Clients map without locking.

    Args:
        path: the file (``/dev/shm/...`` for shared memory).
        nbytes: its size; the server creates it, a client maps what it finds.
        create: make a new file (replacing a stale one left by a dead
            server), sized ``nbytes``, mode ``0600`` or ``0660`` with ``gid``;
            the caller owns it.
        gid: the group that may map the arena (``None``: the owner only).

    Raises:
        ArenaInUseError: ``create``, and a live server owns the file.
        OSError: the file cannot be created, opened or mapped.
    """

    def __init__(self, path: str, nbytes: int, *, create: bool, gid: int | None = None) -> None:
        self.path = path
        self.nbytes = nbytes
        #: The server's name for this arena's life (set by a client from ``hello``).
        self.arena_id = ""
        self._lock_fd: int | None = None
        mode = 0o600 if gid is None else 0o660
        if create:
            _check_unowned(path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        else:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            if create:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.fchmod(fd, mode)  # the umask may have taken bits away
                if gid is not None:
                    os.fchown(fd, -1, gid)
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size < nbytes:
                raise OSError(f"arena {path} is smaller than the {nbytes} bytes announced")
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.inode = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            if create:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
        if create:
            self._lock_fd = fd  # the lock lives as long as this descriptor
        else:
            os.close(fd)
        self._view = memoryview(self._map)

    @classmethod
    def adopt(cls, path: str, nbytes: int, *, gid: int | None = None) -> Arena:
        """Own and map an arena left by an earlier server, if it is exactly ``nbytes``.

        Raises:
            ArenaInUseError: a live server owns it.
            OSError: no such file, or one of another size.
        """
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as e:
                raise ArenaInUseError(f"arena {path} is in use by another server") from e
            if os.fstat(fd).st_size != nbytes:
                raise OSError(f"arena {path} is not {nbytes} bytes")
            os.fchmod(fd, 0o600 if gid is None else 0o660)
            if gid is not None:
                os.fchown(fd, -1, gid)
            arena = cls(path, nbytes, create=False)
        except BaseException:
            os.close(fd)
            raise
        arena._lock_fd = fd
        return arena

    def views(self, extents: Sequence[Extent]) -> list[memoryview]:
        """Writable views of ``extents`` (checked to lie inside the arena).

        Raises:
            ValueError: an extent outside the arena.
        """
        out = []
        for off, n in extents:
            if off < 0 or n <= 0 or off + n > self.nbytes:
                raise ValueError(f"extent ({off}, {n}) is outside the {self.nbytes}-byte arena")
            out.append(self._view[off : off + n])
        return out

    def page(self, extents: Sequence[Extent], format: str) -> PageBuffer:
        """A `PageBuffer` whose segments are the arena's memory itself (zero-copy)."""
        return PageBuffer.from_segments(self.views(extents), format)

    def close(self) -> None:
        """Unmap (once no view of it is left; else the mapping goes with the last one)."""
        with contextlib.suppress(BufferError):
            self._view.release()
            self._map.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the ownership lock
            self._lock_fd = None

    def unlink(self) -> None:
        """Remove the file (mappings stay valid until unmapped)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _check_unowned(path: str) -> None:
    """Raise `ArenaInUseError` if a live server holds the lock of the file at ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        raise ArenaInUseError(f"arena {path} is in use by another server") from e
    finally:
        os.close(fd)


def copy_into(arena: Arena, extents: Sequence[Extent], page: PageBuffer) -> None:
    """Copy ``page``'s bytes into the arena at ``extents`` (any thread)."""
    _scatter(page.segments, arena.views(extents))


def copy_out_of(arena: Arena, extents: Sequence[Extent], page: PageBuffer) -> None:
    """Copy the arena's bytes at ``extents`` into ``page`` (any thread)."""
    _scatter(arena.views(extents), page.segments)
