"""`TierController`: moves KV pages between the device, host and storage tiers.

The asyncio form of SGLang's ``HiCacheController``. One event loop owns every
piece of control state (allocators, queues, acks); the bytes move on copy
streams (`CopyStream`: CUDA streams, or ordered worker threads on a CPU) and
their completion comes back to the loop as futures. Nothing here blocks the
loop: a copy of gigabytes leaves it free to serve other requests.

On CUDA, every copy first waits for the event its caller named as ``ready``
at submission (by default one recorded in the submitting call on the
caller's current stream of the pool's device), and a copy job's slots are
released only once everything it queued has finished, whether it succeeded
or failed. See "CUDA streams and lifetimes" in the README.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import itertools
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self

import numpy as np
import torch

from tiercache._aio import check_on_loop
from tiercache._checks import check_bool, check_choice, check_instance, check_int
from tiercache._resource import AsyncResource
from tiercache._tasks import TaskGroup
from tiercache.errors import (
    BackendUnavailableError,
    ClosedError,
    ConfigError,
    InvalidInputError,
    StateError,
)
from tiercache.ledger import Lease, Ledger, PoolLedger, live_fences
from tiercache.memory.allocator import PageAllocator, check_slot_pages, page_ids
from tiercache.memory.pools import DeviceKVPool, HostKVPool
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
    collective_device,
)
from tiercache.transfer.engine import CopyEngine, TransferPlan
from tiercache.transfer.layer_done import LayerDoneCounter, LayerDoneSet
from tiercache.transfer.streams import Completion, CopyStream, new_event

#: What a caller may name as the producer (writes) or the last reader (loads)
#: of the slots it hands over: an event recorded after that work, or the
#: stream it was queued on (an event is recorded on it at submission).
Ready = torch.cuda.Event | torch.cuda.Stream | None

__all__ = [
    "Ready",
    "ControllerState",
    "ControllerStats",
    "CopyAck",
    "LoadHandle",
    "TierController",
]

logger = logging.getLogger(__name__)


class ControllerState(enum.Enum):
    CREATED = "created"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(slots=True)
class ControllerStats:
    """Counters of the device<->host half (storage counters live with the storage engine)."""

    writes: int = 0
    loads: int = 0
    write_batches: int = 0
    load_batches: int = 0
    bytes_device_to_host: int = 0
    bytes_host_to_device: int = 0
    host_full: int = 0
    device_full: int = 0
    copy_errors: int = 0
    storage_auto_detaches: int = 0


class _Completion:
    """The public completion shared by `CopyAck` and `LoadHandle`.

    The controller settles it on the loop thread once its copy has settled
    and its own bookkeeping is done (slots released, stats counted). Done
    callbacks then run at once, in registration order, before any task
    awaiting the completion resumes.
    """

    __slots__ = ("_callbacks", "_future", "_settled")

    def __init__(self, future: asyncio.Future[None]) -> None:
        self._future = future
        self._callbacks: list[Callable[[Any], None]] | None = None
        self._settled = False

    def done(self) -> bool:
        """Whether the copy has settled (succeeded, failed or was cancelled by `reset`)."""
        return self._settled

    def failed(self) -> bool:
        """Whether the copy has settled with an error (or was cancelled)."""
        return self._settled and (self._future.cancelled() or self._future.exception() is not None)

    def add_done_callback(self, fn: Callable[[Self], None]) -> None:
        """Call ``fn(self)`` on the loop thread once the copy has settled.

        Callbacks run in registration order, after the controller's
        bookkeeping for the copy and before awaiting tasks resume. Registered
        after it settled, ``fn`` runs on the next loop iteration. An exception
        from ``fn`` goes to the loop's exception handler. Loop thread only.
        """
        if self._settled:
            self._future.get_loop().call_soon(fn, self)
        elif self._callbacks is None:
            self._callbacks = [fn]
        else:
            self._callbacks.append(fn)

    async def wait(self) -> None:
        """Wait for the copy to settle; cancelling the waiter does not cancel the copy.

        Raises:
            The copy's failure (``asyncio.CancelledError`` after `reset` dropped it).
        """
        await asyncio.shield(self._future)

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.shield(self._future).__await__()

    def _settle(self, error: BaseException | None) -> None:
        """Resolve the completion and run its callbacks (loop thread, the controller only).

        Nobody but this method resolves or cancels the future (`backup` and
        `load_back` wait on a future of their own), so it carries the copy's
        outcome to everyone who awaits the completion.
        """
        if self._settled:
            return
        self._settled = True
        fut = self._future
        if error is None:
            fut.set_result(None)
        elif isinstance(error, asyncio.CancelledError):
            fut.cancel()
        else:
            fut.set_exception(error)
            fut.exception()  # reported to awaiters; nobody awaiting is fine
        callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            _run_callback(fut.get_loop(), fn, self)


def _run_callback(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Call ``fn(*args)``; an exception goes to the loop's handler, not to the caller."""
    try:
        fn(*args)
    except Exception as e:
        loop.call_exception_handler(
            {"message": f"tiercache callback {fn!r} failed", "exception": e}
        )


class CopyAck(_Completion):
    """Completion of one write (device->host) or load (host->device) operation.

    Await it (``await ack`` or ``await ack.wait()``) to wait for the bytes to
    be in place; cancelling the awaiting task does not cancel the copy.
    ``add_done_callback`` runs code once it has settled. ``host_indices`` and
    ``device_indices`` are the slots involved; the caller owns them.
    """

    __slots__ = ("device_indices", "host_indices", "kind", "node_id")

    def __init__(
        self,
        kind: Literal["write", "load"],
        node_id: int,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        future: asyncio.Future[None],
    ) -> None:
        super().__init__(future)
        self.kind = kind
        self.node_id = node_id
        self.host_indices = host_indices
        self.device_indices = device_indices

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"CopyAck({self.kind}, node_id={self.node_id}, tokens={self.host_indices.numel()}, {state})"


class LoadHandle(_Completion):
    """A started layer-by-layer load.

    ``await handle.layer(i)`` returns once layer ``i`` is on the device;
    ``await handle`` (or ``await handle.wait()``) once every layer is, and
    ``add_done_callback`` runs code then. A synchronous forward pass running in
    a worker thread calls ``handle.wait_layer(i)`` instead, and on CUDA
    ``handle.wait_layer_device(i)`` makes the compute stream wait without
    blocking the host. ``producer_id`` is the `LayerDoneCounter` set it uses.
    """

    __slots__ = ("acks", "device_indices", "host_indices", "layers", "producer_id")

    def __init__(
        self,
        producer_id: int,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layers: LayerDoneSet,
        future: asyncio.Future[None],
        acks: list[CopyAck],
    ) -> None:
        super().__init__(future)
        self.producer_id = producer_id
        self.host_indices = host_indices
        self.device_indices = device_indices
        self.layers = layers
        self.acks = acks

    @property
    def num_layers(self) -> int:
        return self.layers.num_layers

    async def layer(self, i: int) -> None:
        await self.layers.wait(i)

    def wait_layer(self, i: int, timeout: float | None = None) -> None:
        self.layers.wait_sync(i, timeout)

    def wait_layer_device(self, i: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the calling thread's current stream of the
        pool's device) wait for layer ``i`` on the GPU; see `LayerDoneSet.wait_device`."""
        self.layers.wait_device(i, stream)

    def __repr__(self) -> str:
        return f"LoadHandle(producer={self.producer_id}, tokens={self.device_indices.numel()}, done={self.done()})"


@dataclass(slots=True)
class _Operation:
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    priority: int
    ack: CopyAck
    track: bool
    host_pages: np.ndarray[Any, np.dtype[np.int64]]
    device_pages: np.ndarray[Any, np.dtype[np.int64]]
    #: CUDA: the copy stream waits for these fences before it touches the slots
    #: (the caller's ``ready``, and for a write the producers of its device
    #: pages, for a load the last readers of its device pages).
    fences: list[Any] | None = None
    #: Loads: write jobs still filling some of the host slots it reads.
    after: list[_WriteJob] | None = None


#: Page ids of a pool, one per page of some slots, in order.
_Pages = np.ndarray[Any, np.dtype[np.int64]]


@dataclass(slots=True, eq=False)
class _WriteJob:
    """A merged write, from `start_writing` until it has settled.

    ``settled`` resolves (or fails) once every byte of it is on the host;
    a load that reads any of ``host_pages`` waits for it first.
    """

    host_pages: np.ndarray[Any, np.dtype[np.int64]]
    settled: concurrent.futures.Future[None] | None = None


#: `TierController.backup` and `load_back` of at least this many slots yield to
#: the loop once before their synchronous part (checks and bookkeeping, which
#: read every slot: about a millisecond at 256k slots), so that it never runs
#: in one loop step with whatever the caller did before the call.
_YIELD_SLOTS = 1 << 16


def _is_large(indices: object) -> bool:
    return isinstance(indices, torch.Tensor) and indices.numel() >= _YIELD_SLOTS


def _op_args(priority: object, node_id: object, track: object) -> tuple[int, int | None, bool]:
    """A copy's ``priority``, ``node_id`` (or ``None``) and ``track``, checked
    before the copy takes any slot.

    Raises:
        InvalidInputError: a priority or node id that is not an int, or a
            ``track`` that is not a bool.
    """
    if priority.__class__ is not int:  # the common cases skip the full checks
        priority = check_int(priority, "priority")
    if node_id is not None and node_id.__class__ is not int:
        node_id = check_int(node_id, "node_id")
    if track.__class__ is not bool:
        track = check_bool(track, "track")
    return priority, node_id, track


def _merged(ops: list[_Operation]) -> tuple[torch.Tensor, torch.Tensor]:
    """The host and device slots of ``ops`` in priority order (lower first; stable)."""
    if len(ops) == 1:
        return ops[0].host_indices, ops[0].device_indices
    ops.sort(key=lambda o: o.priority)
    return torch.cat([o.host_indices for o in ops]), torch.cat([o.device_indices for o in ops])


def _settled(error: BaseException | None) -> concurrent.futures.Future[None]:
    """A finished future with ``error`` (or a result, when ``None``)."""
    fut: concurrent.futures.Future[None] = concurrent.futures.Future()
    fut.set_running_or_notify_cancel()
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
    return fut


def _wait_exception(fut: concurrent.futures.Future[None]) -> BaseException | None:
    """Block (a copy worker thread) until ``fut`` is done; return its exception."""
    concurrent.futures.wait([fut])
    return fut.exception()


def _mark_done(layers: LayerDoneSet, i: int) -> Callable[[], None]:
    return lambda: layers.mark_done(i)


class _HostSlots:
    """The slice of a controller its storage tier may use (`storage_tier.HostSlots`).

    The host pool, the device (for collectives), and the host half of the
    controller's `Ledger`: a storage call takes a lease on the host pages it
    reads (a backup) or fills (a prefetch, `Lease.FETCH`) while it runs, and
    frees the pages a prefetch did not fill through it. Ending a lease wakes
    the ledger's release listeners. The fault callback is a bound method of
    the controller, held weakly: the controller owns this object, and a
    strong reference back would put the controller, and the pools it holds,
    in a cycle that only the garbage collector frees. Loop thread only.
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


def _own(given: object, checked: tuple[torch.Tensor, _Pages]) -> tuple[torch.Tensor, _Pages]:
    """Checked slots (and their pages) that are not the caller's tensor ``given``.

    A queued copy reads its slots when it runs, and its ack hands them out:
    a caller that reuses its index tensor after the call must change neither.
    """
    slots, pages = checked
    return (slots.clone() if slots is given else slots), pages


def _allocator(given: object, num_slots: int, page_size: int, pool: str) -> PageAllocator:
    """The allocator given for a pool (checked to be one over its slots), or a new one.

    Raises:
        InvalidInputError: ``given`` is not a `PageAllocator`, or not one of
            ``num_slots`` slots in pages of ``page_size``.
    """
    if given is None:
        return PageAllocator(num_slots, page_size)
    alloc = check_instance(given, PageAllocator, f"{pool}_allocator")
    if alloc.page_size != page_size or alloc.num_slots != num_slots:
        raise InvalidInputError(
            f"{pool}_allocator does not match its pool ({alloc} vs {num_slots} slots)"
        )
    return alloc


class TierController(AsyncResource):
    """Moves KV pages between a device pool, a host pool and (optionally) storage.

    Verbs follow SGLang's ``HiCacheController``: `write` queues a device->host
    backup and returns the host slots; `load` queues a host->device load and
    returns the device slots; `start_writing` / `start_loading` merge what is
    queued, in priority order (lower first), into one copy on the write / load
    stream. By default a queued write starts on the next loop iteration, so
    writes issued in the same scheduler tick are merged; loads start when the
    engine calls `start_loading`, which hands back the `LoadHandle` whose
    layer futures the forward pass waits on.

    Every method must be called from the event loop that opened the controller.

    Args:
        device_pool: the L1 pool.
        host_pool: the L2 pool (the same `KVLayout` as ``device_pool``).
        device_allocator: the device pool's allocator (created when not
            given; pass the engine's own device allocator to share it).
        host_allocator: the host pool's allocator (created when not given).
        auto_start_writes: start queued writes on the next loop iteration
            (off: at `start_writing`; a `backup` starts its own write either way).
        track_acks: keep finished write acks for `drain_acks` (what an
            engine's scheduler tick polls).
        inline_copy_bytes: on a CPU device, a merged copy this small runs on
            the loop thread when its stream is idle: a thread hand-off costs
            more than moving this much (256 KiB: tens of microseconds of memcpy). 0
            disables it; CUDA never runs copies inline.
        model: the model name folded into storage keys.
        tp_rank: this tensor-parallel shard (folded into storage keys; for
            MLA only rank 0 writes to storage).
        tp_size: the number of tensor-parallel shards.
        tp_group: a ``torch.distributed`` process group over the TP ranks:
            prefetch hit counts are agreed across it (MIN).
        storage_config: prefetch / backup knobs (`StorageTierConfig`).
        tasks: the task group background work runs in (a `TierCache` passes
            its own; by default the controller makes one and closes it in
            `aclose`). A background failure is raised once, by the next
            verb that checks the controller is open or by `aclose`.

    Raises:
        ConfigError: a bad ``inline_copy_bytes``, ``auto_start_writes`` or ``track_acks``.
        InvalidInputError: pools or allocators that are not a `DeviceKVPool`,
            a `HostKVPool` and `PageAllocator` instances, or that do not match.
    """

    #: CUDA: the side stream where a caller's ready event is pinned at
    #: submission (`ready_event`); made on first use.
    _ready_stream: torch.cuda.Stream | None = None

    def __init__(
        self,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        *,
        device_allocator: PageAllocator | None = None,
        host_allocator: PageAllocator | None = None,
        auto_start_writes: bool = True,
        track_acks: bool = True,
        inline_copy_bytes: int = 256 * 1024,
        model: str = "default",
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
        storage_config: StorageTierConfig | None = None,
        tasks: TaskGroup | None = None,
    ) -> None:
        self.engine = CopyEngine(device_pool, host_pool)
        self._cuda = device_pool.device.type == "cuda"
        self.layout = device_pool.layout
        self.device_pool = device_pool
        self.host_pool = host_pool
        ps = self.layout.page_size
        self.device_allocator = _allocator(device_allocator, device_pool.num_slots, ps, "device")
        self.host_allocator = _allocator(host_allocator, host_pool.num_slots, ps, "host")
        self.auto_start_writes = check_bool(
            auto_start_writes, "auto_start_writes", error=ConfigError
        )
        self.inline_copy_bytes = check_int(
            inline_copy_bytes, "inline_copy_bytes", minimum=0, error=ConfigError
        )
        self.track_acks = check_bool(track_acks, "track_acks", error=ConfigError)
        self.state = ControllerState.CREATED
        self.stats = ControllerStats()
        #: What its copy streams and storage tier report their timings as, in
        #: `tiercache.observe` (a token, not the controller: they hold it, and
        #: holding the controller would keep it and its pools alive in a cycle).
        self.observe_source: object = object()
        # Validates model / TP fields now rather than at attach time.
        self.namespace = StorageNamespace.for_layout(
            self.layout, host_pool.host_layout, model=model, tp_rank=tp_rank, tp_size=tp_size
        )
        if tp_group is not None:
            collective_device(tp_group, device_pool.device)  # a clear ConfigError now
        self.tp_group = tp_group
        self.storage_config = storage_config or StorageTierConfig()
        self.storage: StorageTier | None = None
        self._storage_lock = asyncio.Lock()
        # The counts of the tiers detached so far, and of those being detached.
        self._past_storage = StorageTierStats()
        self._detaching: list[StorageTier] = []
        self._owns_tasks = tasks is None
        self.tasks = TaskGroup("controller") if tasks is None else tasks
        self._settle_callbacks: list[Callable[[], None]] = []
        self._idle_waiters: list[asyncio.Future[None]] = []
        self.layer_done_counter = LayerDoneCounter(self.layout.num_layers)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None  # the thread of that loop
        self._write_stream: CopyStream | None = None
        self._load_stream: CopyStream | None = None
        self._write_queue: list[_Operation] = []
        self._load_queue: list[_Operation] = []
        self._write_start_scheduled = False
        self._load_start_scheduled = False
        self._finished: deque[CopyAck] = deque()
        #: Tracked backups ended by (or before) a detach, not drained yet.
        self._detached_backups: deque[BackupOperation] = deque()
        self._inflight = 0  # copy jobs started and not yet settled on the loop
        self._closed = asyncio.Event()
        self._ids = itertools.count()
        #: Who owns every page of both pools, the leases copies and storage
        #: calls hold on them, their fences: the one caller of the allocators.
        self.ledger = Ledger(self.device_allocator, self.host_allocator)
        self.ledger.on_release(self._notify_settled)
        self._slots = _HostSlots(
            host_pool, self.ledger.host, device_pool.device, self._storage_failed
        )
        self._write_jobs: set[_WriteJob] = set()
        self._queued_write_job: _WriteJob | None = None
        #: The stream the engine's forward pass runs on (CUDA; `use_compute_stream`):
        #: the default producer and last reader of the slots it hands over.
        self.compute_stream: torch.cuda.Stream | None = None

    # -- lifecycle ------------------------------------------------------------

    async def open(self) -> Self:
        """Start the copy streams on the running loop. Called by ``async with``.

        Raises:
            StateError: already opened; ClosedError: closed.
        """
        if self.state is ControllerState.OPEN:
            raise StateError("the controller is already open")
        if self.state is not ControllerState.CREATED:
            raise ClosedError("the controller was closed; create a new one")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._write_stream = CopyStream(
            "write", self.device_pool.device, source=self.observe_source
        )
        self._load_stream = CopyStream("load", self.device_pool.device, source=self.observe_source)
        self.state = ControllerState.OPEN
        return self

    async def _aenter(self) -> None:
        await self.open()

    async def aclose(self) -> None:
        """Start what is queued, wait for every copy in flight, stop the streams.

        Idempotent. If the closing task is cancelled, the streams are still
        stopped (after their current copy) and the cancellation propagates.

        Raises:
            StateError: called off the loop that opened the controller (it
                stays open); or a background task of the controller's own task
                group failed and that failure was not raised before (a group
                passed in as ``tasks`` is closed by its owner instead).
        """
        if self.state in (ControllerState.CLOSED, ControllerState.CREATED):
            self.state = ControllerState.CLOSED
            if self._owns_tasks:
                await self.tasks.aclose()
            return
        self._check_loop()
        if self.state is ControllerState.CLOSING:
            await self._closed.wait()
            return
        self.state = ControllerState.CLOSING
        try:
            async with self._storage_lock:  # after a detach in progress
                tier, self.storage = self.storage, None
                if tier is not None:
                    await tier.stop()
            self._start_loads_now()  # loads queued for a start_loading that never came
            await self.wait_idle()
        finally:
            await self._close_streams()
        self._detached_backups.clear()  # nobody drains a closed controller
        if self._owns_tasks:
            await self.tasks.aclose()

    async def _close_streams(self) -> None:
        """Stop both copy streams (after their current copy), then mark the controller closed."""
        streams = [s for s in (self._write_stream, self._load_stream) if s is not None]

        def close_streams() -> None:
            for s in streams:
                s.close()

        closer = asyncio.ensure_future(asyncio.to_thread(close_streams))
        try:
            await asyncio.shield(closer)
        finally:
            self.state = ControllerState.CLOSED
            self._closed.set()

    @property
    def busy(self) -> bool:
        """Whether a copy is in flight, queued to start, or about to start.

        Writes queued for the next loop iteration count; loads queued for an
        engine's `start_loading` count once a start is scheduled (as
        `load_back` does). `wait_idle` returns once this is false.
        """
        return bool(self._inflight or self._write_queue or self._load_start_scheduled)

    def add_settle_callback(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn()`` each time slots may have become free.

        That is: each time a copy settles (success or failure), after the
        controller's bookkeeping for it and its acks' callbacks; after
        `free_device` / `free_host` have freed slots; and when a storage call
        releases its hold on host slots. ``fn`` runs synchronously on the loop
        thread and must not block; an exception from it goes to the loop's
        exception handler. What a caller waiting for room uses instead of
        polling.

        Returns:
            A function that removes ``fn`` (idempotent).

        Raises:
            StateError: called off the controller's loop.
        """
        self._check_loop()
        self._settle_callbacks.append(fn)

        def remove() -> None:
            if fn in self._settle_callbacks:
                self._settle_callbacks.remove(fn)

        return remove

    def _notify_settled(self) -> None:
        """Run the settle callbacks; wake `wait_idle` once nothing is in flight."""
        if self._settle_callbacks:
            loop = self._loop or asyncio.get_running_loop()
            for fn in list(self._settle_callbacks):
                _run_callback(loop, fn)
        if not self._inflight and self._idle_waiters:
            waiters, self._idle_waiters = self._idle_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    async def wait_idle(self) -> None:
        """Return once no copy is queued or in flight (copy errors are not raised here).

        Starts what is queued to start, then sleeps until the last copy in
        flight settles (woken by its completion, never by a timer).

        Raises:
            StateError: called off the controller's loop.
        """
        self._check_loop()
        while True:
            if self._write_queue:
                self._start_writes_now()
            if self._load_start_scheduled:
                self._start_loads_now()
            if not self._inflight:
                return
            assert self._loop is not None
            waiter = self._loop.create_future()
            self._idle_waiters.append(waiter)
            await waiter

    def _check_open(self) -> asyncio.AbstractEventLoop:
        """The controller's loop; raises a background failure not raised before.

        Raises:
            StateError: not open yet, called from another thread or event
                loop than the one that opened it (nothing is changed), or a
                background task failed.
            ClosedError: closed.
        """
        if self.state is not ControllerState.OPEN:
            self.tasks.raise_failure()
            if self.state is ControllerState.CREATED:
                raise StateError(
                    "the controller is not open: use `async with controller` or `await open()`"
                )
            raise ClosedError("the controller is closed")
        self._check_loop()
        self.tasks.raise_failure()
        assert self._loop is not None
        return self._loop

    def _check_loop(self) -> None:
        """Raise `StateError` when called off the loop that opened the controller.

        For the verbs that also serve a controller that is closing or closed
        (never opened: no loop to check).
        """
        if self._loop is not None:
            check_on_loop(self._loop, self._thread, "TierController")

    # -- bookkeeping ----------------------------------------------------------

    def _leases(self, op: _Operation) -> tuple[tuple[PoolLedger, _Pages, Lease], ...]:
        """What ``op`` leases: a write reads the device and fills the host, a load the reverse."""
        dev, host = self.ledger.device, self.ledger.host
        if op.ack.kind == "write":
            return (dev, op.device_pages, Lease.READ), (host, op.host_pages, Lease.FILL)
        return (host, op.host_pages, Lease.READ), (dev, op.device_pages, Lease.FILL)

    def _release(self, op: _Operation) -> None:
        """``op`` no longer uses its pages: it has settled, or `reset` dropped it.

        The release listeners are not run here: the caller runs them once,
        after every page of the job is released.
        """
        for pool, pages, kind in self._leases(op):
            pool.end_lease(pages, kind, wake=False)

    def _new_op(
        self,
        kind: Literal["write", "load"],
        host: tuple[torch.Tensor, _Pages],
        dev: tuple[torch.Tensor, _Pages],
        priority: int,
        node_id: int | None,
        track: bool,
    ) -> _Operation:
        """A new operation on ``host`` and ``dev`` (CPU slots, and their page ids; ``priority`` checked)."""
        loop = self._loop
        assert loop is not None  # the submitting verb checked the controller is open
        nid = next(self._ids) if node_id is None else node_id
        ack = CopyAck(kind, nid, host[0], dev[0], loop.create_future())
        op = _Operation(host[0], dev[0], priority, ack, track, host[1], dev[1])
        for pool, pages, lease in self._leases(op):
            pool.lease(pages, lease)
        return op

    def ready_event(self, ready: Ready, what: str = "ready") -> torch.cuda.Event | None:
        """Resolve a caller's ``ready`` into the event a copy stream will wait for.

        Public so that a facade that submits the copy later (after an await)
        can pin the ordering point at its own entry: pass the result back as
        ``ready``.

        Runs synchronously in the submitting call, on the caller's thread: the
        default is an event recorded *now* on the engine's compute stream
        (`use_compute_stream`) or, when none was named, on the caller's
        current stream of the pool's device, so the copy is ordered after
        everything queued there before it submitted. A caller's event is
        pinned now too: a side stream waits for it as recorded at this call
        and a private event is recorded after that wait, so recording the
        caller's event again later does not move the copy's ordering point.
        ``None`` on a CPU
        device, where the caller's work is done when it calls us.

        Raises:
            InvalidInputError: ``ready`` is neither ``None``, a CUDA event nor a
                CUDA stream of the pool's device, or is given for a CPU pool.
        """
        device = self.device_pool.device
        if not self._cuda:
            if ready is not None:
                raise InvalidInputError(
                    f"{what}: ready names a CUDA stream or event, but the device pool is on {device}"
                )
            return None
        if ready is None:
            ev = new_event()
            ev.record(self.compute_stream or torch.cuda.current_stream(device))
            return ev
        if isinstance(ready, torch.cuda.Event):
            side = self._ready_stream
            if side is None:
                side = self._ready_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            side.wait_event(ready)  # the event as recorded now
            ev = new_event()
            ev.record(side)
            return ev
        if isinstance(ready, torch.cuda.Stream):
            if ready.device != device:
                raise InvalidInputError(
                    f"{what}: ready is a stream of {ready.device}, the pool is on {device}"
                )
            ev = new_event()
            ev.record(ready)
            return ev
        raise InvalidInputError(
            f"{what}: ready must be a torch.cuda.Event, a torch.cuda.Stream or None, "
            f"got {type(ready).__name__}"
        )

    def use_compute_stream(self, stream: torch.cuda.Stream | None) -> None:
        """Name the stream the engine's forward pass (attention) runs on; ``None``: the caller's current one.

        Every ``ready`` left to its default is then an event recorded on that
        stream, not on the calling thread's current stream (the loop thread's,
        for the copies the cache starts itself: write-backs, write-through,
        the fences of slots it frees).

        Raises:
            InvalidInputError: not a CUDA stream of the pool's device (or any
                stream on a CPU pool).
        """
        if stream is not None:
            device = self.device_pool.device
            if not self._cuda or not isinstance(stream, torch.cuda.Stream):
                raise InvalidInputError(
                    f"use_compute_stream: needs a torch.cuda.Stream of the pool's device ({device})"
                )
            if stream.device != device:
                raise InvalidInputError(
                    f"use_compute_stream: a stream of {stream.device}, the pool is on {device}"
                )
        self.compute_stream = stream

    def _pinned_indices(self, indices: torch.Tensor) -> torch.Tensor:
        """CUDA: ``indices`` in pinned memory, so the plan's host->device index copy
        is asynchronous on the copy stream (not a pageable copy that waits)."""
        if self._cuda and not indices.is_pinned():
            return indices.pin_memory()
        return indices

    # -- device -> host -------------------------------------------------------

    def submit_write(
        self,
        device_indices: torch.Tensor,
        priority: int = 0,
        node_id: int | None = None,
        *,
        track: bool = True,
        ready: Ready = None,
    ) -> CopyAck | None:
        """Queue a backup of ``device_indices`` into newly allocated host slots.

        Args:
            device_indices: the page-aligned device slots to back up.
            priority: merge order within one copy (lower first).
            node_id: the id reported on the ack (one is made up when ``None``).
            track: report the finished ack through `drain_acks`.
            ready: CUDA only: the producer of the KV in ``device_indices``: an
                event recorded after the kernels that wrote it, or the stream
                they were queued on (an event is recorded on it now). By
                default an event is recorded now on the calling thread's
                current stream of the pool's device. The copy stream waits for
                it before reading a byte. See "CUDA streams and lifetimes".

        Returns:
            The ack (with ``host_indices``), or ``None`` when host memory is full.
            The caller owns the host slots (free them with `free_host`).

        Raises:
            InvalidInputError: bad device indices or ``ready``, a ``priority``
                or ``node_id`` that is not an int, a ``track`` that is not a bool.
            StateError: a load (queued or in flight) still fills some of
                ``device_indices``: back them up once its ack has settled.
            ClosedError / StateError: not open.
        """
        self._check_open()
        dev = _own(
            device_indices,
            check_slot_pages(
                device_indices, self.layout.page_size, self.device_pool.num_slots, "device_indices"
            ),
        )
        device = self.ledger.device
        if not device.allocated(dev[1]):
            raise InvalidInputError("device_indices include slots that are not allocated")
        if device.leased(dev[1], Lease.FILL):
            raise StateError(
                "a load still fills some of device_indices: back them up once its ack has settled"
            )
        if device.spoiled(dev[1]):
            raise StateError(
                "some of device_indices hold no KV (the load into them failed): nothing to back up"
            )
        priority, node_id, track = _op_args(priority, node_id, track)
        ready_ev = self.ready_event(ready, "submit_write")
        host = self.ledger.host.alloc(dev[0].numel())
        if host is None:
            self.stats.host_full += 1
            return None
        try:
            op = self._new_op("write", host, dev, priority, node_id, track)
        except BaseException:
            self.ledger.host.free(host[1])
            raise
        # The producers of the device pages (recorded when they were inserted)
        # travel with them: the copy waits for them as well as for ``ready``.
        op.fences = live_fences((ready_ev, *device.producers(dev[1])))
        job = self._queued_write_job
        if job is None:
            job = self._queued_write_job = _WriteJob(op.host_pages)
        else:
            job.host_pages = np.concatenate([job.host_pages, op.host_pages])
        self._write_queue.append(op)
        self.stats.writes += 1
        if self.auto_start_writes and not self._write_start_scheduled:
            self._schedule_start("write")
        return op.ack

    def _schedule_start(self, kind: Literal["write", "load"]) -> None:
        """Start what is queued of ``kind`` on the next loop iteration (once, however often called)."""
        assert self._loop is not None
        if kind == "write":
            if not self._write_start_scheduled:
                self._write_start_scheduled = True
                self._loop.call_soon(self._start_writes_now)
        elif not self._load_start_scheduled:
            self._load_start_scheduled = True
            self._loop.call_soon(self._start_loads_now)

    def write(
        self,
        device_indices: torch.Tensor,
        priority: int = 0,
        node_id: int | None = None,
        *,
        ready: Ready = None,
    ) -> torch.Tensor | None:
        """The seed's verb: queue a backup; return the host slots or ``None`` when host memory is full.

        ``ready`` is `submit_write`'s. Its completion comes out of
        `drain_acks`; `submit_write` returns an awaitable ack instead.
        """
        ack = self.submit_write(device_indices, priority, node_id, ready=ready)
        return None if ack is None else ack.host_indices

    def start_writing(self) -> int:
        """Start every queued write now, merged into one copy; returns how many were started."""
        self._check_open()
        return self._start_writes_now()

    def _start_writes_now(self) -> int:
        self._write_start_scheduled = False
        ops, self._write_queue = self._write_queue, []
        wjob, self._queued_write_job = self._queued_write_job, None
        if not ops or self._write_stream is None:
            return 0
        assert wjob is not None
        host, dev = _merged(ops)
        readies = live_fences(ev for o in ops for ev in o.fences or ())
        pinned = self._pinned_indices
        stream = self._write_stream
        engine = self.engine

        def job() -> Completion:
            for ev in readies:
                stream.wait_for(ev)
            # Planned here, inside the copy stream's context: the device index
            # tensor goes up from pinned memory on the copy stream, after the
            # waits above, never on the caller's stream.
            plan = engine.plan(host, pinned(dev), checked=True)
            engine.backup_all_layers(plan)
            # The plan's index tensors stay alive until the copy has settled.
            return Completion([(stream.record_event(), None)], keep=plan)

        nbytes = host.numel() * self.layout.token_bytes
        self.stats.write_batches += 1
        self.stats.bytes_device_to_host += nbytes
        self._write_jobs.add(wjob)
        wjob.settled = self._launch(stream, job, ops, nbytes, wjob=wjob)
        return len(ops)

    # -- host -> device -------------------------------------------------------

    def submit_load(
        self,
        host_indices: torch.Tensor,
        priority: int = 0,
        node_id: int | None = None,
        *,
        track: bool = True,
        ready: Ready = None,
    ) -> CopyAck | None:
        """Queue a load of ``host_indices`` into newly allocated device slots.

        The copy starts at the next `start_loading`. When a write into some of
        ``host_indices`` is still queued or running, the load is ordered after
        it (it waits for that write's bytes to be on the host; if the write
        fails, so does the load).

        Args:
            host_indices: the page-aligned host slots to load.
            priority: merge order within one copy (lower first).
            node_id: the id reported on the ack.
            track: kept for symmetry with `submit_write` (loads are not drained).
            ready: CUDA only: the last readers of the device slots the load
                will fill (slots freed just before may still be read by queued
                attention kernels): an event recorded after them or their
                stream. By default an event is recorded now on the calling
                thread's current stream of the pool's device. Fences recorded
                by `free_device` are waited for as well.

        Returns:
            The ack (with ``device_indices``), or ``None`` when device memory is full.

        Raises:
            InvalidInputError: bad host indices or ``ready``, a ``priority``
                or ``node_id`` that is not an int, a ``track`` that is not a bool.
            StateError: a storage prefetch still fills some of
                ``host_indices`` (load them once it has ended).
            ClosedError / StateError: not open.
        """
        self._check_open()
        host = _own(
            host_indices,
            check_slot_pages(
                host_indices, self.layout.page_size, self.host_pool.num_slots, "host_indices"
            ),
        )
        pool = self.ledger.host
        if not pool.allocated(host[1]):
            raise InvalidInputError("host_indices include slots that are not allocated")
        if pool.leased(host[1], Lease.FETCH):
            raise StateError(
                "a storage prefetch still fills some of host_indices: load them once it has ended"
            )
        if pool.spoiled(host[1]):
            raise StateError(
                "some of host_indices hold no KV (the copy into them failed): "
                "they cannot be loaded; free them"
            )
        priority, node_id, track = _op_args(priority, node_id, track)
        ready_ev = self.ready_event(ready, "submit_load")
        device = self.ledger.device
        dev = device.alloc(host[0].numel())
        if dev is None:
            self.stats.device_full += 1
            return None
        try:
            op = self._new_op("load", host, dev, priority, node_id, track)
        except BaseException:
            device.free(dev[1])
            raise
        # The last readers of the device pages it overwrites (their fences left
        # the ledger with it; a load that fails gives them back).
        op.fences = live_fences((ready_ev, *device.take_fences(dev[1])))
        if pool.leased(op.host_pages, Lease.FILL):
            jobs = list(self._write_jobs)
            if self._queued_write_job is not None:
                jobs.append(self._queued_write_job)
            op.after = [j for j in jobs if np.isin(op.host_pages, j.host_pages).any()]
        self._load_queue.append(op)
        self.stats.loads += 1
        return op.ack

    def load(
        self,
        host_indices: torch.Tensor,
        priority: int = 0,
        node_id: int | None = None,
        *,
        ready: Ready = None,
    ) -> torch.Tensor | None:
        """The seed's verb: queue a load; return the device slots or ``None`` when device memory is full.

        ``ready`` is `submit_load`'s.
        """
        ack = self.submit_load(host_indices, priority, node_id, ready=ready)
        return None if ack is None else ack.device_indices

    def start_loading(self) -> LoadHandle | None:
        """Start every queued load now, merged, layer by layer on the load stream.

        Never blocks on the GPU: on CUDA it hands the copy to the load stream's
        worker and returns.

        Returns:
            The `LoadHandle`, or ``None`` when nothing was queued.
        """
        self._check_open()
        return self._start_loads_now()

    def _start_loads_now(self) -> LoadHandle | None:
        self._load_start_scheduled = False
        ops, self._load_queue = self._load_queue, []
        loop, stream = self._loop, self._load_stream
        if not ops or stream is None or loop is None:
            return None
        writes = self._writes_read_by(ops)
        host, dev = _merged(ops)
        readies = live_fences(ev for o in ops for ev in o.fences or ())
        producer_id, layers = self.layer_done_counter.update_producer(
            loop, cuda=stream.is_cuda, device=self.device_pool.device
        )
        job = self._load_job(stream, host, dev, readies, writes, layers)
        nbytes = host.numel() * self.layout.token_bytes
        self.stats.load_batches += 1
        self.stats.bytes_host_to_device += nbytes
        handle = LoadHandle(
            producer_id, host, dev, layers, loop.create_future(), [o.ack for o in ops]
        )
        # Never inline while a write it waits for runs: that wait would block the loop.
        inline_ok = all(w.done() for w in writes)
        self._launch(stream, job, ops, nbytes, handle=handle, inline_ok=inline_ok)
        return handle

    def _writes_read_by(self, ops: list[_Operation]) -> list[concurrent.futures.Future[None]]:
        """The completions of the write jobs still filling host slots that ``ops`` read.

        Starts those writes first if they are still queued (the loads read
        what they put on the host).
        """
        after: list[_WriteJob] = []
        for o in ops:
            for j in o.after or ():
                if j not in after:
                    after.append(j)
        if any(j.settled is None for j in after):
            self._start_writes_now()
        return [j.settled for j in after if j.settled is not None]

    def _load_job(
        self,
        stream: CopyStream,
        host: torch.Tensor,
        dev: torch.Tensor,
        readies: list[torch.cuda.Event],
        writes: list[concurrent.futures.Future[None]],
        layers: LayerDoneSet,
    ) -> Callable[[], Completion]:
        """The copy job of one merged load, run by the load stream, layer by layer.

        It waits for the writes it reads and for ``readies``, then loads each
        layer and reports it to ``layers`` (on CUDA: once its event fires).
        On failure the stream settles before the failure is reported.
        """
        engine = self.engine
        pinned = self._pinned_indices

        def job() -> Completion:
            try:
                # The last readers of the slots first: whatever fails below,
                # no later copy on this stream overtakes them.
                for r in readies:
                    stream.wait_for(r)
                for w in writes:
                    # A backup into these host slots: its bytes first (rare:
                    # the index only hands out host slots whose write settled).
                    if _wait_exception(w) is not None:
                        raise StateError("the backup into these host slots failed")
                plan = engine.plan(host, pinned(dev), checked=True)
                steps: list[tuple[torch.cuda.Event | None, Callable[[], None] | None]] = []

                def landed(i: int) -> None:  # layers 0..i are in place (CPU) or queued
                    ev = stream.record_event()
                    if ev is None:
                        layers.mark_done(i)  # CPU: the bytes are in place
                    else:
                        layers.mark_recorded(i, ev)
                        steps.append((ev, _mark_done(layers, i)))

                engine.load_all_layers(plan, landed)
            except BaseException as e:
                stream.settle()  # what was queued finishes before anyone frees the slots
                layers.mark_failed(e, settled=True)  # queued layers landed
                raise
            return Completion(steps, on_error=layers.mark_failed, keep=plan)

        return job

    # -- completion -----------------------------------------------------------

    def _launch(
        self,
        stream: CopyStream,
        job: Callable[[], Completion],
        ops: list[_Operation],
        nbytes: int,
        *,
        wjob: _WriteJob | None = None,
        handle: LoadHandle | None = None,
        inline_ok: bool = True,
    ) -> concurrent.futures.Future[None]:
        """Run ``job`` on ``stream``; settle ``ops`` (and ``handle``) on the loop once it has settled.

        A small CPU copy on an idle stream runs here; otherwise the stream's
        worker runs it. Either way the job is settled on the loop one hop
        later (never inside this call: callers of the start verbs see their
        acks settle on a later iteration, as with a copy off the loop).

        Returns:
            The job's thread-safe future, resolved once every byte the job
            queued has landed (or, on failure, once the stream has settled
            after it).
        """
        loop = self._loop
        assert loop is not None
        if inline_ok and nbytes <= self.inline_copy_bytes and not stream.is_cuda and stream.idle:
            # A copy this small takes less time than waking the worker
            # thread and the loop again: run it here.
            cf: concurrent.futures.Future[None] = concurrent.futures.Future()
            cf.set_running_or_notify_cancel()
            error: BaseException | None = None
            try:
                stream.run_inline(job)
            except BaseException as e:
                error = e
                cf.set_exception(e)
            else:
                cf.set_result(None)
            self._inflight += 1
            loop.call_soon(self._finish, error, ops, wjob, handle)
            return cf
        try:
            cf = stream.submit(job)
        except BaseException as e:
            if handle is not None:
                handle.layers.mark_failed(e)
            self._inflight += 1
            loop.call_soon(self._finish, e, ops, wjob, handle)
            cf = concurrent.futures.Future()
            cf.set_running_or_notify_cancel()
            cf.set_exception(e)
            return cf
        self._inflight += 1

        def settled(f: concurrent.futures.Future[None]) -> None:  # a worker thread
            error = asyncio.CancelledError() if f.cancelled() else f.exception()
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._finish, error, ops, wjob, handle)

        cf.add_done_callback(settled)
        return cf

    def _finish(
        self,
        error: BaseException | None,
        ops: list[_Operation],
        wjob: _WriteJob | None,
        handle: LoadHandle | None,
    ) -> None:
        """A job has settled: release its pages, then resolve its acks (loop thread).

        Every page of the job is released before the first callback runs, and
        the settle callbacks run last.
        """
        self._inflight -= 1
        if error is not None:
            self.stats.copy_errors += 1
            logger.warning(
                "a %s copy of %d operation(s) failed: %r", ops[0].ack.kind, len(ops), error
            )
        if wjob is not None:
            self._write_jobs.discard(wjob)
            # The stream's future keeps the callback that settled it, and that
            # callback refers to this job: a cycle through the controller (and
            # its pools) that only the garbage collector would free. A settled
            # copy of the future carries the outcome on instead.
            wjob.settled = _settled(error)
        for op in ops:
            self._release(op)
            self._record_outcome(op, error)
        tracked = self.track_acks
        for op in ops:
            op.ack._settle(error)
            if tracked and op.track and wjob is not None:
                self._finished.append(op.ack)
        if handle is not None:
            handle._settle(error)
        self._notify_settled()

    def _record_outcome(self, op: _Operation, error: BaseException | None) -> None:
        """Write what ``op``'s copy did to its pages' bytes into the ledger.

        A copy that failed leaves its destination without the KV (a load or a
        backup of it is refused until it is filled again or freed). A failed
        load gives back the reader fences it took: it may have failed before
        its stream waited for them, and the pages' next fill must still wait.
        A write that landed ends its device pages' producers: their bytes
        have left the device.
        """
        dev, host = self.ledger.device, self.ledger.host
        if op.ack.kind == "write":
            if error is None:
                host.filled(op.host_pages)
                dev.copied_out(op.device_pages)
            else:
                host.spoil(op.host_pages)
        elif error is None:
            dev.filled(op.device_pages)
        else:
            dev.spoil(op.device_pages)
            for ev in op.fences or ():
                dev.add_fence(op.device_pages, ev)

    def drain_acks(self) -> list[CopyAck]:
        """Finished write acks since the last call, oldest first (non-blocking).

        What an engine's scheduler tick polls instead of awaiting each ack.

        Raises:
            StateError: called off the controller's loop.
        """
        self._check_loop()
        out = list(self._finished)
        self._finished.clear()
        return out

    # -- cancel-safe coroutines -----------------------------------------------

    async def backup(
        self, device_indices: torch.Tensor, priority: int = 0, *, ready: Ready = None
    ) -> torch.Tensor | None:
        """Copy device slots into new host slots and wait for the bytes.

        ``ready`` is `submit_write`'s (the producer of the KV; default: the
        caller's current stream when this is called).

        Returns:
            The host slots (the caller owns them), or ``None`` when host memory is full.

        The write starts on the next loop iteration, merged with the writes
        queued by then, also when ``auto_start_writes`` is off (as `load_back`
        starts its load without waiting for `start_loading`).

        Cancelling the caller does not stop the copy; its host slots are freed
        when it finishes, so nothing leaks. A failed copy frees them and raises.

        With 65,536 slots or more, the call yields to the loop once before it
        queues the copy (the checks read every slot), so that this work and
        the caller's own before the call never stall the loop together.
        ``ready`` is still resolved when called.
        """
        if _is_large(device_indices):
            ready = self.ready_event(ready, "backup")  # ordered after what came before the call
            await asyncio.sleep(0)
        ack = self.submit_write(device_indices, priority, track=False, ready=ready)
        if ack is None:
            return None
        self._schedule_start("write")  # also with auto_start_writes off: nobody else may
        host = self.ledger.host
        await self._await_or_release(ack, lambda: host.free(host.pages(ack.host_indices)))
        return ack.host_indices

    async def load_back(
        self, host_indices: torch.Tensor, priority: int = 0, *, ready: Ready = None
    ) -> torch.Tensor | None:
        """Load host slots into new device slots and wait for all layers.

        ``ready`` is `submit_load`'s (the last readers of recycled device
        slots; default: the caller's current stream when this is called).

        The load starts on the next loop iteration, merged with the loads
        other tasks queue in the same iteration (as writes are).

        Returns:
            The device slots (the caller owns them), or ``None`` when device memory is full.

        Cancel-safe like `backup`: the device slots of an abandoned load are
        freed once its copy finishes. Large loads yield once first, as in `backup`.
        """
        if _is_large(host_indices):
            ready = self.ready_event(ready, "load_back")
            await asyncio.sleep(0)
        ack = self.submit_load(host_indices, priority, track=False, ready=ready)
        if ack is None:
            return None
        self._schedule_start("load")
        await self._await_or_release(ack, lambda: self._free_failed_load(ack))
        return ack.device_indices

    def _free_failed_load(self, ack: CopyAck) -> None:
        """Free the device slots of a load nobody takes, behind a fence on the compute stream.

        Its layers that landed may be read by attention still queued there
        (the forward pass waited for them layer by layer): the next fill of
        those slots waits for it (`use_compute_stream`; default: the calling
        thread's current stream).
        """
        dev = self.ledger.device
        dev.free(dev.pages(ack.device_indices), fence=self.ready_event(None, "load_back"))

    async def _await_or_release(self, ack: CopyAck, release: Callable[[], None]) -> None:
        """Wait for the ack of a `backup` / `load_back`; on any error, ``release`` its slots.

        It waits on a future of its own that the ack's first done callback
        resolves, not through a shield: the task wakes on the iteration after
        the copy settled, not one later. Cancelling it cancels only that
        waiter, never the ack, which others may hold (the `LoadHandle` a
        load was merged into lists it) and which goes on to report its copy.
        The ack still settles (and runs ``release``) once its copy has.
        Cancelled after the copy settled (the cancellation came before this
        task resumed), it releases at once: a done callback would run on the
        next iteration, after whatever runs before it (a `reset`, and whoever
        takes the slots next).
        """
        waiter = ack._future.get_loop().create_future()

        def wake(settled: CopyAck) -> None:
            if waiter.done():  # the waiting task was cancelled
                return
            fut = settled._future
            if fut.cancelled():
                waiter.cancel()
            elif (error := fut.exception()) is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(None)

        ack.add_done_callback(wake)
        try:
            await waiter
        except asyncio.CancelledError:
            if ack.done():
                release()
            else:
                ack.add_done_callback(lambda _a: release())
            raise
        except BaseException:
            release()
            raise

    # -- freeing slots and reset ----------------------------------------------

    def ack_busy(self, pool: Literal["device", "host"], indices: torch.Tensor) -> bool:
        """Whether any page of ``indices`` has a copy queued or in flight (or a storage hold).

        Raises:
            InvalidInputError: an unknown pool, or bad slots for that pool.
            StateError: called off the controller's loop.
        """
        self._check_loop()
        check_choice(pool, ("device", "host"), "pool")
        books = self.ledger.device if pool == "device" else self.ledger.host
        return books.leased(
            check_slot_pages(indices, self.layout.page_size, books.num_slots, "indices")[1]
        )

    def free_device(
        self, device_indices: torch.Tensor, *, ready: Ready = None, checked: bool = False
    ) -> int:
        """Free device slots (their host copies, if any, stay). Returns slots freed.

        ``ready`` (CUDA only): the last readers of the slots, as an event or
        stream (default: the calling thread's current stream of the pool's
        device, recorded now). The next load's copy stream waits for it before
        it overwrites any freed slot. ``checked``: the caller already
        validated ``device_indices`` with `check_slot_indices` against the
        device pool (CPU int64, aligned, in range): skip that pass.
        Allocation state is always checked, before the fence is recorded: a
        refused call leaves no fence and wakes no waiter.

        Raises:
            StateError: a copy of those slots is queued or in flight.
            InvalidInputError / DoubleFreeError: bad or unallocated slots, bad ``ready``.
        """
        self._check_open()
        if checked:
            dev, pages = device_indices, page_ids(device_indices, self.layout.page_size)
        else:
            dev, pages = check_slot_pages(
                device_indices, self.layout.page_size, self.device_pool.num_slots, "device_indices"
            )
        if self.ledger.device.leased(pages):
            raise StateError("device slots with a copy in flight cannot be freed; await its ack")
        # The ledger refuses a double free before it changes anything: only
        # then is the fence kept (on the freed pages) and are the waiters woken.
        self.ledger.device.free(pages, fence=self.ready_event(ready, "free_device"))
        return int(dev.numel())

    def fence_device_reads(self, ready: Ready = None) -> None:
        """Order the next load after the readers of device slots freed now (CUDA; else no-op).

        Call it when freeing device slots through the allocator directly while
        kernels that read them may still be queued: ``ready`` names those
        readers (an event or their stream; default: the calling thread's
        current stream of the pool's device, recorded now). Every load that
        starts before it has finished waits for it (the ledger drops it once
        it has).

        Raises:
            InvalidInputError: bad ``ready``.
            StateError: called off the controller's loop.
        """
        self._check_loop()
        self.ledger.device.add_fence(None, self.ready_event(ready, "fence_device_reads"))

    def free_host(self, host_indices: torch.Tensor) -> int:
        """Free host slots. Returns slots freed.

        Raises:
            StateError: a copy of those slots is queued or in flight, or a
                storage prefetch or backup still uses them.
            InvalidInputError / DoubleFreeError: bad or unallocated slots.
        """
        self._check_open()
        host, pages = check_slot_pages(
            host_indices, self.layout.page_size, self.host_pool.num_slots, "host_indices"
        )
        self.ledger.host.free(pages)  # refuses slots a copy or storage call leases
        return int(host.numel())

    async def reset(self) -> None:
        """Wait for every copy and storage backup, terminate every prefetch, then free every slot.

        Every device and host slot is freed, those of prefetches that ended
        before included: nothing still writes or reads a slot once it is free.
        The completed prefixes of those prefetches no longer count against
        ``prefetch_capacity_tokens`` (collecting them later hands nothing over).
        """
        self._check_open()
        while True:
            await self.wait_idle()
            tier = self.storage
            if tier is None or not tier.busy:
                break
            await tier.terminate_all()
        if tier is not None:
            tier.forget_uncollected()
        for op in self._load_queue:
            self._release(op)
            op.ack._settle(asyncio.CancelledError())
        self._load_queue.clear()
        self._finished.clear()
        self.ledger.device.reset()
        self.ledger.host.reset()
        self.layer_done_counter.reset()

    def plan(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> TransferPlan:
        """Validate a host/device pairing (see `CopyEngine.plan`)."""
        return self.engine.plan(host_indices, device_indices)

    # -- storage (L3) -----------------------------------------------------------

    @property
    def storage_attached(self) -> bool:
        return self.storage is not None

    def storage_stats(self) -> StorageTierStats:
        """The storage counters of every backend attached so far, summed.

        Detaching a backend (by hand or by the ``auto_detach`` fault policy)
        keeps its counts: these totals never go down, as the monitoring
        counters built on them must not.
        """
        total = StorageTierStats()
        total.add(self._past_storage)
        for tier in (*self._detaching, self.storage):
            if tier is not None:
                total.add(tier.stats)
        return total

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
        async with self._storage_lock:
            if self.storage is not None:
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
                self._check_open()
                self.storage = StorageTier(
                    self._slots,
                    self.tasks,
                    opened,
                    self.namespace,
                    self.storage_config,
                    owns_backend=owns,
                    tp_group=self.tp_group,
                    write_enabled=not (self.layout.mla and self.namespace.tp_rank != 0),
                    source=self.observe_source,
                )
            except BaseException:
                if owns:
                    await opened.aclose()
                raise
            logger.info("storage backend %s attached", opened.name)
            return opened

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
        async with self._storage_lock:
            if tier is not None and self.storage is not tier:
                return False
            tier, self.storage = self.storage, None
            if tier is None:
                return False
            self._detaching.append(tier)
            try:
                await tier.stop()
            finally:
                self._detaching.remove(tier)
                self._past_storage.add(tier.stats)
            # Tracked backups that ended (the detach ended those in flight)
            # are still reported once, by `drain_backup_acks`.
            self._detached_backups.extend(tier.drain_backup_acks())
            logger.info("storage backend %s detached", tier.backend.name)
            return True

    def _storage_failed(self, tier: StorageTier) -> None:
        """`_HostSlots.storage_failed`: count it, detach ``tier`` in the task group."""
        self.stats.storage_auto_detaches += 1
        if self.state is ControllerState.OPEN:  # closing stops the tier anyway
            self.tasks.spawn(self.detach_storage_backend(tier=tier), "the automatic storage detach")

    def _tier(self) -> StorageTier:
        self._check_open()
        if self.storage is None:
            raise BackendUnavailableError("no storage backend is attached")
        return self.storage

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
        host, tokens = check_storage_args(
            self._slots, self.namespace, host_indices, token_ids, last_hash, fill=True
        )
        cached_tokens = check_cached_tokens(cached_tokens, self.layout.page_size)
        if self.storage is None:
            return None
        host = host.clone() if host is host_indices else host  # it fills them later
        return self.storage.prefetch(
            request_id, host, tokens, last_hash, cached_tokens=cached_tokens, checked=True
        )

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
        cached_tokens = check_cached_tokens(cached_tokens, self.layout.page_size)
        if self.storage is not None:
            self.storage.abstain(cached_tokens)

    def prefetch_rate_limited(self) -> bool:
        return self.storage is not None and self.storage.rate_limited()

    async def terminate_prefetch(self, operation: PrefetchOperation) -> tuple[int, list[str]]:
        """Stop a prefetch; return ``(completed_tokens, hash_values)`` (see `StorageTier.terminate_prefetch`).

        Works after a detach too (the operation is already ended then).

        Raises:
            InvalidInputError: ``operation`` is not a `PrefetchOperation`
                (`prefetch` returns ``None`` when it started nothing).
        """
        if not isinstance(operation, PrefetchOperation):
            raise InvalidInputError(
                f"operation must be a PrefetchOperation, got {type(operation).__name__}"
            )
        tier = self.storage
        if tier is None:
            await operation.wait()
            return operation.take_completed()
        return await tier.terminate_prefetch(operation)

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
        if self.storage is None:
            return None
        # It reads them batch by batch, later: the caller may reuse its own at once.
        host = host.clone() if host is host_indices else host
        return self.storage.write_storage(
            host,
            tokens,
            hash_value,
            node_id=node_id,
            hash_values=None if hash_values is None else list(hash_values),
            track=track,
            checked=True,
        )

    def drain_backup_acks(self) -> list[BackupOperation]:
        """Tracked backups that ended since the last call, oldest first (non-blocking).

        Backups that a detach ended (or that ended before it) are reported
        too, so a caller that waits for its backups here never misses one.

        Raises:
            StateError: called off the controller's loop.
        """
        self._check_loop()
        out = list(self._detached_backups)
        self._detached_backups.clear()
        if self.storage is not None:
            out.extend(self.storage.drain_backup_acks())
        return out

    def __repr__(self) -> str:
        return f"TierController({self.layout.describe()}, state={self.state.value})"
