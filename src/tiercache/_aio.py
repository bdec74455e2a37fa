"""Awaiting work that must end before its caller regains control.

A ``run_in_executor`` job keeps running after the task awaiting it is
cancelled, and so does a backend call that copies into host pages. Such a job
writes into pages the caller owns: if the caller got control back (to free or
reuse those pages) while the job still ran, the job would write into pages
that belong to someone else. Every await of such work goes through these two
helpers, so that the rule lives in one place:

- `finish` awaits a future or task to its end even if the caller is cancelled
  meanwhile, then re-raises the cancellation.
- `bounded` does the same under a deadline: on timeout it cancels the task,
  waits for it to settle, and only then raises `TimeoutError`.

Both run on the event loop thread. `check_on_loop` refuses a call made
anywhere else, for the objects whose state only their loop may touch.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable
from typing import TypeVar

from tiercache.errors import StateError

__all__ = ["bounded", "check_on_loop", "finish"]

T = TypeVar("T")


async def _settle(fut: asyncio.Future[T]) -> None:
    """Wait until ``fut`` is done, however often the waiting task is cancelled."""
    while not fut.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([fut])


async def finish(aw: Awaitable[T]) -> T:
    """Await ``aw`` to its end; if the caller is cancelled meanwhile, still wait, then re-raise.

    Args:
        aw: an executor future, a task, or a coroutine (wrapped in a task).

    Returns:
        The result of ``aw``.

    Raises:
        asyncio.CancelledError: the caller was cancelled (raised once ``aw`` is done).
        Exception: whatever ``aw`` raised.
    """
    fut = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await _settle(fut)
        if not fut.cancelled():
            fut.exception()  # retrieved: the caller's cancellation is what it sees
        raise


async def bounded(aw: Awaitable[T], timeout_s: float | None) -> T:
    """Await ``aw`` for at most ``timeout_s`` seconds; it has settled before this returns.

    On timeout, or when the caller is cancelled, the task running ``aw`` is
    cancelled and awaited to its end before the exception propagates: a
    timed-out call may be copying into pages the caller is about to reuse.

    Args:
        aw: a coroutine or task.
        timeout_s: the deadline in seconds, or None for none.

    Returns:
        The result of ``aw``.

    Raises:
        TimeoutError: the deadline passed (the task has been cancelled and has settled).
        asyncio.CancelledError: the caller was cancelled.
        Exception: whatever ``aw`` raised.
    """
    task = asyncio.ensure_future(aw)
    try:
        async with asyncio.timeout(timeout_s):
            return await asyncio.shield(task)
    except BaseException:
        if not task.done():
            task.cancel()
            await _settle(task)
        if not task.cancelled():
            task.exception()  # retrieved here: the caller sees the timeout or cancellation
        raise


def check_on_loop(loop: asyncio.AbstractEventLoop | None, thread: int | None, what: str) -> None:
    """Raise `StateError` unless called on ``loop``, the loop that opened ``what``.

    A synchronous call may also come from ``thread``, that loop's thread,
    while the loop is not running (between ``run_until_complete`` calls).
    The object's bookkeeping is not locked: a call from another thread or
    loop would race with the loop's own.
    """
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is not loop and (running is not None or threading.get_ident() != thread):
        raise StateError(
            f"{what} is not thread-safe: call it on the event loop that opened it "
            "(from another thread, use asyncio.run_coroutine_threadsafe)"
        )
