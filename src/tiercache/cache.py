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
opened the cache; the bookkeeping is synchronous, so an ``await`` never
interrupts it halfway.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Self

import torch

from tiercache._resource import AsyncResource
from tiercache.config import TierCacheConfig
from tiercache.controller import CopyAck, LoadHandle, Ready, TierController
from tiercache.errors import CapacityError, ClosedError, InvalidInputError, StateError
from tiercache.index.radix import MatchResult, Node, RadixIndex
from tiercache.memory.allocator import PageAllocator
from tiercache.memory.pools import DeviceKVPool, HostKVPool, resolve_device
from tiercache.storage.base import StorageBackend
from tiercache.storage_tier import BackupOperation, PrefetchOperation

__all__ = ["CacheMatch", "CacheState", "CacheStats", "Request", "TierCache"]

logger = logging.getLogger(__name__)


class CacheState(enum.Enum):
    CREATED = "created"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(slots=True)
class CacheStats:
    """What the cache did. Token counts are per matched request."""

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
        device_indices: device slots of the device-resident prefix.
        device_tokens: its length.
        host_tokens: tokens after it that are on the host only (`load_back` them).
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
        config = config or TierCacheConfig()
        if not isinstance(config, TierCacheConfig):
            raise InvalidInputError(
                f"config must be a TierCacheConfig, got {type(config).__name__}"
            )
        if overrides:
            config = config.replace(**overrides)
        self.config = config
        self.layout = config.layout()
        self._device_pool = device_pool
        self._device_allocator = device_allocator
        self._tp_group = tp_group
        self.state = CacheState.CREATED
        self.index = RadixIndex(self.layout.page_size)
        self._stats = CacheStats()
        self._controller: TierController | None = None
        # Loads in flight and the device slots they fill: a request whose
        # prefix shares those slots waits for them too (the index already
        # shows the nodes as device-resident while the bytes are landing).
        self._pending_loads: dict[LoadHandle, torch.Tensor] = {}
        self._backups: set[BackupOperation] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._error: BaseException | None = None
        self._open_requests = 0

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
        device = resolve_device(cfg.device) if self._device_pool is None else None

        def build() -> tuple[DeviceKVPool, HostKVPool]:
            dev = self._device_pool or DeviceKVPool(lay, cfg.device_tokens, device or cfg.device)
            host = HostKVPool(lay, cfg.resolved_host_tokens(), host_layout=cfg.host_layout)
            return dev, host

        dev, host = await asyncio.to_thread(build)
        ctl = TierController(
            dev,
            host,
            device_allocator=self._device_allocator,
            write_policy=cfg.write_policy,
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
        self.state = CacheState.OPEN
        return self

    async def _aenter(self) -> None:
        await self.open()

    async def aclose(self) -> None:
        """Wait for copies and backups, stop storage, close the controller. Idempotent."""
        if self.state is not CacheState.OPEN:
            self.state = CacheState.CLOSED
            return
        ctl = self.controller
        self.state = CacheState.CLOSED
        try:
            await self._drain_tasks()
        finally:
            await ctl.aclose()

    async def _drain_tasks(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None and self._error is None:
                self._error = t.exception()
                logger.error("a cache task failed: %r", t.exception(), exc_info=t.exception())

        task.add_done_callback(done)
        return task

    def _check(self) -> TierController:
        ctl = self.controller
        if self._error is not None:
            err, self._error = self._error, None
            raise StateError(f"a background task of the cache failed: {err!r}") from err
        return ctl

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
        """
        ctl = self._check()
        toks = self._tokens(tokens)
        m = self.index.match_prefix(toks, extra_key)
        ps = self.layout.page_size
        rest = (len(toks) - m.matched_length) // ps * ps
        if self.config.write_policy == "write_through_selective":
            for n in self.index.path(m.last_device_node):
                if n.hit_count >= self.config.write_through_threshold and not n.on_host:
                    self._write_node(ctl, n)
        return CacheMatch(m.device_indices, m.device_length, m.host_hit_length, rest, m, extra_key)

    @staticmethod
    def _tokens(tokens: Sequence[int] | torch.Tensor) -> list[int]:
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 1 or tokens.dtype.is_floating_point:
                raise InvalidInputError("tokens must be a 1-D integer tensor or a sequence of ints")
            return list(tokens.tolist())
        if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence):
            raise InvalidInputError(
                f"tokens must be a sequence of ints, got {type(tokens).__name__}"
            )
        return list(tokens)

    def lock(self, node: Node) -> None:
        """Keep ``node`` and its ancestors from eviction (a request is using them)."""
        self.index.lock(node)

    def unlock(self, node: Node) -> None:
        self.index.unlock(node)

    # -- device allocation and eviction ----------------------------------------

    async def alloc_device(self, num_tokens: int) -> torch.Tensor:
        """Device slots for ``num_tokens`` (a multiple of the page size), evicting LRU nodes if needed.

        Raises:
            CapacityError: not enough can be evicted (everything is locked).
            InvalidInputError: a bad size.
        """
        ctl = self._check()
        got = ctl.device_allocator.alloc(num_tokens)
        if got is None:
            await self._make_device_room(num_tokens)
            got = ctl.device_allocator.alloc(num_tokens)
        if got is None:
            raise CapacityError(
                f"cannot find {num_tokens} device slots: {ctl.device_allocator.available} free, the rest locked"
            )
        return got

    async def _make_device_room(self, num_tokens: int) -> None:
        """Evict until ``num_tokens`` device slots are free, waiting for host copies in flight.

        Nodes whose host copy is still running cannot leave the device yet;
        when eviction alone falls short, wait for those copies and try again.
        """
        ctl = self.controller
        for _ in range(4):
            short = num_tokens - ctl.device_allocator.available
            if short <= 0:
                return
            if await self.evict_device(short) >= short:
                return
            if not ctl._inflight and not ctl._write_queue:
                return
            await ctl.wait_idle()

    def free_device(self, indices: torch.Tensor) -> None:
        """Return device slots from `alloc_device` that were not inserted."""
        self._check().evict_device(indices)

    async def evict_device(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots (fewer when the rest is locked), LRU leaves first.

        A node whose pages are on host just leaves the device. One that is not
        (``write_back``, or a host write that found no room) is written to host
        first; if that fails it is dropped when nothing below it needs it, and
        kept otherwise. Returns slots freed.
        """
        ctl = self._check()
        freed = 0
        if num_tokens <= 0:
            return 0
        for node in self.index.evict_device_candidates(num_tokens):
            if node.device_indices is None or node.lock_ref or node.parent is None:
                continue
            if any(c.device_indices is not None for c in node.children.values()):
                continue
            if not node.on_host and not await self._write_back(node):
                if node.children or node.lock_ref or node.host_pin or node.device_indices is None:
                    continue  # its host-only children need its pages: keep it
                dev = node.device_indices
                self.index.remove(node)
                ctl.evict_device(dev)
                freed += dev.numel()
                self._stats.device_evictions += 1
                self._stats.device_evicted_tokens += dev.numel()
                continue
            if (
                not node.on_host
                or node.write_in_flight
                or node.lock_ref
                or node.device_indices is None
            ):
                continue
            if any(c.device_indices is not None for c in node.children.values()):
                continue
            dev = self.index.mark_device_evicted(node)
            ctl.evict_device(dev)
            freed += dev.numel()
            self._stats.device_evictions += 1
            self._stats.device_evicted_tokens += dev.numel()
        return freed

    async def _write_back(self, node: Node) -> bool:
        """Copy ``node`` to host (making room) and wait, before it leaves the device."""
        ctl = self.controller
        if not await self._ensure_host(node.num_tokens):
            return False
        ack = self._write_node(ctl, node)
        if ack is None:
            return False
        self._stats.write_backs += 1
        await ack
        return node.on_host and not node.write_in_flight

    async def _ensure_host(self, num_tokens: int) -> bool:
        ctl = self.controller
        if ctl.host_allocator.available < num_tokens:
            self._evict_host_now(num_tokens - ctl.host_allocator.available)
        return ctl.host_allocator.available >= num_tokens

    async def evict_host(self, num_tokens: int) -> int:
        """Drop LRU host-only nodes (not pinned or locked) to free ``num_tokens`` host slots.

        Their pages stay in storage if they were backed up. Returns slots freed.
        """
        self._check()
        return self._evict_host_now(num_tokens)

    def _evict_host_now(self, num_tokens: int) -> int:
        ctl = self.controller
        freed = 0
        if num_tokens <= 0:
            return 0
        for node in self.index.evict_host_candidates(num_tokens):
            host = node.host_indices
            assert host is not None
            if ctl.ack_busy("host", host):
                continue
            self.index.remove(node)
            ctl.evict_host(host)
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

        Whole pages only: a trailing partial page is not inserted and its
        slots stay the caller's. Slots of the part already cached are freed
        here. Under ``write_through`` the new node is written to host (and,
        once there, to storage when attached).

        Returns:
            How many leading tokens were already cached.

        Raises:
            InvalidInputError: lengths that differ, bad slots.
        """
        ctl = self._check()
        ready_ev = ctl.ready_event(ready, "insert")
        toks = self._tokens(tokens)
        if not isinstance(device_indices, torch.Tensor) or device_indices.numel() != len(toks):
            raise InvalidInputError("device_indices must be a tensor with one slot per token")
        ps = self.layout.page_size
        n = len(toks) // ps * ps
        dev = device_indices.cpu()[:n]
        cached = self.index.match_prefix(toks[:n], extra_key, touch=False).device_indices
        result = self.index.insert(toks[:n], dev, extra_key)
        if result.prefix_len:
            # Free the duplicates, but never the index's own slots (a request
            # committing its prefix passes those back).
            dup = dev[: result.prefix_len].view(-1, ps)
            mine = cached[: result.prefix_len].view(-1, ps)
            differ = (dup != mine).any(dim=1)
            if bool(differ.any()):
                ctl.device_allocator.free(dup[differ].reshape(-1))
        self._stats.tokens_inserted += n - result.prefix_len
        node = result.node
        if node is not None and self.config.write_policy == "write_through":
            self._write_node(ctl, node, ready=ready_ev)
        # Reattached host-only nodes already have a host copy: nothing to write.
        return result.prefix_len

    def _write_node(
        self, ctl: TierController, node: Node, *, ready: Ready = None
    ) -> CopyAck | None:
        """Start a device->host write of ``node``; its storage backup follows the ack."""
        if node.on_host or node.device_indices is None or node.write_in_flight:
            return None
        short = node.num_tokens - ctl.host_allocator.available
        if short > 0:
            # Make room on host by dropping LRU host-only nodes (those backed
            # up to storage can come back from there).
            self._evict_host_now(short)
        ack = ctl.submit_write(node.device_indices, node_id=node.id, track=False, ready=ready)
        if ack is None:
            return None  # host full: the node stays device-only
        wid = self.index.begin_write(node, ack.host_indices)
        ack.add_done_callback(lambda a: self._write_done(wid, a))
        return ack

    def _write_done(self, wid: int, ack: CopyAck) -> None:
        ctl = self._controller
        if ctl is None:
            return
        try:
            nodes = self.index.finish_write(wid, ok=not ack.failed())
        except StateError:  # flushed meanwhile
            return
        if ack.failed():
            ctl.host_allocator.free(ack.host_indices)
            return
        if ctl.storage_attached:
            for n in nodes:
                self._backup_node(ctl, n)

    def _backup_node(self, ctl: TierController, node: Node) -> None:
        if node.backuped_storage or node.host_indices is None or node.parent is None:
            return
        self.index.pin_host(node)
        op = ctl.write_storage(
            node.host_indices, list(node.key), node_id=node.id, hash_values=list(node.page_hashes)
        )
        if op is None:
            self.index.unpin_host(node)
            return
        self._backups.add(op)

        async def wait() -> None:
            try:
                await op
            finally:
                self._backups.discard(op)
                if node.parent is not None or node.host_pin:
                    self.index.unpin_host(node)
                if op.succeeded:
                    node.backuped_storage = True
                    self._stats.storage_backups += 1

        self._spawn(wait())

    async def backup_to_storage(self) -> int:
        """Back up every host-resident node not yet in storage; wait for it. Returns nodes written."""
        ctl = self._check()
        if not ctl.storage_attached:
            return 0
        count = 0
        for n in list(self.index.nodes()):
            if not n.is_root and n.on_host and not n.write_in_flight and not n.backuped_storage:
                self._backup_node(ctl, n)
                count += 1
        await self.wait_idle()
        return count

    # -- load back and prefetch ---------------------------------------------------

    async def load_back(self, match: CacheMatch) -> tuple[torch.Tensor, LoadHandle | None]:
        """Load the host part of ``match`` into device slots, layer by layer.

        Returns:
            ``(device_indices, handle)``: the slots of the whole matched prefix
            (device part + loaded part) and the `LoadHandle` whose layer
            futures the forward pass waits on (``None`` when nothing was on
            host only). The loaded nodes stay locked until the load completes.

        Raises:
            CapacityError: no device room for the host part.
        """
        ctl = self._check()
        if match.host_tokens == 0:
            return match.device_indices, None
        target = match.index.last_host_node
        path = self.index.load_path(target)
        if not path:  # the tree changed since the match
            m = self.index.match_prefix(
                self.index.prefix_tokens(target), match.extra_key, touch=False
            )
            return m.device_indices, None
        self.index.lock(target)
        try:
            total = sum(n.num_tokens for n in path)
            await self._make_device_room(total)
            path = self.index.load_path(target)
            host = torch.cat([n.host_indices for n in path if n.host_indices is not None])
            ack = ctl.submit_load(host, node_id=target.id, track=False)
            if ack is None:
                raise CapacityError(
                    f"no device room to load {host.numel()} tokens back: the rest is locked"
                )
            handle = ctl.start_loading()
            assert handle is not None
            self.index.attach_device(target, ack.device_indices)
        except BaseException:
            self.index.unlock(target)
            raise
        self._stats.loads_back += 1

        def unlock(_f: object) -> None:
            try:
                self.index.unlock(target)
            except StateError:
                pass

        handle._future.add_done_callback(unlock)
        self._pending_loads[handle] = ack.device_indices
        handle._future.add_done_callback(lambda _f: self._pending_loads.pop(handle, None))
        full = self.index.match_prefix(
            self.index.prefix_tokens(target), match.extra_key, touch=False
        )
        return full.device_indices, handle

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

        Returns:
            Tokens fetched and inserted (0 without storage, under the
            threshold, or on any storage failure).
        """
        ctl = self._check()
        toks = self._tokens(tokens)
        match = match or self.match_prefix(toks)
        n = match.storage_candidate_tokens
        policy = policy or self.config.prefetch_policy
        if not ctl.storage_attached or n <= 0 or n < self.config.prefetch_threshold:
            return 0
        start = match.index.matched_length
        parent = match.index.last_node
        if not await self._ensure_host(n):
            return 0
        host = ctl.host_allocator.alloc(n)
        if host is None:
            return 0
        if not parent.is_root:
            self.index.pin_host(parent)
        op = ctl.prefetch(request_id, host, toks[start : start + n], match.index.prior_hash)
        if op is None:
            ctl.host_allocator.free(host)
            if not parent.is_root:
                self.index.unpin_host(parent)
            return 0
        self._stats.prefetches += 1
        settle = self._settle_prefetch(ctl, op, toks[start : start + n], parent, match.extra_key)
        try:
            await self._wait_policy(op, policy, n)
        except BaseException:
            # Cancelled while waiting: finish on our own so the fetched pages
            # are kept (or freed) and nothing stays held.
            self._spawn(settle)
            raise
        return await settle

    async def _settle_prefetch(
        self,
        ctl: TierController,
        op: PrefetchOperation,
        toks: list[int],
        parent: Node,
        extra_key: str | None,
    ) -> int:
        """Terminate ``op``, insert what arrived under ``parent``, free the rest."""
        try:
            done, hashes = await ctl.terminate_prefetch(op)
        finally:
            if not parent.is_root and parent.host_pin:
                self.index.unpin_host(parent)
        if done == 0:
            return 0
        got = op.host_indices[:done]
        if self.state is not CacheState.OPEN or (parent.parent is None and not parent.is_root):
            ctl.host_allocator.free(got)  # closing, or the parent was dropped meanwhile
            return 0
        res = self.index.insert_host(
            toks[:done], got, parent=parent, extra_key=extra_key, page_hashes=hashes
        )
        if res.prefix_len:
            ctl.host_allocator.free(got[: res.prefix_len])
        if res.node is not None:
            res.node.backuped_storage = True
        # Pages another request cached meanwhile are counted where they were found.
        self._stats.tokens_storage_hit += done - res.prefix_len
        return done

    async def _wait_policy(self, op: PrefetchOperation, policy: str, num_tokens: int) -> None:
        if policy == "wait_complete":
            await op
        elif policy == "timeout":
            try:
                await asyncio.wait_for(
                    asyncio.shield(op._done), self.config.prefetch_timeout(num_tokens)
                )
            except TimeoutError:
                pass
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
        """Serve one request: match, prefetch from storage, load back, lock; unlock on exit."""
        self._check()
        toks = self._tokens(tokens)
        m = self.match_prefix(toks, extra_key)
        first_device, first_matched = m.device_tokens, m.index.matched_length
        if prefetch and m.storage_candidate_tokens:
            # Hold what matched while the prefetch awaits: nothing under it may
            # be evicted meanwhile, so the prefetched pages continue it.
            held = m.index.last_node
            self.lock(held)
            try:
                await self.prefetch(toks, m, request_id=request_id)
            finally:
                self.unlock(held)
            m = self.match_prefix(toks, extra_key)
        prefix, handle = await self.load_back(m)
        node = self.index.match_prefix(
            toks[: prefix.numel()], extra_key, touch=False
        ).last_device_node
        self.lock(node)
        loads = [handle] if handle is not None else []
        for h, dev in list(self._pending_loads.items()):
            if h is not handle and prefix.numel() and bool(torch.isin(dev, prefix).any()):
                loads.append(h)
        req = Request(self, toks, extra_key, prefix, loads, node)
        self._open_requests += 1
        self._stats.requests += 1
        self._stats.tokens_requested += len(toks)
        device_hit = min(first_device, int(prefix.numel()))
        self._stats.tokens_device_hit += device_hit
        self._stats.tokens_host_hit += max(0, min(int(prefix.numel()), first_matched) - device_hit)
        try:
            yield req
        finally:
            try:
                await req._release()
            finally:
                self._open_requests -= 1

    # -- flush, stats, waiting ----------------------------------------------------

    async def wait_idle(self) -> None:
        """Wait for every copy, backup and background task in flight, and their completion callbacks."""
        ctl = self._check()
        while True:
            await ctl.wait_idle()
            await self._drain_tasks()
            if ctl.storage is not None:
                await ctl.storage.wait_idle()
            # Completions are delivered by callbacks scheduled on the loop:
            # let them run, then check nothing new started.
            await asyncio.sleep(0)
            if (
                not self._tasks
                and not ctl._inflight
                and not ctl._write_queue
                and not self.index.pending_writes()
                and (ctl.storage is None or not ctl.storage.busy)
            ):
                return

    async def flush(self) -> None:
        """Drop everything on the device and host tiers; keep storage (what a restart looks like).

        Raises:
            StateError: a request is open or a node is locked (its slots
                would be freed under it).
        """
        ctl = self._check()
        if self._open_requests:
            raise StateError(f"flush while {self._open_requests} request(s) are open")
        await self.wait_idle()
        if self._open_requests or any(n.lock_ref for n in self.index.nodes()):
            raise StateError("flush while requests hold locks")
        await ctl.reset()
        self.index.reset()

    def stats(self) -> CacheStats:
        """A snapshot of the counters, including the controller's and the storage tier's."""
        ctl = self._controller
        s = CacheStats(**{k: getattr(self._stats, k) for k in CacheStats.__slots__ if k != "extra"})
        if ctl is not None:
            s.bytes_device_to_host = ctl.stats.bytes_device_to_host
            s.bytes_host_to_device = ctl.stats.bytes_host_to_device
            if ctl.storage is not None:
                st = ctl.storage.stats
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
            }
        return s

    def __repr__(self) -> str:
        return f"TierCache({self.layout.describe()}, state={self.state.value})"


class Request:
    """One request's view of the cache, from `TierCache.request`.

    Attributes:
        tokens: the prompt.
        cached_tokens: leading tokens whose KV is on the device (or loading).
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
        self._owned: list[torch.Tensor] = []
        self._committed = False
        self._released = False

    def layer_ready(self, layer: int) -> None:
        """Block a worker thread until ``layer`` of the prefix is on the device (no-op when it is)."""
        for h in self.loads:
            h.wait_layer(layer)

    async def wait_loaded(self) -> None:
        """Wait until the whole prefix is on the device."""
        for h in self.loads:
            await h

    async def alloc(self, num_tokens: int) -> torch.Tensor:
        """Device slots for new tokens, rounded up to whole pages; the first ``num_tokens`` are returned.

        Slots the request does not commit are freed when it ends.
        """
        ps = self.cache.layout.page_size
        pages = -(-num_tokens // ps) * ps
        slots = await self.cache.alloc_device(pages)
        self._owned.append(slots)
        return slots[:num_tokens]

    async def commit(
        self,
        tokens: Sequence[int] | torch.Tensor,
        device_indices: torch.Tensor,
        *,
        ready: Ready = None,
    ) -> int:
        """Insert the KV of ``tokens`` (the prompt, plus generated tokens if any) held in ``device_indices``.

        ``device_indices`` is the prefix's slots followed by slots from
        `alloc`. Whole pages are inserted; the slots of a trailing partial
        page go back when the request ends. Returns how many tokens were
        already cached.

        ``ready`` (CUDA): the producer of the new KV (the forward pass's
        stream or an event after it); by default the caller's current stream,
        recorded when ``commit`` is called, before it awaits anything.
        """
        ready_ev = self.cache._check().ready_event(ready, "commit")
        if self._committed:
            raise StateError("a request commits once")
        toks = TierCache._tokens(tokens)
        if len(toks) < self.cached_tokens or not torch.equal(
            device_indices[: self.cached_tokens].cpu(), self.prefix_indices.cpu()
        ):
            raise InvalidInputError("device_indices must start with the request's prefix_indices")
        ps = self.cache.layout.page_size
        n = len(toks) // ps * ps
        own = torch.cat(self._owned) if self._owned else torch.empty(0, dtype=torch.int64)
        new = device_indices[self.cached_tokens : n].cpu()
        if new.numel() and not bool(torch.isin(new, own).all()):
            raise InvalidInputError("new tokens' slots must come from Request.alloc")
        self._committed = True
        await self.wait_loaded()
        # The prefix is already in the index: insert() frees nothing of it
        # (the same slots), and takes the new pages' slots.
        dup = await self.cache.insert(
            toks[:n], device_indices[:n].cpu(), self.extra_key, ready=ready_ev
        )
        self._owned = [own[~torch.isin(own, new)]] if own.numel() else []
        return dup

    async def _release(self) -> None:
        if self._released:
            return
        self._released = True
        cache = self.cache
        if cache.state is not CacheState.OPEN:
            return
        for h in self.loads:
            try:
                await h
            except Exception:  # the load failed: the slots are still accounted below
                pass
        try:
            cache.unlock(self._node)
        except StateError:
            pass
        for slots in self._owned:
            if slots.numel():
                cache.free_device(slots)
        self._owned = []
