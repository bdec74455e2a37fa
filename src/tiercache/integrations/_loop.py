"""`LoopThread`: one asyncio event loop in a daemon thread, called from other threads.

Serving engines call storage synchronously from their own threads. An adapter
keeps its async tiercache objects on one event loop that it owns and runs in a
daemon thread; engine threads submit coroutines with
``asyncio.run_coroutine_threadsafe`` and wait for the result with a deadline.
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

#: How long `LoopThread.close` waits for the thread to finish its last callbacks.
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

    `run` may be called from any thread except the loop's own; `close` from
    any thread except the loop's own, and more than once.
    """

    def __init__(self, name: str = "tiercache-loop") -> None:
        self.loop = _new_loop()
        self._ready = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            asyncio.set_event_loop(None)

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future.

        Raises:
            ClosedError: the loop thread was closed (``coro`` is closed unrun).
        """
        with self._lock:
            if self._closed:
                coro.close()
                raise ClosedError("the tiercache event loop thread is closed")
            return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for its result, at most ``timeout`` seconds.

        Called from a thread other than the loop's. On timeout the coroutine is
        cancelled.

        Returns:
            What ``coro`` returns.

        Raises:
            StorageTimeoutError: no result within ``timeout`` seconds.
            ClosedError: the loop thread is closed.
            Exception: whatever ``coro`` raises.
        """
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("LoopThread.run called from its own loop thread (would deadlock)")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise StorageTimeoutError(f"no answer from the tiercache loop in {timeout} s") from None

    def close(self, drain: Coroutine[Any, Any, Any] | None = None, timeout: float = 30.0) -> None:
        """Run ``drain`` (if given), cancel what is left, stop the loop and join the thread.

        After it returns no thread of this object runs and the loop is closed
        (its selector and self-pipe file descriptors released). Idempotent.
        """
        with self._lock:
            if self._closed:
                if drain is not None:
                    drain.close()
                return
            self._closed = True
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(drain, timeout), self.loop)
        try:
            fut.result(timeout + _JOIN_TIMEOUT_S)
        except Exception as e:  # the drain failing must not keep the thread alive
            logger.warning("draining the tiercache loop thread failed: %r", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(_JOIN_TIMEOUT_S)
        if self.thread.is_alive():  # pragma: no cover - only a callback blocking forever
            logger.error("the tiercache loop thread %s did not stop", self.thread.name)
            return
        self.loop.close()

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
        await self.loop.shutdown_asyncgens()
        await self.loop.shutdown_default_executor()
