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

The controller keeps the verbs and checks their arguments before anything
changes; the work is done beside it: the write and load queues, jobs and
streams by `CopyScheduler` (copy_scheduler.py), the storage tier and its
verbs by `StorageLink` and `StorageVerbs` (storage_link.py), the resolution
of ``ready`` by `ReadyFences` (ready_fences.py). `CopyAck`, `LoadHandle`
and `ControllerStats` live in acks.py and are re-exported here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import threading
from collections.abc import Callable
from typing import Any, Literal, Self

import torch

from tiercache._aio import check_on_loop
from tiercache._checks import check_bool, check_choice, check_instance, check_int
from tiercache._resource import AsyncResource
from tiercache._tasks import TaskGroup
from tiercache.acks import ControllerStats, CopyAck, LoadHandle, await_or_release
from tiercache.copy_scheduler import CopyScheduler, Pages
from tiercache.errors import ClosedError, ConfigError, InvalidInputError, StateError
from tiercache.ledger import Lease, Ledger, PoolLedger
from tiercache.memory.allocator import PageAllocator, check_slot_pages, copy_slots, page_ids
from tiercache.memory.pools import DeviceKVPool, HostKVPool
from tiercache.ready_fences import Ready, ReadyFences
from tiercache.storage.keys import StorageNamespace
from tiercache.storage_link import StorageLink, StorageVerbs
from tiercache.storage_tier import StorageTierConfig, collective_device
from tiercache.transfer.engine import CopyEngine, TransferPlan
from tiercache.transfer.layer_done import LayerDoneCounter

__all__ = [
    "Ready",
    "ControllerState",
    "ControllerStats",
    "CopyAck",
    "LoadHandle",
    "TierController",
]


class ControllerState(enum.Enum):
    CREATED = "created"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


#: `TierController.backup` and `load_back` of at least this many slots yield to
#: the loop before their synchronous part, and once more between its two
#: halves (`_checked_apart`): the check of the caller's slots, which reads
#: every one (about a millisecond at 256k slots), and the bookkeeping. Neither
#: then runs in one loop step with whatever the caller did before the call,
#: nor with the other.
_YIELD_SLOTS = 1 << 16


def _is_large(indices: object) -> bool:
    return isinstance(indices, torch.Tensor) and indices.numel() >= _YIELD_SLOTS


@dataclasses.dataclass(frozen=True, slots=True)
class _Checked:
    """Slots that passed `check_slot_pages`, copied (ours, not the caller's),
    with their page ids: `_copy_source` takes them without reading them again."""

    slots: torch.Tensor
    pages: Pages


async def _checked_apart(given: object, page_size: int, num_slots: int, what: str) -> _Checked:
    """The first half of a large copy verb, in its own loop step: ``given`` checked
    and copied (a pure function of the caller's tensor), then one more yield
    before the bookkeeping, which decides on the page ids alone (the caller's
    tensor is not read again: changing it meanwhile changes nothing).

    Raises:
        InvalidInputError: bad slots (as `check_slot_pages`).
    """
    slots, pages = check_slot_pages(given, page_size, num_slots, what)
    own = _Checked(copy_slots(slots), pages)
    await asyncio.sleep(0)
    return own


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


#: Why a copy refuses the slots it reads: (the name of its argument, the lease
#: of a copy still filling them, what it says then, what it says of spoiled slots).
_REFUSALS: dict[str, tuple[str, Lease, str, str]] = {
    "write": (
        "device_indices",
        Lease.FILL,
        "a load still fills some of device_indices: back them up once its ack has settled",
        "some of device_indices hold no KV (the load into them failed): nothing to back up",
    ),
    "load": (
        "host_indices",
        Lease.FETCH,
        "a storage prefetch still fills some of host_indices: load them once it has ended",
        "some of host_indices hold no KV (the copy into them failed): "
        "they cannot be loaded; free them",
    ),
}


def _copy_source(
    books: PoolLedger, given: object, page_size: int, kind: Literal["write", "load"]
) -> tuple[torch.Tensor, Pages]:
    """The slots a copy reads, and their pages, checked before anything changes.

    The slots returned may be the caller's tensor ``given``: a copy that is
    queued takes them through `_own`.

    Raises:
        InvalidInputError: bad slots, or slots that are not allocated.
        StateError: a copy or a prefetch still fills some of them, or a
            failed copy left some without their KV.
    """
    name, filling, busy, spoiled = _REFUSALS[kind]
    if isinstance(given, _Checked):
        slots, pages = given.slots, given.pages
    else:
        slots, pages = check_slot_pages(given, page_size, books.num_slots, name)
    if not books.allocated(pages):
        raise InvalidInputError(f"{name} include slots that are not allocated")
    if books.leased(pages, filling):
        raise StateError(busy)
    if books.spoiled(pages):
        raise StateError(spoiled)
    return slots, pages


def _own(source: tuple[torch.Tensor, Pages], given: object) -> tuple[torch.Tensor, Pages]:
    """``source`` (from `_copy_source`) with slots of its own where they are the caller's
    tensor ``given``, which it may reuse after the call: a queued copy reads them
    when it runs, and its ack hands them out."""
    slots, pages = source
    return (copy_slots(slots) if slots is given else slots), pages


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


class TierController(StorageVerbs, AsyncResource):
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
        inline_copy_bytes: on a CPU device, a copy this small runs on the
            loop thread (a `backup` / `load_back` in the call; a merged copy
            when its stream is idle): handing it to the stream's thread and
            back through the loop costs about 0.2 ms, and 1 MiB takes 20 us
            (cached) to 0.25 ms (cold, p99) of memcpy on a 2-core machine. 0
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

    def __init__(
        self,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        *,
        device_allocator: PageAllocator | None = None,
        host_allocator: PageAllocator | None = None,
        auto_start_writes: bool = True,
        track_acks: bool = True,
        inline_copy_bytes: int = 1 << 20,
        model: str = "default",
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
        storage_config: StorageTierConfig | None = None,
        tasks: TaskGroup | None = None,
    ) -> None:
        self.engine = CopyEngine(device_pool, host_pool)
        self.layout = device_pool.layout
        self.device_pool = device_pool
        self.host_pool = host_pool
        ps = self.layout.page_size
        self.device_allocator = _allocator(device_allocator, device_pool.num_slots, ps, "device")
        self.host_allocator = _allocator(host_allocator, host_pool.num_slots, ps, "host")
        auto_start_writes = check_bool(auto_start_writes, "auto_start_writes", error=ConfigError)
        inline_copy_bytes = check_int(
            inline_copy_bytes, "inline_copy_bytes", minimum=0, error=ConfigError
        )
        track_acks = check_bool(track_acks, "track_acks", error=ConfigError)
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
        self._owns_tasks = tasks is None
        self.tasks = TaskGroup("controller") if tasks is None else tasks
        self.layer_done_counter = LayerDoneCounter(self.layout.num_layers)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None  # the thread of that loop
        self._closed = asyncio.Event()
        #: Who owns every page of both pools, the leases copies and storage
        #: calls hold on them, their fences: the one caller of the allocators.
        self.ledger = Ledger(self.device_allocator, self.host_allocator)
        #: The write and load queues, their copy streams and jobs.
        self._copies = CopyScheduler(
            self.engine,
            self.ledger,
            self.stats,
            self.layer_done_counter,
            auto_start_writes=auto_start_writes,
            track_acks=track_acks,
            inline_copy_bytes=inline_copy_bytes,
        )
        #: The storage tier (attached at runtime) and what stays of those detached.
        self._storage = StorageLink(
            host_pool,
            self.ledger.host,
            device_pool.device,
            self.namespace,
            self.storage_config,
            tp_group=tp_group,
            tasks=self.tasks,
            stats=self.stats,
            write_enabled=not (self.layout.mla and self.namespace.tp_rank != 0),
            source=self.observe_source,
        )
        #: Resolves ``ready`` on the caller's thread (`ready_event`).
        self._fences = ReadyFences(device_pool.device)

    # -- knobs (the copy scheduler applies them) --------------------------------

    @property
    def auto_start_writes(self) -> bool:
        """Start queued writes on the next loop iteration (else at `start_writing`)."""
        return self._copies.auto_start_writes

    @auto_start_writes.setter
    def auto_start_writes(self, value: bool) -> None:
        self._copies.auto_start_writes = check_bool(value, "auto_start_writes")

    @property
    def track_acks(self) -> bool:
        """Keep finished write acks for `drain_acks`."""
        return self._copies.track_acks

    @track_acks.setter
    def track_acks(self, value: bool) -> None:
        self._copies.track_acks = check_bool(value, "track_acks")

    @property
    def inline_copy_bytes(self) -> int:
        """On a CPU device, the largest merged copy run on the loop thread when its stream is idle."""
        return self._copies.inline_copy_bytes

    @inline_copy_bytes.setter
    def inline_copy_bytes(self, value: int) -> None:
        self._copies.inline_copy_bytes = check_int(value, "inline_copy_bytes", minimum=0)

    @property
    def compute_stream(self) -> torch.cuda.Stream | None:
        """The stream the engine's forward pass runs on (CUDA; `use_compute_stream`):
        the default producer and last reader of the slots it hands over."""
        return self._fences.compute_stream

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
        self._copies.open(self._loop, self.observe_source)
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
            await self._storage.stop()
            self._copies.start_loads()  # loads queued for a start_loading that never came
            await self.wait_idle()
        finally:
            try:
                await self._copies.close_streams()
            finally:
                self.state = ControllerState.CLOSED
                self._closed.set()
        self._storage.forget_backups()  # nobody drains a closed controller
        if self._owns_tasks:
            await self.tasks.aclose()

    @property
    def busy(self) -> bool:
        """Whether a copy is in flight, queued to start, or about to start.

        Writes queued for the next loop iteration count; loads queued for an
        engine's `start_loading` count once a start is scheduled (as
        `load_back` does). `wait_idle` returns once this is false.
        """
        return self._copies.busy

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
        return self._copies.add_settle_callback(fn)

    async def wait_idle(self) -> None:
        """Return once no copy is queued or in flight (copy errors are not raised here).

        Starts what is queued to start, then sleeps until the last copy in
        flight settles (woken by its completion, never by a timer).

        Raises:
            StateError: called off the controller's loop.
        """
        self._check_loop()
        await self._copies.wait_idle()

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

    # -- CUDA ordering --------------------------------------------------------

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
        return self._fences.resolve(ready, what)

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
        self._fences.use_compute_stream(stream)

    def _copy_args(
        self,
        kind: Literal["write", "load"],
        given: object,
        priority: object,
        node_id: object,
        track: object,
        ready: Ready,
        what: str,
    ) -> tuple[tuple[torch.Tensor, Pages], int, int | None, bool, torch.cuda.Event | None]:
        """The copy verbs' checks, before anything changes: the controller is open,
        the slots a copy of ``kind`` reads (`_copy_source`), its other arguments
        (`_op_args`) and ``ready`` (resolved now, as ``what``)."""
        self._check_open()
        books = self.ledger.device if kind == "write" else self.ledger.host
        source = _copy_source(books, given, self.layout.page_size, kind)
        priority, node_id, track = _op_args(priority, node_id, track)
        return source, priority, node_id, track, self.ready_event(ready, what)

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
        dev, priority, node_id, track, ready_ev = self._copy_args(
            "write", device_indices, priority, node_id, track, ready, "submit_write"
        )
        return self._copies.queue_write(
            _own(dev, device_indices), priority, node_id, track, ready_ev
        )

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
        return self._copies.start_writes()

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
        host, priority, node_id, track, ready_ev = self._copy_args(
            "load", host_indices, priority, node_id, track, ready, "submit_load"
        )
        return self._copies.queue_load(_own(host, host_indices), priority, node_id, track, ready_ev)

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
        return self._copies.start_loads()

    def drain_acks(self) -> list[CopyAck]:
        """Finished write acks since the last call, oldest first (non-blocking).

        What an engine's scheduler tick polls instead of awaiting each ack.

        Raises:
            StateError: called off the controller's loop.
        """
        self._check_loop()
        return self._copies.drain_acks()

    # -- cancel-safe coroutines -----------------------------------------------

    async def backup(
        self, device_indices: torch.Tensor, priority: int = 0, *, ready: Ready = None
    ) -> torch.Tensor | None:
        """Copy device slots into new host slots and wait for the bytes.

        ``ready`` is `submit_write`'s (the producer of the KV; default: the
        caller's current stream when this is called).

        Returns:
            The host slots (the caller owns them), or ``None`` when host memory is full.

        On a CPU device, a copy of at most ``inline_copy_bytes`` is made in
        the call, by page ids, and the call returns without yielding: the
        caller's bytes are in place when it calls, the host slots are new,
        and such a copy takes less time than the loop turns of a queued one.
        Otherwise the write starts on the next loop iteration, merged with the
        writes queued by then, also when ``auto_start_writes`` is off (as
        `load_back` starts its load without waiting for `start_loading`).

        Cancelling the caller does not stop the copy; its host slots are freed
        when it finishes, so nothing leaks. A failed copy frees them and raises.

        With 65,536 slots or more, the call yields to the loop before it
        checks ``device_indices`` (which reads every slot) and again before
        it queues the copy, so that neither part runs in one loop step with
        the other or with the caller's own work before the call. Only a copy
        of the slots is read after the check. ``ready`` is still resolved
        when called.
        """
        queued, made = await _begin_copy(self, "write", device_indices, priority, ready, "backup")
        if queued is None:
            return made
        copies = self._copies
        ack = copies.queue_write(queued[0], queued[1], None, False, queued[2])
        if ack is None:
            return None
        copies.schedule_start("write")  # also with auto_start_writes off: nobody else may
        host = self.ledger.host
        await await_or_release(ack, lambda: host.free(host.pages(ack.host_indices)))
        return ack.host_indices

    async def load_back(
        self, host_indices: torch.Tensor, priority: int = 0, *, ready: Ready = None
    ) -> torch.Tensor | None:
        """Load host slots into new device slots and wait for all layers.

        ``ready`` is `submit_load`'s (the last readers of recycled device
        slots; default: the caller's current stream when this is called).

        A small CPU load is made in the call, as in `backup` (unless a write
        still fills some of ``host_indices``: the load is then ordered after
        it). Otherwise the load starts on the next loop iteration, merged with
        the loads other tasks queue in the same iteration (as writes are).

        Returns:
            The device slots (the caller owns them), or ``None`` when device memory is full.

        Cancel-safe like `backup`: the device slots of an abandoned load are
        freed once its copy finishes. Large loads yield twice, as in `backup`.
        """
        queued, made = await _begin_copy(self, "load", host_indices, priority, ready, "load_back")
        if queued is None:
            return made
        copies = self._copies
        ack = copies.queue_load(queued[0], queued[1], None, False, queued[2])
        if ack is None:
            return None
        copies.schedule_start("load")

        # Its landed layers may still be read by attention queued on the compute
        # stream: the next fill of its slots waits for an event recorded there then.
        def release() -> None:
            self._copies.free_failed_load(ack, self.ready_event(None, "load_back"))

        await await_or_release(ack, release)
        return ack.device_indices

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
        if ready is None and self._fences.cpu and self.ledger.device.free_if_one(device_indices):
            return self.layout.page_size  # one page, by its id: no fence to keep
        if checked:
            dev, pages = device_indices, page_ids(device_indices, self.layout.page_size)
        else:
            dev, pages = check_slot_pages(
                device_indices, self.layout.page_size, self.device_pool.num_slots, "device_indices"
            )
        self.ledger.device.check_unleased(pages)
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
        if self.ledger.host.free_if_one(host_indices):
            return self.layout.page_size
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
        self._copies.reset()

    def plan(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> TransferPlan:
        """Validate a host/device pairing (see `CopyEngine.plan`)."""
        return self.engine.plan(host_indices, device_indices)

    def __repr__(self) -> str:
        return f"TierController({self.layout.describe()}, state={self.state.value})"


async def _begin_copy(
    ctl: TierController,
    kind: Literal["write", "load"],
    given: torch.Tensor,
    priority: int,
    ready: Ready,
    what: str,
) -> tuple[tuple[tuple[torch.Tensor, Pages], int, Any] | None, torch.Tensor | None]:
    """The start of `TierController.backup` (``kind`` write) and `load_back`: a
    copy made in the call (one page by its id, or a few pages checked), or the
    checked arguments of a queued one; a large input is checked in a loop step
    of its own (`_checked_apart`).

    Returns:
        ``(None, new slots or None)`` when the copy was made in the call (``None``:
        a full pool), else ``((source, priority, ready event), None)``.
    """
    ctl._check_open()
    copies = ctl._copies
    if ready is None and priority.__class__ is int:  # one page in the call: by its id
        if (page := copies.page_now(kind, given)) is not None:
            return None, copies.copy_one(kind, page)
    checked: object = given
    if _is_large(given):
        ready = ctl.ready_event(ready, what)  # ordered after what came before the call
        await asyncio.sleep(0)
        pool = ctl.device_pool if kind == "write" else ctl.host_pool
        name = _REFUSALS[kind][0]
        checked = await _checked_apart(given, ctl.layout.page_size, pool.num_slots, name)
    src, priority, _, _, ready_ev = ctl._copy_args(
        kind, checked, priority, None, False, ready, what
    )
    if copies.copies_now(kind, src):
        return None, copies.copy_now(kind, src[1])
    return (_own(src, given), priority, ready_ev), None
