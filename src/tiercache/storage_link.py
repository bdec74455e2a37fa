"""`StorageLink`: a controller's storage tier (L3), attached and detached at runtime.

It opens or takes a `StorageBackend`, wraps it in a `StorageTier` that sees
the host pool only through `_HostSlots` (the `storage_tier.HostSlots`
protocol), and serves the controller's storage verbs: prefetch, backup,
their acks and counters. A detached tier's counts and tracked backups stay
here, so the totals never go down and no backup goes unreported. When the
fault policy gives up on a tier, the link detaches it in the controller's
task group. The controller checks that it is open before it calls in.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tiercache._checks import check_bool
from tiercache._tasks import TaskGroup
from tiercache.acks import ControllerStats
from tiercache.errors import BackendUnavailableError, InvalidInputError, StateError
from tiercache.ledger import Lease, PoolLedger
from tiercache.memory.allocator import copy_slots
from tiercache.memory.pools import HostKVPool
from tiercache.storage.base import BackendState, StorageBackend
from tiercache.storage.keys import StorageNamespace
from tiercache.storage_tier import (
    BackupOperation,
    PrefetchOperation,
    StorageTier,
    StorageTierConfig,
    StorageTierStats,
    check_cached_tokens,
    check_storage_args,
)

__all__ = ["StorageLink", "StorageVerbs"]

logger = logging.getLogger(__name__)


class _HostSlots:
    """The slice of a controller its storage tier may use (`storage_tier.HostSlots`).

    The host pool, the device (for collectives), and the host half of the
    controller's `Ledger`: a storage call takes a lease on the host pages it
    reads (a backup) or fills (a prefetch, `Lease.FETCH`) while it runs, and
    frees the pages a prefetch did not fill through it. Ending a lease wakes
    the ledger's release listeners. The fault callback is a bound method of
    the `StorageLink`, held weakly: the link owns this object, and a strong
    reference back would put the link, and the pools this holds, in a cycle
    that only the garbage collector frees. Loop thread only.
    """

    __slots__ = ("_device", "_failed", "_host", "_pool")

    def __init__(
        self,
        pool: HostKVPool,
        host: PoolLedger,
        device: torch.device,
        failed: Callable[[StorageTier], None],
    ) -> None:
        self._pool = pool
        self._host = host
        self._device = device
        self._failed = weakref.WeakMethod(failed)

    @property
    def pool(self) -> HostKVPool:
        return self._pool

    @property
    def device(self) -> torch.device:
        return self._device

    def allocated(self, host_indices: torch.Tensor) -> bool:
        """Whether every page of these (checked) host slots is allocated."""
        return self._host.allocated(self._host.pages(host_indices))

    def hold(self, host_indices: torch.Tensor, *, fill: bool = False) -> None:
        """Lease host slots to a storage call (a backup reads them; with ``fill`` a prefetch fills them)."""
        self._host.lease(self._host.pages(host_indices), Lease.FETCH if fill else Lease.READ)

    def release(self, host_indices: torch.Tensor, *, fill: bool = False) -> None:
        """End a `hold`; wakes the release listeners (the pages may be freed now).

        A prefetch's completed prefix holds its tokens' KV from then on.
        """
        pages = self._host.pages(host_indices)
        self._host.end_lease(pages, Lease.FETCH if fill else Lease.READ)

    def free(self, host_indices: torch.Tensor) -> None:
        """Free host slots a prefetch did not fill (nothing leases them any more)."""
        self._host.free(self._host.pages(host_indices))

    def in_use(self, host_indices: torch.Tensor) -> bool:
        """Whether a copy or a storage call uses any of these host slots."""
        return self._host.leased(self._host.pages(host_indices))

    def filling(self, host_indices: torch.Tensor) -> bool:
        """Whether a device->host copy or a prefetch still fills any of these host slots."""
        pages = self._host.pages(host_indices)
        return self._host.leased(pages, Lease.FILL) or self._host.leased(pages, Lease.FETCH)

    def spoiled(self, host_indices: torch.Tensor) -> bool:
        """Whether a failed copy left some of these host slots without their KV."""
        return self._host.spoiled(self._host.pages(host_indices))

    def storage_failed(self, tier: StorageTier) -> None:
        """The fault policy gave up on ``tier``: the controller detaches it in the background."""
        failed = self._failed()
        if failed is not None:
            failed(tier)


class StorageLink:
    """The storage tier of one controller, and what stays of those detached.

    Args:
        host_pool: the controller's host pool (what storage reads and fills).
        host: the host half of the controller's ledger.
        device: the device pool's device (for the TP group's collectives).
        namespace: the storage keys' namespace.
        config: the prefetch / backup knobs of every tier attached.
        tp_group: the TP ranks' process group, or ``None``.
        tasks: the controller's task group (background storage work, the
            automatic detach).
        stats: the controller's counters (it counts automatic detaches).
        write_enabled: whether this rank writes to storage.
        source: what the tiers report their timings as (`tiercache.observe`).

    Loop thread only.
    """

    def __init__(
        self,
        host_pool: HostKVPool,
        host: PoolLedger,
        device: torch.device,
        namespace: StorageNamespace,
        config: StorageTierConfig,
        *,
        tp_group: Any,
        tasks: TaskGroup,
        stats: ControllerStats,
        write_enabled: bool,
        source: object,
    ) -> None:
        self.namespace = namespace
        self.config = config
        self.tp_group = tp_group
        self.tasks = tasks
        self.stats = stats
        self.write_enabled = write_enabled
        self.source = source
        self._page_size = host_pool.layout.page_size
        #: The attached tier, or ``None``.
        self.tier: StorageTier | None = None
        self._lock = asyncio.Lock()
        self._closing = False
        # The counts of the tiers detached so far, and of those being detached.
        self._past = StorageTierStats()
        self._detaching: list[StorageTier] = []
        #: Tracked backups ended by (or before) a detach, not drained yet.
        self._detached_backups: deque[BackupOperation] = deque()
        self._slots = _HostSlots(host_pool, host, device, self._failed)

    def stats_total(self) -> StorageTierStats:
        """`TierController.storage_stats`."""
        total = StorageTierStats()
        total.add(self._past)
        for tier in (*self._detaching, self.tier):
            if tier is not None:
                total.add(tier.stats)
        return total

    async def attach(
        self,
        backend: StorageBackend | str,
        options: dict[str, Any],
        check_open: Callable[[], object],
    ) -> StorageBackend:
        """`TierController.attach_storage_backend`; ``check_open`` is called again
        once the backend is open (the controller may have closed meanwhile)."""
        async with self._lock:
            if self.tier is not None:
                raise StateError("a storage backend is already attached; detach it first")
            owns = isinstance(backend, str)
            if isinstance(backend, str):
                from tiercache.storage.registry import open_backend

                opened = await open_backend(backend, **options)
            elif isinstance(backend, StorageBackend):
                if options:
                    raise InvalidInputError("options are only accepted with a backend URL")
                if backend.state is BackendState.CLOSED:
                    # Every call would fail: the fault policy would take it for an outage.
                    raise BackendUnavailableError(
                        f"the {backend.name} backend is closed: attach an open one"
                    )
                opened = backend
            else:
                raise InvalidInputError(
                    f"expected a StorageBackend or a URL, got {type(backend).__name__}"
                )
            try:
                check_open()
                self.tier = StorageTier(
                    self._slots,
                    self.tasks,
                    opened,
                    self.namespace,
                    self.config,
                    owns_backend=owns,
                    tp_group=self.tp_group,
                    write_enabled=self.write_enabled,
                    source=self.source,
                )
            except BaseException:
                if owns:
                    await opened.aclose()
                raise
            logger.info("storage backend %s attached", opened.name)
            return opened

    async def detach(self, *, tier: StorageTier | None = None) -> bool:
        """`TierController.detach_storage_backend` (the loop was checked)."""
        async with self._lock:
            if tier is not None and self.tier is not tier:
                return False
            tier, self.tier = self.tier, None
            if tier is None:
                return False
            self._detaching.append(tier)
            try:
                await tier.stop()
            finally:
                self._detaching.remove(tier)
                self._past.add(tier.stats)
            # Tracked backups that ended (the detach ended those in flight)
            # are still reported once, by `drain_backup_acks`.
            self._detached_backups.extend(tier.drain_backup_acks())
            logger.info("storage backend %s detached", tier.backend.name)
            return True

    async def stop(self) -> None:
        """The controller is closing: stop the tier (after a detach in progress);
        a fault no longer detaches in the background."""
        self._closing = True
        async with self._lock:
            tier, self.tier = self.tier, None
            if tier is not None:
                await tier.stop()

    def forget_backups(self) -> None:
        """Drop the detached tiers' backups not drained (nobody drains a closed controller)."""
        self._detached_backups.clear()

    def _failed(self, tier: StorageTier) -> None:
        """`_HostSlots.storage_failed`: count it, detach ``tier`` in the task group."""
        self.stats.storage_auto_detaches += 1
        if not self._closing:  # closing stops the tier anyway
            self.tasks.spawn(self.detach(tier=tier), "the automatic storage detach")

    def prefetch(
        self,
        request_id: object,
        host_indices: torch.Tensor,
        token_ids: Sequence[int],
        last_hash: str | None,
        cached_tokens: int,
    ) -> PrefetchOperation | None:
        """`TierController.prefetch` (the controller is open)."""
        host, tokens = check_storage_args(
            self._slots, self.namespace, host_indices, token_ids, last_hash, fill=True
        )
        cached_tokens = check_cached_tokens(cached_tokens, self._page_size)
        if self.tier is None:
            return None
        host = copy_slots(host) if host is host_indices else host  # it fills them later
        return self.tier.prefetch(
            request_id, host, tokens, last_hash, cached_tokens=cached_tokens, checked=True
        )

    def abstain(self, cached_tokens: int) -> None:
        """`TierController.abstain_prefetch` (the controller is open)."""
        cached_tokens = check_cached_tokens(cached_tokens, self._page_size)
        if self.tier is not None:
            self.tier.abstain(cached_tokens)

    def rate_limited(self) -> bool:
        """Whether the attached tier refuses prefetches for now (none attached: no)."""
        return self.tier is not None and self.tier.rate_limited()

    async def terminate_prefetch(self, operation: PrefetchOperation) -> tuple[int, list[str]]:
        """`TierController.terminate_prefetch`."""
        if not isinstance(operation, PrefetchOperation):
            raise InvalidInputError(
                f"operation must be a PrefetchOperation, got {type(operation).__name__}"
            )
        tier = self.tier
        if tier is None:
            await operation.wait()
            return operation.take_completed()
        return await tier.terminate_prefetch(operation)

    def write_storage(
        self,
        host_indices: torch.Tensor,
        token_ids: Sequence[int],
        hash_value: str | None,
        *,
        node_id: object,
        hash_values: list[str] | None,
        track: bool,
    ) -> BackupOperation | None:
        """`TierController.write_storage` (the controller is open)."""
        check_bool(track, "track")
        host, tokens = check_storage_args(
            self._slots,
            self.namespace,
            host_indices,
            token_ids,
            hash_value,
            hash_values,
            fill=False,
        )
        if self.tier is None:
            return None
        # It reads them batch by batch, later: the caller may reuse its own at once.
        host = copy_slots(host) if host is host_indices else host
        return self.tier.write_storage(
            host,
            tokens,
            hash_value,
            node_id=node_id,
            hash_values=None if hash_values is None else list(hash_values),
            track=track,
            checked=True,
        )

    def drain_backup_acks(self) -> list[BackupOperation]:
        """`TierController.drain_backup_acks` (the loop was checked)."""
        out = list(self._detached_backups)
        self._detached_backups.clear()
        if self.tier is not None:
            out.extend(self.tier.drain_backup_acks())
        return out


class StorageVerbs(ABC):
    """The storage verbs of `TierController` (L3): attach, detach, prefetch, back up.

    A base class of the controller, which provides the `StorageLink` they
    act on and its lifecycle checks; each verb checks them first, then its
    arguments, then calls the link. Loop thread only.
    """

    #: The controller's storage tier and what stays of those detached.
    _storage: StorageLink

    @abstractmethod
    def _check_open(self) -> object:
        """`TierController._check_open`."""

    @abstractmethod
    def _check_loop(self) -> None:
        """`TierController._check_loop`."""

    @property
    def storage(self) -> StorageTier | None:
        """The attached storage tier, or ``None``."""
        return self._storage.tier

    @property
    def storage_attached(self) -> bool:
        return self._storage.tier is not None

    def storage_stats(self) -> StorageTierStats:
        """The storage counters of every backend attached so far, summed.

        Detaching a backend (by hand or by the ``auto_detach`` fault policy)
        keeps its counts: these totals never go down, as the monitoring
        counters built on them must not.
        """
        return self._storage.stats_total()

    async def attach_storage_backend(
        self, backend: StorageBackend | str, **options: Any
    ) -> StorageBackend:
        """Attach a storage backend at runtime: an open `StorageBackend`, or a URL to open.

        Rollback-safe: if opening the backend fails, the controller is left
        exactly as it was and the error propagates. A backend opened here from
        a URL is closed on detach; one passed in stays the caller's to close.

        Returns:
            The attached backend.

        Raises:
            StateError: a backend is already attached (detach it first).
            ConfigError / BackendNotFoundError / StorageError: the URL or the
                backend failed to open.
            BackendUnavailableError: the backend given is closed.
        """
        self._check_open()
        return await self._storage.attach(backend, options, self._check_open)

    async def detach_storage_backend(self, *, tier: StorageTier | None = None) -> bool:
        """Detach the storage backend: terminate prefetches, stop backups, free their slots.

        Idempotent. Returns once no storage coroutine is left running;
        ``True`` if a backend was attached. Prefetch operations in flight end
        `TERMINATED` with what they completed (collect it with
        `terminate_prefetch`). With ``tier``, detach only if that tier is still
        the attached one (the fault policy's automatic detach).

        Raises:
            StateError: called off the controller's loop.
        """
        self._check_loop()
        return await self._storage.detach(tier=tier)

    def prefetch(
        self,
        request_id: object,
        host_indices: torch.Tensor,
        token_ids: Sequence[int],
        last_hash: str | None = None,
        *,
        cached_tokens: int = 0,
    ) -> PrefetchOperation | None:
        """Start a storage prefetch of ``token_ids`` into ``host_indices`` (see `StorageTier.prefetch`).

        ``cached_tokens``: the tokens this rank already holds before
        ``token_ids`` (its matched prefix). With a TP group the ranks agree
        on where the prefix ends (the MIN of ``cached_tokens`` + storage
        hits), so ranks whose caches differ still end with the same prefix.

        Returns ``None`` (the caller keeps its slots) when no backend is
        attached or prefetch is rate-limited. The arguments are checked in
        either case.

        Raises:
            InvalidInputError: bad slots, tokens, ``last_hash`` or
                ``cached_tokens`` (see `check_storage_args`).
            StateError: a copy or a storage call still uses some of
                ``host_indices`` (the prefetch would overwrite its bytes).
        """
        self._check_open()
        return self._storage.prefetch(request_id, host_indices, token_ids, last_hash, cached_tokens)

    def abstain_prefetch(self, cached_tokens: int = 0) -> None:
        """With a TP group: take part in a prefetch's agreements without prefetching.

        Every rank must make one agreement per prefetch. A rank that decides on
        its own not to call `prefetch` for a request the other ranks prefetch
        (its host memory is full, or it already holds the whole prefix) calls
        this instead, with the tokens of the request it holds: the ranks then
        fetch no further than that (with the default 0, no rank loads), and
        a rank that holds the prefix lets the others fetch up to it. Without
        a TP group, or with no backend attached, it does nothing. `prefetch`
        itself already abstains when the backend is down or rate limited.

        Raises:
            InvalidInputError: ``cached_tokens`` is not a non-negative multiple
                of the page size.
        """
        self._check_open()
        self._storage.abstain(cached_tokens)

    def prefetch_rate_limited(self) -> bool:
        return self._storage.rate_limited()

    async def terminate_prefetch(self, operation: PrefetchOperation) -> tuple[int, list[str]]:
        """Stop a prefetch; return ``(completed_tokens, hash_values)`` (see `StorageTier.terminate_prefetch`).

        Works after a detach too (the operation is already ended then).

        Raises:
            InvalidInputError: ``operation`` is not a `PrefetchOperation`
                (`prefetch` returns ``None`` when it started nothing).
        """
        return await self._storage.terminate_prefetch(operation)

    def write_storage(
        self,
        host_indices: torch.Tensor,
        token_ids: Sequence[int],
        hash_value: str | None = None,
        *,
        node_id: object = None,
        hash_values: list[str] | None = None,
        track: bool = True,
    ) -> BackupOperation | None:
        """Back host pages up to storage (see `StorageTier.write_storage`); ``None`` when detached.

        ``track``: report the ended operation through `drain_backup_acks`.
        The arguments are checked whether or not a backend is attached.

        Raises:
            InvalidInputError: bad slots, tokens, ``hash_value``,
                ``hash_values`` or ``track`` (see `check_storage_args`).
            StateError: a device->host copy into some of ``host_indices`` has
                not settled (its bytes are not there yet: await its ack
                first), or a storage prefetch still fills some of them (they
                hold its tokens' KV only once it has ended, and only up to its
                ``completed_tokens``).
        """
        self._check_open()
        return self._storage.write_storage(
            host_indices,
            token_ids,
            hash_value,
            node_id=node_id,
            hash_values=hash_values,
            track=track,
        )

    def drain_backup_acks(self) -> list[BackupOperation]:
        """Tracked backups that ended since the last call, oldest first (non-blocking).

        Backups that a detach ended (or that ended before it) are reported
        too, so a caller that waits for its backups here never misses one.

        Raises:
            StateError: called off the controller's loop.
        """
        self._check_loop()
        return self._storage.drain_backup_acks()
