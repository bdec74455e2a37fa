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

`TierCache` is the facade: it owns the public verbs and their argument
checks, and hands each concept to one object (made at `TierCache.open`):

- `request.Request` and its `request.RequestLease` (a request's prefix lock
  and device pages), through a narrow port;
- `room.RoomBroker` and `room.DeviceRoom`: who waits for room, first come,
  first served, woken by every release; the deadlock test;
- `evictor.Evictor`: one synchronous eviction pass at a time;
- `write_policy.WritePolicy`: write-through, selective, write-back, deferred
  writes and storage backups;
- `loads.LoadBacks`: the loads back in flight; `prefetcher.Prefetcher`:
  storage prefetch; `insertion.Inserter`: finished KV into the index;
- `operations.Operations`: what is in flight, for `wait_idle` and `flush`.

Three rules hold at every verb:

- Arguments are checked before anything changes (`tiercache._checks`): a
  refused call leaves the index, the allocators and the request as they were.
- The index never claims KV that did not land: the controller's `Ledger` knows
  who owns every page (the index, a request, a caller) and which a load still
  fills; `match_prefix` reports those as not landed, and a failed load back
  (`loads.LoadOp`) hands its nodes back to the host tier and frees their
  slots once the copy has settled.
- Room that others hold is waited for, not failed on, up to
  ``config.alloc_timeout_s``, and nothing polls (`tiercache.room`).

Every background task of the cache (a deferred write-through, a backup's
bookkeeping, a prefetch finished on behalf of a cancelled caller) runs in the
cache's `TaskGroup`, which the controller and its storage tier share: a
failure is logged once and raised once, at the next call or at close.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
import torch

from tiercache._aio import check_on_loop
from tiercache._checks import (
    check_choice,
    check_count,
    check_extra_key,
    check_instance,
    token_list,
)
from tiercache._resource import AsyncResource
from tiercache._tasks import TaskGroup
from tiercache.cache_values import (
    CacheMatch,
    CacheState,
    CacheStats,
    check_device_match,
    check_match,
    check_match_of,
    count_request,
    merged_stats,
)
from tiercache.config import PREFETCH_POLICIES, TierCacheConfig
from tiercache.controller import LoadHandle, Ready, TierController
from tiercache.errors import (
    CapacityError,
    ClosedError,
    ConfigError,
    InvalidInputError,
    StateError,
)
from tiercache.evictor import Evictor
from tiercache.index.radix import Node, RadixIndex
from tiercache.insertion import Inserter
from tiercache.ledger import Owner
from tiercache.loads import LoadBacks
from tiercache.memory.allocator import PageAllocator, check_slot_indices
from tiercache.memory.pools import DeviceKVPool, HostKVPool, resolve_device
from tiercache.operations import Operations
from tiercache.prefetcher import Prefetcher
from tiercache.request import Request, RequestLease
from tiercache.room import DeviceRoom, RoomBroker
from tiercache.storage.base import StorageBackend
from tiercache.write_policy import WritePolicy

__all__ = ["CacheMatch", "CacheState", "CacheStats", "Request", "TierCache"]


@dataclass(frozen=True, slots=True)
class _Parts:
    """The objects an open cache delegates to (made at `TierCache.open`, dropped at close)."""

    ctl: TierController
    room: RoomBroker
    device: DeviceRoom
    writes: WritePolicy
    loads: LoadBacks
    prefetcher: Prefetcher
    inserter: Inserter

    @classmethod
    def wire(cls, cache: TierCache, ctl: TierController) -> _Parts:
        """The parts of ``cache``, wired to its controller ``ctl`` (no await).

        The room broker wakes its waiters on the controller's settle callbacks from here on.
        """
        cfg, index, ops, stats = cache.config, cache.index, cache._ops, cache._stats

        def is_open() -> bool:
            return cache.state is CacheState.OPEN

        room = RoomBroker(index, ctl, ops, Evictor(index, ctl, stats))
        loads = LoadBacks(index, ctl, is_open, room.release)
        ops.loads = loads
        writes = WritePolicy(cfg, room, stats)

        def write_back_started() -> None:
            stats.write_backs += 1

        device = DeviceRoom(room, cfg.alloc_timeout_s, writes.write_back, write_back_started)
        room.attach()
        prefetcher = Prefetcher(cfg, room, stats, cache._tp_group)
        inserter = Inserter(index, ctl, loads, writes, stats, cache._check)
        return cls(ctl, room, device, writes, loads, prefetcher, inserter)


async def _open_controller(
    cfg: TierCacheConfig,
    device_pool: DeviceKVPool | None,
    device_allocator: PageAllocator | None,
    tasks: TaskGroup,
    tp_group: Any,
) -> TierController:
    """Allocate the pools (off the loop) and open a controller on them, storage attached.

    Raises:
        ConfigError: ``cfg.device`` names a CUDA device this machine lacks.
        CapacityError: a pool does not fit.
        ConfigError / StorageError: the storage URL failed (nothing stays open).
    """
    lay = cfg.layout()

    # "cuda" means this thread's current device (a TP rank's own GPU), not
    # that of the worker thread the pools are built on.
    try:
        device = resolve_device(cfg.device) if device_pool is None else None
    except InvalidInputError as e:  # the setting does not fit this machine (no CUDA)
        raise ConfigError(f"device={cfg.device!r}: {e}") from e

    def build() -> tuple[DeviceKVPool, HostKVPool]:
        dev = device_pool or DeviceKVPool(lay, cfg.device_tokens, device or cfg.device)
        # Pinned in the device pool's context, not device 0's (this thread chose none).
        on = dev.device if dev.device.type == "cuda" else None
        host = HostKVPool(lay, cfg.resolved_host_tokens(), host_layout=cfg.host_layout, device=on)
        return dev, host

    try:
        dev, host = await asyncio.to_thread(build)
    except (RuntimeError, MemoryError) as e:  # torch's out-of-memory is a RuntimeError
        raise CapacityError(f"cannot allocate the KV pools: {e}") from e
    ctl = TierController(
        dev,
        host,
        tasks=tasks,
        device_allocator=device_allocator,
        model=cfg.model,
        tp_rank=cfg.tp_rank,
        tp_size=cfg.tp_size,
        tp_group=tp_group,
        storage_config=cfg.storage_tier_config(),
    )
    await ctl.open()
    try:
        if cfg.storage_url:
            await ctl.attach_storage_backend(cfg.storage_url, **cfg.storage_options)
    except BaseException:
        await ctl.aclose()
        raise
    return ctl


class _RequestPort:
    """A `Request`'s narrow port on its cache (`request.RequestPort`)."""

    def __init__(self, cache: TierCache) -> None:
        self._cache = cache
        self.page_size = cache.layout.page_size
        self.num_layers = cache.layout.num_layers

    def check(self) -> TierController:
        return self._cache._check().ctl

    def check_on_loop(self) -> None:
        check_on_loop(self._cache._loop, self._cache._thread, "TierCache")

    def settle_loads(self) -> None:
        if self._cache._parts is not None:
            self._cache._parts.loads.settle_finished()

    async def alloc(self, num_tokens: int, own: int, key: object) -> torch.Tensor:
        return await self._cache._alloc_device(num_tokens, own=own, key=key)

    async def insert(
        self,
        toks: list[int],
        slots: torch.Tensor,
        extra_key: str | None,
        owner: torch.Tensor,
        ready: Any,
    ) -> int:
        return await self._cache._insert(toks, slots, extra_key, owner=owner, ready=ready)

    def held_pages(self, key: object) -> np.ndarray[Any, np.dtype[np.int64]]:
        return self._cache.controller.ledger.device.request_pages(key)

    def release(self, key: object, node: Node) -> None:
        parts = self._cache._parts
        if parts is None or self._cache.state is not CacheState.OPEN:
            return
        try:
            parts.room.release(node)
        except StateError:
            pass  # flushed meanwhile
        ctl = parts.ctl
        # Behind a fence on the compute stream: the forward pass may still read them.
        ctl.ledger.device.free_request(key, fence=ctl.ready_event(None, "free_device"))


class TierCache(AsyncResource):
    """A tiered KV cache: device pool, host pool and an optional storage backend.

    Args:
        config: the configuration (default: `TierCacheConfig()`).
        device_pool: an engine's own `DeviceKVPool` to manage (default: one made from the config).
        device_allocator: the engine's `PageAllocator` over its pool's slots (default: a new one).
        tp_group: a ``torch.distributed`` process group over the TP ranks.
        **overrides: `TierCacheConfig` fields, applied on top of ``config``.

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
        #: The background tasks of the cache, the controller and its storage tier.
        self.tasks = TaskGroup("cache")
        self._ops = Operations(self.tasks)  # what it has in flight: loads, backups, tasks
        self._parts: _Parts | None = None  # what the verbs delegate to, while open
        # Locks taken with `lock` and not yet released by `unlock`, per node.
        self._locks: dict[Node, int] = {}
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
        ctl = await _open_controller(
            self.config, self._device_pool, self._device_allocator, self.tasks, self._tp_group
        )
        self._controller = ctl
        self._parts = _Parts.wire(self, ctl)
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
        parts = self._parts
        assert parts is not None
        self.state = CacheState.CLOSED
        parts.room.close()  # waiters see the cache closed
        try:
            await self._ops.join()
        finally:
            # They refer back to the cache: dropped, no cycle waits for the collector.
            parts.room.detach()
            self._ops.loads = None
            self._parts = None
            try:
                await ctl.aclose()
            finally:
                await self.tasks.aclose()

    def _check(self) -> _Parts:
        """The open cache's parts, after settling finished loads and raising a background failure.

        Raises:
            StateError / ClosedError: the cache is not open, or the caller is
                not on its loop thread; a background task failed since the last call.
        """
        self.controller  # noqa: B018 (raises when not open)
        check_on_loop(self._loop, self._thread, "TierCache")
        parts = self._parts
        assert parts is not None
        parts.loads.settle_finished()
        self.tasks.raise_failure()
        return parts

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
        self._check().ctl.use_compute_stream(stream)

    # -- storage ----------------------------------------------------------------

    async def attach_storage(self, backend: StorageBackend | str, **options: Any) -> StorageBackend:
        """Attach a storage backend at runtime (see `TierController.attach_storage_backend`)."""
        return await self._check().ctl.attach_storage_backend(backend, **options)

    async def detach_storage(self) -> bool:
        """Detach the storage backend; idempotent."""
        return await self._check().ctl.detach_storage_backend()

    # -- matching and locks -------------------------------------------------------

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
        toks = token_list(tokens)
        check_extra_key(extra_key)
        return self._match(toks, extra_key)

    def _match(self, toks: list[int], extra_key: str | None) -> CacheMatch:
        """`match_prefix` of checked tokens and ``extra_key``."""
        p = self._check()
        m = p.loads.landed(self.index.match_prefix(toks, extra_key, checked=True))
        ps = self.layout.page_size
        rest = (len(toks) - m.matched_length) // ps * ps
        p.writes.on_match(m.last_device_node)
        return CacheMatch(m.device_indices, m.device_length, m.host_hit_length, rest, m, extra_key)

    def lock(self, node: Node) -> None:
        """Keep ``node`` and its ancestors from eviction (a request is using them).

        Each `lock` is released by one `unlock` of the same node.

        Raises:
            InvalidInputError: not a `Node`. StateError: not in the index.
        """
        self._check().room.hold(node)
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
        p = self._check()
        self.index.path(node)  # a Node of this index, else refused before the lock count
        held = self._locks.get(node, 0)
        if held <= 0:
            raise StateError(f"unlock of {node}: it holds no lock taken with TierCache.lock")
        p.room.release(node)
        if held == 1:
            del self._locks[node]
        else:
            self._locks[node] = held - 1

    # -- device allocation and eviction ----------------------------------------

    async def alloc_device(self, num_tokens: int) -> torch.Tensor:
        """Device slots for ``num_tokens`` (a multiple of the page size), evicting LRU nodes if needed.

        When the pool is short only because other requests or copies hold
        slots, waits for them (see `tiercache.room`): first come, first served,
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

    async def _alloc_device(self, num_tokens: int, own: int, key: object = None) -> torch.Tensor:
        """`alloc_device`; with ``key`` (a request's lease), the slots are listed under it."""
        p = self._check()
        n = check_count(num_tokens, "num_tokens", multiple_of=self.layout.page_size)
        held = p.ctl.ledger.device.num_slots
        if n > held:
            raise CapacityError(f"{n} device slots asked: the pool holds {held}")
        return await p.device.alloc(n, own, key)

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
        ctl = self._check().ctl
        ready_ev = ctl.ready_event(ready, "free_device")  # checked before anything changes
        dev = check_slot_indices(
            indices, self.layout.page_size, ctl.device_pool.num_slots, "indices"
        )
        books = ctl.ledger.device
        pages = books.pages(dev)
        if books.owned(pages, Owner.INDEX):
            raise InvalidInputError("free_device: some of these slots hold cached KV of the index")
        if books.owned(pages, Owner.REQUEST):
            raise InvalidInputError(
                "free_device: some of these slots belong to an open request (it frees them)"
            )
        books.check_unleased(pages)
        # The ledger's release wakes the waiters for room.
        books.free(pages, fence=ready_ev)

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
        p = self._check()
        n = check_count(num_tokens)
        deadline = asyncio.get_running_loop().time() + self.config.alloc_timeout_s
        return await p.device.evict(n, deadline)

    async def evict_host(self, num_tokens: int) -> int:
        """Drop LRU host-only nodes (not pinned or locked) to free ``num_tokens`` host slots.

        Their pages stay in storage if they were backed up. Returns slots freed.

        Raises:
            InvalidInputError: ``num_tokens`` is not a non-negative int.
        """
        p = self._check()
        return p.room.evictor.evict_host(check_count(num_tokens))

    # -- insert and storage backups ---------------------------------------------------

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
        p = self._check()
        ready_ev = p.ctl.ready_event(ready, "insert")
        toks = token_list(tokens)
        check_extra_key(extra_key)
        return await p.inserter.insert(toks, device_indices, extra_key, owner, ready_ev)

    async def backup_to_storage(self) -> int:
        """Back up every host-resident node not yet in storage; wait for it.

        Returns:
            Nodes written: whose backup succeeded. A node whose backup failed
            or ended early (a storage error is a miss, never raised) is not
            counted, and the next call tries it again.
        """
        ops = self._check().writes.backup_all()
        if not ops:
            return 0
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
        p = self._check()
        check_match(self.index, match)
        if match.host_tokens == 0:
            if not fresh:
                check_device_match(self.index, match)
            return match.device_indices, None
        target = match.index.last_host_node
        handle = await p.loads.load(target, p.room.hold, p.device.taker(own))
        if handle is not None:
            self._stats.loads_back += 1
        return await p.loads.with_loads(
            target, match.extra_key, handle, self._check, wait=not fresh
        )

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
        p = self._check()
        toks = token_list(tokens)
        policy = check_choice(
            self.config.prefetch_policy if policy is None else policy, PREFETCH_POLICIES, "policy"
        )
        if match is not None:
            check_match(self.index, match)
            check_match_of(self.index, match, toks)
        done, _ = await p.prefetcher.run(toks, match or self._match(toks, None), request_id, policy)
        return done

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
        p = self._check()
        toks = token_list(tokens)
        check_extra_key(extra_key)
        if not isinstance(prefetch, bool):
            raise InvalidInputError(f"prefetch must be a bool, got {prefetch!r}")
        key = toks[:-1]
        m = self._match(key, extra_key)
        # Open from here: the locks it takes below hold device room until it ends.
        with p.room.open_request():
            req, lease = await self._start_request(m, toks, extra_key, request_id, prefetch)
            try:
                yield req
            finally:
                lease.release()

    async def _start_request(
        self,
        m: CacheMatch,
        toks: list[int],
        extra_key: str | None,
        request_id: object,
        prefetch: bool,
    ) -> tuple[Request, RequestLease]:
        """`request` up to the body: prefetch, load back, lock the prefix (``m``: its match)."""
        p, key, first_device = self._check(), toks[:-1], m.device_tokens
        storage_hits = await p.prefetcher.for_request(key, m, request_id) if prefetch else 0
        if prefetch and m.storage_candidate_tokens:
            m = self._match(key, extra_key)
        prefix, handle = await self._load_back(m, own=0, fresh=True)
        node = self.index.match_prefix(
            key[: prefix.numel()], extra_key, touch=False, checked=True
        ).last_device_node
        p.room.hold(node)
        port = _RequestPort(self)  # the request's, not the cache's: no cycle back to the cache
        lease = RequestLease(port, node)
        loads = [handle] if handle is not None else []
        loads += [h for h in p.loads.over(prefix) if h is not handle]
        count_request(self._stats, len(toks), first_device, int(prefix.numel()), storage_hits)
        return Request(port, lease, toks, extra_key, prefix, loads), lease

    # -- flush, stats, waiting ----------------------------------------------------

    async def wait_idle(self) -> None:
        """Wait for every copy, backup and background task in flight, and their completion callbacks."""
        await self._ops.wait_idle(self._check().ctl, self.index)

    async def flush(self) -> None:
        """Drop everything on the device and host tiers; keep storage (what a restart looks like).

        Raises:
            StateError: a request is open, a node is locked, or device slots
                from `alloc_device` are neither inserted nor freed (with an
                engine's own allocator: any slots the engine holds). Their
                slots would be freed under them and handed out again.
        """
        p = self._check()
        if p.room.open_requests:
            raise StateError(f"flush while {p.room.open_requests} request(s) are open")
        await self.wait_idle()
        if p.room.open_requests or any(n.lock_ref for n in self.index.nodes()):
            raise StateError("flush while requests hold locks")
        held = p.room.held_outside_index()
        if held:
            raise StateError(
                f"flush while {held} device slots are allocated outside the index: "
                "insert or free_device them first"
            )
        await p.ctl.reset()
        p.prefetcher.flushes += 1
        self.index.reset()

    def stats(self) -> CacheStats:
        """A snapshot of the counters, including the controller's and the storage tier's."""
        return merged_stats(self._stats, self._controller, self.index)

    def __repr__(self) -> str:
        return f"TierCache({self.layout.describe()}, state={self.state.value})"
