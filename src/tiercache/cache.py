"""`TierCache`: the object a serving engine talks to.

The role of SGLang's hierarchical radix cache around the controller: a prefix
index (`RadixIndex`) that knows which token prefixes are cached and on which
tier, the write policies that copy new KV down the tiers, load back and
storage prefetch that bring it up again, and LRU eviction that makes room.

An engine's request goes::

    async with cache.request(prompt) as req:          # match, load back, prefetch, lock
        slots = await req.alloc(len(prompt) - req.cached_tokens)
        logits = model.prefill(pool, prompt[req.cached_tokens:], slots,
                               prefix_slots=req.prefix_indices,
                               layer_ready=req.layer_ready)   # waits layer by layer
        await req.commit(prompt, torch.cat([req.prefix_indices, slots]))

or uses the verbs `match_prefix`, `load_back`, `prefetch`, `alloc_device`,
`insert`, `lock` / `unlock` directly. Every method runs on the loop that
opened the cache (a call from another thread or loop is a `StateError`;
`Request.layer_ready` is the one verb meant for a worker thread); the
bookkeeping is synchronous, so an ``await`` never interrupts it halfway.

Three rules hold at every verb:

- Arguments are checked before anything changes (`tiercache._checks`): a
  refused call leaves the index, the allocators and the request as they were.
- The index never claims KV that did not land: the controller's `Ledger` knows
  who owns every page (the index, a request, a caller) and which a load still
  fills; `match_prefix` reports those as not landed, and a failed load back
  (`loads.LoadOp`) hands its nodes back to the host tier and frees their
  slots once the copy has settled.
- Room that others hold is waited for, not failed on. Device allocations,
  and host writes and prefetches that may wait, queue for room first come,
  first served (`_RoomQueue`, one per pool), up to ``config.alloc_timeout_s``.
  Nothing polls: a waiter sleeps until an event that may release room (a
  request ends, slots are freed, a copy, load or backup settles, a prefetch
  ends) wakes it. Making device room is one loop (`TierCache._evict_device`):
  each pass decides on the index as it is, with no await inside it.

Every background task of the cache (a deferred write-through, a backup's
bookkeeping, a prefetch finished on behalf of a cancelled caller) runs in the
cache's `TaskGroup`, which the controller and its storage tier share: a
failure is logged once and raised once, at the next call or at close.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

import numpy as np
import torch

from tiercache._aio import check_on_loop
from tiercache._checks import (
    check_choice,
    check_count,
    check_extra_key,
    check_instance,
    check_slot_tensor,
    token_list,
)
from tiercache._resource import AsyncResource
from tiercache._tasks import TaskGroup
from tiercache.config import PREFETCH_POLICIES, TierCacheConfig
from tiercache.controller import CopyAck, LoadHandle, Ready, TierController
from tiercache.errors import (
    CapacityError,
    ClosedError,
    ConfigError,
    InvalidInputError,
    StateError,
)
from tiercache.index.hashing import INLINE_HASH_PAGES, page_hashes
from tiercache.index.radix import MatchResult, Node, RadixIndex, extra_key_prior
from tiercache.ledger import Owner
from tiercache.loads import LoadBacks
from tiercache.memory.allocator import PageAllocator, check_slot_indices, page_ids
from tiercache.memory.pools import DeviceKVPool, HostKVPool, resolve_device
from tiercache.storage.base import StorageBackend
from tiercache.storage_tier import BackupOperation, PrefetchOperation

__all__ = ["CacheMatch", "CacheState", "CacheStats", "Request", "TierCache"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def _nothing() -> None:
    pass


class _RoomQueue:
    """Tasks waiting for room in one pool, served first come, first served.

    Only the task at the head of the queue tries to take room (evicting for
    it); the others wait behind it. Nothing polls: a waiter sleeps until
    `wake` is called, by every event that may release room and whenever a
    waiter leaves the queue, or until its own deadline, which a loop timer
    marks by waking the queue once. The cache keeps one queue for device
    room and one for host room.
    """

    def __init__(self) -> None:
        self._tickets: deque[object] = deque()
        self._event = asyncio.Event()

    def __len__(self) -> int:
        """Tasks waiting, the head included."""
        return len(self._tickets)

    def wake(self) -> None:
        """Let every waiter look again (nothing happens when none waits)."""
        if self._tickets:
            event, self._event = self._event, asyncio.Event()
            event.set()

    async def serve(
        self,
        attempt: Callable[[], Awaitable[_T | None]],
        deadline: float,
        needs_nothing: Callable[[], bool] = lambda: False,
    ) -> _T | None:
        """Wait for this task's turn, then run ``attempt`` whenever room may have appeared.

        Args:
            attempt: takes the room and returns what it took, or ``None`` to
                wait for the next wake; it may raise to give up.
            deadline: the ``loop.time()`` at which waiting stops.
            needs_nothing: whether the task needs no room any more (another
                task did its work meanwhile): then it attempts at once,
                wherever it stands in the queue, since taking nothing it
                passes no one.

        Returns:
            ``attempt``'s first result, or ``None`` once the deadline has passed.
            Cancelling the caller takes it out of the queue, holding nothing.
        """
        loop = asyncio.get_running_loop()
        ticket = object()
        self._tickets.append(ticket)
        # The timer says when the deadline has passed: a loop may run it a hair
        # before loop.time() reaches ``deadline``, so the clock alone is not asked.
        expired = asyncio.Event()

        def expire() -> None:
            expired.set()
            self.wake()

        timer = loop.call_at(deadline, expire)
        try:
            while True:
                event = self._event  # taken before the attempt: a wake during it is not lost
                if self._tickets[0] is ticket or needs_nothing():
                    got = await attempt()
                    if got is not None:
                        return got
                if expired.is_set() or loop.time() >= deadline:
                    return None
                await event.wait()
        finally:
            timer.cancel()
            self._tickets.remove(ticket)
            self.wake()  # the next in line may go now


@dataclass(slots=True)
class _EvictionPass:
    """What one synchronous pass over the device LRU candidates did."""

    freed: int = 0
    #: Write backs it started: once they land, the next pass evicts their nodes.
    writes: list[tuple[Node, CopyAck]] = field(default_factory=list)
    #: The first node that could not be written back for want of host room.
    homeless: Node | None = None
    #: Nodes that can neither leave nor be dropped (their write back failed,
    #: and host-only children or a pin need them): the next pass looks past them.
    stuck: set[int] = field(default_factory=set)


class CacheState(enum.Enum):
    CREATED = "created"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(slots=True)
class CacheStats:
    """What the cache did. Token counts are per matched request.

    Every count only grows: the storage ones add up every backend attached so
    far (a detached backend keeps its counts here).
    """

    requests: int = 0
    tokens_requested: int = 0
    tokens_device_hit: int = 0
    tokens_host_hit: int = 0
    tokens_storage_hit: int = 0
    tokens_inserted: int = 0
    device_evictions: int = 0
    device_evicted_tokens: int = 0
    host_evictions: int = 0
    host_evicted_tokens: int = 0
    write_backs: int = 0
    loads_back: int = 0
    prefetches: int = 0
    bytes_device_to_host: int = 0
    bytes_host_to_device: int = 0
    bytes_storage_read: int = 0
    bytes_storage_written: int = 0
    prefetch_revoked: int = 0
    prefetch_terminated: int = 0
    prefetch_completed: int = 0
    prefetch_failed: int = 0
    storage_backups: int = 0
    storage_errors: int = 0
    storage_outages: int = 0
    storage_reconnects: int = 0
    storage_auto_detaches: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        hit = self.tokens_device_hit + self.tokens_host_hit + self.tokens_storage_hit
        return hit / self.tokens_requested if self.tokens_requested else 0.0

    def hit_rates(self) -> dict[str, float]:
        n = self.tokens_requested or 1
        return {
            "device": self.tokens_device_hit / n,
            "host": self.tokens_host_hit / n,
            "storage": self.tokens_storage_hit / n,
            "total": self.hit_rate,
        }


@dataclass(frozen=True, slots=True)
class CacheMatch:
    """What `TierCache.match_prefix` found for a prompt.

    Attributes:
        device_indices: device slots of the device-resident prefix whose bytes have landed.
        device_tokens: its length.
        host_tokens: tokens after it that are on the host only, or whose load
            back is still in flight (`load_back` them: it returns the slots
            with the handle of the load that fills them).
        storage_candidate_tokens: whole-page tokens after the device and host
            parts that a storage prefetch may still find.
        index: the index's raw result (nodes to lock, the prior hash).
    """

    device_indices: torch.Tensor
    device_tokens: int
    host_tokens: int
    storage_candidate_tokens: int
    index: MatchResult
    extra_key: str | None


class TierCache(AsyncResource):
    """A tiered KV cache: device pool, host pool and an optional storage backend.

    Args:
        config: the configuration (default: `TierCacheConfig()`); keyword
            ``overrides`` are applied on top.
        device_pool: an engine's own `DeviceKVPool` to manage (created from the
            config when not given), with its ``device_allocator``.
        tp_group: a ``torch.distributed`` process group over the TP ranks.

    Raises:
        InvalidInputError: ``config``, ``device_pool`` or ``device_allocator``
            of the wrong type, or a ``device_pool`` of another layout than
            the config's (checked here; the allocator's size at `open`).
        ConfigError: a bad override.

    Use ``async with TierCache(config) as cache:``. Closing waits for copies,
    stops storage coroutines and frees every slot.
    """

    def __init__(
        self,
        config: TierCacheConfig | None = None,
        *,
        device_pool: DeviceKVPool | None = None,
        device_allocator: PageAllocator | None = None,
        tp_group: Any = None,
        **overrides: Any,
    ) -> None:
        config = check_instance(config or TierCacheConfig(), TierCacheConfig, "config")
        if overrides:
            config = config.replace(**overrides)
        self.config = config
        self.layout = config.layout()
        if device_pool is not None:
            check_instance(device_pool, DeviceKVPool, "device_pool")
            if device_pool.layout != self.layout:
                raise InvalidInputError(
                    f"device_pool holds {device_pool.layout.describe()}, "
                    f"the config describes {self.layout.describe()}"
                )
        if device_allocator is not None:
            check_instance(device_allocator, PageAllocator, "device_allocator")
        self._device_pool = device_pool
        self._device_allocator = device_allocator
        self._tp_group = tp_group
        self.state = CacheState.CREATED
        self.index = RadixIndex(self.layout.page_size)
        self._stats = CacheStats()
        self._controller: TierController | None = None
        # Loads in flight: their handle, the device slots they fill, and
        # slots of nodes a failed load took away that this load still writes
        # (freed when it settles). A request whose prefix shares those slots
        # waits for them too (the index already shows the nodes as
        # device-resident while the bytes are landing).
        self._pending_loads: LoadBacks | None = None  # made at open
        # Who owns each page (the index, a request, a caller) lives in the
        # controller's `Ledger`: `insert` refuses pages the index or another
        # request owns, and a failed load frees what nobody owns.
        # Tasks waiting for device room and for host room (`_RoomQueue`);
        # `_notify_room` wakes both. Nodes whose write-through waits for host room.
        self._device_queue = _RoomQueue()
        self._host_queue = _RoomQueue()
        self._deferred_writes: set[int] = set()
        self._backups: set[BackupOperation] = set()
        #: The background tasks of the cache, the controller and its storage tier.
        self.tasks = TaskGroup("cache")
        # The cache's own tasks among them (the storage tier's run until detach).
        self._own: set[asyncio.Task[Any]] = set()
        self._forget_settle: Callable[[], None] = _nothing
        self._open_requests = 0
        # Open requests waiting in the device queue, with the slots each holds
        # outside the index: they free nothing until they are served.
        self._blocked: dict[object, int] = {}
        # Locks taken with `lock` and not yet released by `unlock`, per node.
        self._locks: dict[Node, int] = {}
        # Flushes so far: a prefetch that spans one finds its parent and its
        # host slots gone (`_settle_prefetch`).
        self._flushes = 0
        # The loop that opened the cache: every verb runs on it (see `_check`).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None

    # -- lifecycle --------------------------------------------------------------

    @property
    def controller(self) -> TierController:
        if self._controller is None or self.state is not CacheState.OPEN:
            raise (
                ClosedError("the cache is not open")
                if self.state is CacheState.CLOSED
                else StateError("the cache is not open: use `async with TierCache(...)`")
            )
        return self._controller

    @property
    def device_pool(self) -> DeviceKVPool:
        return self.controller.device_pool

    @property
    def host_pool(self) -> HostKVPool:
        return self.controller.host_pool

    async def open(self) -> Self:
        """Allocate the pools (off the loop), open the controller, attach storage if configured.

        Raises:
            StateError / ClosedError: opened twice or after close.
            ConfigError: ``config.device`` names a CUDA device this machine lacks.
            CapacityError: a pool does not fit.
            ConfigError / StorageError: the storage URL failed (nothing stays open).
        """
        if self.state is CacheState.OPEN:
            raise StateError("the cache is already open")
        if self.state is CacheState.CLOSED:
            raise ClosedError("the cache was closed; create a new one")
        cfg = self.config
        lay = self.layout

        # "cuda" means this thread's current device (a TP rank's own GPU), not
        # that of the worker thread the pools are built on.
        try:
            device = resolve_device(cfg.device) if self._device_pool is None else None
        except InvalidInputError as e:  # the setting does not fit this machine (no CUDA)
            raise ConfigError(f"device={cfg.device!r}: {e}") from e

        def build() -> tuple[DeviceKVPool, HostKVPool]:
            dev = self._device_pool or DeviceKVPool(lay, cfg.device_tokens, device or cfg.device)
            # Pinned in the device pool's context, not device 0's (this thread chose none).
            on = dev.device if dev.device.type == "cuda" else None
            host = HostKVPool(
                lay, cfg.resolved_host_tokens(), host_layout=cfg.host_layout, device=on
            )
            return dev, host

        try:
            dev, host = await asyncio.to_thread(build)
        except (RuntimeError, MemoryError) as e:  # torch's out-of-memory is a RuntimeError
            raise CapacityError(f"cannot allocate the KV pools: {e}") from e
        ctl = TierController(
            dev,
            host,
            tasks=self.tasks,
            device_allocator=self._device_allocator,
            model=cfg.model,
            tp_rank=cfg.tp_rank,
            tp_size=cfg.tp_size,
            tp_group=self._tp_group,
            storage_config=cfg.storage_tier_config(),
        )
        await ctl.open()
        try:
            if cfg.storage_url:
                await ctl.attach_storage_backend(cfg.storage_url, **cfg.storage_options)
        except BaseException:
            await ctl.aclose()
            raise
        self._controller = ctl
        self._pending_loads = LoadBacks(
            self.index, ctl, lambda: self.state is CacheState.OPEN, self._notify_room
        )
        self._forget_settle = ctl.add_settle_callback(self._notify_room)
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self.state = CacheState.OPEN
        return self

    async def _aenter(self) -> None:
        await self.open()

    async def aclose(self) -> None:
        """Wait for copies and backups, stop storage, close the controller. Idempotent.

        Raises:
            StateError: a background task failed and its failure was not
                raised by an earlier call (the cache is closed all the same).
        """
        if self.state is not CacheState.OPEN:
            self.state = CacheState.CLOSED
            return
        ctl = self.controller
        self.state = CacheState.CLOSED
        self._notify_room()  # waiters see the cache closed
        try:
            await self._join_own()
        finally:
            self._forget_settle()
            # It refers to this cache (its callback): drop it, or the cache and
            # its pools would wait for the garbage collector.
            self._forget_settle = _nothing
            self._pending_loads = None  # it refers back to the cache: no cycle left behind
            try:
                await ctl.aclose()
            finally:
                await self.tasks.aclose()

    async def _join_own(self) -> None:
        """Wait for the cache's own background tasks (not the storage tier's), those started meanwhile too."""
        while self._own:
            await asyncio.wait(set(self._own))

    def _spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        """Run ``coro`` in the cache's `TaskGroup` (a failure surfaces at the next call or close)."""
        task = self.tasks.spawn(coro, what)
        self._own.add(task)
        task.add_done_callback(self._own.discard)

    def _check(self) -> TierController:
        """The open controller, after settling finished loads and raising a background failure.

        Raises:
            StateError / ClosedError: the cache is not open.
            StateError: called from another thread or event loop than the one
                that opened the cache (nothing is changed).
            StateError: a background task failed since the last call (raised once).
        """
        ctl = self.controller
        check_on_loop(self._loop, self._thread, "TierCache")
        if self._pending_loads:
            self._pending_loads.settle_finished()
        self.tasks.raise_failure()
        return ctl

    def use_compute_stream(self, stream: torch.cuda.Stream | None) -> None:
        """Name the stream the engine's forward pass (attention) runs on (CUDA).

        The copies the cache starts on its own (write-backs at eviction,
        write-through, loads back) and the slots it frees (evictions, a
        request's end, a failed load) are then ordered after the work queued
        on that stream when they happen, not after the loop thread's current
        stream. ``None`` goes back to the calling thread's current stream.
        See `TierController.use_compute_stream`.

        Raises:
            InvalidInputError: not a CUDA stream of the device pool's device.
        """
        self._check().use_compute_stream(stream)

    def _check_loads(self) -> None:
        """Settle the loads back whose copy has ended (`Request.wait_loaded` after a failure)."""
        if self._pending_loads:
            self._pending_loads.settle_finished()

    # -- storage ----------------------------------------------------------------

    async def attach_storage(self, backend: StorageBackend | str, **options: Any) -> StorageBackend:
        """Attach a storage backend at runtime (see `TierController.attach_storage_backend`)."""
        return await self._check().attach_storage_backend(backend, **options)

    async def detach_storage(self) -> bool:
        """Detach the storage backend; idempotent."""
        return await self._check().detach_storage_backend()

    # -- matching ---------------------------------------------------------------

    def match_prefix(
        self, tokens: Sequence[int] | torch.Tensor, extra_key: str | None = None
    ) -> CacheMatch:
        """Find the cached prefix of ``tokens`` on the device and host tiers.

        Counts towards stats and LRU. Under ``write_through_selective`` a
        device node reaching the hit threshold is written to host now.

        Raises:
            InvalidInputError: ``tokens`` is not a list, tuple or 1-D integer
                tensor of ids in ``[0, 2**32)``, or ``extra_key`` is not a str.
        """
        self._check()
        toks = self._tokens(tokens)
        check_extra_key(extra_key)
        return self._match(toks, extra_key)

    def _match(self, toks: list[int], extra_key: str | None) -> CacheMatch:
        """`match_prefix` of checked tokens and ``extra_key``."""
        ctl = self._check()
        assert self._pending_loads is not None
        m = self._pending_loads.landed(self.index.match_prefix(toks, extra_key, checked=True))
        ps = self.layout.page_size
        rest = (len(toks) - m.matched_length) // ps * ps
        if self.config.write_policy == "write_through_selective":
            for n in self.index.path(m.last_device_node):
                if n.hit_count >= self.config.write_through_threshold and not n.on_host:
                    self._write_node(ctl, n, defer=True)
        return CacheMatch(m.device_indices, m.device_length, m.host_hit_length, rest, m, extra_key)

    @staticmethod
    def _tokens(tokens: Sequence[int] | torch.Tensor) -> list[int]:
        return token_list(tokens)

    def lock(self, node: Node) -> None:
        """Keep ``node`` and its ancestors from eviction (a request is using them).

        Each `lock` is released by one `unlock` of the same node.

        Raises:
            InvalidInputError: not a `Node`. StateError: not in the index.
        """
        self._check()
        self.index.lock(node)
        self._locks[node] = self._locks.get(node, 0) + 1

    def unlock(self, node: Node) -> None:
        """Release a `lock` of ``node``.

        Only locks taken with `lock` are released here: the locks the cache
        takes itself (an open request's prefix, a copy or load in flight)
        are not the caller's to drop.

        Raises:
            InvalidInputError: not a `Node`. StateError: ``node`` holds no
                `lock` (nothing is changed), or is not in the index.
        """
        self._check()
        self.index.path(node)  # a Node of this index, else refused before the lock count
        held = self._locks.get(node, 0)
        if held <= 0:
            raise StateError(f"unlock of {node}: it holds no lock taken with TierCache.lock")
        self.index.unlock(node)
        if held == 1:
            del self._locks[node]
        else:
            self._locks[node] = held - 1
        self._notify_room()

    # -- device allocation and eviction ----------------------------------------

    async def alloc_device(self, num_tokens: int) -> torch.Tensor:
        """Device slots for ``num_tokens`` (a multiple of the page size), evicting LRU nodes if needed.

        When the pool is short only because other requests or copies hold
        slots, waits for them (see `_take_room`): first come, first served,
        up to ``config.alloc_timeout_s``. Cancelling the caller while it waits
        takes nothing.

        Returns:
            CPU ``int64`` slots, page-aligned: the caller owns them until it
            passes them to `insert` or `free_device`.

        Raises:
            CapacityError: more than the pool holds, nothing will free room
                (no other request, copy or load is in flight, or every other
                open request waits for device room itself), or the timeout
                passed.
            InvalidInputError: not a non-negative int multiple of the page size.
        """
        return await self._alloc_device(num_tokens, own=-1)

    async def _alloc_device(
        self, num_tokens: int, own: int, request: object = None
    ) -> torch.Tensor:
        """`alloc_device`; with ``request``, the slots are that request's in the ledger."""
        ctl = self._check()
        n = check_count(num_tokens, "num_tokens", multiple_of=self.layout.page_size)
        books = ctl.ledger.device
        if n > books.num_slots:
            raise CapacityError(f"{n} device slots asked: the pool holds {books.num_slots}")

        def take() -> torch.Tensor | None:
            if request is not None:
                return books.grant(request, n)
            got = books.alloc(n)
            return None if got is None else got[0]

        return await self._take_room(lambda: n, take, own)

    async def _take_room(
        self,
        need: Callable[[], int],
        take: Callable[[], _T | None],
        own: int,
    ) -> _T:
        """Run ``take`` (synchronous: it allocates, or returns ``None``) once ``need()`` device slots can be had.

        Every device allocation that may wait goes through here: at once when
        nobody waits and the room is free, else in the device `_RoomQueue`,
        where the head evicts for its shortfall (`_make_device_room`) and
        the others wait behind it. A call that needs no slots (an alloc of
        0, a load back whose pages another call loaded meanwhile) never
        waits, whether on arrival or while queued: ``take`` runs at once.

        Args:
            need: the slots still needed (re-read each turn: a load back
                may shrink while it waits); ``take`` never returns ``None``
                when it is 0.
            take: the allocation itself.
            own: device slots the caller itself holds outside the index (a
                request's earlier `Request.alloc`): waiting for those is futile.

        Raises:
            CapacityError: the timeout passed, or nothing else holds or moves
                device slots, so waiting cannot help.
            ClosedError: the cache was closed while the caller waited.
        """
        if not self._device_queue or need() <= 0:
            got = take()
            if got is not None:
                return got
        timeout = self.config.alloc_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout
        key = object()

        async def attempt() -> _T | None:
            return await self._make_device_room(need, take, own, deadline, key)

        if own >= 0:
            # This request now waits too: the head may find that nothing else will free room.
            self._blocked[key] = own
            self._device_queue.wake()
        try:
            got = await self._device_queue.serve(attempt, deadline, lambda: need() <= 0)
        finally:
            self._blocked.pop(key, None)
        if got is None:  # it needed room to the end: need() > 0 here
            raise CapacityError(
                f"no room for {need()} device slots within alloc_timeout_s={timeout}: "
                f"{self.controller.device_allocator.available} free, the rest held by others"
            )
        return got

    async def _make_device_room(
        self,
        need: Callable[[], int],
        take: Callable[[], _T | None],
        own: int,
        deadline: float,
        key: object,
    ) -> _T | None:
        """One turn at the head of the device queue: take, evicting LRU nodes while that frees room.

        Returns:
            What ``take`` returned, or ``None`` when others hold the room (wait for a wake).

        Raises:
            CapacityError: nothing else holds or moves device slots.
            ClosedError: the cache is closed.
        """
        if self.state is not CacheState.OPEN:
            raise ClosedError("the cache was closed while waiting for device room")
        alloc = self.controller.device_allocator
        while (got := take()) is None:
            short = need() - alloc.available
            if short <= 0 or not await self._evict_device(short, deadline):
                break
        if got is not None:
            return got
        if self._nothing_will_free(own, key):
            raise CapacityError(
                f"cannot find {need()} device slots: {alloc.available} free, the rest locked "
                "or held by requests that wait for room themselves"
            )
        return None

    def _nothing_will_free(self, own: int, key: object = None) -> bool:
        """Whether no other request, copy, load or task can release device slots.

        ``own`` is what the caller holds outside the index when it is an open
        request, ``-1`` for a direct `alloc_device` call (whose own holdings
        cannot be told from others': they count as others'). Open requests
        queued behind the caller (``key``: its entry in ``_blocked``) release
        nothing before the caller is served: they hold and wait, as it does,
        and waiting would only end at the timeout.
        """
        ctl = self.controller
        blocked = [held for k, held in self._blocked.items() if k is not key]
        outside = self._held_outside_index()
        others_open = self._open_requests - (1 if own >= 0 else 0) - len(blocked)
        return (
            others_open <= 0
            and outside <= max(own, 0) + sum(blocked)
            and not ctl.busy
            and not self._pending_loads
            and len(self._own) <= len(self._deferred_writes)  # those free no device room
            and len(self._device_queue) <= 1 + len(blocked)
        )

    def _held_outside_index(self) -> int:
        """Device slots allocated that no index node holds: requests', callers' of
        `alloc_device` (or, with an engine's allocator, the engine's), copies'."""
        used = self.controller.device_allocator.used
        return used - self.controller.ledger.device.tokens_owned(Owner.INDEX)

    def _notify_room(self) -> None:
        """Wake the tasks waiting for device or host room: room may have appeared.

        Called on every event that may release room: a request ends, slots
        are freed, an index lock or pin is dropped, a copy, load or backup
        settles, a prefetch ends, the cache closes.
        """
        self._device_queue.wake()
        self._host_queue.wake()

    def free_device(self, indices: torch.Tensor, *, ready: Ready = None) -> None:
        """Return device slots from `alloc_device` that were not inserted.

        ``ready`` (CUDA): the last readers of those slots (kernels still
        queued that read them), as an event or their stream; default: the
        caller's current stream of the pool's device, recorded in this call.
        The next load into any freed slot waits for it (see
        `TierController.fence_device_reads`). On a CPU pool it must be ``None``.

        Raises:
            InvalidInputError: not slots of this pool, slots the index holds,
                or a bad ``ready``.
            DoubleFreeError: slots that are not allocated.
            StateError: a copy of those slots is in flight.
        """
        ctl = self._check()
        ready_ev = ctl.ready_event(ready, "free_device")  # checked before anything changes
        dev = check_slot_indices(
            indices, self.layout.page_size, ctl.device_pool.num_slots, "indices"
        )
        pages = self._pages(dev)
        books = ctl.ledger.device
        if books.owned(pages, Owner.INDEX):
            raise InvalidInputError("free_device: some of these slots hold cached KV of the index")
        if books.owned(pages, Owner.REQUEST):
            raise InvalidInputError(
                "free_device: some of these slots belong to an open request (it frees them)"
            )
        if books.leased(pages):
            raise StateError("device slots with a copy in flight cannot be freed; await its ack")
        # The ledger's release wakes the waiters for room.
        books.free(pages, fence=ready_ev)

    def _pages(self, dev: torch.Tensor) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Page ids of page-aligned CPU slot indices."""
        return page_ids(dev, self.layout.page_size)

    def _set_index_pages(self, dev: torch.Tensor, held: bool) -> None:
        """The index takes ``dev`` (``held``), or gives it up to the cache (which frees it)."""
        if dev.numel():
            self.controller.ledger.device.give(
                self._pages(dev), Owner.INDEX if held else Owner.CALLER
            )

    def _free_device_now(self, dev: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        """Free device slots the cache holds, behind a fence on the engine's compute stream
        (``ready``, or one recorded now: `TierController.use_compute_stream`)."""
        ctl = self.controller
        fence = ready if ready is not None else ctl.ready_event(None, "free_device")
        ctl.ledger.device.free(self._pages(dev), fence=fence)

    async def evict_device(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots (fewer when the rest is locked), LRU leaves first.

        A node whose pages are on host just leaves the device. One that is not
        (``write_back``, or a host write that found no room) is written to host
        first, waiting up to ``config.alloc_timeout_s`` for host room that
        copies in flight hold; if there is no room or the copy fails, it is
        dropped when nothing below it needs it, and kept otherwise. Returns
        slots freed.

        Raises:
            InvalidInputError: ``num_tokens`` is not a non-negative int.
        """
        self._check()
        n = check_count(num_tokens)
        deadline = asyncio.get_running_loop().time() + self.config.alloc_timeout_s
        return await self._evict_device(n, deadline)

    async def _evict_device(self, num_tokens: int, deadline: float) -> int:
        """`evict_device`: the one loop that makes device room. Returns slots freed.

        Each round is a synchronous pass over fresh LRU candidates
        (`_eviction_pass`: no await inside it, so no candidate goes stale),
        then at most one wait:

        1. the pass frees every candidate that has a host copy, and starts a
           write back of each that has none, where host room can be made;
        2. if it started write backs, wait for their copies: the next pass
           evicts those nodes (or drops them, if the copy failed);
        3. else, if a node found no host room, wait (once per node) for host
           room that copies in flight hold, up to ``deadline``; if none comes,
           the next pass drops that node when nothing below it needs it;
        4. else, if the pass found nodes that must stay (their write back
           failed and they cannot be dropped), pass again looking past them:
           other, less recently used nodes may leave instead;
        5. else nothing more can be freed.

        Every round starts a write back, waits once for a node, gives a node
        up, or sets one aside: the loop ends.
        """
        loop = asyncio.get_running_loop()
        freed = 0
        failed: set[int] = set()  # nodes no write back will save: dropped, not retried
        waited: set[int] = set()  # nodes host room was waited for (once each)
        stuck: set[int] = set()  # nodes that must stay: later passes look past them
        granted = False  # host room was just made for a write back: it may go first
        while freed < num_tokens:
            step = self._eviction_pass(num_tokens - freed, failed, granted, stuck)
            freed += step.freed
            homeless, granted = step.homeless, False
            if step.writes:
                await self._wait_write_backs(step.writes, failed)
            elif homeless is None:
                if step.stuck <= stuck:
                    break
                stuck |= step.stuck
            elif homeless.id in waited:
                failed.add(homeless.id)  # room was made for it, yet it could not be written
            else:
                waited.add(homeless.id)
                granted = await self._host_room(homeless.num_tokens, deadline - loop.time())
                if not granted:
                    failed.add(homeless.id)
        return freed

    def _eviction_pass(
        self, num_tokens: int, failed: set[int], granted: bool, stuck: set[int]
    ) -> _EvictionPass:
        """Evict what can leave the device now, LRU first; start write backs for the rest.

        The candidates come from the index in an order where a node follows
        its device-resident children. A node whose child stays on the device
        stays too. A node whose child leaves once its write back lands is
        written back as well (a pin that child's storage backup takes could
        keep a device-only parent from ever being offered again), and leaves
        in a later pass.
        """
        ctl = self.controller
        out = _EvictionPass()
        stays: set[int] = set()  # a child stays on the device
        waits: set[int] = set()  # a child leaves once its write back lands
        for node in self.index.evict_device_candidates(num_tokens, skip=stuck):
            if node.id in stays:
                fate = "stays"
            elif node.id not in waits and node.on_host:
                out.freed += self._leave_device(ctl, node)
                continue
            else:
                fate = self._save_or_drop(ctl, node, failed, granted, out)
                if fate == "gone":
                    continue
            assert node.parent is not None
            (stays if fate == "stays" else waits).add(node.parent.id)
        return out

    def _save_or_drop(
        self,
        ctl: TierController,
        node: Node,
        failed: set[int],
        granted: bool,
        out: _EvictionPass,
    ) -> str:
        """Decide the fate of a candidate that cannot simply leave the device now.

        Returns:
            ``"gone"`` (dropped: its KV is lost), ``"leaving"`` (its host
            copy exists or is being written: it leaves in a later pass) or
            ``"stays"``.
        """
        if node.on_host:
            return "leaving"  # waits for a child's write back
        if node.id in failed:
            dropped = self._drop_device_only(ctl, node)
            out.freed += dropped
            if not dropped:
                out.stuck.add(node.id)
            return "gone" if dropped else "stays"
        ack = self._start_write_back(ctl, node, granted)
        if ack is not None:
            out.writes.append((node, ack))
            return "leaving"
        if out.homeless is None:
            out.homeless = node
        return "stays"

    def _leave_device(self, ctl: TierController, node: Node) -> int:
        """Free the device copy of a node that has a host copy; returns slots freed."""
        dev = self.index.mark_device_evicted(node)
        self._set_index_pages(dev, False)
        self._free_device_now(dev)
        self._stats.device_evictions += 1
        self._stats.device_evicted_tokens += dev.numel()
        return int(dev.numel())

    def _drop_device_only(self, ctl: TierController, node: Node) -> int:
        """Drop a device-only node (its KV is lost) unless host-only children or a pin need it."""
        if node.children or node.host_pin:
            return 0
        dev = node.device_indices
        assert dev is not None
        self.index.remove(node)
        self._set_index_pages(dev, False)
        self._free_device_now(dev)
        self._stats.device_evictions += 1
        self._stats.device_evicted_tokens += dev.numel()
        return int(dev.numel())

    def _start_write_back(self, ctl: TierController, node: Node, granted: bool) -> CopyAck | None:
        """Start copying a device-only node to host, if host room can be had now (no waiting).

        ``granted``: this task was just served by the host queue; else it
        does not go ahead of tasks waiting there.
        """
        if self._host_queue and not granted:
            return None
        if not self._make_host_room(node.num_tokens):
            return None
        ack = self._write_node(ctl, node)
        if ack is not None:
            self._stats.write_backs += 1
        return ack

    @staticmethod
    async def _wait_write_backs(writes: list[tuple[Node, CopyAck]], failed: set[int]) -> None:
        """Wait for write backs to land; a node whose copy failed goes into ``failed``."""
        for node, ack in writes:
            try:
                await ack
            except Exception as e:
                # The copy has settled and `_write_done` (its first callback)
                # has dropped the host copy: the node is device-only, as before.
                logger.warning("a write back of %d tokens failed: %r", node.num_tokens, e)
                failed.add(node.id)

    def _make_host_room(self, num_tokens: int) -> bool:
        """Evict LRU host-only nodes until ``num_tokens`` host slots are free; whether they are."""
        ctl = self.controller
        if ctl.host_allocator.available < num_tokens:
            self._evict_host_now(num_tokens - ctl.host_allocator.available)
        return ctl.host_allocator.available >= num_tokens

    def _host_will_free(self) -> bool:
        """Whether something in flight may release host room: a device->host copy
        (a failed one frees its slots; a finished one may become evictable), a
        storage backup (it pins its nodes), a prefetch (it holds its slots) or a
        load back (it locks its nodes)."""
        ctl = self.controller
        return bool(
            ctl.busy
            or self._backups
            or self._pending_loads
            or (ctl.storage is not None and ctl.storage.busy)
        )

    async def _host_room(self, num_tokens: int, wait_s: float) -> bool:
        """Make ``num_tokens`` host slots free, waiting up to ``wait_s`` seconds for room that copies hold.

        Host room that no copy, backup, prefetch or load holds is made by
        evicting LRU host-only nodes, at once. When that is not enough and
        something in flight may release host room (`_host_will_free`), the
        caller waits in the host `_RoomQueue`: first come, first served (only
        the head evicts), cancellable (a cancelled waiter takes nothing).
        With ``wait_s <= 0`` it only tries once, without queueing.

        Returns:
            Whether the room is free now; the caller allocates it before its
            next ``await``.
        """
        if wait_s <= 0 or not self._host_queue:
            if self._make_host_room(num_tokens):
                return True
            if wait_s <= 0 or num_tokens > self.controller.host_allocator.num_slots:
                return False

        async def attempt() -> bool | None:
            if self.state is not CacheState.OPEN:
                return False
            if self._make_host_room(num_tokens):
                return True
            return None if self._host_will_free() else False

        deadline = asyncio.get_running_loop().time() + wait_s
        return bool(await self._host_queue.serve(attempt, deadline))

    async def evict_host(self, num_tokens: int) -> int:
        """Drop LRU host-only nodes (not pinned or locked) to free ``num_tokens`` host slots.

        Their pages stay in storage if they were backed up. Returns slots freed.

        Raises:
            InvalidInputError: ``num_tokens`` is not a non-negative int.
        """
        self._check()
        return self._evict_host_now(check_count(num_tokens))

    def _evict_host_now(self, num_tokens: int) -> int:
        ctl = self.controller
        freed = 0
        if num_tokens <= 0:
            return 0
        for node in self.index.evict_host_candidates(num_tokens):
            host = node.host_indices
            assert host is not None
            if ctl.ledger.host.leased(self._pages(host)):
                continue
            self.index.remove(node)
            ctl.ledger.host.free(self._pages(host))
            freed += host.numel()
            self._stats.host_evictions += 1
            self._stats.host_evicted_tokens += host.numel()
        return freed

    # -- insert and write policies ------------------------------------------------

    async def insert(
        self,
        tokens: Sequence[int] | torch.Tensor,
        device_indices: torch.Tensor,
        extra_key: str | None = None,
        *,
        ready: Ready = None,
    ) -> int:
        """Record freshly computed KV of ``tokens`` held in ``device_indices``.

        ``ready`` (CUDA): the producer of that KV, as `TierController.submit_write`
        takes it (default: the caller's current stream, recorded at this call).

        The index keeps a copy of ``device_indices``: the caller may reuse
        its tensor at once (what every verb returns is a new tensor too).

        Whole pages only: a trailing partial page is not inserted and its
        slots stay the caller's. Slots of the part already cached are freed
        here (unless they are the index's own: a request committing its
        prefix passes those back). Under ``write_through`` the new node is
        written to host (and, once there, to storage when attached); when
        copies in flight hold the host room, the write follows once they
        release it (up to ``config.alloc_timeout_s``), without this call
        waiting. When
        the cached part is still being loaded back, waits for that load
        first (nothing may be inserted on top of KV that has not landed).
        If that load fails and ``device_indices`` hold the caller's own copy
        of the prefix, the index takes the caller's copy instead.

        Every argument is checked before anything changes: a refused call
        leaves the index and the allocators as they were, and can be retried.

        Returns:
            How many leading tokens were already cached.

        Raises:
            InvalidInputError: bad tokens, ``device_indices`` not a 1-D int64
                tensor with one slot per token, slots that are not
                page-aligned, not allocated, listed twice, or (for the new
                pages) already held by the index or by an open request.
            StateError: the load back of the cached part failed and
                ``device_indices`` named the slots it was loading into (the
                prefix is not on the device; request it again).
        """
        return await self._insert(tokens, device_indices, extra_key, owner=None, ready=ready)

    async def _insert(
        self,
        tokens: Sequence[int] | torch.Tensor,
        device_indices: torch.Tensor,
        extra_key: str | None,
        owner: torch.Tensor | None,
        ready: Ready = None,
    ) -> int:
        """`insert`; ``owner``: slots of the committing request, which it may pass (and gives up)."""
        ctl = self._check()
        ready_ev = ctl.ready_event(ready, "insert")
        toks = self._tokens(tokens)
        check_extra_key(extra_key)
        dev = self._insert_slots(ctl, toks, device_indices)
        n = int(dev.numel())
        chain = await self._long_chain(toks[:n], extra_key)
        # The cached part may still be landing: wait, then decide on the
        # index as it is after the wait (no await from here on).
        cached = await self._wait_loads_under(toks[:n], extra_key, dev)
        ctl = self._check()
        same = self._check_new_slots(ctl, dev, cached, owner)
        result = self.index.insert(toks[:n], dev, extra_key, checked=True, chain=chain)
        self._free_duplicates(ctl, dev[: result.prefix_len], same, ready_ev)
        self._set_index_pages(dev[result.prefix_len :], True)
        # The producer of the new KV travels with its pages: a write of them
        # (write-through now, a write-back at eviction later) waits for it.
        ctl.ledger.device.set_producer(self._pages(dev[result.prefix_len :]), ready_ev)
        self._stats.tokens_inserted += n - result.prefix_len
        node = result.node
        if node is not None and self.config.write_policy == "write_through":
            self._write_node(ctl, node, ready=ready_ev, defer=True)
        # Reattached host-only nodes already have a host copy: nothing to write.
        return result.prefix_len

    async def _long_chain(self, toks: list[int], extra_key: str | None) -> list[str] | None:
        """The page hash chain of a long prompt's ``toks``, hashed off the loop; else ``None``.

        ``None`` when few of its pages are new to the index (a commit that
        adds a page to a cached prompt): the index hashes those itself, in
        less time than a thread hop. The chain starts at the namespace's
        root, so it fits whatever the index holds once the hashing is done.
        """
        ps = self.layout.page_size
        if len(toks) // ps <= INLINE_HASH_PAGES:
            return None
        known = self.index.match_prefix(toks, extra_key, touch=False, checked=True)
        if (len(toks) - known.matched_length) // ps <= INLINE_HASH_PAGES:
            return None  # the pages not in the index yet are few: hashed inline
        loop = asyncio.get_running_loop()
        # Cancelling the caller leaves the thread to finish on a list no one changes.
        return await loop.run_in_executor(None, page_hashes, toks, ps, extra_key_prior(extra_key))

    def _insert_slots(
        self, ctl: TierController, toks: list[int], device_indices: torch.Tensor
    ) -> torch.Tensor:
        """The whole-page slots of an insert, checked: one per token, page-aligned, no page twice.

        Raises:
            InvalidInputError: anything else.
        """
        ps = self.layout.page_size
        slots = check_slot_tensor(device_indices, "device_indices", ctl.device_pool.num_slots)
        if slots.numel() != len(toks):
            raise InvalidInputError(
                f"device_indices has {slots.numel()} slots for {len(toks)} tokens: one per token"
            )
        n = len(toks) // ps * ps
        dev = check_slot_indices(slots[:n], ps, ctl.device_pool.num_slots, "device_indices")
        if n and ctl.device_allocator.has_repeats(self._pages(dev)):
            raise InvalidInputError("device_indices lists a page twice")
        return dev

    def _check_new_slots(
        self,
        ctl: TierController,
        dev: torch.Tensor,
        cached: torch.Tensor,
        owner: torch.Tensor | None,
    ) -> torch.Tensor:
        """Check the slots of an insert that are not the cached prefix's own.

        Returns:
            Per cached page, whether ``dev`` names the index's own slots for it.

        Raises:
            InvalidInputError: new slots not allocated, held by the index or
                by an open request other than ``owner``, or with a copy in flight.
        """
        ps = self.layout.page_size
        k = int(cached.numel())
        mine = dev[:k].view(-1, ps)
        same = (mine == cached.view(-1, ps)).all(dim=1) if k else torch.zeros(0, dtype=torch.bool)
        fresh = torch.cat([mine[~same].reshape(-1), dev[k:]])
        if not fresh.numel():
            return same
        pages = self._pages(fresh)
        books = ctl.ledger.device
        if not books.allocated(pages):
            raise InvalidInputError(
                "device_indices include slots that are not allocated (use alloc_device)"
            )
        if books.owned(pages, Owner.INDEX):
            raise InvalidInputError(
                "device_indices include slots that hold other cached KV of the index"
            )
        others = pages
        if owner is not None and owner.numel():
            others = pages[~np.isin(pages, self._pages(owner))]
        if books.owned(others, Owner.REQUEST):
            raise InvalidInputError(
                "device_indices include slots an open request owns (commit them through it)"
            )
        if books.leased(pages):
            raise InvalidInputError("device_indices include slots with a copy in flight")
        return same

    def _free_duplicates(
        self, ctl: TierController, dup: torch.Tensor, same: torch.Tensor, ready: Ready
    ) -> None:
        """Free the slots of an insert's already-cached part, but never the index's own."""
        if not dup.numel():
            return
        ps = self.layout.page_size
        differ = ~same[: dup.numel() // ps]
        if bool(differ.any()):
            # The producer may still be writing them: the next load waits
            # (``ready``), and the controller's settle callbacks wake the waiters.
            pages = self._pages(dup.view(-1, ps)[differ].reshape(-1))
            ctl.ledger.device.free(pages, fence=ctl.ready_event(ready, "insert"))

    async def _wait_loads_under(
        self, toks: list[int], extra_key: str | None, dev: torch.Tensor
    ) -> torch.Tensor:
        """Wait until no load in flight fills the cached prefix of ``toks`` or any of ``dev``.

        New pages may only hang under a prefix whose bytes have landed: were
        a load under them to fail, its rollback would leave them on the
        device under a host-only parent. A load into slots of ``dev`` is one
        the caller's KV was computed on, so its failure is the caller's; a
        load of a prefix the caller holds in slots of its own is not (once
        it failed, the index takes the caller's copy instead).

        Returns:
            The device slots of the cached prefix, with no load in flight
            into them (read after the last wait: no await may follow).

        Raises:
            StateError: a load into slots of ``dev`` failed.
        """
        while True:
            cached = self.index.match_prefix(
                toks, extra_key, touch=False, checked=True
            ).device_indices
            assert self._pending_loads is not None
            pending = self._pending_loads.under(cached, dev)
            if not pending:
                return cached
            for handle, mine in pending:
                try:
                    await handle
                except Exception as e:
                    if mine:
                        raise StateError(
                            f"the load back of this prefix failed ({e!r}): request it again"
                        ) from e
            self._check()

    def _write_node(
        self, ctl: TierController, node: Node, *, ready: Ready = None, defer: bool = False
    ) -> CopyAck | None:
        """Start a device->host write of ``node``; its storage backup follows the ack.

        With ``defer`` (write-through), a host that is short only because
        copies, backups, prefetches or loads in flight hold its room does not
        leave the node device-only: a background task waits for the room (see
        `_host_room`, up to ``config.alloc_timeout_s``) and writes it then.
        """
        if node.on_host or node.device_indices is None or node.write_in_flight:
            return None
        if defer and self._host_queue:
            self._defer_write(node, ready)  # others wait for host room first
            return None
        short = node.num_tokens - ctl.host_allocator.available
        if short > 0:
            # Make room on host by dropping LRU host-only nodes (those backed
            # up to storage can come back from there).
            self._evict_host_now(short)
        if defer and ctl.host_allocator.available < node.num_tokens:
            self._defer_write(node, ready)
            return None
        ack = ctl.submit_write(node.device_indices, node_id=node.id, track=False, ready=ready)
        if ack is None:
            return None  # host full: the node stays device-only
        wid = self.index.begin_write(node, ack.host_indices)
        ack.add_done_callback(lambda a: self._write_done(wid, a))
        return ack

    def _defer_write(self, node: Node, ready: Ready) -> None:
        """Write ``node`` (and device-only nodes above it) once host room frees."""
        if (
            node.id in self._deferred_writes
            or self.config.alloc_timeout_s <= 0
            or node.num_tokens > self.controller.host_allocator.num_slots
            or not (self._host_will_free() or self._host_queue)
        ):
            self.controller.stats.host_full += 1
            return  # nothing will free host room: the node stays device-only
        self._deferred_writes.add(node.id)

        async def write() -> None:
            try:
                if not await self._host_room(node.num_tokens, self.config.alloc_timeout_s):
                    return
                if self.state is not CacheState.OPEN or node.parent is None:
                    return
                ctl = self.controller
                # A split meanwhile moved part of the key into a new parent:
                # write every device-only node of the path, top down.
                for n in self.index.path(node):
                    if not n.on_host and n.device_indices is not None and not n.write_in_flight:
                        if not self._make_host_room(n.num_tokens):
                            return
                        self._write_node(ctl, n, ready=ready)
            finally:
                self._deferred_writes.discard(node.id)

        self._spawn(write(), "a deferred write-through")

    def _write_done(self, wid: int, ack: CopyAck) -> None:
        ctl = self._controller
        if ctl is None:
            return
        try:
            nodes = self.index.finish_write(wid, ok=not ack.failed())
        except StateError:  # flushed meanwhile
            return
        self._notify_room()  # host room may have freed (or become evictable)
        if ack.failed():
            ctl.ledger.host.free(self._pages(ack.host_indices))
            return
        if ctl.storage_attached:
            for n in nodes:
                self._backup_node(ctl, n)

    def _backup_node(self, ctl: TierController, node: Node) -> BackupOperation | None:
        """Start backing ``node`` up to storage; the operation, or ``None`` when none started."""
        if node.backuped_storage or node.host_indices is None or node.parent is None:
            return None
        self.index.pin_host(node)
        try:
            op = ctl.write_storage(
                node.host_indices,
                list(node.key),
                node_id=node.id,
                hash_values=list(node.page_hashes),
                track=False,  # awaited below: nobody drains it
            )
        except BaseException:
            self.index.unpin_host(node)  # a refused backup holds nothing
            raise
        if op is None:
            self.index.unpin_host(node)
            return None
        self._backups.add(op)

        async def wait() -> None:
            try:
                await op.wait()
            finally:
                self._backups.discard(op)
                if node.parent is not None or node.host_pin:
                    self.index.unpin_host(node)
                if op.succeeded:
                    if node.parent is not None:
                        self.index.mark_backed_up(node)
                    self._stats.storage_backups += 1
                self._notify_room()  # an unpinned host-only node may be evicted now

        self._spawn(wait(), "a storage backup's bookkeeping")
        return op

    async def backup_to_storage(self) -> int:
        """Back up every host-resident node not yet in storage; wait for it.

        Returns:
            Nodes written: whose backup succeeded. A node whose backup failed
            or ended early (a storage error is a miss, never raised) is not
            counted, and the next call tries it again.
        """
        ctl = self._check()
        if not ctl.storage_attached:
            return 0
        ops = [
            self._backup_node(ctl, n)
            for n in list(self.index.nodes())
            if not n.is_root and n.on_host and not n.write_in_flight and not n.backuped_storage
        ]
        await self.wait_idle()
        return sum(1 for op in ops if op is not None and op.succeeded)

    # -- load back and prefetch ---------------------------------------------------

    async def load_back(self, match: CacheMatch) -> tuple[torch.Tensor, LoadHandle | None]:
        """Load the host part of ``match`` into device slots, layer by layer.

        Waits for device room as `alloc_device` does. Slots still loading are
        only handed out with a handle that covers them: nothing is loaded
        twice, a concurrent call's load lends its handle, and with several
        loads under the prefix this call waits for all but the last. A failed
        copy's nodes go back to host-only, its slots freed once it settled.

        Returns:
            ``(device_indices, handle)``: the slots of the whole matched prefix
            (device part + loaded part) and the `LoadHandle` whose layer
            futures the forward pass waits on (``None`` when every slot has
            landed). The loaded nodes stay locked until the load completes.

        Raises:
            InvalidInputError: ``match`` is not a `CacheMatch`.
            StateError: the index changed since ``match`` (its nodes were
                evicted or flushed): match again; ``match`` comes from
                another `TierCache`; or a load of the prefix this call waited
                for failed (match again).
            CapacityError: no device room for the host part (see `alloc_device`).
        """
        return await self._load_back(match, own=-1)

    async def _load_back(
        self, match: CacheMatch, own: int, *, fresh: bool = False
    ) -> tuple[torch.Tensor, LoadHandle | None]:
        """`load_back`; ``fresh``: ``match`` was taken with no await since (nothing to check),
        by `request`, which collects the handles of every load under the prefix itself."""
        self._check()
        self._check_match(match)
        if match.host_tokens == 0:
            if not fresh:
                self._check_device_match(match)
            return match.device_indices, None
        target = match.index.last_host_node
        try:
            self.index.lock(target)
        except StateError as e:
            raise StateError("the index changed since this match: match again") from e

        def need() -> int:
            return sum(n.num_tokens for n in self.index.load_path(target))

        try:
            assert self._pending_loads is not None
            start = self._pending_loads.start
            ack, handle = await self._take_room(need, lambda: start(target), own)
        except BaseException:
            self.index.unlock(target)
            self._notify_room()
            raise
        if ack is None:
            self.index.unlock(target)
            self._notify_room()
        else:
            self._stats.loads_back += 1
        if fresh:  # `request`: it collects every load its prefix waits on itself
            full = self.index.match_prefix(
                self.index.prefix_tokens(target), match.extra_key, touch=False, checked=True
            )
            return full.device_indices, handle
        return await self._with_loads(target, match.extra_key, handle)

    async def _with_loads(
        self, target: Node, extra_key: str | None, handle: LoadHandle | None
    ) -> tuple[torch.Tensor, LoadHandle | None]:
        """The device slots of the prefix down to ``target``, and the handle their bytes wait on.

        ``handle`` is this call's own load, if it started one. Slots that
        other loads still fill are only handed out with a handle that
        covers them: with no load of its own and one other in flight, that
        load's handle; with more, the call waits for all but the last
        (its own comes last).

        Raises:
            StateError: a load this prefix waited for failed (its nodes went
                back to the host tier): match again.
        """
        while True:
            prefix = self.index.match_prefix(
                self.index.prefix_tokens(target), extra_key, touch=False, checked=True
            ).device_indices
            assert self._pending_loads is not None
            others = self._pending_loads.over(prefix, but=handle)
            if not others or (handle is None and len(others) == 1):
                return prefix, handle if handle is not None else (others[0] if others else None)
            wait = others if handle is not None else others[:-1]
            for h in wait:
                try:
                    await h
                except Exception as e:
                    raise StateError(
                        f"the load back of this prefix failed ({e!r}): match again"
                    ) from e
            self._check()

    def _check_match(self, match: CacheMatch) -> None:
        """Check that ``match`` is a `CacheMatch` of this cache.

        Raises:
            InvalidInputError: not a `CacheMatch`.
            StateError: a match of another cache (its nodes and slots are
                that cache's).
        """
        check_instance(match, CacheMatch, "match")
        if not self.index.owns(match.index.last_node):
            raise StateError("match comes from another TierCache: match on this one")

    def _check_match_of(self, match: CacheMatch, toks: list[int]) -> None:
        """Check that ``match`` was taken on ``toks`` (or on a prompt they start with).

        Raises:
            InvalidInputError: its matched prefix is not that of ``toks``, or
                its storage part reaches past their end.
            StateError: its nodes are no longer in the index (match again).
        """
        m = match.index
        prefix = self.index.prefix_tokens(m.last_node)
        if (
            len(prefix) != m.matched_length
            or tuple(toks[: m.matched_length]) != prefix
            or m.matched_length + match.storage_candidate_tokens > len(toks)
        ):
            raise InvalidInputError("match is not a match of these tokens: match them again")

    def _check_device_match(self, match: CacheMatch) -> None:
        """Check that the index still holds ``match``'s device prefix in the same slots.

        Its slots are only the prefix's while the index still holds them
        there: a match from before an eviction or a flush names slots that
        may be free or another prefix's by now.

        Raises:
            StateError: it does not.
        """
        node = match.index.last_device_node
        try:
            now = self.index.match_prefix(
                self.index.prefix_tokens(node), match.extra_key, touch=False, checked=True
            ).device_indices
        except StateError as e:
            raise StateError("the index changed since this match: match again") from e
        if not torch.equal(now, match.device_indices):
            raise StateError("the index changed since this match: match again")

    async def prefetch(
        self,
        tokens: Sequence[int] | torch.Tensor,
        match: CacheMatch | None = None,
        *,
        request_id: object = None,
        policy: str | None = None,
    ) -> int:
        """Fetch from storage the pages of ``tokens`` after the matched prefix, into host memory.

        The policy (``config.prefetch_policy`` unless given): ``best_effort``
        takes what has arrived without waiting past one check, ``wait_complete``
        waits for all, ``timeout`` waits up to the configured deadline. The
        fetched prefix is inserted into the index as host-only nodes; host
        pages duplicating existing nodes are freed.

        Host room: LRU host-only nodes are evicted for it. When copies,
        backups, prefetches or loads in flight hold the rest, ``wait_complete``
        waits up to ``config.alloc_timeout_s`` and ``timeout`` within its own
        deadline; ``best_effort`` does not wait, nor does any policy with a
        TP group (every rank must reach the agreement in call order). A rank
        that finds no room still joins the TP hit-count agreement (with 0
        hits, so no rank loads the prefix) and returns 0.

        Returns:
            Tokens fetched and inserted (0 without storage, under the
            threshold, without host room, on any storage failure, or when a
            `flush` came while it was fetching: the flush dropped the pages).

        Raises:
            InvalidInputError: bad tokens, a ``match`` that is not a
                `CacheMatch` of ``tokens``, or an unknown ``policy``.
            StateError: ``match`` names a node no longer in the index, or
                comes from another `TierCache`.
        """
        ctl = self._check()
        toks = self._tokens(tokens)
        policy = check_choice(
            self.config.prefetch_policy if policy is None else policy, PREFETCH_POLICIES, "policy"
        )
        if match is not None:
            self._check_match(match)
            self._check_match_of(match, toks)
        done, _ = await self._prefetch(
            ctl, toks, match or self._match(toks, None), request_id, policy
        )
        return done

    async def _prefetch(
        self,
        ctl: TierController,
        toks: list[int],
        match: CacheMatch,
        request_id: object,
        policy: str,
    ) -> tuple[int, int]:
        """`prefetch` once its arguments are checked.

        Returns:
            The tokens fetched, and of those the ones this prefetch added to
            the index (the rest were cached meanwhile by another request):
            its storage hits.
        """
        n = match.storage_candidate_tokens
        start = match.index.matched_length
        if not ctl.storage_attached:
            return 0, 0
        if n <= 0 or n < self.config.prefetch_threshold:
            # Decided from this rank's own index: with a TP group it still
            # joins the agreement (with what it holds), so a rank that does
            # prefetch never waits, and no rank fetches past this one's prefix.
            ctl.abstain_prefetch(start)
            return 0, 0
        parent = match.index.last_node
        loop = asyncio.get_running_loop()
        began = loop.time()
        host = await self._prefetch_room(ctl, parent, n, self._prefetch_wait_s(policy, n))
        if host is None:
            # This rank cannot take part; with a TP group it still joins the
            # hit-count agreement (with what it holds), or the other ranks would block in it.
            ctl.abstain_prefetch(start)
            return 0, 0
        if not parent.is_root:
            self.index.pin_host(parent)
        wanted = toks[start : start + n]
        op = None
        try:
            op = ctl.prefetch(request_id, host, wanted, match.index.prior_hash, cached_tokens=start)
        finally:
            if op is None:  # nothing started (or refused): give back what was taken for it
                ctl.ledger.host.free(self._pages(host))
                if not parent.is_root:
                    self.index.unpin_host(parent)
                self._notify_room()
        if op is None:
            return 0, 0
        op.add_done_callback(lambda _op: self._notify_room())  # it freed its unfilled slots
        self._stats.prefetches += 1
        settle = self._settle_prefetch(ctl, op, wanted, parent, match.extra_key, self._flushes)
        try:
            await self._wait_policy(op, policy, n, spent=loop.time() - began)
        except BaseException:
            # Cancelled while waiting: finish on our own so the fetched pages
            # are kept (or freed) and nothing stays held.
            self._spawn(settle, "a prefetch whose caller was cancelled")
            raise
        return await settle

    def _prefetch_wait_s(self, policy: str, num_tokens: int) -> float:
        """How long a prefetch under ``policy`` waits for host room that copies in flight hold.

        A best-effort prefetch does not wait (it must not stall the request
        it serves), nor does any under TP (every rank must reach the
        agreement in the same order).
        """
        if policy == "best_effort" or self._tp_group is not None:
            return 0.0
        if policy == "timeout":
            return min(self.config.prefetch_timeout(num_tokens), self.config.alloc_timeout_s)
        return self.config.alloc_timeout_s

    async def _prefetch_room(
        self, ctl: TierController, parent: Node, num_tokens: int, wait_s: float
    ) -> torch.Tensor | None:
        """Host slots for a prefetch under ``parent``, waiting up to ``wait_s`` for room; ``None`` if none."""
        if not parent.is_root:
            self.index.lock(parent)  # nothing may evict it while we wait
        try:
            room = await self._host_room(num_tokens, wait_s)
        finally:
            if not parent.is_root:
                self.index.unlock(parent)
                self._notify_room()
        got = ctl.ledger.host.alloc(num_tokens) if room else None
        return None if got is None else got[0]

    async def _settle_prefetch(
        self,
        ctl: TierController,
        op: PrefetchOperation,
        toks: list[int],
        parent: Node,
        extra_key: str | None,
        flushes: int,
    ) -> tuple[int, int]:
        """Terminate ``op``, insert what arrived under ``parent``, free the rest.

        Returns ``(fetched, added)`` as `_prefetch` does.

        ``flushes``: `_flushes` when ``op`` started. A flush since then has
        dropped ``parent`` and freed every host slot, the fetched ones
        included: nothing is inserted, unpinned or freed, and 0 is returned.
        """
        try:
            done, hashes = await ctl.terminate_prefetch(op)
        finally:
            if self._flushes == flushes and not parent.is_root and parent.host_pin:
                self.index.unpin_host(parent)
                self._notify_room()
        if done == 0 or self._flushes != flushes:
            return 0, 0
        got = op.host_indices[:done]
        if self.state is not CacheState.OPEN or (parent.parent is None and not parent.is_root):
            ctl.ledger.host.free(self._pages(got))  # closing, or the parent was dropped meanwhile
            return 0, 0
        res = self.index.insert_host(
            toks[:done], got, parent=parent, extra_key=extra_key, page_hashes=hashes, checked=True
        )
        if res.prefix_len:
            ctl.ledger.host.free(self._pages(got[: res.prefix_len]))
        if res.node is not None:
            self.index.mark_backed_up(res.node)
        # Pages another request cached meanwhile are hits where that request put them.
        self._stats.tokens_storage_hit += done - res.prefix_len
        return done, done - res.prefix_len

    async def _wait_policy(
        self, op: PrefetchOperation, policy: str, num_tokens: int, spent: float = 0.0
    ) -> None:
        """Wait for ``op`` as ``policy`` says; ``spent``: seconds the timeout already used."""
        if policy == "wait_complete":
            await op.wait()
        elif policy == "timeout":
            # The deadline stops the waiting only: `op.wait` is shielded.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(
                    max(0.0, self.config.prefetch_timeout(num_tokens) - spent)
                ):
                    await op.wait()
        else:  # best_effort: let the query and what IO is ready run, then take it
            await asyncio.sleep(0)

    # -- the request helper -------------------------------------------------------

    @asynccontextmanager
    async def request(
        self,
        tokens: Sequence[int] | torch.Tensor,
        extra_key: str | None = None,
        *,
        request_id: object = None,
        prefetch: bool = True,
    ) -> AsyncIterator[Request]:
        """Serve one request: match, prefetch from storage, load back, lock; unlock on exit.

        At least one token is always left to compute, as SGLang does: the
        prefix is matched on ``tokens[:-1]``, so ``cached_tokens`` is at most
        ``len(tokens) - 1`` (rounded down to whole pages) and the forward pass
        always has a last position to take logits from, even for an exact
        repeat of a page-aligned prompt.

        Raises:
            InvalidInputError: ``tokens`` is not a list, tuple or 1-D integer
                tensor of ids in ``[0, 2**32)``, or ``extra_key`` is not a str.
            CapacityError: no device room to load the host part back (see
                `alloc_device`).
        """
        self._check()
        toks = self._tokens(tokens)
        check_extra_key(extra_key)
        if not isinstance(prefetch, bool):
            raise InvalidInputError(f"prefetch must be a bool, got {prefetch!r}")
        key = toks[:-1]
        m = self._match(key, extra_key)
        # Open from here: the locks it takes below hold device room until it ends.
        self._open_requests += 1
        try:
            req = await self._start_request(m, toks, key, extra_key, request_id, prefetch)
            try:
                yield req
            finally:
                await req._release()
        finally:
            self._open_requests -= 1
            self._notify_room()

    async def _start_request(
        self,
        m: CacheMatch,
        toks: list[int],
        key: list[int],
        extra_key: str | None,
        request_id: object,
        prefetch: bool,
    ) -> Request:
        """`request` up to the body: prefetch, load back, lock the prefix."""
        first_device = m.device_tokens
        stored = 0  # tokens this request's prefetch added: its storage hits
        if prefetch and m.storage_candidate_tokens:
            # Hold what matched while the prefetch awaits: nothing under it may
            # be evicted meanwhile, so the prefetched pages continue it.
            held = m.index.last_node
            self.index.lock(held)
            try:
                policy = self.config.prefetch_policy
                _, stored = await self._prefetch(self.controller, key, m, request_id, policy)
            finally:
                self.index.unlock(held)
                self._notify_room()
            m = self._match(key, extra_key)
        elif prefetch:
            # TP: every rank joins each request's agreement, with the prefix it holds.
            self.controller.abstain_prefetch(m.index.matched_length)
        prefix, handle = await self._load_back(m, own=0, fresh=True)
        node = self.index.match_prefix(
            key[: prefix.numel()], extra_key, touch=False, checked=True
        ).last_device_node
        self.index.lock(node)
        loads = [handle] if handle is not None else []
        assert self._pending_loads is not None
        loads += [h for h in self._pending_loads.over(prefix) if h is not handle]
        self._stats.requests += 1
        self._stats.tokens_requested += len(toks)
        # The prefix: what was on the device when it matched, what its own
        # prefetch stored, and the rest from host (there then, or put there
        # meanwhile by a concurrent request's prefetch or commit).
        device_hit = min(first_device, int(prefix.numel()))
        self._stats.tokens_device_hit += device_hit
        self._stats.tokens_host_hit += max(0, int(prefix.numel()) - device_hit - stored)
        return Request(self, toks, extra_key, prefix, loads, node)

    # -- flush, stats, waiting ----------------------------------------------------

    async def wait_idle(self) -> None:
        """Wait for every copy, backup and background task in flight, and their completion callbacks."""
        ctl = self._check()
        while True:
            await ctl.wait_idle()
            await self._join_own()
            if ctl.storage is not None:
                await ctl.storage.wait_idle()
            # Completions are delivered by callbacks scheduled on the loop:
            # let them run, then check nothing new started.
            await asyncio.sleep(0)
            if (
                not self._own
                and not ctl.busy
                and not self.index.pending_writes()
                and (ctl.storage is None or not ctl.storage.busy)
            ):
                return

    async def flush(self) -> None:
        """Drop everything on the device and host tiers; keep storage (what a restart looks like).

        Raises:
            StateError: a request is open, a node is locked, or device slots
                from `alloc_device` are neither inserted nor freed (with an
                engine's own allocator: any slots the engine holds). Their
                slots would be freed under them and handed out again.
        """
        ctl = self._check()
        if self._open_requests:
            raise StateError(f"flush while {self._open_requests} request(s) are open")
        await self.wait_idle()
        if self._open_requests or any(n.lock_ref for n in self.index.nodes()):
            raise StateError("flush while requests hold locks")
        held = self._held_outside_index()
        if held:
            raise StateError(
                f"flush while {held} device slots are allocated outside the index: "
                "insert or free_device them first"
            )
        await ctl.reset()
        self._flushes += 1
        self.index.reset()

    def stats(self) -> CacheStats:
        """A snapshot of the counters, including the controller's and the storage tier's."""
        ctl = self._controller
        s = CacheStats(**{k: getattr(self._stats, k) for k in CacheStats.__slots__ if k != "extra"})
        if ctl is not None:
            s.bytes_device_to_host = ctl.stats.bytes_device_to_host
            s.bytes_host_to_device = ctl.stats.bytes_host_to_device
            st = ctl.storage_stats()  # every backend attached so far: never goes down
            s.bytes_storage_read = st.bytes_read
            s.bytes_storage_written = st.bytes_written
            s.prefetch_revoked = st.prefetch_revoked
            s.prefetch_terminated = st.prefetch_terminated
            s.prefetch_completed = st.prefetch_completed
            s.prefetch_failed = st.prefetch_failed
            s.storage_errors = st.storage_errors + st.storage_timeouts
            s.storage_outages = st.outages
            s.storage_reconnects = st.reconnects
            s.storage_auto_detaches = ctl.stats.storage_auto_detaches
            s.extra = {
                "device_tokens_cached": float(self.index.total_device_tokens()),
                "host_tokens_cached": float(self.index.total_host_tokens()),
                "device_free": float(ctl.device_allocator.available),
                "host_free": float(ctl.host_allocator.available),
                "storage_attached": float(ctl.storage is not None),
                "storage_down": float(ctl.storage is not None and ctl.storage.down),
            }
        return s

    def __repr__(self) -> str:
        return f"TierCache({self.layout.describe()}, state={self.state.value})"


class Request:
    """One request's view of the cache, from `TierCache.request`.

    Attributes:
        tokens: the prompt, as a list of ints.
        cached_tokens: leading tokens whose KV is on the device (or loading):
            whole pages, at most ``len(tokens) - 1`` (one token is always left
            to compute).
        prefix_indices: their device slots.
        load: the `LoadHandle` of the part this request loaded back from host, or ``None``.
        loads: every load the prefix waits on (its own, and loads started by
            concurrent requests for the same pages).
    """

    def __init__(
        self,
        cache: TierCache,
        tokens: list[int],
        extra_key: str | None,
        prefix: torch.Tensor,
        loads: list[LoadHandle],
        node: Node,
    ) -> None:
        self.cache = cache
        self.tokens = tokens
        self.extra_key = extra_key
        self.prefix_indices = prefix
        self.cached_tokens = int(prefix.numel())
        self.loads = loads
        self.load = loads[0] if loads else None
        self._node = node
        # The slots of the last page `alloc` took that it has not returned yet.
        self._spare = torch.empty(0, dtype=torch.int64)
        self._committed = False
        self._committing = False
        self._released = False

    def layer_ready(self, layer: int) -> None:
        """Block a worker thread until ``layer`` of the prefix is on the device (no-op when it is).

        Raises:
            InvalidInputError: ``layer`` is not an int in ``[0, num_layers)``
                (whether or not a load is pending: one answer for one input).
            StateError: called on the event loop's own thread while a load
                is pending (it would deadlock).
            Exception: the load's error, if it failed.
        """
        n = self.cache.layout.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
            raise InvalidInputError(f"layer must be an int in [0, {n}), got {layer!r}")
        for h in self.loads:
            h.wait_layer(layer)

    async def wait_loaded(self) -> None:
        """Wait until the whole prefix is on the device.

        Raises:
            Exception: the copy's error when a load of the prefix failed. The
                index no longer claims those pages on the device by then; the
                request cannot `commit`, and the next request loads them again.
            StateError: called from another thread or event loop than the
                cache's.
        """
        check_on_loop(self.cache._loop, self.cache._thread, "TierCache")
        for h in self.loads:
            try:
                await h
            except BaseException:
                self.cache._check_loads()
                raise

    async def alloc(self, num_tokens: int) -> torch.Tensor:
        """Device slots for the next ``num_tokens`` new tokens, page by page.

        The request takes whole pages: the slots the previous `alloc` left
        unused in its last page come first, then new pages (waiting for room
        held by other requests or copies, see `TierCache.alloc_device`). So
        successive calls (the prompt's tokens, then generated ones) return
        slots that continue each other, and ``prefix_indices`` followed by
        every `alloc`'s slots, in order, is what `commit` takes for the
        prompt and its generated tokens. Slots the request does not commit
        are freed when it ends.

        Raises:
            InvalidInputError: ``num_tokens`` is not a non-negative int.
            CapacityError: more than the pool can ever give, or no room
                within ``config.alloc_timeout_s``.
            StateError: the request has ended.
        """
        if self._released:
            raise StateError("the request has ended")
        self.cache._check()  # the loop's thread, open, no failure pending: spare slots too
        n = check_count(num_tokens)
        ps = self.cache.layout.page_size
        spare = self._spare[:n]
        more = n - int(spare.numel())
        if more <= 0:
            self._spare = self._spare[n:]
            return spare
        own = self._held().size * ps
        slots = await self.cache._alloc_device(-(-more // ps) * ps, own=own, request=self)
        self._spare = slots[more:]
        return torch.cat([spare, slots[:more]])

    async def commit(
        self,
        tokens: Sequence[int] | torch.Tensor,
        device_indices: torch.Tensor,
        *,
        ready: Ready = None,
    ) -> int:
        """Insert the KV of ``tokens`` (the prompt, plus generated tokens if any) held in ``device_indices``.

        ``tokens`` must start with the request's own tokens; ``device_indices``
        is one slot per token: the prefix's slots (`prefix_indices`) followed
        by the slots of the request's `alloc` calls, in order (one for the
        prompt, more for generated tokens: they continue each other). Whole pages are inserted; the slots of a
        trailing partial page go back when the request ends. Waits for the
        prefix's load first.

        ``ready`` (CUDA): the producer of the new KV (the forward pass's
        stream or an event after it); by default the caller's current stream,
        recorded when ``commit`` is called, before it awaits anything.

        Every argument is checked before anything changes: a refused commit
        leaves the request uncommitted, and a correct one may follow.

        Returns:
            How many tokens were already cached.

        Raises:
            InvalidInputError: tokens that do not extend the request's,
                ``device_indices`` not a 1-D int64 tensor of one slot per
                token, not starting with `prefix_indices`, or new slots that
                did not come from this request's `alloc`.
            StateError: committed already, the request has ended, or the
                prefix's load back failed (its KV is not on the device).
        """
        if self._released:
            raise StateError("the request has ended")
        ready_ev = self.cache._check().ready_event(ready, "commit")
        if self._committed or self._committing:
            raise StateError("a request commits once")
        cache = self.cache
        ctl = cache._check()
        toks = token_list(tokens)
        if toks[: len(self.tokens)] != self.tokens:
            raise InvalidInputError(
                "commit tokens must be the request's tokens, optionally followed by generated ones"
            )
        slots = check_slot_tensor(device_indices, "device_indices", ctl.device_pool.num_slots)
        if slots.numel() != len(toks):
            raise InvalidInputError(
                f"device_indices has {slots.numel()} slots for {len(toks)} tokens: one per token"
            )
        if not torch.equal(slots[: self.cached_tokens], self.prefix_indices.cpu()):
            raise InvalidInputError("device_indices must start with the request's prefix_indices")
        ps = cache.layout.page_size
        n = len(toks) // ps * ps
        new = slots[self.cached_tokens : n]
        if new.numel() and not np.isin(cache._pages(new), self._held()).all():
            raise InvalidInputError("new tokens' slots must come from this request's alloc")
        self._committing = True
        try:
            try:
                await self.wait_loaded()
            except Exception as e:
                raise StateError(
                    f"the load back of this request's prefix failed ({e!r}): nothing committed"
                ) from e
            # The prefix is already in the index: insert() frees nothing of it
            # (the same slots), and takes the new pages' slots, which stop
            # being the request's (handed over, or freed as duplicates).
            dup = await cache._insert(
                toks[:n], slots[:n], self.extra_key, owner=new, ready=ready_ev
            )
        finally:
            self._committing = False
        self._committed = True
        return dup

    def _held(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The device pages this request holds (from `alloc`, not yet committed)."""
        return self.cache.controller.ledger.device.request_pages(self)

    async def _release(self) -> None:
        """Unlock the prefix and free the slots not committed (no await: cancel-safe)."""
        if self._released:
            return
        self._released = True
        cache = self.cache
        if cache.state is not CacheState.OPEN:
            return
        try:
            cache.index.unlock(self._node)
        except StateError:
            pass
        ctl = cache.controller
        # Behind a fence on the compute stream: the forward pass may still read them.
        ctl.ledger.device.free_request(self, fence=ctl.ready_event(None, "free_device"))
