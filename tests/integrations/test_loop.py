"""`LoopThread`: the event loop thread that engine adapters call into from their own threads."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from tiercache.errors import ClosedError, StorageTimeoutError
from tiercache.integrations._loop import LoopThread


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_run_returns_the_result_computed_on_the_loop_thread() -> None:
    lt = LoopThread(name="tiercache-test-loop")
    try:

        async def where() -> str:
            await asyncio.sleep(0)
            return threading.current_thread().name

        assert lt.run(where(), timeout=5) == "tiercache-test-loop"
    finally:
        lt.close()


def test_an_exception_reaches_the_caller() -> None:
    lt = LoopThread()
    try:

        async def fail() -> None:
            raise KeyError("x")

        with pytest.raises(KeyError):
            lt.run(fail(), timeout=5)
    finally:
        lt.close()


def test_a_call_past_its_deadline_is_cancelled_and_raises() -> None:
    lt = LoopThread()
    cancelled = threading.Event()
    try:

        async def hang() -> None:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        with pytest.raises(StorageTimeoutError):
            lt.run(hang(), timeout=0.1)
        assert cancelled.wait(5)
    finally:
        lt.close()


def test_close_drains_then_stops_and_leaves_no_thread_or_fd() -> None:
    before = _fds()
    lt = LoopThread(name="tiercache-test-close")
    drained: list[str] = []
    started = threading.Event()

    async def background() -> None:
        started.set()
        await asyncio.sleep(60)

    lt.submit(background())
    assert started.wait(5)

    async def drain() -> None:
        await asyncio.sleep(0.01)
        drained.append("done")

    lt.close(drain())
    lt.close()  # idempotent
    assert drained == ["done"]
    assert not lt.thread.is_alive()
    assert lt.loop.is_closed()
    assert _fds() - before == set()

    async def late() -> None:
        return None

    with pytest.raises(ClosedError):
        lt.run(late(), timeout=1)


def test_run_from_the_loop_thread_itself_is_refused() -> None:
    lt = LoopThread()
    try:

        async def nested() -> str:
            async def inner() -> None:
                return None

            try:
                lt.run(inner(), timeout=1)
            except RuntimeError as e:
                return str(e)
            return "no error"

        assert "own loop thread" in lt.run(nested(), timeout=5)
    finally:
        lt.close()
