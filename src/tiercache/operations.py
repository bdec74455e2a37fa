"""`Operations`: what the facade has in flight, and waiting for all of it to end.

The facade starts work that outlives the verb that started it: loads back
(`LoadBacks`), storage backups whose bookkeeping follows their end, deferred
write-throughs waiting for host room, prefetches finished on behalf of a
cancelled caller. This registry holds every one of them, so that three
questions have one answer each:

- what may still release room (`device_may_free`, `host_may_free`: the
  room broker asks before it gives up on a waiter);
- when everything has ended (`wait_idle`: `TierCache.wait_idle` and
  `TierCache.flush` wait on it);
- which tasks the facade must join at close (`join`).

The background tasks run in the cache's `TaskGroup` (a failure surfaces at
the next call or at close); the registry keeps the facade's own among them.
Every method but the waits is synchronous and runs on the cache's loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from tiercache._tasks import TaskGroup
from tiercache.controller import TierController
from tiercache.index.radix import RadixIndex
from tiercache.loads import LoadBacks
from tiercache.storage_tier import BackupOperation

__all__ = ["Operations"]


class Operations:
    """The facade's operations in flight (false when there are none).

    Args:
        tasks: the cache's task group (shared with the controller and its storage tier).
    """

    def __init__(self, tasks: TaskGroup) -> None:
        self.tasks = tasks
        #: Loads back in flight; set when the cache opens, ``None`` once it closed.
        self.loads: LoadBacks | None = None
        self._own: set[asyncio.Task[Any]] = set()
        self._backups: set[BackupOperation] = set()
        #: Nodes whose write-through waits for host room (a task each).
        self._deferred: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self._own or self._backups or self.loads)

    # -- what is in flight -------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        """Run ``coro`` in the task group as one of the facade's own tasks."""
        task = self.tasks.spawn(coro, what)
        self._own.add(task)
        task.add_done_callback(self._own.discard)

    def add_backup(self, op: BackupOperation) -> None:
        """Count ``op`` as in flight until `end_backup`."""
        self._backups.add(op)

    def end_backup(self, op: BackupOperation) -> None:
        self._backups.discard(op)

    def defer(self, node_id: int) -> bool:
        """Mark a write-through of node ``node_id`` as waiting; false if one waits already."""
        if node_id in self._deferred:
            return False
        self._deferred.add(node_id)
        return True

    def end_deferred(self, node_id: int) -> None:
        self._deferred.discard(node_id)

    @property
    def deferred_writes(self) -> int:
        """Write-throughs waiting for host room."""
        return len(self._deferred)

    # -- what may release room ------------------------------------------------------

    def device_may_free(self, ctl: TierController) -> bool:
        """Whether a copy, a load back or a task of the facade may release device slots
        (a deferred write-through frees none: it only copies to host)."""
        return bool(ctl.busy or self.loads or len(self._own) > len(self._deferred))

    def host_may_free(self, ctl: TierController) -> bool:
        """Whether something in flight may release host room: a device->host copy (a
        failed one frees its slots; a finished one may become evictable), a storage
        backup (it pins its nodes), a prefetch (it holds its slots) or a load back
        (it locks its nodes)."""
        return bool(
            ctl.busy
            or self._backups
            or self.loads
            or (ctl.storage is not None and ctl.storage.busy)
        )

    # -- waiting --------------------------------------------------------------------

    async def join(self) -> None:
        """Wait for the facade's own tasks (not the storage tier's), those started meanwhile too."""
        while self._own:
            await asyncio.wait(set(self._own))

    async def wait_idle(self, ctl: TierController, index: RadixIndex) -> None:
        """Wait for every copy, backup and task in flight, and their completion callbacks."""
        while True:
            await ctl.wait_idle()
            await self.join()
            if ctl.storage is not None:
                await ctl.storage.wait_idle()
            # Completions are delivered by callbacks scheduled on the loop:
            # let them run, then check nothing new started.
            await asyncio.sleep(0)
            if (
                not self._own
                and not ctl.busy
                and not index.pending_writes()
                and (ctl.storage is None or not ctl.storage.busy)
            ):
                return
