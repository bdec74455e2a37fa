"""What `TierController` hands out: the completions of its copies and its counters.

`CopyAck` (one write or load) and `LoadHandle` (a started layer-by-layer
load) settle on the loop thread once their copy has settled and the
controller's bookkeeping is done; `ControllerStats` counts the device<->host
half. Only the copy scheduler settles a completion (`settle`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Literal, Self

import torch

from tiercache.transfer.layer_done import LayerDoneSet

__all__ = [
    "Completion",
    "ControllerStats",
    "CopyAck",
    "LoadHandle",
    "await_or_release",
    "run_callback",
    "settle",
]


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


class Completion:
    """Something that ends once: a copy (`CopyAck`, `LoadHandle`) or a storage
    operation (`PrefetchOperation`, `BackupOperation`).

    Its owner settles it on the loop thread once its own bookkeeping is done
    (slots released, stats counted). Done callbacks then run at once, in
    registration order, before any task awaiting it resumes: every kind of
    operation orders its callbacks the same way.
    """

    __slots__ = ("_callbacks", "_future", "_settled")

    def __init__(self, future: asyncio.Future[None]) -> None:
        self._future = future
        self._callbacks: list[Callable[[Any], None]] | None = None
        self._settled = False

    def done(self) -> bool:
        """Whether it has ended (a copy: succeeded, failed or cancelled by `reset`)."""
        return self._settled

    def failed(self) -> bool:
        """Whether the copy has settled with an error (or was cancelled)."""
        return self._settled and (self._future.cancelled() or self._future.exception() is not None)

    def add_done_callback(self, fn: Callable[[Self], None]) -> None:
        """Call ``fn(self)`` on the loop thread once it has ended.

        Callbacks run in registration order, after the owner's bookkeeping
        and before awaiting tasks resume. Registered
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
        """Wait for it to end; cancelling the waiter does not cancel the operation.

        A storage operation raises nothing: its errors end it early and are
        kept in its ``error``.

        Raises:
            asyncio.CancelledError: a copy that `reset` dropped.
            Exception: the error a copy failed with.
        """
        await asyncio.shield(self._future)

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.shield(self._future).__await__()

    def _settle(self, error: BaseException | None) -> None:
        """Resolve the completion and run its callbacks (loop thread, its owner only).

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
            run_callback(fut.get_loop(), fn, self)


def run_callback(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Call ``fn(*args)``; an exception goes to the loop's handler, not to the caller."""
    try:
        fn(*args)
    except Exception as e:
        loop.call_exception_handler(
            {"message": f"tiercache callback {fn!r} failed", "exception": e}
        )


class CopyAck(Completion):
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


class LoadHandle(Completion):
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


def settle(completion: Completion, error: BaseException | None) -> None:
    """Resolve ``completion`` with ``error`` (``None``: success) and run its callbacks.

    Its owner's alone (the copy scheduler, the storage tier), on the loop
    thread, once its bookkeeping is done.
    """
    completion._settle(error)


async def await_or_release(ack: CopyAck, release: Callable[[], None]) -> None:
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
