"""`GuardedBackend`: a storage backend's calls under a deadline, checked, counted and
reported to a `FaultPolicy`.

The storage tier (`tiercache.storage_tier`) makes every backend call through
one: a call that times out, raises, or answers outside the backend contract
(a plugin's bug) becomes a `StorageError` (a miss for the caller) and a
failure for the fault policy; while the policy has the backend down, the call
is not made at all. Every call's latency and outcome go to `tiercache.observe`.
"""

from __future__ import annotations

import asyncio
import operator
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from tiercache._aio import bounded
from tiercache._checks import is_int
from tiercache.errors import BackendUnavailableError, StorageError, StorageTimeoutError
from tiercache.observe import observe
from tiercache.storage.base import PageBuffer, PageKey, StorageBackend
from tiercache.storage.fault_policy import FaultPolicy

__all__ = ["CallCounts", "GuardedBackend"]

T = TypeVar("T")


class CallCounts(Protocol):
    """Where a `GuardedBackend` counts failed and skipped calls (an owner's stats)."""

    storage_errors: int
    storage_timeouts: int
    skipped_while_down: int


def _observe_call(what: str, task: asyncio.Future[Any], seconds: float, source: object) -> None:
    """Report one backend call's latency and outcome to `tiercache.observe`."""
    outcome = "cancelled" if task.cancelled() else "error" if task.exception() else "ok"
    observe("storage", what, seconds, outcome, source=source)


def _exists_answer(answer: object, num_keys: int) -> int:
    """A backend's ``batch_exists`` answer as a count of ``num_keys`` keys.

    Raises:
        StorageError: not an int (a plugin that breaks the contract): a miss,
            never a failure of the cache.
    """
    if not is_int(answer):
        raise StorageError(
            f"the backend answered exists with {type(answer).__name__}, not an int count"
        )
    return max(0, min(operator.index(answer), num_keys))  # type: ignore[arg-type]


def _flags_answer(answer: object, what: str, num_pages: int) -> Sequence[object]:
    """A backend's ``batch_get`` / ``batch_set`` answer: one flag per page.

    Raises:
        StorageError: not a list, tuple or 1-D array of ``num_pages`` flags
            (a plugin that breaks the contract). Too many flags would claim
            pages that were never asked for, too few leave pages unaccounted:
            the whole batch is a miss.
    """
    if isinstance(answer, np.ndarray) and answer.ndim == 1:
        answer = answer.tolist()
    if not isinstance(answer, list | tuple):
        raise StorageError(
            f"the backend answered {what} with {type(answer).__name__}, not a list of flags"
        )
    if len(answer) != num_pages:
        raise StorageError(
            f"the backend answered {what} with {len(answer)} flags for {num_pages} pages"
        )
    return answer


class GuardedBackend:
    """``backend``'s batch calls under ``timeout_s``, reported to ``faults``.

    Args:
        backend: the open backend.
        faults: the backend's fault policy: told of every call's outcome,
            asked whether the backend is down.
        timeout_s: the deadline of every call.
        counts: where failed (``storage_errors``, ``storage_timeouts``) and
            skipped (``skipped_while_down``) calls are counted.
        source: the source of the call timings in `tiercache.observe`.

    Every method runs on the owner's event loop.
    """

    def __init__(
        self,
        backend: StorageBackend,
        faults: FaultPolicy,
        *,
        timeout_s: float,
        counts: CallCounts,
        source: object | None = None,
    ) -> None:
        self.backend = backend
        self.faults = faults
        self.timeout_s = timeout_s
        self.counts = counts
        self.source = source

    async def exists(self, keys: list[PageKey]) -> int:
        """``batch_exists``: how many leading ``keys`` are stored.

        Raises:
            StorageError: the call failed, timed out, was skipped (the backend
                is down: `BackendUnavailableError`) or broke the contract.
        """
        n = len(keys)
        return await self._call(
            "exists", self.backend.batch_exists(keys), lambda a: _exists_answer(a, n)
        )

    async def get(self, keys: list[PageKey], pages: list[PageBuffer]) -> Sequence[object]:
        """``batch_get`` into ``pages``: one flag per page (raises as `exists`)."""
        n = len(keys)
        return await self._call(
            "get", self.backend.batch_get(keys, pages), lambda a: _flags_answer(a, "get", n)
        )

    async def set(self, keys: list[PageKey], pages: list[PageBuffer]) -> Sequence[object]:
        """``batch_set`` from ``pages``: one flag per page (raises as `exists`)."""
        n = len(keys)
        return await self._call(
            "set", self.backend.batch_set(keys, pages), lambda a: _flags_answer(a, "set", n)
        )

    async def _call(self, what: str, coro: Awaitable[Any], check: Callable[[Any], T]) -> T:
        """Await a backend call under the deadline; errors become `StorageError`.

        ``check`` turns the backend's answer into the caller's value, or
        raises `StorageError` for an answer that breaks the backend contract
        (a plugin's bug): that is a failed call too, a miss.

        While the fault policy has the backend down the call is not made: it
        fails at once with `BackendUnavailableError`. A call that times out,
        or whose caller is cancelled, is cancelled and has settled before this
        raises (it may be writing into host pages).
        """
        if self.faults.down:
            if asyncio.iscoroutine(coro):
                coro.close()
            self.counts.skipped_while_down += 1
            raise BackendUnavailableError(
                f"the storage backend is {self.faults.state.value} under the fault policy"
            )
        task = asyncio.ensure_future(coro)
        t0 = time.perf_counter()
        task.add_done_callback(
            lambda t: _observe_call(what, t, time.perf_counter() - t0, self.source)
        )
        try:
            result = check(await bounded(task, self.timeout_s))
        except TimeoutError:
            self.counts.storage_timeouts += 1
            self.faults.failed()
            raise StorageTimeoutError(
                f"storage {what} timed out after {self.timeout_s} s"
            ) from None
        except StorageError:
            self.counts.storage_errors += 1
            self.faults.failed()
            raise
        except Exception as e:
            # A backend that raises outside the StorageError tree is still a storage failure.
            self.counts.storage_errors += 1
            self.faults.failed()
            raise StorageError(f"storage {what} failed: {e!r}") from e
        self.faults.succeeded()
        return result
