"""The client side of ``tiercache serve``: `ServeClient` (one connection) and `ServeBackend`.

`ServeBackend` is a `StorageBackend` registered under the URL scheme
``tiercache+unix``::

    tiercache+unix:///run/tiercache/node.sock
    tiercache+unix:///run/tiercache/node.sock?timeout_s=2&backoff_max_s=5

so `TierCache`, the SGLang adapter and the vLLM tier use a node's server with
no change beyond the storage URL. It maps the server's arena and copies page
bytes straight between the caller's buffers and arena pages; the socket only
carries keys, ids and extents.

A server that is down, restarting or slow is a miss for reads and a failed
backup for writes, never an exception: the backend reconnects on the next
call after a backoff that doubles from ``backoff_min_s`` up to
``backoff_max_s`` while the server stays away. A call that times out closes
its connection, and the server reclaims whatever that connection held.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Sequence
from typing import Any, Self, TypeVar
from urllib.parse import unquote, urlsplit

import msgpack

from tiercache._aio import finish
from tiercache._resource import AsyncResource
from tiercache.errors import BackendUnavailableError, ConfigError, StorageError
from tiercache.memory.pages import PageBuffer
from tiercache.serve import protocol as proto
from tiercache.serve.arena import Arena, Extent, copy_into, copy_out_of
from tiercache.storage.base import BackendState, BackendStats, PageKey, StorageBackend
from tiercache.storage.format import check_target
from tiercache.storage.keys import check_batch
from tiercache.storage.registry import option_float, reject_unknown, url_options

__all__ = ["ServeBackend", "ServeClient", "ServerError"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Copies of more bytes than this run in an executor, off the event loop.
_OFFLOAD_BYTES = 1 << 20
#: The most worker threads one batch's copies are spread over.
_COPY_THREADS = 4
#: The most keys a backend remembers as valid (`ServeBackend._checked_keys`).
_KNOWN_KEYS = 1 << 16


class ServerError(StorageError):
    """The server answered a request with an error (``code`` says which)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def _extents(raw: Any) -> list[Extent]:
    return [(int(o), int(n)) for o, n in raw]


class ServeClient(AsyncResource):
    """One connection to a server, with the arena mapped.

    The verbs are the protocol's ops (`tiercache.serve.protocol`), one round
    trip each; replies come back in order, so concurrent calls from tasks of
    the same loop are matched to their requests by id. If the connection
    drops, every pending and later call raises `BackendUnavailableError`;
    open a new client to reconnect.

    Use `connect` to make one. All methods run on the loop that connected it.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        hello: dict[str, Any],
        arena: Arena,
        unpacker: msgpack.Unpacker,
    ) -> None:
        self._reader = reader
        self._unpacker = unpacker
        self._writer = writer
        self.hello = hello
        self.arena = arena
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._closed = False
        self._lost: BaseException | None = None
        self._reader_task = asyncio.create_task(self._read_replies(), name="serve-client-reader")

    @classmethod
    async def connect(
        cls,
        socket_path: str,
        *,
        timeout_s: float = 5.0,
        arena: Arena | None = None,
    ) -> ServeClient:
        """Connect, say hello and map the arena (``arena``: a mapping to reuse if still current).

        Raises:
            BackendUnavailableError: no server answers, it refused this
                process (``refused``), or its arena cannot be mapped.
        """
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(socket_path, limit=proto.MAX_FRAME_BYTES), timeout_s
            )
        except (OSError, TimeoutError) as e:
            raise BackendUnavailableError(f"no tiercache server on {socket_path}: {e}") from e
        try:
            writer.write(proto.request(0, "hello", {}))
            unpacker = proto.make_unpacker()
            reply = await asyncio.wait_for(_read_one(reader, unpacker), timeout_s)
            hello = _result(reply)
            if (
                arena is None
                or arena.path != hello["arena"]
                or arena.nbytes != hello["arena_bytes"]
                or arena.arena_id != hello["arena_id"]
            ):
                arena = await asyncio.to_thread(
                    Arena, str(hello["arena"]), int(hello["arena_bytes"]), create=False
                )
                arena.arena_id = str(hello["arena_id"])
        except BaseException as e:
            writer.close()
            if isinstance(e, (OSError, TimeoutError, KeyError, TypeError, ValueError)):
                raise BackendUnavailableError(f"tiercache server on {socket_path}: {e!r}") from e
            raise
        return cls(reader, writer, hello, arena, unpacker)

    async def _read_replies(self) -> None:
        try:
            while True:
                reply = await _read_one(self._reader, self._unpacker)
                rid = reply[0] if isinstance(reply, list) and reply else None
                fut = self._pending.pop(rid, None) if isinstance(rid, int) else None
                if fut is None:
                    raise BackendUnavailableError(f"unexpected reply from the server: {reply!r}")
                if not fut.done():
                    fut.set_result(reply)
        except (Exception, asyncio.CancelledError) as e:
            self._lost = e
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(BackendUnavailableError(f"connection lost: {e!r}"))
            self._pending.clear()
            self._writer.close()

    @property
    def connected(self) -> bool:
        return not self._closed and self._lost is None

    async def call(self, op: str, body: Any, *, timeout_s: float | None = None) -> Any:
        """One request; returns its result.

        Raises:
            ServerError: the server refused the request.
            BackendUnavailableError: the connection is gone or the call timed out
                (the connection is then closed: the server reclaims its holdings).
        """
        if not self.connected:
            raise BackendUnavailableError("the connection to the server is closed")
        rid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self._writer.write(proto.request(rid, op, body))
        try:
            # asyncio.timeout, not wait_for(shield(...)): no extra task or future per
            # call. A cancelled or expired ``fut`` is skipped when its reply arrives.
            async with asyncio.timeout(timeout_s):
                reply = await fut
        except TimeoutError as e:
            await self.aclose()
            raise BackendUnavailableError(f"the server did not answer {op} in time") from e
        return _result(reply)

    async def _aenter(self) -> None:
        if not self.connected:
            raise BackendUnavailableError("the connection to the server is closed")

    async def aclose(self) -> None:
        """Close the connection (the server reclaims what it held). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._reader_task.cancel()
        with contextlib.suppress(BaseException):
            await self._reader_task
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()


async def _read_one(reader: asyncio.StreamReader, unpacker: msgpack.Unpacker) -> Any:
    while True:
        try:
            return unpacker.unpack()
        except msgpack.OutOfData:
            pass
        data = await reader.read(1 << 16)
        if not data:
            raise BackendUnavailableError("the server closed the connection")
        unpacker.feed(data)


def _result(reply: Any) -> Any:
    if not (isinstance(reply, list) and len(reply) == 3):
        raise BackendUnavailableError(f"malformed reply from the server: {reply!r}")
    _, status, body = reply
    if status == "ok":
        return body
    code = body.get("code", "?") if isinstance(body, dict) else "?"
    message = body.get("message", "") if isinstance(body, dict) else repr(body)
    raise ServerError(str(code), str(message))


class ServeBackend(StorageBackend):
    """A `StorageBackend` over a node's ``tiercache serve`` (URL ``tiercache+unix:///PATH``).

    ``batch_set`` reserves arena pages, copies the caller's pages into them
    and commits (a page is visible only once whole); ``batch_get`` leases
    the pages, copies them out and releases, and reports them arrived only
    if the server acknowledges the release: the leases were then held for
    the whole copy, so no page was reused under it. Copies of more than 1 MiB run
    in the default executor; a cancelled call returns only once its copy is
    done, and its leases and reservations are given back.

    A server that is down or answers badly costs a miss (``batch_exists`` 0,
    ``batch_get`` all ``False``) or a failed backup (``batch_set`` all
    ``False``), never an exception; calls while it is away fail fast until
    the next reconnect attempt. Only usage errors raise (`InvalidInputError`:
    a bad key or target, or a target of another format than the page held).

    Args:
        socket_path: the server's socket.
        timeout_s: the longest one request may take.
        backoff_min_s, backoff_max_s: the reconnect backoff range.

    All methods run on the loop that opened the backend.
    """

    name = "tiercache+unix"

    def __init__(
        self,
        socket_path: str,
        *,
        timeout_s: float = 5.0,
        backoff_min_s: float = 0.05,
        backoff_max_s: float = 2.0,
    ) -> None:
        super().__init__()
        if not socket_path or not os.path.isabs(socket_path):
            raise ConfigError(f"the server socket must be an absolute path, got {socket_path!r}")
        self.socket_path = socket_path
        self.timeout_s = option_float("timeout_s", timeout_s, minimum=0.001)
        self.backoff_min_s = option_float("backoff_min_s", backoff_min_s, minimum=0.0)
        self.backoff_max_s = option_float("backoff_max_s", backoff_max_s, minimum=0.0)
        self._client: ServeClient | None = None
        self._arena: Arena | None = None
        self._next_try = 0.0
        self._backoff = self.backoff_min_s
        self._connecting: asyncio.Lock | None = None
        self._background: set[asyncio.Future[None]] = set()
        self._known_keys: set[str] = set()
        self._stats.extra.update(reconnects=0, down_calls=0)

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> Self:
        """Open ``tiercache+unix:///PATH`` (options: ``timeout_s``, ``backoff_min_s``, ``backoff_max_s``).

        The server need not be up yet: the backend connects on first use.

        Raises:
            ConfigError: a URL with a host, without an absolute path, or bad options.
        """
        base, opts = url_options(url, options)
        parts = urlsplit(base)
        if parts.scheme != cls.name or parts.netloc not in ("", "localhost") or not parts.path:
            raise ConfigError(f"a server URL is 'tiercache+unix:///abs/path.sock', got {url!r}")
        reject_unknown(cls.name, opts, {"timeout_s", "backoff_min_s", "backoff_max_s"})
        kwargs = {k: option_float(k, v, minimum=0.0) for k, v in opts.items()}
        return cls(unquote(parts.path), **kwargs)

    # -- connection -------------------------------------------------------------

    async def _connection(self) -> ServeClient | None:
        """The live connection, or a new one; ``None`` while the server is away (backing off)."""
        if self._client is not None and self._client.connected:
            return self._client
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._client is not None and self._client.connected:
                return self._client
            if time.monotonic() < self._next_try:
                return None
            if self._client is not None:
                await self._client.aclose()
                self._client = None
            try:
                client = await ServeClient.connect(
                    self.socket_path, timeout_s=self.timeout_s, arena=self._arena
                )
            except StorageError as e:
                self._next_try = time.monotonic() + self._backoff
                logger.warning(
                    "tiercache server %s unavailable (%s); retrying in %.2f s",
                    self.socket_path,
                    e,
                    self._backoff,
                )
                self._backoff = min(max(self._backoff * 2, 0.001), self.backoff_max_s)
                return None
            if self._arena is not None and self._arena is not client.arena:
                self._arena.close()
            self._arena = client.arena
            self._client = client
            self._backoff = self.backoff_min_s
            self._stats.extra["reconnects"] = int(self._stats.extra["reconnects"]) + 1
            return client

    async def _call(self, client: ServeClient, op: str, body: Any) -> Any:
        """A call whose failure to reach the server raises `_Down` (the caller's miss)."""
        try:
            return await client.call(op, body, timeout_s=self.timeout_s)
        except ServerError:
            raise
        except StorageError as e:
            self._stats.errors += 1
            self._next_try = time.monotonic() + self._backoff
            raise _Down(str(e)) from e

    # -- StorageBackend ---------------------------------------------------------

    def _checked_keys(self, keys: Sequence[PageKey]) -> list[PageKey]:
        """``keys`` as a list, each checked with `validate_key` unless it passed before.

        A prefix is queried again and again (every ``exists`` of a request,
        then its reads), and the key rule's regular expression over 128 keys
        cost about half of an ``exists`` round trip. Only exact ``str``
        objects are remembered, at most `_KNOWN_KEYS` of them (forgotten all
        at once past that); a key that fails is never remembered.
        """
        known = self._known_keys
        listed = None if isinstance(keys, str) else list(keys)  # an iterator is read once
        if listed is not None and all(type(k) is str and k in known for k in listed):
            return listed
        ks = check_batch(keys if listed is None else listed)  # the rule, and a refusal's reason
        if len(known) + len(ks) > _KNOWN_KEYS:
            known.clear()
        known.update(k for k in ks if type(k) is str)
        return ks

    async def batch_exists(self, keys: Sequence[PageKey]) -> int:
        self._check_open()
        ks = self._checked_keys(keys)
        self._stats.exists_calls += 1
        if not ks:
            return 0
        client = await self._connection()
        if client is None:
            return self._down(0)
        try:
            return int(await self._call(client, "exists", list(ks)))
        except (_Down, ServerError) as e:
            logger.debug("exists: %s", e)
            return 0

    async def batch_get(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        """Lease, copy out, release.

        Raises:
            InvalidInputError: a bad key or target, or a page held in another
                format or length than its target (nothing is copied).
        """
        self._check_open()
        ks = check_batch(keys, pages, targets=True)
        self._stats.get_pages += len(ks)
        if not ks:
            return []
        client = await self._connection()
        if client is None:
            return self._down([False] * len(ks))
        body = [[k, p.nbytes, p.format] for k, p in zip(ks, pages, strict=True)]
        try:
            answer = await self._acquire(client, "lease", body, "hit", "release")
        except (_Down, ServerError) as e:
            logger.debug("lease: %s", e)
            return [False] * len(ks)
        lids = [a[1] for a in answer if a[0] == "hit"]
        try:
            for k, a, page in zip(ks, answer, pages, strict=True):
                if a[0] == "mismatch":
                    check_target(k, str(a[1]), int(a[2]), page)
            copies = [
                (_extents(a[2]), page)
                for a, page in zip(answer, pages, strict=True)
                if a[0] == "hit"
            ]
            nbytes = sum(p.nbytes for _, p in copies)
            await self._copy(client.arena, copies, out=True, nbytes=nbytes)
        finally:
            held = await asyncio.shield(self._release(client, lids)) if lids else True
        if not held:
            # The server did not take the release: the connection (and with it
            # the leases) may have gone while the bytes were being copied, and
            # a page no longer leased may have been reused. Nothing counts.
            return [False] * len(ks)
        found = [a[0] == "hit" for a in answer]
        self._stats.get_hits += len(lids)
        self._stats.bytes_read += nbytes
        return found

    async def _acquire(
        self, client: ServeClient, op: str, body: Any, granted: str, undo: str
    ) -> Any:
        """``op`` (lease / reserve); if the caller is cancelled meanwhile, what the
        server granted is given back (``undo``) once the reply arrives."""
        task = asyncio.ensure_future(self._call(client, op, body))
        try:
            answer = await asyncio.shield(task)
        except asyncio.CancelledError:

            def give_back(t: asyncio.Future[Any]) -> None:
                if t.cancelled() or t.exception() is not None:
                    return
                ids = [a[1] for a in t.result() if a[0] == granted]
                if ids:
                    bg = asyncio.ensure_future(self._undo(client, undo, ids))
                    self._background.add(bg)
                    bg.add_done_callback(self._background.discard)

            task.add_done_callback(give_back)
            raise
        if not _well_formed(answer, [item[1] for item in body], granted, client.arena.nbytes):
            # A server that answers nonsense holds who knows what: drop the
            # connection, and with it everything it granted this client.
            logger.warning("malformed %s answer from the server; reconnecting", op)
            await client.aclose()
            raise _Down(f"malformed {op} answer")
        return answer

    async def _undo(self, client: ServeClient, op: str, ids: list[int]) -> None:
        with contextlib.suppress(_Down, ServerError):
            await self._call(client, op, ids)

    async def _release(self, client: ServeClient, lids: list[int]) -> bool:
        """End leases; True only if the server acknowledged (they were held to the end)."""
        try:
            await self._call(client, "release", lids)
        except (_Down, ServerError) as e:
            logger.debug("release: %s", e)
            return False
        return True

    async def batch_set(self, keys: Sequence[PageKey], pages: Sequence[PageBuffer]) -> list[bool]:
        """Reserve, copy in, commit; a key already held counts as stored."""
        self._check_open()
        ks = check_batch(keys, pages)
        self._stats.set_pages += len(ks)
        if not ks:
            return []
        client = await self._connection()
        if client is None:
            return self._down([False] * len(ks))
        body = [[k, p.nbytes, p.format] for k, p in zip(ks, pages, strict=True)]
        try:
            answer = await self._acquire(client, "reserve", body, "new", "abort")
        except (_Down, ServerError) as e:
            logger.debug("reserve: %s", e)
            return [False] * len(ks)
        rids = [a[1] for a in answer if a[0] == "new"]
        copies = [
            (_extents(a[2]), page) for a, page in zip(answer, pages, strict=True) if a[0] == "new"
        ]
        nbytes = sum(p.nbytes for _, p in copies)
        committed = False
        try:
            await self._copy(client.arena, copies, out=False, nbytes=nbytes)
            if rids:
                await self._call(client, "commit", rids)
            committed = True
        except (_Down, ServerError) as e:
            logger.debug("commit: %s", e)
        finally:
            if rids and not committed:
                await asyncio.shield(self._abort(client, rids))
        self._stats.set_written += len(rids) if committed else 0
        self._stats.bytes_written += nbytes if committed else 0
        return [a[0] in ("have", "busy") or (a[0] == "new" and committed) for a in answer]

    async def _abort(self, client: ServeClient, rids: list[int]) -> None:
        with contextlib.suppress(_Down, ServerError):
            await self._call(client, "abort", rids)

    async def _copy(
        self,
        arena: Arena,
        copies: list[tuple[list[Extent], PageBuffer]],
        *,
        out: bool,
        nbytes: int,
    ) -> None:
        fn = copy_out_of if out else copy_into

        def run(part: list[tuple[list[Extent], PageBuffer]]) -> None:
            for ext, page in part:
                fn(arena, ext, page)

        if nbytes <= _OFFLOAD_BYTES:
            run(copies)
            return
        # Pages in a few groups, copied in parallel worker threads (the copies
        # release the GIL); the caller gets control back only once all are done.
        n = min(_COPY_THREADS, len(copies))
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(None, run, copies[i::n]) for i in range(n)]
        # return_exceptions: a failed group must not return control while others still copy
        results = await finish(asyncio.gather(*futures, return_exceptions=True))
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def delete(self, keys: Sequence[PageKey]) -> int:
        self._check_open()
        ks = check_batch(keys)
        client = await self._connection()
        if client is None:
            return self._down(0)
        try:
            return int(await self._call(client, "delete", list(ks)))
        except (_Down, ServerError) as e:
            raise BackendUnavailableError(f"delete failed: {e}") from e

    async def clear(self) -> None:
        self._check_open()
        client = await self._connection()
        if client is None:
            raise BackendUnavailableError(f"no tiercache server on {self.socket_path}")
        try:
            await self._call(client, "clear", {})
        except (_Down, ServerError) as e:
            raise BackendUnavailableError(f"clear failed: {e}") from e

    async def server_status(self) -> dict[str, Any] | None:
        """The server's counters, or ``None`` while it is away."""
        self._check_open()
        client = await self._connection()
        if client is None:
            return None
        try:
            out: dict[str, Any] = await self._call(client, "status", {})
        except (_Down, ServerError):
            return None
        return out

    async def stats(self) -> BackendStats:
        s = await super().stats()
        s.extra["connected"] = int(self._client is not None and self._client.connected)
        return s

    def _down(self, value: _T) -> _T:
        self._stats.extra["down_calls"] = int(self._stats.extra["down_calls"]) + 1
        return value

    async def aclose(self) -> None:
        if self.state is BackendState.CLOSED:
            return
        self.state = BackendState.CLOSED
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def __repr__(self) -> str:
        return f"ServeBackend({self.socket_path!r}, state={self.state.value})"


def _well_formed(answer: Any, sizes: list[int], granted: str, arena_bytes: int) -> bool:
    """Whether a lease / reserve answer has one item per page, granted ones extents of its size."""
    if not isinstance(answer, list) or len(answer) != len(sizes):
        return False
    for a, size in zip(answer, sizes, strict=True):
        if not (isinstance(a, list) and a and isinstance(a[0], str)):
            return False
        if a[0] == granted:
            if len(a) != 3 or not isinstance(a[1], int) or not isinstance(a[2], list):
                return False
            for e in a[2]:
                if not (
                    isinstance(e, list)
                    and len(e) == 2
                    and all(isinstance(x, int) for x in e)
                    and e[0] >= 0
                    and e[1] > 0
                    and e[0] + e[1] <= arena_bytes
                ):
                    return False
            if sum(e[1] for e in a[2]) != size:
                return False
        elif a[0] == "mismatch" and not (
            len(a) == 3 and isinstance(a[1], str) and isinstance(a[2], int)
        ):
            return False
    return True


class _Down(Exception):
    """The server could not be reached for one call (a miss for the caller)."""
