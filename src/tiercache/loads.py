"""Loads back in flight: one `LoadOp` per load, and the `LoadBacks` registry of them.

A load back attaches device slots to the index before their bytes land, and
locks the loaded path until it has. A `LoadOp` holds all of that (the ack and
handle of the copy, the slots it fills, the locked node, the slots of nodes a
failed load took away that this load still writes) and gives it back in one
`LoadOp.settle`: on failure it hands its nodes back to the host tier; either
way it frees what nobody owns once the copy has settled, then unlocks. The
registry answers what a prefix waits on: which loads fill which slots, and
where the landed part of a match ends, and starts the loads of
`TierCache.load_back` (`LoadBacks.load`, `LoadBacks.with_loads`).

Everything runs on the cache's loop thread; the bookkeeping is synchronous
(no await inside a decision).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tiercache.controller import CopyAck, LoadHandle, TierController
from tiercache.errors import StateError
from tiercache.index.radix import MatchResult, Node, RadixIndex
from tiercache.ledger import Lease, Owner
from tiercache.memory.allocator import cat_slots

__all__ = ["LoadBacks", "LoadOp", "Started", "TakeRoom"]

logger = logging.getLogger(__name__)

#: What `LoadBacks.start` returns: the load's ack and handle, ``(None, None)``
#: when there was nothing left to load, ``None`` when the device is full.
Started = tuple[CopyAck, LoadHandle] | tuple[None, None]
#: ``take_room(need, take)``: runs ``take`` once ``need()`` device slots can be had.
TakeRoom = Callable[[Callable[[], int], Callable[[], Started | None]], Awaitable[Started]]


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether CPU int64 slot tensors ``a`` and ``b`` share a slot (numpy's table lookup:
    0.6 ms for a 128k-token prompt, where `torch.isin` sorts and takes 24)."""
    x, y = a.numpy(), b.numpy()
    if not x.size or not y.size:
        return False
    return bool(np.isin(x, y, kind="table").any())


@dataclass(slots=True, eq=False)
class LoadOp:
    """One load back in flight, and everything it holds until it settles."""

    ack: CopyAck
    handle: LoadHandle
    device_indices: torch.Tensor
    #: The deepest node that was on the device when it started (the loaded path hangs under it).
    anchor: Node
    #: The node locked until the load settles.
    target: Node
    #: Slots of nodes a failed load took from the index that this load still writes.
    orphans: list[torch.Tensor] = field(default_factory=list)

    def failed(self) -> bool:
        # A copy run inline may have failed before its ack is resolved.
        return self.handle.layers.error is not None or (self.ack.done() and self.ack.failed())

    def settle(self, loads: LoadBacks) -> None:
        """Give back what the load holds: roll back its nodes if it failed, free its
        orphans once its copy is settled in the controller's books, unlock its path."""
        if self.failed():
            loads.roll_back(self)
        self._free_orphans(loads.controller)
        try:
            loads.unlock(self.target)  # wakes the room waiters
        except StateError:
            pass  # flushed meanwhile

    def _free_orphans(self, ctl: TierController) -> None:
        """Free the orphans once the copy is settled (a copy run inline on the loop has
        ended before its ack resolved: its pages are still leased until then), behind a
        fence on the compute stream: attention over layers that landed may still read them."""
        slots = self.orphans
        if not slots:
            return
        books = ctl.ledger.device

        def free(_ack: object = None) -> None:
            if ctl.ledger.device is not books:
                return
            fence = ctl.ready_event(None, "free_device")
            for dev in slots:
                books.free(books.pages(dev), fence=fence)

        if self.ack.done():
            free()
        else:
            self.ack.add_done_callback(free)


class LoadBacks:
    """The loads back in flight of one cache (false when there are none).

    Args:
        index: the cache's prefix index.
        controller: the cache's controller (its ledger owns the pages).
        is_open: whether the cache is still open (a closed one settles nothing).
        unlock: drops an index lock and wakes the room waiters (`RoomBroker.release`).
    """

    def __init__(
        self,
        index: RadixIndex,
        controller: TierController,
        is_open: Callable[[], bool],
        unlock: Callable[[Node], None],
    ) -> None:
        self.index = index
        self.controller = controller
        self._is_open = is_open
        self.unlock = unlock
        self._ops: dict[CopyAck, LoadOp] = {}

    def __bool__(self) -> bool:
        return bool(self._ops)

    def __len__(self) -> int:
        return len(self._ops)

    def start(self, target: Node) -> Started | None:
        """Start loading the host-only path down to ``target`` (locked by the caller; no await).

        Returns:
            The load's ack and handle; ``(None, None)`` when a concurrent call
            loaded the path meanwhile; ``None`` when the device is full.
        """
        path = self.index.load_path(target)
        if not path:
            return None, None
        ctl = self.controller
        host = cat_slots([n.host_indices for n in path if n.host_indices is not None])
        ack = ctl.submit_load(host, node_id=target.id, track=False)
        if ack is None:
            return None
        handle = ctl.start_loading()
        assert handle is not None
        anchor = path[0].parent
        assert anchor is not None
        self.index.attach_device(target, ack.device_indices)
        books = ctl.ledger.device
        books.give(books.pages(ack.device_indices), Owner.INDEX)
        self._ops[ack] = LoadOp(ack, handle, ack.device_indices, anchor, target)
        # On the handle, not the ack: its callbacks run before any awaiter of
        # the handle (or of a later request) sees the load end, so the
        # rollback of a failed load is done by then.
        handle.add_done_callback(lambda _h: self.settle_finished())
        return ack, handle

    def settle_finished(self) -> None:
        """Settle every load whose copy has ended (from the handle's callback, and before
        each public verb: a copy run inline on the loop ends before any callback runs)."""
        if not self._is_open():
            return
        for ack, op in list(self._ops.items()):
            if op.handle.done():
                del self._ops[ack]
                op.settle(self)

    def roll_back(self, failed: LoadOp) -> None:
        """Take from the index every node that claims slots of ``failed``, and what hangs under it.

        Slots that a load still in flight writes become its orphans (freed
        when it settles); the rest ``failed``'s own.
        """
        books = self.controller.ledger.device
        bad = set(books.pages(failed.device_indices).tolist())
        ps = books.page_size
        try:
            self.index.path(failed.anchor)
        except StateError:
            return
        roots: list[Node] = []
        stack = list(failed.anchor.children.values())
        while stack:
            n = stack.pop()
            if n.device_indices is None:
                continue
            if int(n.device_indices[0]) // ps in bad:
                roots.append(n)
            else:
                stack.extend(n.children.values())
        for n in roots:
            for dev in self.index.detach_failed_load(n):
                books.give(books.pages(dev), Owner.CALLER)
                owner = next(
                    (p for p in self._ops.values() if overlap(dev[:1], p.device_indices)), None
                )
                (owner or failed).orphans.append(dev)
        logger.warning(
            "a load back of %d tokens failed: its nodes are host-only again",
            failed.device_indices.numel(),
        )

    def landed(self, m: MatchResult) -> MatchResult:
        """``m`` with its device part ending where a load still in flight begins.

        Slots whose bytes have not landed are never reported as on the
        device: the nodes they hold count as host hits (they are on the
        host), and a load back of the match hands them out with the handle
        of the load that fills them.
        """
        if not self._ops or not m.device_length:
            return m
        books = self.controller.ledger.device
        cut = 0
        for node in self.index.path(m.last_device_node):
            dev = node.device_indices
            assert dev is not None
            if books.leased(books.pages(dev[:1]), Lease.FILL):
                assert node.parent is not None
                return MatchResult(
                    m.device_indices[:cut],
                    node.parent,
                    m.host_hit_length + m.device_length - cut,
                    m.last_host_node if m.host_hit_length else m.last_device_node,
                    m.last_node,
                    m.prior_hash,
                )
            cut += node.num_tokens
        return m

    def over(self, slots: torch.Tensor, but: LoadHandle | None = None) -> list[LoadHandle]:
        """The handles of the loads in flight into any of ``slots`` (``but`` left out), oldest first."""
        if not slots.numel():
            return []
        return [
            op.handle
            for op in self._ops.values()
            if op.handle is not but and overlap(op.device_indices, slots)
        ]

    def under(self, cached: torch.Tensor, dev: torch.Tensor) -> list[tuple[LoadHandle, bool]]:
        """The loads in flight into ``cached`` or ``dev``; each with whether it fills ``dev``."""
        out = []
        for op in self._ops.values():
            mine = overlap(op.device_indices, dev)
            if mine or overlap(op.device_indices, cached):
                out.append((op.handle, mine))
        return out

    async def load(
        self, target: Node, lock: Callable[[Node], None], take_room: TakeRoom
    ) -> LoadHandle | None:
        """Load the host-only path down to ``target`` once device room is had.

        ``lock`` locks ``target`` first (`RoomBroker.hold`); the lock is the
        load's until it settles; when none started, or on any error, it is
        dropped here. ``take_room(need, take)`` runs ``take`` once ``need()``
        device slots can be had (`room.DeviceRoom.take`).

        Returns:
            The load's handle, or ``None`` when a concurrent call loaded the path meanwhile.

        Raises:
            StateError: ``target`` is no longer in the index (match again).
            CapacityError: no device room (see `TierCache.alloc_device`).
        """
        try:
            lock(target)
        except StateError as e:
            raise StateError("the index changed since this match: match again") from e

        def need() -> int:
            return sum(n.num_tokens for n in self.index.load_path(target))

        try:
            ack, handle = await take_room(need, lambda: self.start(target))
        except BaseException:
            self.unlock(target)
            raise
        if ack is None:
            self.unlock(target)
        return handle

    async def with_loads(
        self,
        target: Node,
        extra_key: str | None,
        handle: LoadHandle | None,
        recheck: Callable[[], object],
        *,
        wait: bool = True,
    ) -> tuple[torch.Tensor, LoadHandle | None]:
        """The device slots of the prefix down to ``target``, and the handle their bytes wait on.

        ``handle`` is the caller's own load, if it started one. Slots that
        other loads still fill are only handed out with a handle that
        covers them: with no load of its own and one other in flight, that
        load's handle; with more, the call waits for all but the last
        (its own comes last). ``recheck`` runs after each wait (the facade's
        check: open, no background failure). Without ``wait`` (`TierCache.request`,
        which collects every load its prefix waits on itself) it returns at once.

        Raises:
            StateError: a load this prefix waited for failed (its nodes went
                back to the host tier): match again.
        """
        while True:
            prefix = self.index.match_prefix(
                self.index.prefix_tokens(target), extra_key, touch=False, checked=True
            ).device_indices
            if not wait:
                return prefix, handle
            others = self.over(prefix, but=handle)
            if not others or (handle is None and len(others) == 1):
                return prefix, handle if handle is not None else (others[0] if others else None)
            earlier = others if handle is not None else others[:-1]
            for h in earlier:
                try:
                    await h
                except Exception as e:
                    raise StateError(
                        f"the load back of this prefix failed ({e!r}): match again"
                    ) from e
            recheck()
