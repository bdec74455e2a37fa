"""`NodeServer`: one KV page cache per node, shared by every engine process on it.

The server owns a page arena in shared memory (`Arena`), the index and lease
table over it (`PageTable`) and, optionally, a storage backend behind it
(any tiercache URL). Clients connect over a Unix socket and speak the
protocol of `tiercache.serve.protocol`; page bytes never cross the socket,
clients copy them straight between their buffers and the arena.

One event loop serves every client. Each connection is one holder in the
table: whatever it reserved or leased is given back when it drops, however
it drops (a clean close, a crash, ``kill -9``). A page a client was writing
when it died was never committed, so it was never visible.

Behind the arena sit the storage tiers:

- **write-behind**: a committed page is leased by the server (so it is
  neither evicted nor reused) and queued; one coroutine writes the queue to
  storage in batches and releases the pages;
- **read-through**: a lease that misses the arena reserves room, reads the
  page from storage straight into the arena, commits it and leases it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import grp
import hashlib
import logging
import os
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from tiercache._resource import AsyncResource
from tiercache.errors import ConfigError, InvalidInputError, StateError, StorageError
from tiercache.memory.pages import PageBuffer
from tiercache.serve import protocol as proto
from tiercache.serve.arena import Arena, ArenaInUseError, Extent
from tiercache.serve.persist import KeptPage, index_path, load_index, save_index
from tiercache.serve.table import Hold, Outcome, PageTable
from tiercache.storage.base import PageKey, StorageBackend
from tiercache.storage.keys import MAX_KEY_LENGTH, validate_key

__all__ = ["NodeServer", "ServerStats", "default_arena_path"]

logger = logging.getLogger(__name__)

#: Default size of an arena block (a page takes whole blocks).
DEFAULT_BLOCK_BYTES = 64 << 10
_READ_CHUNK = 1 << 16
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def default_arena_path(socket_path: str) -> str:
    """The arena file a server on ``socket_path`` uses unless told otherwise."""
    digest = hashlib.sha256(os.path.abspath(socket_path).encode()).hexdigest()[:16]
    return f"/dev/shm/tiercache-{digest}.arena"


@dataclass(frozen=True, slots=True)
class ServerStats:
    """A snapshot of the server's counters (``tiercache status`` prints them).

    Bytes are arena bytes; pages are ready pages; ``hits`` / ``misses`` count
    leased pages, read-through hits included in ``hits``.
    """

    arena_bytes: int
    arena_used_bytes: int
    arena_free_bytes: int
    block_bytes: int
    pages: int
    writing: int
    leases: int
    clients: int
    hits: int
    misses: int
    restored: int
    read_through: int
    evictions: int
    refused_writes: int
    committed: int
    write_behind_backlog: int
    write_behind_done: int
    write_behind_failed: int
    refused_peers: int
    bad_frames: int
    storage: str

    def as_dict(self) -> dict[str, int | str]:
        return dataclasses.asdict(self)


class _State:
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class NodeServer(AsyncResource):
    """The node-local cache server, as a library (``tiercache serve`` runs one).

    ``async with NodeServer(...) as server:`` creates the arena, opens the
    storage, and listens; leaving the block (or `aclose`) stops accepting,
    lets each connection finish the request it is on, flushes the
    write-behind queue within ``drain_timeout_s``, closes the connections
    (reclaiming what they held), removes the socket and the arena file.

    Args:
        socket_path: the Unix socket to listen on (a stale socket is replaced;
            a live one is refused).
        arena_bytes: the arena's size.
        storage_url: a storage backend behind the arena (any tiercache URL).
        storage: an already open backend instead (not closed by the server).
        group: a group name or gid allowed besides the server's own user:
            the socket and the arena become ``0660`` in that group.
        block_bytes: the arena's block size.
        arena_path: the arena file (default `default_arena_path`).
        allow_uids: peer uids accepted (default: the server's effective uid).
        drain_timeout_s: the longest `aclose` waits for in-flight work and
            the write-behind queue.
        write_behind_batch: pages per storage write.
        request_timeout_s: the longest a storage call of one request may take.
        keep_arena: on a clean stop, leave the arena and an index of its pages
            in place; on start, adopt the pages of a kept arena that pass their
            checks (`tiercache.serve.persist`). The arena's memory stays taken
            while no server runs.

    Raises:
        ConfigError: bad sizes, an unknown group, a socket path in use.

    All methods run on the loop that entered the server.
    """

    def __init__(
        self,
        socket_path: str,
        arena_bytes: int,
        *,
        storage_url: str | None = None,
        storage: StorageBackend | None = None,
        group: str | int | None = None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        arena_path: str | None = None,
        allow_uids: frozenset[int] | None = None,
        drain_timeout_s: float = 10.0,
        write_behind_batch: int = 64,
        request_timeout_s: float = 10.0,
        keep_arena: bool = False,
    ) -> None:
        if not isinstance(arena_bytes, int) or arena_bytes < 1:
            raise ConfigError(f"arena_bytes must be a positive int, got {arena_bytes!r}")
        if not isinstance(block_bytes, int) or block_bytes < 1:
            raise ConfigError(f"block_bytes must be a positive int, got {block_bytes!r}")
        if arena_bytes < block_bytes:
            raise ConfigError(f"arena_bytes ({arena_bytes}) is below one block ({block_bytes})")
        if storage_url is not None and storage is not None:
            raise ConfigError("give storage_url or storage, not both")
        if len(os.fsencode(socket_path)) >= 108:
            raise ConfigError(f"a Unix socket path is at most 107 bytes: {socket_path!r}")
        self.socket_path = socket_path
        self.block_bytes = block_bytes
        self.arena_bytes = arena_bytes - arena_bytes % block_bytes
        self.arena_path = arena_path or default_arena_path(socket_path)
        self.gid = _group_id(group)
        self.allow_uids = frozenset({os.geteuid()}) if allow_uids is None else allow_uids
        self.drain_timeout_s = drain_timeout_s
        self.write_behind_batch = write_behind_batch
        self.request_timeout_s = request_timeout_s
        self.keep_arena = keep_arena
        self._storage_url = storage_url
        self._storage = storage
        self._owns_storage = storage is None
        self._state = _State.NEW
        self._table = PageTable(self.arena_bytes // block_bytes, block_bytes)
        self._arena: Arena | None = None
        self._server: asyncio.Server | None = None
        self._conns: dict[int, asyncio.Task[None]] = {}
        self._busy: set[int] = set()
        self._queue: asyncio.Queue[tuple[str, int, str, list[Extent]]] = asyncio.Queue()
        self._wb_task: asyncio.Task[None] | None = None
        self._wb_holder = 0
        self._rt_holder = 0
        self._arena_id = ""
        self._counts = dict.fromkeys(
            (
                "hits",
                "misses",
                "restored",
                "read_through",
                "refused_writes",
                "committed",
                "write_behind_done",
                "write_behind_failed",
                "refused_peers",
                "bad_frames",
            ),
            0,
        )
        self._wb_inflight = 0
        self._stopped = asyncio.Event()
        self._progress = asyncio.Event()  # set when a request or a write-behind batch ends
        self._ops = self._handlers()  # built once: looked up for every frame

    # -- lifecycle -------------------------------------------------------------

    async def _aenter(self) -> None:
        await self.start()

    async def start(self) -> None:
        """Create the arena, open the storage and listen.

        Raises:
            StateError: started twice, or after close.
            ConfigError: the socket path is in use by a live server, or bad storage.
            OSError: the arena or the socket cannot be created.
        """
        if self._state != _State.NEW:
            raise StateError(f"the server is {self._state}; make a new one")
        self._state = _State.OPEN
        try:
            await asyncio.to_thread(self._claim_socket_path)
            arena, kept, dropped = await asyncio.to_thread(self._open_arena)
            self._arena = arena
            self._table.restore([(p.key, p.blocks, p.nbytes, p.format) for p in kept])
            self._counts["restored"] = len(kept)
            if kept or dropped:
                logger.info(
                    "kept arena %s: serving %d pages, dropped %d that failed their checks",
                    self.arena_path,
                    len(kept),
                    dropped,
                )
            self._arena_id = f"{arena.inode}-{os.getpid()}-{time.time_ns()}"
            if self._storage_url is not None:
                from tiercache.storage.registry import open_backend

                self._storage = await open_backend(self._storage_url)
            self._wb_holder = self._table.add_holder()
            self._rt_holder = self._table.add_holder()
            if self._storage is not None:
                self._wb_task = asyncio.create_task(self._write_behind(), name="serve-write-behind")
            self._server = await asyncio.start_unix_server(
                self._on_connect, path=self.socket_path, limit=proto.MAX_FRAME_BYTES
            )
            await asyncio.to_thread(self._open_socket_mode)
        except BaseException:
            await self._teardown()
            raise
        logger.info(
            "serving on %s: arena %s, %d bytes in %d-byte blocks",
            self.socket_path,
            self.arena_path,
            self.arena_bytes,
            self.block_bytes,
        )

    def _open_arena(self) -> tuple[Arena, list[KeptPage], int]:
        """The arena (kept from the last clean stop when asked and possible, else new) and its pages."""
        if self.keep_arena and os.path.exists(index_path(self.arena_path)):
            try:
                arena = Arena.adopt(self.arena_path, self.arena_bytes, gid=self.gid)
            except ArenaInUseError:
                raise
            except OSError as e:
                logger.warning("cannot keep arena %s (%s): starting empty", self.arena_path, e)
            else:
                kept, dropped = load_index(arena, self.block_bytes)
                return arena, kept, dropped
        with contextlib.suppress(FileNotFoundError):
            os.unlink(index_path(self.arena_path))
        return Arena(self.arena_path, self.arena_bytes, create=True, gid=self.gid), [], 0

    def _claim_socket_path(self) -> None:
        """Remove a stale socket at our path; refuse a live one or a non-socket."""
        try:
            st = os.lstat(self.socket_path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(f"{self.socket_path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(self.socket_path)
        except OSError:
            os.unlink(self.socket_path)  # nobody listens: left by a dead server
            return
        finally:
            probe.close()
        raise ConfigError(f"a server is already listening on {self.socket_path}")

    def _open_socket_mode(self) -> None:
        os.chmod(self.socket_path, 0o600 if self.gid is None else 0o660)
        if self.gid is not None:
            os.chown(self.socket_path, -1, self.gid)

    async def serve_forever(self) -> None:
        """Wait until the server is closed (by `aclose`, from another task)."""
        await self._stopped.wait()

    async def aclose(self) -> None:
        """Stop accepting, finish in-flight requests, flush write-behind, close. Idempotent.

        Each wait is bounded by ``drain_timeout_s``; past it the remaining
        write-behind pages are dropped (logged) and the connections cut.
        """
        if self._state in (_State.CLOSING, _State.CLOSED):
            await self._stopped.wait()
            return
        if self._state == _State.NEW:
            self._state = _State.CLOSED
            self._stopped.set()
            return
        self._state = _State.CLOSING
        try:
            if self._server is not None:
                self._server.close()
            deadline = time.monotonic() + self.drain_timeout_s
            await self._drain(deadline)
        finally:
            await self._teardown()

    def _pending_work(self) -> bool:
        writing_behind = self._wb_task is not None and not self._wb_task.done()
        return bool(self._busy) or (
            writing_behind and (not self._queue.empty() or self._wb_inflight > 0)
        )

    async def _drain(self, deadline: float) -> None:
        """Wait until no request is in flight and the write-behind queue is empty, or the deadline."""
        while self._pending_work():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), min(left, 0.1))
        unwritten = self._queue.qsize() + self._wb_inflight
        if unwritten:
            logger.warning("drain deadline passed: %d write-behind pages not written", unwritten)

    async def _teardown(self) -> None:
        tasks = [t for t in (*self._conns.values(), self._wb_task) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        if self._storage is not None and self._owns_storage:
            with contextlib.suppress(Exception):
                await self._storage.aclose()
        if self._arena is not None:
            arena = self._arena
            if self.keep_arena and self._state == _State.CLOSING:
                pages = [KeptPage(*p) for p in self._table.ready_pages()]
                n = await asyncio.to_thread(save_index, arena, self.block_bytes, pages)
                logger.info("kept arena %s with an index of %d pages", self.arena_path, n)
            else:
                await asyncio.to_thread(arena.unlink)
            arena.close()
        if self._server is not None:  # ours: a refused start leaves a live server's socket be
            with contextlib.suppress(OSError):
                st = await asyncio.to_thread(os.lstat, self.socket_path)
                if stat.S_ISSOCK(st.st_mode):
                    await asyncio.to_thread(os.unlink, self.socket_path)
        self._state = _State.CLOSED
        self._stopped.set()

    # -- stats -----------------------------------------------------------------

    def stats(self) -> ServerStats:
        """The counters now (event loop thread)."""
        t = self._table.stats()
        free = t.free_blocks * self.block_bytes
        return ServerStats(
            arena_bytes=self.arena_bytes,
            arena_used_bytes=self.arena_bytes - free,
            arena_free_bytes=free,
            block_bytes=self.block_bytes,
            pages=t.pages,
            writing=t.writing,
            leases=t.leases,
            clients=len(self._conns),
            evictions=t.evictions,
            write_behind_backlog=self._queue.qsize() + self._wb_inflight,
            storage=self._storage.name if self._storage is not None else "",
            **self._counts,
        )

    # -- connections -----------------------------------------------------------

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._state != _State.OPEN:
            writer.close()
            return
        holder = self._table.add_holder()
        self._conns[holder] = task
        try:
            if await self._check_peer(reader, writer):
                await self._serve_connection(holder, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # the server is closing
        finally:
            self._conns.pop(holder, None)
            self._busy.discard(holder)
            reservations, leases = self._table.drop_holder(holder)
            if reservations or leases:
                logger.info(
                    "client gone: reclaimed %d reservations and %d leases", reservations, leases
                )
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _check_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        sock: socket.socket = writer.get_extra_info("socket")
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        pid, uid, gid = _PEERCRED.unpack(raw)
        if uid in self.allow_uids:
            return True
        if self.gid is not None and (
            gid == self.gid or self.gid in await asyncio.to_thread(_groups_of, pid)
        ):
            return True
        self._counts["refused_peers"] += 1
        logger.warning("refused a client: pid %d uid %d gid %d is not allowed", pid, uid, gid)
        writer.write(proto.error_reply(None, "refused", f"uid {uid} / gid {gid} is not allowed"))
        with contextlib.suppress(ConnectionError, TimeoutError):
            await writer.drain()
            writer.write_eof()
            # Read what the peer sent until it closes (briefly): closing a Unix
            # socket with unread input resets it, and the peer would never
            # read why it was refused. Nothing it sends is looked at.
            async with asyncio.timeout(1.0):
                while await reader.read(_READ_CHUNK):
                    pass
        return False

    async def _serve_connection(
        self, holder: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        unpacker = proto.make_unpacker()
        fed = 0  # bytes received
        whole = 0  # bytes of the frames decoded whole (``tell`` also counts a partial one)
        while True:
            data = await reader.read(_READ_CHUNK)
            if not data:
                if fed > whole:
                    self._bad_frame("truncated", "the connection closed inside a frame")
                return
            try:
                unpacker.feed(data)
            except msgpack.BufferFull:
                await self._refuse(writer, None, "oversized", "frame larger than the limit")
                return
            fed += len(data)
            while True:
                try:
                    frame = unpacker.unpack()
                except msgpack.OutOfData:
                    break
                except (ValueError, msgpack.StackError, msgpack.ExtraData) as e:
                    await self._refuse(writer, None, "malformed", f"not a msgpack frame: {e!r}")
                    return
                whole = unpacker.tell()
                if not await self._handle(holder, frame, writer):
                    return

    def _bad_frame(self, code: str, message: str) -> None:
        self._counts["bad_frames"] += 1
        logger.warning("bad frame from a client (%s): %s", code, message)

    async def _refuse(
        self, writer: asyncio.StreamWriter, rid: int | None, code: str, message: str
    ) -> None:
        self._bad_frame(code, message)
        writer.write(proto.error_reply(rid, code, message))
        with contextlib.suppress(ConnectionError):
            await writer.drain()

    async def _handle(self, holder: int, frame: Any, writer: asyncio.StreamWriter) -> bool:
        """Answer one frame; False closes the connection."""
        if not (isinstance(frame, list) and len(frame) == 4):
            await self._refuse(writer, None, "malformed", "a request is [version, id, op, body]")
            return False
        version, rid, op, body = frame
        if not isinstance(rid, int) or isinstance(rid, bool):
            await self._refuse(writer, None, "malformed", "the request id is not an int")
            return False
        if version != proto.VERSION:
            await self._refuse(
                writer,
                rid,
                "version",
                f"protocol version {version!r}; this server speaks {proto.VERSION}",
            )
            return False
        handler = self._ops.get(op) if isinstance(op, str) else None
        if handler is None:
            await self._refuse(writer, rid, "unknown_op", f"unknown op {op!r}")
            return True
        self._busy.add(holder)
        try:
            result = await handler(holder, body)
        except (InvalidInputError, proto.ProtocolError) as e:
            code = e.code if isinstance(e, proto.ProtocolError) else "invalid"
            await self._refuse(writer, rid, code, str(e))
            return True
        except Exception as e:  # a bug: this client is cut off (its holdings reclaimed), no other
            logger.exception("internal error answering %s; closing this client", op)
            writer.write(proto.error_reply(rid, "internal", repr(e)))
            return False
        finally:
            self._busy.discard(holder)
            self._progress.set()
        writer.write(proto.ok_reply(rid, result))
        await writer.drain()
        return True

    def _handlers(self) -> dict[str, Callable[[int, Any], Awaitable[Any]]]:
        return {
            "hello": self._op_hello,
            "exists": self._op_exists,
            "reserve": self._op_reserve,
            "commit": self._op_commit,
            "abort": self._op_abort,
            "lease": self._op_lease,
            "release": self._op_release,
            "delete": self._op_delete,
            "clear": self._op_clear,
            "status": self._op_status,
        }

    # -- ops -------------------------------------------------------------------

    async def _op_hello(self, holder: int, body: Any) -> Any:
        return {
            "version": proto.VERSION,
            "arena": self.arena_path,
            "arena_bytes": self.arena_bytes,
            "block_bytes": self.block_bytes,
            "arena_id": self._arena_id,
            "pid": os.getpid(),
        }

    async def _op_status(self, holder: int, body: Any) -> Any:
        return self.stats().as_dict()

    async def _op_exists(self, holder: int, body: Any) -> Any:
        keys = _keys(body, lookup=True)
        n = self._table.exists(keys)
        if n < len(keys) and self._storage is not None:
            try:
                n += await asyncio.wait_for(
                    self._storage.batch_exists([PageKey(k) for k in keys[n:]]),
                    self.request_timeout_s,
                )
            except (StorageError, InvalidInputError, TimeoutError) as e:
                logger.debug("storage exists failed: %r", e)
        return n

    async def _op_reserve(self, holder: int, body: Any) -> Any:
        items = _page_items(body)
        out: list[Any] = []
        for key, nbytes, fmt in items:
            if not self._fits(nbytes):  # answered per page: the others of the batch go on
                self._counts["refused_writes"] += 1
                out.append([Outcome.FULL.value])
                continue
            h = self._table.reserve(holder, key, nbytes, fmt)
            if h.outcome is Outcome.NEW:
                out.append(["new", h.ident, self._extents(h, nbytes)])
            else:
                if h.outcome is Outcome.FULL:
                    self._counts["refused_writes"] += 1
                out.append([h.outcome.value])
        return out

    async def _op_commit(self, holder: int, body: Any) -> Any:
        rids = _ids(body)
        pages = self._table.commit(holder, rids)
        self._counts["committed"] += len(pages)
        if self._storage is not None:
            for key in pages:
                self._queue_write_behind(key)
        return None

    async def _op_abort(self, holder: int, body: Any) -> Any:
        self._table.abort(holder, _ids(body))
        return None

    async def _op_lease(self, holder: int, body: Any) -> Any:
        items = _page_items(body, lookup=True)
        holds = [self._table.lease(holder, k, n, f) for k, n, f in items]
        missing = [i for i, h in enumerate(holds) if h.outcome is Outcome.MISS]
        if missing and self._storage is not None:
            await self._read_through(holder, items, holds, missing)
        out: list[Any] = []
        for (_, nbytes, _), h in zip(items, holds, strict=True):
            if h.outcome is Outcome.HIT:
                self._counts["hits"] += 1
                out.append(["hit", h.ident, self._extents(h, nbytes)])
            elif h.outcome is Outcome.MISMATCH:
                out.append(["mismatch", h.format, h.nbytes])
            else:
                self._counts["misses"] += 1
                out.append(["miss"])
        return out

    async def _op_release(self, holder: int, body: Any) -> Any:
        self._table.release(holder, _ids(body))
        return None

    async def _op_delete(self, holder: int, body: Any) -> Any:
        return self._table.delete(_keys(body))

    async def _op_clear(self, holder: int, body: Any) -> Any:
        return self._table.clear()

    def _fits(self, nbytes: int) -> bool:
        """Whether a page of ``nbytes`` can ever fit the arena."""
        return self._table.blocks_for(nbytes) <= self._table.blocks

    @staticmethod
    def _extents(h: Hold, nbytes: int) -> tuple[tuple[int, int], ...]:
        return h.extents  # msgpack sends tuples as arrays

    # -- storage behind the arena -----------------------------------------------

    def _queue_write_behind(self, key: str) -> None:
        """Lease a just-committed page to the write-behind holder and queue it."""
        nbytes, fmt = self._table.shape(key)
        h = self._table.lease(self._wb_holder, key, nbytes, fmt)
        assert h.outcome is Outcome.HIT, "a page just committed is ready"
        self._queue.put_nowait((key, h.ident, fmt, list(h.extents)))

    async def _write_behind(self) -> None:
        """Write committed pages to storage in batches; release them whatever the outcome."""
        assert self._storage is not None and self._arena is not None
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.write_behind_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            self._wb_inflight = len(batch)
            try:
                pages = [self._arena.page(ext, fmt) for _, _, fmt, ext in batch]
                try:
                    ok = await asyncio.wait_for(
                        self._storage.batch_set([PageKey(k) for k, *_ in batch], pages),
                        self.request_timeout_s,
                    )
                except (StorageError, TimeoutError) as e:
                    logger.warning("write-behind of %d pages failed: %r", len(batch), e)
                    ok = [False] * len(batch)
                done = sum(1 for x in ok if x is True)
                self._counts["write_behind_done"] += done
                self._counts["write_behind_failed"] += len(batch) - done
            finally:
                self._table.release(self._wb_holder, [lid for _, lid, _, _ in batch])
                self._wb_inflight = 0
                self._progress.set()

    async def _read_through(
        self,
        holder: int,
        items: list[tuple[str, int, str]],
        holds: list[Hold],
        missing: list[int],
    ) -> None:
        """Fill the arena from storage for the ``missing`` items, then lease them to ``holder``."""
        assert self._storage is not None and self._arena is not None
        reserved: list[tuple[int, int]] = []  # (item index, reservation id)
        pages: list[PageBuffer] = []
        for i in missing:
            key, nbytes, fmt = items[i]
            if not self._fits(nbytes) or not _storable(key):
                continue
            h = self._table.reserve(self._rt_holder, key, nbytes, fmt)
            if h.outcome is Outcome.NEW:
                reserved.append((i, h.ident))
                pages.append(self._arena.page(h.extents, fmt))
        if not reserved:
            return
        keys = [PageKey(items[i][0]) for i, _ in reserved]
        try:
            got = await asyncio.wait_for(
                self._storage.batch_get(keys, pages), self.request_timeout_s
            )
        except (StorageError, InvalidInputError, TimeoutError) as e:
            logger.debug("read-through failed: %r", e)
            got = [False] * len(reserved)
        except BaseException:
            self._table.abort(self._rt_holder, [rid for _, rid in reserved])
            raise
        good = [rid for (_, rid), g in zip(reserved, got, strict=True) if g is True]
        bad = [rid for (_, rid), g in zip(reserved, got, strict=True) if g is not True]
        self._table.abort(self._rt_holder, bad)
        self._table.commit(self._rt_holder, good)
        self._counts["read_through"] += len(good)
        for (i, _), g in zip(reserved, got, strict=True):
            if g is True:
                key, nbytes, fmt = items[i]
                holds[i] = self._table.lease(holder, key, nbytes, fmt)


def _group_id(group: str | int | None) -> int | None:
    if group is None:
        return None
    if isinstance(group, int):
        return group
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError as e:
        raise ConfigError(f"no group named {group!r}") from e


def _groups_of(pid: int) -> set[int]:
    """The supplementary groups of process ``pid`` (empty when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def _check_batch_len(body: list[Any]) -> None:
    if len(body) > proto.MAX_BATCH:
        raise proto.ProtocolError("too_many", f"{len(body)} items; at most {proto.MAX_BATCH}")


def _keys(body: Any, *, lookup: bool = False) -> list[str]:
    """The keys of a request; ``lookup``: only looked up, never stored (see `_lookup_key`)."""
    if not isinstance(body, list):
        raise proto.ProtocolError("malformed", "the body is a list of keys")
    _check_batch_len(body)
    if lookup and all(type(k) is str and len(k) <= MAX_KEY_LENGTH for k in body):
        return body  # every key passes `_lookup_key`: no call per key
    check = _lookup_key if lookup else validate_key
    return [check(k) for k in body]


def _storable(key: str) -> bool:
    try:
        validate_key(key)
    except InvalidInputError:
        return False
    return True


def _lookup_key(key: object) -> str:
    """A key that is only looked up: any str of at most `MAX_KEY_LENGTH` characters.

    Only reserved keys enter the index, and those pass `validate_key`, so a
    key that breaks its rules is simply not found; skipping its regular
    expression here saves most of an ``exists`` round trip's server time.
    """
    if type(key) is not str or len(key) > MAX_KEY_LENGTH:
        raise InvalidInputError(f"a page key is a str of at most {MAX_KEY_LENGTH} characters")
    return key


def _ids(body: Any) -> list[int]:
    if not isinstance(body, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in body
    ):
        raise proto.ProtocolError("malformed", "the body is a list of ids")
    _check_batch_len(body)
    return body


def _page_items(body: Any, *, lookup: bool = False) -> list[tuple[str, int, str]]:
    if not isinstance(body, list):
        raise proto.ProtocolError("malformed", "the body is a list of [key, nbytes, format]")
    _check_batch_len(body)
    out: list[tuple[str, int, str]] = []
    for item in body:
        if not (
            isinstance(item, list)
            and len(item) == 3
            and isinstance(item[1], int)
            and not isinstance(item[1], bool)
            and item[1] > 0
            and isinstance(item[2], str)
            and len(item[2]) <= 1024
        ):
            raise proto.ProtocolError(
                "malformed", "an item is [key, nbytes > 0, format (a str of at most 1024 chars)]"
            )
        out.append(((_lookup_key if lookup else validate_key)(item[0]), item[1], item[2]))
    return out
