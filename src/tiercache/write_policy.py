"""`WritePolicy`: how new KV goes down the tiers (device -> host -> storage).

``write_through`` writes a node to host when it is inserted;
``write_through_selective`` when its hit count reaches
``config.write_through_threshold``; ``write_back`` only when eviction needs
it to leave the device (`WritePolicy.write_back`). Once a node's host copy
has landed it is backed up to storage, if a backend is attached.

A write-through that finds the host short only because copies, backups,
prefetches or loads in flight hold its room is deferred, not dropped: a
background task waits for host room (`RoomBroker.host_room`, up to
``config.alloc_timeout_s``) and writes it then.

Loop thread only; the decisions are synchronous.
"""

from __future__ import annotations

from tiercache.cache_values import CacheStats
from tiercache.config import TierCacheConfig
from tiercache.controller import CopyAck, Ready, TierController
from tiercache.errors import StateError
from tiercache.index.radix import Node, RadixIndex
from tiercache.operations import Operations
from tiercache.room import RoomBroker
from tiercache.storage_tier import BackupOperation

__all__ = ["WritePolicy"]


class WritePolicy:
    """The write policy of one open cache.

    Args:
        config: the cache's configuration (the policy, its threshold, the timeout).
        room: the cache's room broker (host room, index holds).
        stats: the cache's counters.
    """

    def __init__(self, config: TierCacheConfig, room: RoomBroker, stats: CacheStats) -> None:
        self.config = config
        self.room = room
        self.stats = stats

    @property
    def _ctl(self) -> TierController:
        return self.room.controller

    @property
    def _index(self) -> RadixIndex:
        return self.room.index

    @property
    def _ops(self) -> Operations:
        return self.room.operations

    # -- when to write ------------------------------------------------------------

    def on_match(self, last_device_node: Node) -> None:
        """After a match: ``write_through_selective`` writes the nodes that reached the threshold."""
        if self.config.write_policy != "write_through_selective":
            return
        for n in self._index.path(last_device_node):
            if n.hit_count >= self.config.write_through_threshold and not n.on_host:
                self.write_node(n, defer=True)

    def on_insert(self, node: Node | None, ready: Ready) -> None:
        """After an insert: ``write_through`` writes the new node (reattached host-only
        nodes already have a host copy: nothing to write)."""
        if node is not None and self.config.write_policy == "write_through":
            self.write_node(node, ready=ready, defer=True)

    def write_back(self, node: Node) -> CopyAck | None:
        """Write a device-only node to host for eviction (the caller made host room)."""
        return self.write_node(node)

    # -- writing ----------------------------------------------------------------------

    def write_node(self, node: Node, *, ready: Ready = None, defer: bool = False) -> CopyAck | None:
        """Start a device->host write of ``node``; its storage backup follows the ack.

        With ``defer`` (write-through), a host that is short only because
        copies, backups, prefetches or loads in flight hold its room does not
        leave the node device-only: a background task waits for the room and
        writes it then.
        """
        if node.on_host or node.device_indices is None or node.write_in_flight:
            return None
        ctl = self._ctl
        if defer and self.room.host:
            self._defer(node, ready)  # others wait for host room first
            return None
        # Make room on host by dropping LRU host-only nodes (those backed
        # up to storage can come back from there).
        if not self.room.evictor.make_host_room(node.num_tokens) and defer:
            self._defer(node, ready)
            return None
        ack = ctl.submit_write(node.device_indices, node_id=node.id, track=False, ready=ready)
        if ack is None:
            self.stats.host_writes_skipped += 1
            return None  # host full: the node stays device-only
        wid = self._index.begin_write(node, ack.host_indices)
        ack.add_done_callback(lambda a: self._write_done(wid, a))
        return ack

    def _defer(self, node: Node, ready: Ready) -> None:
        """Write ``node`` (and device-only nodes above it) once host room frees."""
        room = self.room
        if (
            self.config.alloc_timeout_s <= 0
            or node.num_tokens > self._ctl.host_allocator.num_slots
            or not (room.host_will_free() or room.host)
            or not self._ops.defer(node.id)
        ):
            self.stats.host_writes_skipped += 1
            return  # nothing will free host room: the node stays device-only

        async def write() -> None:
            try:
                if not await room.host_room(node.num_tokens, self.config.alloc_timeout_s):
                    return
                if not room.open or node.parent is None:
                    return
                # A split meanwhile moved part of the key into a new parent:
                # write every device-only node of the path, top down.
                for n in self._index.path(node):
                    if not n.on_host and n.device_indices is not None and not n.write_in_flight:
                        if not room.make_host_room(n.num_tokens):
                            return
                        self.write_node(n, ready=ready)
            finally:
                self._ops.end_deferred(node.id)

        self._ops.spawn(write(), "a deferred write-through")

    def _write_done(self, wid: int, ack: CopyAck) -> None:
        """A host write settled: record it in the index, then back the nodes up.

        Runs among the ack's callbacks: the controller's settle callbacks,
        which wake the room waiters, run after it.
        """
        try:
            nodes = self._index.finish_write(wid, ok=not ack.failed())
        except StateError:  # flushed meanwhile
            return
        ctl = self._ctl
        if ack.failed():
            books = ctl.ledger.host
            books.free(books.pages(ack.host_indices))
            return
        if ctl.storage_attached:
            for n in nodes:
                self.backup(n)

    # -- storage backups ------------------------------------------------------------

    def backup(self, node: Node) -> BackupOperation | None:
        """Start backing ``node`` up to storage; the operation, or ``None`` when none started."""
        if node.backuped_storage or node.host_indices is None or node.parent is None:
            return None
        room, index = self.room, self._index
        room.pin(node)
        try:
            op = self._ctl.write_storage(
                node.host_indices,
                list(node.key),
                node_id=node.id,
                hash_values=list(node.page_hashes),
                track=False,  # awaited below: nobody drains it
            )
        except BaseException:
            room.unpin(node)  # a refused backup holds nothing
            raise
        if op is None:
            room.unpin(node)
            return None
        self._ops.add_backup(op)

        async def wait() -> None:
            try:
                await op.wait()
            finally:
                self._ops.end_backup(op)
                if node.parent is not None or node.host_pin:
                    room.unpin(node)  # an unpinned host-only node may be evicted now
                if op.succeeded:
                    if node.parent is not None:
                        index.mark_backed_up(node)
                    self.stats.storage_backups += 1

        self._ops.spawn(wait(), "a storage backup's bookkeeping")
        return op

    def backup_all(self) -> list[BackupOperation | None]:
        """Start a backup of every host-resident node not yet in storage."""
        if not self._ctl.storage_attached:
            return []
        return [
            self.backup(n)
            for n in list(self._index.nodes())
            if not n.is_root and n.on_host and not n.write_in_flight and not n.backuped_storage
        ]
