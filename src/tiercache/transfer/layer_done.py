"""Per-layer completion of loads: asyncio futures, thread events and CUDA events."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import torch

from tiercache._checks import check_index, check_int, check_number
from tiercache.errors import InvalidInputError, StateError

__all__ = ["LayerDoneCounter", "LayerDoneSet"]


def _consume(fut: asyncio.Future[None]) -> None:
    # Mark a failed future's exception as retrieved: the failure is reported to
    # whoever awaits the layer, and nobody awaiting it is not an error.
    if fut.done() and not fut.cancelled():
        fut.exception()


class _Flags:
    """One flag per layer that threads can wait on: `threading.Event` semantics, one lock.

    A load creates one of these rather than an Event per layer (each a lock
    and a condition of its own): creating the set is on every load's path.
    The condition is made by the first thread that waits; until then setting
    a flag takes no lock (a load nobody waits for in a thread, the usual
    case, pays for none). A waiter makes it under the lock before it tests
    its flag, and a setter writes the flag before it looks for the
    condition: either the waiter sees the flag, or the setter notifies it
    (this relies on the GIL's ordering of those two writes and reads; a
    free-threaded build would take the lock in `set` again).
    """

    __slots__ = ("_cond", "_lock", "_set")

    def __init__(self, n: int) -> None:
        self._set = [False] * n
        self._lock = threading.Lock()
        self._cond: threading.Condition | None = None

    def set(self, i: int) -> None:
        self._set[i] = True
        self._notify()

    def set_all(self) -> None:
        self._set = [True] * len(self._set)
        self._notify()

    def _notify(self) -> None:
        if self._cond is not None:
            with self._lock:
                self._cond.notify_all()

    def is_set(self, i: int) -> bool:
        return self._set[i]

    def wait(self, i: int, timeout: float | None = None) -> bool:
        """Block until flag ``i`` is set or ``timeout`` expires; whether it is set."""
        with self._lock:
            if self._cond is None:
                self._cond = threading.Condition(self._lock)
            return self._cond.wait_for(lambda: self._set[i], timeout)


class LayerDoneSet:
    """Completion of one load, layer by layer.

    For every layer it holds an asyncio future (resolved on the owning loop,
    set from the copy thread with ``call_soon_threadsafe``; layers that finish
    while the loop has not yet woken up resolve in that same wake-up, so a
    load of many small layers does not wake the loop once a layer), a
    flag a thread can wait on (`wait_sync`) for a synchronous forward pass running in a worker
    thread, and on CUDA the ``torch.cuda.Event`` recorded after the layer's
    copy, on which the compute stream can wait without blocking the host.

    The copy thread wakes the loop for a layer only once someone may be
    watching the futures (`wait` on a layer not yet landed, or any read of
    `futures`): a load nobody awaits layer by layer (the whole handle is
    awaited, or a worker thread waits with `wait_sync`) costs the loop no
    wake-up per layer, and leaves the copy thread the GIL. The futures are
    made when they are first watched and brought up to date then, so what
    they say never depends on when that was (a load nobody watches makes
    none).

    Created and awaited on the loop thread; ``mark_*`` are called from the copy
    threads (``mark_recorded`` once the layer's copy is queued, ``mark_done``
    once its bytes landed, ``mark_failed`` once the failed load has settled);
    ``wait_sync`` and ``wait_device`` from any thread but the loop's.

    Args:
        loop: the loop whose futures this set resolves.
        num_layers: layers of the load.
        cuda: the load runs on a CUDA stream (per-layer events are recorded).
        device: the CUDA device of the pool the load fills: `wait_device`
            makes *that* device's current stream wait, whatever the calling
            thread's current device is.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        num_layers: int,
        cuda: bool = False,
        device: torch.device | None = None,
    ) -> None:
        if cuda and (device is None or device.type != "cuda" or device.index is None):
            raise InvalidInputError(f"a CUDA load needs an indexed CUDA device, got {device}")
        self.device = device
        self.loop = loop
        self._loop_thread = threading.get_ident()  # created on the loop's thread
        self.num_layers = num_layers
        #: Made when first watched, and from then on resolved by the copy
        #: thread: a load nobody watches layer by layer creates none (24
        #: futures a load cost 30 us of the loop's time).
        self._futures: list[asyncio.Future[None]] | None = None
        #: Layers whose bytes landed (set before their `_done` flag).
        self._landed = [False] * num_layers
        self._done = _Flags(num_layers)
        self._recorded = _Flags(num_layers) if cuda else None
        self.cuda_events: list[torch.cuda.Event | None] = [None] * num_layers
        self.error: BaseException | None = None
        # Calls from the copy thread waiting for the loop; one wake-up drains them all.
        self._pending: list[tuple[Callable[..., None], tuple[object, ...]]] = []
        self._pending_lock = threading.Lock()

    # -- copy thread side ---------------------------------------------------

    def mark_recorded(self, layer: int, event: torch.cuda.Event | None) -> None:
        """CUDA: the layer's copy is enqueued and ``event`` follows it."""
        self.cuda_events[layer] = event
        if self._recorded is not None:
            self._recorded.set(layer)

    def mark_done(self, layer: int) -> None:
        """The layer's bytes are in place on the device."""
        self._landed[layer] = True
        self._done.set(layer)
        # Written before read, here and in `_watch`: if this thread reads
        # None, the loop reads this layer as landed when it starts watching.
        if self._futures is not None:
            self._call(self._resolve, layer)

    def mark_failed(self, error: BaseException, *, settled: bool = False) -> None:
        """The load failed: every layer that has not landed fails with ``error``.

        ``settled``: the copy stream was settled after the failure (the load
        failed while queuing its copies, and everything it queued has run):
        every layer whose copy was queued (`mark_recorded`) has landed too.
        Without it (waiting for a layer's event failed), only the layers
        already marked done landed.
        """
        if settled and self._recorded is not None:
            for layer in range(self.num_layers):
                if self._recorded.is_set(layer) and not self._landed[layer]:
                    self.mark_done(layer)
        self.error = error
        if self._recorded is not None:
            self._recorded.set_all()
        self._done.set_all()
        self._call(self._fail_all, error)

    def _call(self, fn: Callable[..., None], *args: object) -> None:
        try:
            if threading.get_ident() == self._loop_thread:
                # A copy run inline on the loop: no need to wake it up.
                self.loop.call_soon(fn, *args)
                return
            with self._pending_lock:
                self._pending.append((fn, args))
                first = len(self._pending) == 1
            if first:  # else the wake-up already scheduled runs this call too, in order
                self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody can await any more
            pass

    def _drain(self) -> None:
        """On the loop: run the calls the copy thread queued, in order."""
        with self._pending_lock:
            calls, self._pending = self._pending, []
        for fn, args in calls:
            fn(*args)

    def _resolve(self, layer: int) -> None:
        futures = self._futures
        if futures is None:  # nobody watches yet: `_watch` reads `_landed`
            return
        fut = futures[layer]
        if not fut.done():
            fut.set_result(None)

    def _fail_all(self, error: BaseException) -> None:
        """Layers that landed before the failure succeed; every other one fails."""
        futures = self._futures
        if futures is None:  # nobody watches yet: `_watch` reads `error`
            return
        for layer, fut in enumerate(futures):
            if fut.done():
                continue
            if self._landed[layer]:
                fut.set_result(None)
            else:
                fut.set_exception(error)
                _consume(fut)

    # -- loop side ----------------------------------------------------------

    @property
    def futures(self) -> list[asyncio.Future[None]]:
        """One asyncio future per layer, resolved on the loop once the layer landed.

        Loop thread only. Reading them makes the copy thread wake the loop
        for every layer that lands from now on.
        """
        return self._watch()

    def _watch(self) -> list[asyncio.Future[None]]:
        """Make the futures; from now on the copy thread resolves them. Resolve (or
        fail) those it skipped. Returns the futures."""
        futures = self._futures
        if futures is not None:
            return futures
        futures = self._futures = [self.loop.create_future() for _ in range(self.num_layers)]
        for layer, landed in enumerate(self._landed):
            if landed:
                self._resolve(layer)
        if self.error is not None:  # set before `mark_failed` queues `_fail_all`
            self._fail_all(self.error)
        return futures

    # -- consumer side ------------------------------------------------------

    def _check(self, layer: int) -> int:
        """``layer`` as an int in ``[0, num_layers)`` (numpy integers accepted, as
        `LayerDoneCounter.set_consumer` accepts them; ``bool`` and ``float`` not)."""
        return check_index(layer, "layer", self.num_layers)

    async def wait(self, layer: int) -> None:
        """Return once layer ``layer`` is on the device (raises the load's error if it failed).

        Cancelling the waiter does not cancel the load.
        """
        layer = self._check(layer)
        if self._landed[layer]:
            return
        await asyncio.shield(self.futures[layer])

    def is_done(self, layer: int) -> bool:
        layer = self._check(layer)
        return self._done.is_set(layer)

    def wait_sync(self, layer: int, timeout: float | None = None) -> None:
        """Block the calling thread until layer ``layer`` is on the device.

        For a synchronous forward pass running in a worker thread.

        Raises:
            InvalidInputError: a bad ``layer``, or a ``timeout`` that is not a
                non-negative number or ``None``.
            StateError: called on the event loop's own thread (it would deadlock),
                or ``timeout`` expired.
            Exception: the load's error, if it failed.
        """
        layer = self._check(layer)
        if timeout is not None:
            timeout = check_number(timeout, "timeout")
        if threading.get_ident() == self._loop_thread:
            raise StateError(
                "wait_sync on the event loop thread would deadlock; await the layer instead"
            )
        if not self._done.wait(layer, timeout):
            raise StateError(f"layer {layer} not loaded within {timeout} s")
        if self.error is not None and not self._layer_ok(layer):
            raise self.error

    def _layer_ok(self, layer: int) -> bool:
        return self._landed[layer]

    def wait_device(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """On CUDA, make a compute stream wait for layer ``layer`` without blocking the host.

        ``stream``: the stream that will read the layer; by default the
        calling thread's current stream *of the pool's device* (not of the
        thread's current device). Blocks the calling thread only until the
        layer's copy has been *enqueued* (microseconds: the load's enqueue
        half never waits for an earlier load's bytes); the wait itself happens
        on the GPU. On a CPU device it is `wait_sync`.

        Raises:
            Exception: the load's error, once the failed load has settled, if
                this layer did not land (a layer that landed before a later
                one failed is waited for as usual).
        """
        layer = self._check(layer)
        if self._recorded is None:
            self.wait_sync(layer)
            return
        self._recorded.wait(layer)
        if self.error is not None and not self._landed[layer]:
            raise self.error
        ev = self.cuda_events[layer]
        if ev is not None:
            target = stream if stream is not None else torch.cuda.current_stream(self.device)
            target.wait_event(ev)


class LayerDoneCounter:
    """The seed's three rotating producer sets of per-layer completion.

    Each `start_loading` takes the next set (``update_producer``); the forward
    pass names the set it consumes (``set_consumer``) and waits layer by layer.
    Three sets let the loads of one batch run while the previous batch's
    forward pass still consumes its own. A set is replaced, not reset, so a
    load still in flight keeps resolving the set it was given.
    """

    def __init__(self, num_layers: int, num_counters: int = 3) -> None:
        self.num_layers = num_layers
        self.num_counters = num_counters
        self._sets: list[LayerDoneSet | None] = [None] * num_counters
        self.producer_index = -1
        self.consumer_index = -1

    def update_producer(
        self,
        loop: asyncio.AbstractEventLoop,
        cuda: bool = False,
        device: torch.device | None = None,
    ) -> tuple[int, LayerDoneSet]:
        """Take the next set for a new load; returns its index and the set (see `LayerDoneSet`)."""
        self.producer_index = (self.producer_index + 1) % self.num_counters
        done = LayerDoneSet(loop, self.num_layers, cuda, device)
        self._sets[self.producer_index] = done
        return self.producer_index, done

    def set_consumer(self, index: int) -> None:
        """Name the set the forward pass reads (a ``producer_id`` of a `LoadHandle`).

        Raises:
            InvalidInputError: ``index`` is not an int in ``[0, num_counters)``.
        """
        index = check_int(index, "consumer index")
        if not 0 <= index < self.num_counters:
            raise InvalidInputError(
                f"consumer index must be in [0, {self.num_counters}), got {index}"
            )
        self.consumer_index = index

    def current(self) -> LayerDoneSet | None:
        """The set the consumer reads, or ``None`` when nothing was loaded for it."""
        if self.consumer_index < 0:
            return None
        return self._sets[self.consumer_index]

    async def wait_until(self, layer: int) -> None:
        """Await layer ``layer`` of the consumer's set (no-op when nothing is loading)."""
        done = self.current()
        if done is not None:
            await done.wait(layer)

    def wait_until_sync(self, layer: int, timeout: float | None = None) -> None:
        """Block a worker thread until layer ``layer`` of the consumer's set is loaded."""
        done = self.current()
        if done is not None:
            done.wait_sync(layer, timeout)

    def reset(self) -> None:
        self._sets = [None] * self.num_counters
        self.producer_index = -1
        self.consumer_index = -1
