"""`Evictor`: the decisions that make room, one synchronous pass at a time.

A pass reads the index as it is, frees what can leave now and returns what
it could not do at once (`EvictionPass`: write backs it started, the node
that found no host room, the nodes that must stay). It keeps nothing across
awaits: the loop that waits between passes (`room.DeviceRoom.evict`) holds
the little it carries from one pass to the next (node ids), and every pass
takes fresh candidates, so none goes stale.

Loop thread only; nothing here awaits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tiercache.cache_values import CacheStats
from tiercache.controller import CopyAck, TierController
from tiercache.index.radix import Node, RadixIndex
from tiercache.ledger import Owner

__all__ = ["EvictionPass", "Evictor"]


@dataclass(slots=True)
class EvictionPass:
    """What one synchronous pass over the device LRU candidates did, and left to do."""

    freed: int = 0
    #: Write backs it started: once they land, the next pass evicts their nodes.
    writes: list[tuple[Node, CopyAck]] = field(default_factory=list)
    #: The first node that could not be written back for want of host room.
    homeless: Node | None = None
    #: Nodes that can neither leave nor be dropped (their write back failed,
    #: and host-only children or a pin need them): the next pass looks past them.
    stuck: set[int] = field(default_factory=set)


class Evictor:
    """Drops LRU nodes from the device and host tiers of one open cache.

    Args:
        index: the cache's prefix index.
        controller: the cache's controller (its ledger frees the pages).
        stats: the cache's counters (evictions).
    """

    def __init__(self, index: RadixIndex, controller: TierController, stats: CacheStats) -> None:
        self.index = index
        self.controller = controller
        self.stats = stats

    # -- device ---------------------------------------------------------------------

    def device_pass(
        self,
        num_tokens: int,
        failed: set[int],
        stuck: set[int],
        write_back: Callable[[Node], CopyAck | None],
    ) -> EvictionPass:
        """Evict what can leave the device now, LRU first; start write backs for the rest.

        The candidates come from the index in an order where a node follows
        its device-resident children. A node whose child stays on the device
        stays too. A node whose child leaves once its write back lands is
        written back as well (a pin that child's storage backup takes could
        keep a device-only parent from ever being offered again), and leaves
        in a later pass.

        Args:
            num_tokens: device slots still wanted.
            failed: nodes no write back will save: dropped when nothing needs them.
            stuck: nodes an earlier pass found must stay: not offered again.
            write_back: starts a write back of a device-only node, or returns
                ``None`` when host room cannot be had now.
        """
        out = EvictionPass()
        stays: set[int] = set()  # a child stays on the device
        waits: set[int] = set()  # a child leaves once its write back lands
        for node in self.index.evict_device_candidates(num_tokens, skip=stuck):
            if node.id in stays:
                fate = "stays"
            elif node.id not in waits and node.on_host:
                out.freed += self._leave_device(node)
                continue
            else:
                fate = self._save_or_drop(node, failed, write_back, out)
                if fate == "gone":
                    continue
            assert node.parent is not None
            (stays if fate == "stays" else waits).add(node.parent.id)
        return out

    def _save_or_drop(
        self,
        node: Node,
        failed: set[int],
        write_back: Callable[[Node], CopyAck | None],
        out: EvictionPass,
    ) -> str:
        """Decide the fate of a candidate that cannot simply leave the device now.

        Returns:
            ``"gone"`` (dropped: its KV is lost), ``"leaving"`` (its host
            copy exists or is being written: it leaves in a later pass) or
            ``"stays"``.
        """
        if node.on_host:
            return "leaving"  # waits for a child's write back
        if node.id in failed:
            dropped = self._drop_device_only(node)
            out.freed += dropped
            if not dropped:
                out.stuck.add(node.id)
            return "gone" if dropped else "stays"
        ack = write_back(node)
        if ack is not None:
            out.writes.append((node, ack))
            return "leaving"
        if out.homeless is None:
            out.homeless = node
        return "stays"

    def _leave_device(self, node: Node) -> int:
        """Free the device copy of a node that has a host copy; returns slots freed."""
        return self._free_device(self.index.mark_device_evicted(node))

    def _drop_device_only(self, node: Node) -> int:
        """Drop a device-only node (its KV is lost) unless host-only children or a pin need it."""
        if node.children or node.host_pin:
            return 0
        dev = node.device_indices
        assert dev is not None
        self.index.remove(node)
        return self._free_device(dev)

    def _free_device(self, dev: torch.Tensor) -> int:
        """Free slots the index gave up, behind a fence on the engine's compute stream
        (`TierController.use_compute_stream`); count the eviction. Returns slots freed."""
        ctl = self.controller
        books = ctl.ledger.device
        pages = books.pages(dev)
        if dev.numel():
            books.give(pages, Owner.CALLER)
        books.free(pages, fence=ctl.ready_event(None, "free_device"))
        self.stats.device_evictions += 1
        self.stats.device_evicted_tokens += dev.numel()
        return int(dev.numel())

    # -- host -------------------------------------------------------------------------

    def evict_host(self, num_tokens: int) -> int:
        """Drop LRU host-only nodes (not pinned, locked or leased) for ``num_tokens`` slots.

        Returns:
            Host slots freed.
        """
        if num_tokens <= 0:
            return 0
        books = self.controller.ledger.host
        freed = 0
        for node in self.index.evict_host_candidates(num_tokens):
            host = node.host_indices
            assert host is not None
            if books.leased(books.pages(host)):
                continue
            self.index.remove(node)
            books.free(books.pages(host))
            freed += host.numel()
            self.stats.host_evictions += 1
            self.stats.host_evicted_tokens += host.numel()
        return freed

    def make_host_room(self, num_tokens: int) -> bool:
        """Evict LRU host-only nodes until ``num_tokens`` host slots are free; whether they are."""
        alloc = self.controller.host_allocator
        if alloc.available < num_tokens:
            self.evict_host(num_tokens - alloc.available)
        return alloc.available >= num_tokens
