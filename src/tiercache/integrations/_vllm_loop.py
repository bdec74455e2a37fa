"""`LoopThread`: one asyncio event loop in a daemon thread, for synchronous callers.

An engine calls its extension points synchronously from its own threads; the
tiercache code behind them is asyncio. A `LoopThread` owns one event loop in a
thread of its own and accepts coroutines from any other thread:

- `submit` schedules a coroutine and returns a `concurrent.futures.Future`
  without waiting (what a scheduler hot path uses);
- `call` waits for the result, never longer than its timeout (start-up and
  shutdown only).

`close` stops the loop, cancels what still runs on it, waits for those tasks to
unwind (a storage backend returns from a cancelled batch only once no thread
touches the caller's memory any more), shuts the loop's default executor down
and joins the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from tiercache.errors import ClosedError, StorageTimeoutError

__all__ = ["LoopThread"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class LoopThread:
    """An asyncio event loop running in its own daemon thread.

    Args:
        name: the thread's name (shown by debuggers and leak checks).

    Every method may be called from any thread other than the loop's own.
    """

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop (to compare with, never to run from another thread)."""
        return self._loop

    @property
    def closed(self) -> bool:
        """`close` was called."""
        return self._closed

    def is_alive(self) -> bool:
        """The loop's thread is still running."""
        return self._thread.is_alive()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Schedule ``coro`` on the loop; returns at once.

        Raises:
            ClosedError: the loop thread was closed (``coro`` is closed unrun).
        """
        with self._lock:
            if self._closed:
                coro.close()
                raise ClosedError("the tiercache loop thread is closed")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, _T], timeout: float) -> _T:
        """Run ``coro`` on the loop and wait for its result.

        Args:
            coro: the coroutine.
            timeout: seconds to wait; past it the coroutine is cancelled.

        Returns:
            What the coroutine returned.

        Raises:
            StorageTimeoutError: it did not finish within ``timeout``.
            ClosedError: the loop thread was closed.
            Exception: whatever the coroutine raised.
        """
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise StorageTimeoutError(f"no answer within {timeout:g} s") from None

    def close(self, timeout: float) -> bool:
        """Stop the loop, cancel its remaining tasks and join the thread. Idempotent.

        Args:
            timeout: seconds to wait for the thread to end.

        Returns:
            Whether the thread has ended.
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                self._loop.call_soon_threadsafe(self._loop.stop)
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.close() called from its own loop")
        self._thread.join(timeout)
        alive = self._thread.is_alive()
        if alive:
            logger.error("the tiercache loop thread did not stop within %g s", timeout)
        return not alive

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        except Exception:
            logger.exception("the tiercache loop thread failed while stopping")
        finally:
            asyncio.set_event_loop(None)
            loop.close()
