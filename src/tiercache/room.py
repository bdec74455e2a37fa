"""Room: who waits for device and host slots, and what wakes them.

Device allocations, and host writes and prefetches that may wait, queue
for room first come, first served (`RoomQueue`, one per pool), up to
``config.alloc_timeout_s``. Nothing polls: a waiter sleeps until room may
have been released, and every release wakes it by construction:

- pages freed and leases ended: the ledger's release listeners run the
  controller's settle callbacks (`TierController.add_settle_callback`),
  and the `RoomBroker` is one of them, from `RoomBroker.attach` on;
- a copy, load or backup that settles: the same callbacks, after the
  copy's own acks' callbacks;
- an index hold dropped (a lock, a host pin): the facade and its helpers
  only drop one through `RoomBroker.release` / `RoomBroker.unpin`, which
  wake the queues (`tests/cache/test_room_wakes.py` checks no other module
  unlocks the index);
- a request that ends (`RoomBroker.open_request`) and the cache closing
  (`RoomBroker.close`).

`DeviceRoom` takes device room: at once when nobody waits, else at the
head of the device queue, which evicts for its shortfall (one synchronous
`Evictor.device_pass` per round, then at most one wait) and gives up early
when nothing else will ever release room (the deadlock test,
`DeviceRoom.nothing_will_free`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import torch

from tiercache.controller import CopyAck, TierController
from tiercache.errors import CapacityError, ClosedError
from tiercache.evictor import Evictor
from tiercache.index.radix import Node, RadixIndex
from tiercache.ledger import Owner
from tiercache.loads import Started, TakeRoom
from tiercache.operations import Operations

__all__ = ["DeviceRoom", "RoomBroker", "RoomQueue"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def _nothing() -> None:
    pass


class RoomQueue:
    """Tasks waiting for room in one pool, served first come, first served.

    Only the task at the head of the queue tries to take room (evicting for
    it); the others wait behind it. Nothing polls: a waiter sleeps until
    `wake` is called, by every event that may release room and whenever a
    waiter leaves the queue, or until its own deadline, which a loop timer
    marks by waking the queue once.
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


class RoomBroker:
    """The room queues of one open cache, the index holds whose release wakes them, and host room.

    Args:
        index: the cache's prefix index.
        controller: the cache's controller (its ledger owns the pages).
        operations: what the cache has in flight (what may still release room).
        evictor: drops LRU nodes to make room.

    Loop thread only; nothing here awaits but the waits.
    """

    def __init__(
        self,
        index: RadixIndex,
        controller: TierController,
        operations: Operations,
        evictor: Evictor,
    ) -> None:
        self.index = index
        self.controller = controller
        self.operations = operations
        self.evictor = evictor
        self.device = RoomQueue()
        self.host = RoomQueue()
        self.open = True
        #: Requests between `request`'s match and their end.
        self.open_requests = 0
        self._forget: Callable[[], None] = _nothing

    def attach(self) -> None:
        """Wake the queues on every release the controller sees from now on."""
        self._forget = self.controller.add_settle_callback(self.wake)

    def close(self) -> None:
        """Stop serving: waiters wake and see the cache closed."""
        self.open = False
        self.wake()

    def detach(self) -> None:
        """Drop the settle callback `attach` added (idempotent)."""
        self._forget()
        # It refers to this broker: drop it, or the pools would wait for the collector.
        self._forget = _nothing

    def wake(self) -> None:
        """Wake the tasks waiting for device or host room: room may have appeared."""
        self.device.wake()
        self.host.wake()

    # -- holds whose release frees room ------------------------------------------

    def hold(self, node: Node) -> None:
        """Lock ``node`` and its ancestors in the index (nothing evicts them)."""
        self.index.lock(node)

    def release(self, node: Node) -> None:
        """Drop a `hold`; the nodes may be evicted now, so waiters look again."""
        try:
            self.index.unlock(node)
        finally:
            self.wake()

    @contextlib.contextmanager
    def holding(self, node: Node) -> Iterator[None]:
        """`hold` ``node`` for the block (the root needs none), `release` it on every path."""
        if node.is_root:
            yield
            return
        self.hold(node)
        try:
            yield
        finally:
            self.release(node)

    def pin(self, node: Node) -> None:
        """Keep ``node``'s host copy (a backup or a prefetch under it reads it)."""
        self.index.pin_host(node)

    def unpin(self, node: Node) -> None:
        """Drop a `pin`; the host copy may be evicted now, so waiters look again."""
        try:
            self.index.unpin_host(node)
        finally:
            self.wake()

    @contextlib.contextmanager
    def open_request(self) -> Iterator[None]:
        """Count a request as open for the block: its locks and slots free room when it ends."""
        self.open_requests += 1
        try:
            yield
        finally:
            self.open_requests -= 1
            self.wake()

    def held_outside_index(self) -> int:
        """Device slots allocated that no index node holds: requests', callers' of
        `alloc_device` (or, with an engine's allocator, the engine's), copies'."""
        ctl = self.controller
        return ctl.device_allocator.used - ctl.ledger.device.tokens_owned(Owner.INDEX)

    # -- host room ------------------------------------------------------------------

    def make_host_room(self, num_tokens: int) -> bool:
        """Evict LRU host-only nodes until ``num_tokens`` host slots are free; whether they are."""
        return self.evictor.make_host_room(num_tokens)

    def host_will_free(self) -> bool:
        """Whether something in flight may release host room (`Operations.host_may_free`)."""
        return self.operations.host_may_free(self.controller)

    async def host_room(self, num_tokens: int, wait_s: float) -> bool:
        """Make ``num_tokens`` host slots free, waiting up to ``wait_s`` seconds for room that copies hold.

        Host room that no copy, backup, prefetch or load holds is made by
        evicting LRU host-only nodes, at once. When that is not enough and
        something in flight may release host room, the caller waits in the
        host queue: first come, first served (only the head evicts),
        cancellable (a cancelled waiter takes nothing). With ``wait_s <= 0``
        it only tries once, without queueing.

        Returns:
            Whether the room is free now; the caller allocates it before its
            next ``await``.
        """
        if wait_s <= 0 or not self.host:
            if self.make_host_room(num_tokens):
                return True
            if wait_s <= 0 or num_tokens > self.controller.host_allocator.num_slots:
                return False

        async def attempt() -> bool | None:
            if not self.open:
                return False
            if self.make_host_room(num_tokens):
                return True
            return None if self.host_will_free() else False

        deadline = asyncio.get_running_loop().time() + wait_s
        return bool(await self.host.serve(attempt, deadline))


class DeviceRoom:
    """Taking device room: the device queue's turns, the eviction loop and the deadlock test.

    Args:
        broker: the queues, the holds and host room.
        timeout_s: how long a task waits for room (``config.alloc_timeout_s``).
        write_back: starts a device->host write of a node (the write
            policy's), or returns ``None`` when none started.
        on_write_back: counts a write back started for eviction.
    """

    def __init__(
        self,
        broker: RoomBroker,
        timeout_s: float,
        write_back: Callable[[Node], CopyAck | None],
        on_write_back: Callable[[], None],
    ) -> None:
        self.broker = broker
        self.timeout_s = timeout_s
        self._write_back = write_back
        self._on_write_back = on_write_back
        # Open requests waiting in the device queue, with the slots each holds
        # outside the index: they free nothing until they are served.
        self.blocked: dict[object, int] = {}

    async def alloc(self, num_tokens: int, own: int, key: object = None) -> torch.Tensor:
        """``num_tokens`` device slots (`take`): the caller's, or listed under ``key`` in the ledger
        (a request's lease) when given."""
        books = self.broker.controller.ledger.device

        def take() -> torch.Tensor | None:
            if key is not None:
                return books.grant(key, num_tokens)
            got = books.alloc(num_tokens)
            return None if got is None else got[0]

        return await self.take(lambda: num_tokens, take, own)

    def taker(self, own: int) -> TakeRoom:
        """`take` for a load back whose caller holds ``own`` slots outside the index."""

        async def take_room(need: Callable[[], int], take: Callable[[], Started | None]) -> Started:
            return await self.take(need, take, own)

        return take_room

    async def take(self, need: Callable[[], int], take: Callable[[], _T | None], own: int) -> _T:
        """Run ``take`` (synchronous: it allocates, or returns ``None``) once ``need()`` device slots can be had.

        Every device allocation that may wait goes through here: at once when
        nobody waits and the room is free, else in the device queue, where
        the head evicts for its shortfall (`turn`) and the others wait behind
        it. A call that needs no slots (an alloc of 0, a load back whose
        pages another call loaded meanwhile) never waits: ``take`` runs at once.

        Args:
            need: the slots still needed (re-read each turn: a load back
                may shrink while it waits); ``take`` never returns ``None``
                when it is 0.
            take: the allocation itself.
            own: device slots the caller itself holds outside the index (a
                request's earlier `Request.alloc`): waiting for those is
                futile; ``-1`` for a caller that is not an open request.

        Raises:
            CapacityError: the timeout passed, or nothing else holds or moves
                device slots, so waiting cannot help.
            ClosedError: the cache was closed while the caller waited.
        """
        queue = self.broker.device
        if not queue or need() <= 0:
            got = take()
            if got is not None:
                return got
        timeout = self.timeout_s
        deadline = asyncio.get_running_loop().time() + timeout
        key = object()

        async def attempt() -> _T | None:
            return await self.turn(need, take, own, deadline, key)

        if own >= 0:
            # This request now waits too: the head may find that nothing else will free room.
            self.blocked[key] = own
            queue.wake()
        try:
            got = await queue.serve(attempt, deadline, lambda: need() <= 0)
        finally:
            self.blocked.pop(key, None)
        if got is None:  # it needed room to the end: need() > 0 here
            raise CapacityError(
                f"no room for {need()} device slots within alloc_timeout_s={timeout}: "
                f"{self.broker.controller.device_allocator.available} free, "
                "the rest held by others"
            )
        return got

    async def turn(
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
        if not self.broker.open:
            raise ClosedError("the cache was closed while waiting for device room")
        alloc = self.broker.controller.device_allocator
        while (got := take()) is None:
            short = need() - alloc.available
            if short <= 0 or not await self.evict(short, deadline):
                break
        if got is not None:
            return got
        if self.nothing_will_free(own, key):
            raise CapacityError(
                f"cannot find {need()} device slots: {alloc.available} free, the rest locked "
                "or held by requests that wait for room themselves"
            )
        return None

    def nothing_will_free(self, own: int, key: object = None) -> bool:
        """Whether no other request, copy, load or task can release device slots.

        ``own`` is what the caller holds outside the index when it is an open
        request, ``-1`` for a direct `alloc_device` call (whose own holdings
        cannot be told from others': they count as others'). Open requests
        queued behind the caller (``key``: its entry in ``blocked``) release
        nothing before the caller is served: they hold and wait, as it does,
        and waiting would only end at the timeout.
        """
        b = self.broker
        blocked = [held for k, held in self.blocked.items() if k is not key]
        others_open = b.open_requests - (1 if own >= 0 else 0) - len(blocked)
        return (
            others_open <= 0
            and b.held_outside_index() <= max(own, 0) + sum(blocked)
            and not b.operations.device_may_free(b.controller)
            and len(b.device) <= 1 + len(blocked)
        )

    async def evict(self, num_tokens: int, deadline: float) -> int:
        """The one loop that makes device room (`TierCache.evict_device`). Returns slots freed.

        Each round is one synchronous pass over fresh LRU candidates
        (`Evictor.device_pass`: no await inside it, so no candidate goes
        stale), then at most one wait:

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
            step = self.broker.evictor.device_pass(
                num_tokens - freed, failed, stuck, self._starter(granted)
            )
            freed += step.freed
            homeless, granted = step.homeless, False
            if step.writes:
                await self.wait_write_backs(step.writes, failed)
            elif homeless is None:
                if step.stuck <= stuck:
                    break
                stuck |= step.stuck
            elif homeless.id in waited:
                failed.add(homeless.id)  # room was made for it, yet it could not be written
            else:
                waited.add(homeless.id)
                granted = await self.broker.host_room(homeless.num_tokens, deadline - loop.time())
                if not granted:
                    failed.add(homeless.id)
        return freed

    def _starter(self, granted: bool) -> Callable[[Node], CopyAck | None]:
        """How a pass starts a write back: if host room can be had now, without waiting.

        ``granted``: this task was just served by the host queue; else it
        does not go ahead of tasks waiting there.
        """

        def start(node: Node) -> CopyAck | None:
            b = self.broker
            if (b.host and not granted) or not b.make_host_room(node.num_tokens):
                return None
            ack = self._write_back(node)
            if ack is not None:
                self._on_write_back()
            return ack

        return start

    @staticmethod
    async def wait_write_backs(writes: list[tuple[Node, CopyAck]], failed: set[int]) -> None:
        """Wait for write backs to land; a node whose copy failed goes into ``failed``."""
        for node, ack in writes:
            try:
                await ack
            except Exception as e:
                # The copy has settled and the write policy's done callback
                # has dropped the host copy: the node is device-only, as before.
                logger.warning("a write back of %d tokens failed: %r", node.num_tokens, e)
                failed.add(node.id)
