"""`LoopThread`: one asyncio event loop in a daemon thread, for synchronous callers.

Serving engines call their extension points synchronously from their own
threads; the tiercache code behind them is asyncio. An adapter keeps its async
tiercache objects on one event loop (uvloop when available) that it owns and
runs in a daemon thread, and engine threads hand it coroutines:

- `submit` schedules a coroutine and returns a `concurrent.futures.Future`
  without waiting (what a scheduler hot path uses);
- `run` waits for the result, never longer than its deadline; past it the
  coroutine is cancelled.

`close` optionally runs a drain coroutine first (closing the adapter's
backend), then cancels what still runs on the loop and waits for those tasks to
unwind (a storage backend returns from a cancelled batch only once no thread
touches the caller's memory any more), shuts down async generators and the
loop's default executor, joins the thread and closes the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from tiercache.errors import ClosedError, StorageTimeoutError

__all__ = ["LoopThread"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How long `LoopThread.close` waits for the thread past the drain's own deadline.
_JOIN_TIMEOUT_S = 10.0


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; kept for odd platforms
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class LoopThread:
    """An event loop (uvloop when available) running in a daemon thread.

    Args:
        name: the thread's name; starts with ``"tiercache"`` so that leaks are
            easy to spot.

    `submit`, `run` and `close` may be called from any thread except the
    loop's own (`run` and `close` from it would deadlock and raise
    `RuntimeError`); `close` more than once.
    """

    def __init__(self, name: str = "tiercache-loop") -> None:
        self._loop = _new_loop()
        self._ready = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        try:
            self._loop.run_forever()
        finally:
            asyncio.set_event_loop(None)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop (to schedule on or compare with, never to run from another thread)."""
        return self._loop

    @property
    def thread(self) -> threading.Thread:
        """The thread that runs the loop."""
        return self._thread

    @property
    def closed(self) -> bool:
        """`close` was called."""
        return self._closed

    def is_alive(self) -> bool:
        """The loop's thread is still running."""
        return self._thread.is_alive()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns at once with a thread-safe future.

        Raises:
            ClosedError: the loop thread was closed (``coro`` is closed unrun).
        """
        with self._lock:
            if self._closed:
                coro.close()
                raise ClosedError("the tiercache event loop thread is closed")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for its result, at most ``timeout`` seconds.

        Called from a thread other than the loop's. On timeout the coroutine is
        cancelled.

        Returns:
            What ``coro`` returns.

        Raises:
            StorageTimeoutError: no result within ``timeout`` seconds.
            ClosedError: the loop thread is closed.
            RuntimeError: called from the loop's own thread.
            Exception: whatever ``coro`` raises.
        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run called from its own loop thread (would deadlock)")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise StorageTimeoutError(
                f"no answer from the tiercache loop in {timeout:g} s"
            ) from None

    def close(self, drain: Coroutine[Any, Any, Any] | None = None, timeout: float = 30.0) -> bool:
        """Run ``drain`` (if given), cancel what is left, stop the loop and join the thread.

        The drain gets ``timeout`` seconds; an error or timeout in it is logged
        and does not stop the shutdown. Every task still on the loop is then
        cancelled and awaited, async generators and the default executor are
        shut down, the thread is joined and the loop closed (its selector and
        self-pipe file descriptors released). Idempotent: a later call closes
        its ``drain`` unrun and returns whether the thread has ended.

        Args:
            drain: a coroutine to run on the loop before the rest is cancelled.
            timeout: seconds for the drain; the thread gets another
                ``_JOIN_TIMEOUT_S`` to finish unwinding.

        Returns:
            Whether the thread has ended (``False`` only when a callback on the
            loop blocks the thread; the loop is then left open).

        Raises:
            RuntimeError: called from the loop's own thread.
        """
        if threading.current_thread() is self._thread:
            if drain is not None:
                drain.close()
            raise RuntimeError("LoopThread.close called from its own loop thread (would deadlock)")
        with self._lock:
            if self._closed:
                if drain is not None:
                    drain.close()
                return not self._thread.is_alive()
            self._closed = True
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(drain, timeout), self._loop)
        try:
            fut.result(timeout + _JOIN_TIMEOUT_S)
        except Exception as e:  # the shutdown failing must not keep the thread alive
            logger.warning("shutting down the tiercache loop thread failed: %r", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_JOIN_TIMEOUT_S)
        if self._thread.is_alive():  # pragma: no cover - only a callback blocking forever
            logger.error("the tiercache loop thread %s did not stop", self._thread.name)
            return False
        self._loop.close()
        return True

    async def _shutdown(self, drain: Coroutine[Any, Any, Any] | None, drain_s: float) -> None:
        if drain is not None:
            try:
                async with asyncio.timeout(drain_s):
                    await drain
            except Exception as e:
                logger.warning("closing tiercache resources failed: %r", e)
        me = asyncio.current_task()
        rest = [t for t in asyncio.all_tasks() if t is not me]
        for t in rest:
            t.cancel()
        for t in rest:
            with contextlib.suppress(BaseException):
                await t
        await self._loop.shutdown_asyncgens()
        await self._loop.shutdown_default_executor()
