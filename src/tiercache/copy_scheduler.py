"""`CopyScheduler`: the device<->host half of `TierController`.

It queues writes (device->host) and loads (host->device), merges what is
queued into one job per start, in priority order, runs the job on its copy
stream (`CopyStream`: a CUDA stream, or an ordered worker thread on a CPU),
and settles the job's acks on the loop once its copy has settled: pages
released, the outcome written into the ledger, the acks resolved, then the
settle callbacks. The controller checks every argument before it calls in;
nothing here checks a caller's input again.

On CUDA a job first makes its stream wait for every fence its operations
carry (the caller's ``ready``, the producers or last readers of the pages),
then plans the copy inside the stream's context, so the device index tensor
goes up on the copy stream after those waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from tiercache.acks import ControllerStats, CopyAck, LoadHandle, run_callback, settle
from tiercache.errors import StateError
from tiercache.ledger import Lease, Ledger, PoolLedger, live_fences
from tiercache.memory.allocator import cat_slots, one_page
from tiercache.observe import active as observe_active
from tiercache.observe import observe
from tiercache.transfer.engine import CopyEngine
from tiercache.transfer.layer_done import LayerDoneCounter, LayerDoneSet
from tiercache.transfer.streams import Completion, CopyStream

__all__ = ["CopyScheduler"]

logger = logging.getLogger(__name__)

#: Page ids of a pool, one per page of some slots, in order.
Pages = np.ndarray[Any, np.dtype[np.int64]]


@dataclass(slots=True)
class _Operation:
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    priority: int
    ack: CopyAck
    track: bool
    host_pages: Pages
    device_pages: Pages
    #: CUDA: the copy stream waits for these fences before it touches the slots
    #: (the caller's ``ready``, and for a write the producers of its device
    #: pages, for a load the last readers of its device pages).
    fences: list[Any] | None = None
    #: Loads: write jobs still filling some of the host slots it reads.
    after: list[_WriteJob] | None = None


@dataclass(slots=True, eq=False)
class _WriteJob:
    """A merged write, from `start_writing` until it has settled.

    ``settled`` resolves (or fails) once every byte of it is on the host;
    a load that reads any of ``host_pages`` waits for it first.
    """

    host_pages: Pages
    settled: concurrent.futures.Future[None] | None = None


def _merged(ops: list[_Operation]) -> tuple[torch.Tensor, torch.Tensor]:
    """The host and device slots of ``ops`` in priority order (lower first; stable)."""
    if len(ops) == 1:
        return ops[0].host_indices, ops[0].device_indices
    ops.sort(key=lambda o: o.priority)
    return cat_slots([o.host_indices for o in ops]), cat_slots([o.device_indices for o in ops])


def _finished(error: BaseException | None) -> concurrent.futures.Future[None]:
    """A new finished future with ``error`` (or a result, when ``None``)."""
    fut: concurrent.futures.Future[None] = concurrent.futures.Future()
    fut.set_running_or_notify_cancel()
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
    return fut


#: The finished future of every copy that succeeded: nothing waits on a
#: finished future or keeps a callback on it (one added runs at once), so one
#: serves them all, and a copy does not pay for a new lock and condition.
_SUCCEEDED = _finished(None)


def _settled(error: BaseException | None) -> concurrent.futures.Future[None]:
    """A finished future with ``error`` (`_SUCCEEDED` when ``None``)."""
    return _SUCCEEDED if error is None else _finished(error)


#: Up to this many page ids on both sides, `_overlap` compares Python sets.
_FEW_PAGES = 128


def _overlap(a: Pages, b: Pages) -> bool:
    """Whether page ids ``a`` and ``b`` share a page.

    A few (a load reading what a write still fills): a set, where
    ``np.isin`` costs ~11 us of sorting and call overhead.
    """
    if a.size + b.size <= _FEW_PAGES:
        return not set(a.tolist()).isdisjoint(b.tolist())
    return bool(np.isin(a, b).any())


def _wait_exception(fut: concurrent.futures.Future[None]) -> BaseException | None:
    """Block (a copy worker thread) until ``fut`` is done; return its exception."""
    concurrent.futures.wait([fut])
    return fut.exception()


def _mark_done(layers: LayerDoneSet, i: int) -> Callable[[], None]:
    return lambda: layers.mark_done(i)


class CopyScheduler:
    """The write and load queues of a controller, their copy streams and jobs.

    Owned by one `TierController`, which checks every argument and that it is
    open before it calls in; it holds nothing of the controller (the ledger
    holds its release listener weakly), so dropping the controller frees it
    and the pools without the garbage collector. Loop thread only.

    Args:
        engine: the copy engine over the controller's pools.
        ledger: the controller's ledger (every lease a copy takes is in it).
        stats: the controller's counters (it counts copies, batches, bytes
            and refusals for want of room).
        layer_done_counter: where each merged load takes its `LayerDoneSet`.
        auto_start_writes, track_acks, inline_copy_bytes: the controller's
            knobs of the same names.
    """

    def __init__(
        self,
        engine: CopyEngine,
        ledger: Ledger,
        stats: ControllerStats,
        layer_done_counter: LayerDoneCounter,
        *,
        auto_start_writes: bool,
        track_acks: bool,
        inline_copy_bytes: int,
    ) -> None:
        self.engine = engine
        self.ledger = ledger
        self.stats = stats
        self.layer_done_counter = layer_done_counter
        self.auto_start_writes = auto_start_writes
        self.track_acks = track_acks
        self.inline_copy_bytes = inline_copy_bytes
        self._device = engine.device_pool.device
        self._cuda = self._device.type == "cuda"
        self._token_bytes = engine.device_pool.layout.token_bytes
        self._page_size = engine.device_pool.layout.page_size
        self._page_bytes = engine.device_pool.layout.page_bytes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._source: object = None
        self.write_stream: CopyStream | None = None
        self.load_stream: CopyStream | None = None
        self._write_queue: list[_Operation] = []
        self._load_queue: list[_Operation] = []
        self._write_start_scheduled = False
        self._load_start_scheduled = False
        self._finished: deque[CopyAck] = deque()
        self._inflight = 0  # copy jobs started and not yet settled on the loop
        self._ids = itertools.count()
        self._write_jobs: set[_WriteJob] = set()
        self._queued_write_job: _WriteJob | None = None
        self._settle_callbacks: list[Callable[[], None]] = []
        self._idle_waiters: list[asyncio.Future[None]] = []
        ledger.on_release(self._notify_settled)

    # -- lifecycle ------------------------------------------------------------

    def open(self, loop: asyncio.AbstractEventLoop, source: object) -> None:
        """Start the copy streams; their timings are reported as ``source``."""
        self._loop = loop
        self._source = source
        self.write_stream = CopyStream("write", self._device, source=source)
        self.load_stream = CopyStream("load", self._device, source=source)

    async def close_streams(self) -> None:
        """Stop both copy streams (after their current copy), off the loop thread,
        then the engine's own helper thread (started by a large copy made in
        the call, with ``inline_copy_bytes`` raised that far).

        The closing goes on when the caller is cancelled (it is shielded).
        """
        streams = [s for s in (self.write_stream, self.load_stream) if s is not None]
        engine = self.engine

        def close_streams() -> None:
            for s in streams:
                s.close()
            engine.close()

        closer = asyncio.ensure_future(asyncio.to_thread(close_streams))
        await asyncio.shield(closer)

    @property
    def busy(self) -> bool:
        """`TierController.busy`."""
        return bool(self._inflight or self._write_queue or self._load_start_scheduled)

    def add_settle_callback(self, fn: Callable[[], None]) -> Callable[[], None]:
        """`TierController.add_settle_callback` (the loop was checked)."""
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
                run_callback(loop, fn)
        if not self._inflight and self._idle_waiters:
            waiters, self._idle_waiters = self._idle_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    async def wait_idle(self) -> None:
        """`TierController.wait_idle` (the loop was checked)."""
        while True:
            if self._write_queue:
                self.start_writes()
            if self._load_start_scheduled:
                self.start_loads()
            if not self._inflight:
                return
            assert self._loop is not None
            waiter = self._loop.create_future()
            self._idle_waiters.append(waiter)
            await waiter

    def reset(self) -> None:
        """Drop the loads still queued (their acks are cancelled) and the undrained
        acks, then free every slot of both pools (nothing may be in flight)."""
        for op in self._load_queue:
            self._release(op)
            settle(op.ack, asyncio.CancelledError())
        self._load_queue.clear()
        self._finished.clear()
        self.ledger.device.reset()
        self.ledger.host.reset()
        self.layer_done_counter.reset()

    # -- bookkeeping ----------------------------------------------------------

    def _leases(self, op: _Operation) -> tuple[tuple[PoolLedger, Pages, Lease], ...]:
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
        host: tuple[torch.Tensor, Pages],
        dev: tuple[torch.Tensor, Pages],
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

    def _pinned_indices(self, indices: torch.Tensor) -> torch.Tensor:
        """CUDA: ``indices`` in pinned memory, so the plan's host->device index copy
        is asynchronous on the copy stream (not a pageable copy that waits)."""
        if self._cuda and not indices.is_pinned():
            return indices.pin_memory()
        return indices

    # -- small copies in the call ----------------------------------------------

    def copies_now(self, kind: Literal["write", "load"], src: tuple[torch.Tensor, Pages]) -> bool:
        """Whether a copy of ``kind`` reading the (checked) slots ``src`` runs in the call (`copy_now`).

        On a CPU device, up to ``inline_copy_bytes``: the caller's bytes are
        in place when it calls, a copy this small takes less time than the
        loop turns of a queued one, and its destination slots are new
        (nothing queued can touch them), so there is no order to keep but the
        call's own. A load of host pages a write still fills is queued
        instead, ordered after that write.
        """
        return self._in_call(src[0].numel() * self._token_bytes) and (
            kind == "write" or not self.ledger.host.leased(src[1], Lease.FILL)
        )

    def _in_call(self, nbytes: int) -> bool:
        """Whether this device and engine make a copy of ``nbytes`` in the call: a CPU
        device pool allocated as one tensor, and at most ``inline_copy_bytes``."""
        return not self._cuda and nbytes <= self.inline_copy_bytes and self.engine.copies_pages

    def page_now(self, kind: Literal["write", "load"], given: object) -> int | None:
        """The page id of ``given`` when a copy of ``kind`` reading it is made in the call
        by `copy_one`: ``given`` is one whole page (`one_page`) a copy may read now
        (`PoolLedger.readable`), on a device `copies_now` accepts. ``None`` otherwise,
        bad input included: the checked path then decides (and says what is wrong).
        """
        if not self._in_call(self._page_bytes):
            return None
        books = self.ledger.device if kind == "write" else self.ledger.host
        page = one_page(given, self._page_size, books.num_slots)
        if page is None or not books.readable(page):
            return None
        return page

    def copy_one(self, kind: Literal["write", "load"], page: int) -> torch.Tensor | None:
        """`copy_now` of the one page ``page`` (from `page_now`), by its id."""
        write = kind == "write"
        into = self.ledger.host if write else self.ledger.device
        new = into.alloc_one()
        if new is None:
            self._full(write)
            return None
        pair = ([new], [page]) if write else ([page], [new])
        self._copy_pages(kind, *pair, lambda: into.free_one(new))
        into.filled(new)
        if write:
            self.ledger.device.copied_out(page)
        self._copied(kind, self._page_bytes)
        return into.page_slots(new)

    def copy_now(self, kind: Literal["write", "load"], src_pages: Pages) -> torch.Tensor | None:
        """Copy the (checked) pages ``src_pages`` into new slots of the other pool, in this call.

        A write reads device pages into new host slots, a load host pages
        into new device slots; both are counted as a queued copy is.

        Returns:
            The new slots (the caller owns them), or ``None`` when their pool is full.

        Raises:
            Exception: the copy failed (the new slots are freed first).
        """
        write = kind == "write"
        dev, host = self.ledger.device, self.ledger.host
        into = host if write else dev
        got = into.alloc(src_pages.size * self.engine.layout.page_size)
        if got is None:
            self._full(write)
            return None
        slots, new_pages = got
        pair = (new_pages, src_pages) if write else (src_pages, new_pages)
        self._copy_pages(kind, pair[0].tolist(), pair[1].tolist(), lambda: into.free(new_pages))
        into.filled(new_pages)
        if write:
            dev.copied_out(src_pages)
        self._copied(kind, slots.numel() * self._token_bytes)
        return slots

    def _full(self, write: bool) -> None:
        """Count a copy in the call that found its destination pool full."""
        if write:
            self.stats.host_full += 1
        else:
            self.stats.device_full += 1

    def _copy_pages(
        self,
        kind: Literal["write", "load"],
        host_pages: list[int],
        dev_pages: list[int],
        free_new: Callable[[], None],
    ) -> None:
        """The copy of a copy in the call; a failure frees the new pages (``free_new``),
        is counted and raised. Timed for a listening latency sink."""
        timed = observe_active()
        started = time.perf_counter() if timed else 0.0
        try:
            self.engine.copy_pages(kind == "write", host_pages, dev_pages)
        except BaseException as e:
            free_new()
            self.stats.copy_errors += 1
            logger.warning("a %s copy of 1 operation failed: %r", kind, e)
            if timed:
                observe("copy", kind, time.perf_counter() - started, "error", source=self._source)
            raise
        if timed:
            observe("copy", kind, time.perf_counter() - started, source=self._source)

    def _copied(self, kind: Literal["write", "load"], nbytes: int) -> None:
        """Count a copy in the call as one queued operation of ``nbytes``."""
        stats = self.stats
        if kind == "write":
            stats.writes += 1
            stats.write_batches += 1
            stats.bytes_device_to_host += nbytes
        else:
            stats.loads += 1
            stats.load_batches += 1
            stats.bytes_host_to_device += nbytes

    # -- device -> host -------------------------------------------------------

    def queue_write(
        self,
        dev: tuple[torch.Tensor, Pages],
        priority: int,
        node_id: int | None,
        track: bool,
        ready: torch.cuda.Event | None,
    ) -> CopyAck | None:
        """Queue a backup of the (checked, allocated) device slots ``dev`` into new host slots.

        Returns:
            Its ack, or ``None`` when host memory is full.
        """
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
        op.fences = live_fences((ready, *self.ledger.device.producers(dev[1])))
        job = self._queued_write_job
        if job is None:
            job = self._queued_write_job = _WriteJob(op.host_pages)
        else:
            job.host_pages = np.concatenate([job.host_pages, op.host_pages])
        self._write_queue.append(op)
        self.stats.writes += 1
        if self.auto_start_writes and not self._write_start_scheduled:
            self.schedule_start("write")
        return op.ack

    def schedule_start(self, kind: Literal["write", "load"]) -> None:
        """Start what is queued of ``kind`` on the next loop iteration (once, however often called)."""
        assert self._loop is not None
        if kind == "write":
            if not self._write_start_scheduled:
                self._write_start_scheduled = True
                self._loop.call_soon(self.start_writes)
        elif not self._load_start_scheduled:
            self._load_start_scheduled = True
            self._loop.call_soon(self.start_loads)

    def start_writes(self) -> int:
        """Start every queued write now, merged into one copy; returns how many were started."""
        self._write_start_scheduled = False
        ops, self._write_queue = self._write_queue, []
        wjob, self._queued_write_job = self._queued_write_job, None
        if not ops or self.write_stream is None:
            return 0
        assert wjob is not None
        host, dev = _merged(ops)
        readies = live_fences(ev for o in ops for ev in o.fences or ())
        pinned = self._pinned_indices
        stream = self.write_stream
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

        nbytes = host.numel() * self._token_bytes
        self.stats.write_batches += 1
        self.stats.bytes_device_to_host += nbytes
        self._write_jobs.add(wjob)
        wjob.settled = self._launch(stream, job, ops, nbytes, wjob=wjob)
        return len(ops)

    # -- host -> device -------------------------------------------------------

    def queue_load(
        self,
        host: tuple[torch.Tensor, Pages],
        priority: int,
        node_id: int | None,
        track: bool,
        ready: torch.cuda.Event | None,
    ) -> CopyAck | None:
        """Queue a load of the (checked, allocated) host slots ``host`` into new device slots.

        It is ordered after the writes still filling any of those host slots.

        Returns:
            Its ack, or ``None`` when device memory is full.
        """
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
        op.fences = live_fences((ready, *device.take_fences(dev[1])))
        if self.ledger.host.leased(op.host_pages, Lease.FILL):
            jobs = list(self._write_jobs)
            if self._queued_write_job is not None:
                jobs.append(self._queued_write_job)
            op.after = [j for j in jobs if _overlap(op.host_pages, j.host_pages)]
        self._load_queue.append(op)
        self.stats.loads += 1
        return op.ack

    def start_loads(self) -> LoadHandle | None:
        """Start every queued load now, merged, layer by layer on the load stream.

        Returns:
            The `LoadHandle`, or ``None`` when nothing was queued.
        """
        self._load_start_scheduled = False
        ops, self._load_queue = self._load_queue, []
        loop, stream = self._loop, self.load_stream
        if not ops or stream is None or loop is None:
            return None
        writes = self._writes_read_by(ops)
        host, dev = _merged(ops)
        readies = live_fences(ev for o in ops for ev in o.fences or ())
        producer_id, layers = self.layer_done_counter.update_producer(
            loop, cuda=stream.is_cuda, device=self._device
        )
        job = self._load_job(stream, host, dev, readies, writes, layers)
        nbytes = host.numel() * self._token_bytes
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
            self.start_writes()
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
            error: BaseException | None = None
            try:
                stream.run_inline(job)
            except BaseException as e:
                error = e
            self._inflight += 1
            loop.call_soon(self._finish, error, ops, wjob, handle)
            return _settled(error)
        try:
            cf = stream.submit(job)
        except BaseException as e:
            if handle is not None:
                handle.layers.mark_failed(e)
            self._inflight += 1
            loop.call_soon(self._finish, e, ops, wjob, handle)
            return _settled(e)
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
            # callback refers to this job: a cycle through the scheduler (and
            # the pools of its engine) that only the garbage collector would
            # free. A settled copy of the future carries the outcome on instead.
            wjob.settled = _settled(error)
        for op in ops:
            self._release(op)
            self._record_outcome(op, error)
        tracked = self.track_acks
        for op in ops:
            settle(op.ack, error)
            if tracked and op.track and wjob is not None:
                self._finished.append(op.ack)
        if handle is not None:
            settle(handle, error)
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
        """`TierController.drain_acks` (the loop was checked)."""
        out = list(self._finished)
        self._finished.clear()
        return out

    def free_failed_load(self, ack: CopyAck, fence: torch.cuda.Event | None) -> None:
        """Free the device slots of a load nobody takes, behind ``fence``.

        Its layers that landed may be read by attention still queued (the
        forward pass waited for them layer by layer): the next fill of those
        slots waits for ``fence``, recorded after those readers.
        """
        dev = self.ledger.device
        dev.free(dev.pages(ack.device_indices), fence=fence)
