"""The background tasks of one cache, and the one rule for their failures.

The facade, the controller and the storage tier each start work that nobody
awaits at once: a deferred write-through, a detach after a storage fault, a
prefetch's query and reads, a backup. They all spawn it into one
`TaskGroup`, owned by the object at the top (a `TierCache` makes one and
hands it down; a `TierController` used alone makes its own). The group has
one failure policy:

- a task that ends with an exception is logged once, when it ends;
- the first such failure is raised, as `StateError`, by the next call to
  `TaskGroup.raise_failure` (every public verb of the owner calls it) or by
  `TaskGroup.aclose`, whichever comes first, and then never again;
- a cancelled task is not a failure.

Waiting is event-driven: `TaskGroup.join` wakes when the tasks it waits for
end, never on a timer. Everything here runs on the loop thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from tiercache.errors import StateError

__all__ = ["TaskGroup"]

logger = logging.getLogger("tiercache")

T = TypeVar("T")


class TaskGroup:
    """Tasks spawned by one cache (or one standalone controller), supervised together.

    Args:
        name: what the group belongs to, for log lines and errors (``"cache"``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._failure: BaseException | None = None
        self._failures = 0
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, T], what: str) -> asyncio.Task[T]:
        """Run ``coro`` as a task of this group.

        Args:
            coro: the work.
            what: a few words naming it, for the log line if it fails.

        Returns:
            The task (awaiting or cancelling it is allowed; a failure is
            still reported by the group).

        Raises:
            StateError: the group is closed (``coro`` is closed, not run).
        """
        if self._closed:
            coro.close()
            raise StateError(f"the {self.name} is closed: cannot start {what}")
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._ended(t, what))
        return task

    def _ended(self, task: asyncio.Task[Any], what: str) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        self._failures += 1
        logger.error("tiercache %s: %s failed: %r", self.name, what, exc, exc_info=exc)
        if self._failure is None:
            self._failure = exc

    @property
    def failures(self) -> int:
        """Tasks that have ended with an exception, since the group was made."""
        return self._failures

    def __len__(self) -> int:
        """Tasks still running."""
        return len(self._tasks)

    def raise_failure(self) -> None:
        """Raise the first failure not yet raised, once.

        Raises:
            StateError: a task failed since the last call; its exception is the cause.
        """
        err, self._failure = self._failure, None
        if err is not None:
            raise StateError(f"a background task of the {self.name} failed: {err!r}") from err

    async def join(self) -> None:
        """Return once every task of the group has ended, those started meanwhile too.

        Failures are not raised here (see `raise_failure`). Cancelling the
        caller leaves the tasks running.
        """
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def aclose(self, *, cancel: bool = False) -> None:
        """Refuse new tasks, end the running ones, then raise a failure not yet raised.

        Args:
            cancel: cancel the running tasks instead of waiting for them.

        Raises:
            StateError: a task failed and that failure was not raised before.
        """
        self._closed = True
        if cancel:
            for task in list(self._tasks):
                task.cancel()
        await self.join()
        self.raise_failure()

    def __repr__(self) -> str:
        return f"TaskGroup({self.name!r}, running={len(self._tasks)}, failures={self._failures})"
