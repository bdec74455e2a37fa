"""`LoopThread`: the event loop thread that engine adapters call into from their own threads."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

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


def test_submit_returns_before_the_coroutine_finishes() -> None:
    lt = LoopThread()
    release = asyncio.Event()  # bound to the loop thread's loop on first wait
    try:

        async def wait_for_release() -> int:
            await release.wait()
            return 7

        fut = lt.submit(wait_for_release())
        assert not fut.done()
        lt.loop.call_soon_threadsafe(release.set)
        assert fut.result(5) == 7
    finally:
        lt.close()


def test_close_cancels_remaining_tasks_and_awaits_their_unwinding() -> None:
    lt = LoopThread()
    started = threading.Event()
    unwound: list[str] = []

    async def holds_resource() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)  # cleanup that itself awaits
            unwound.append("cleaned")
            raise

    fut = lt.submit(holds_resource())
    assert started.wait(5)
    assert lt.close(timeout=5) is True
    assert unwound == ["cleaned"]
    assert fut.cancelled()
    assert not lt.is_alive()


def test_close_finalises_open_async_generators() -> None:
    lt = LoopThread()
    finalised = threading.Event()

    async def gen() -> Any:
        try:
            yield 1
            yield 2
        finally:
            finalised.set()

    async def take_one() -> None:
        agen = gen()
        await agen.__anext__()
        holder.append(agen)  # still suspended when the loop shuts down

    holder: list[Any] = []
    lt.run(take_one(), timeout=5)
    lt.close()
    assert finalised.is_set()


def test_a_failing_or_hanging_drain_does_not_keep_the_thread_alive() -> None:
    lt = LoopThread()

    async def hang() -> None:
        await asyncio.sleep(60)

    assert lt.close(hang(), timeout=0.1) is True
    assert not lt.thread.is_alive()

    lt2 = LoopThread()

    async def fail() -> None:
        raise OSError("backend gone")

    assert lt2.close(fail(), timeout=5) is True
    assert lt2.loop.is_closed()


def test_close_from_the_loop_thread_itself_is_refused() -> None:
    lt = LoopThread()
    try:

        async def nested() -> str:
            try:
                lt.close()
            except RuntimeError as e:
                return str(e)
            return "no error"

        assert "own loop thread" in lt.run(nested(), timeout=5)
        assert not lt.closed
    finally:
        lt.close()


def test_submit_after_close_closes_the_coroutine_unrun() -> None:
    lt = LoopThread()
    lt.close()
    ran: list[int] = []

    async def work() -> None:
        ran.append(1)

    coro = work()
    with pytest.raises(ClosedError):
        lt.submit(coro)
    assert coro.cr_frame is None  # closed, so no "never awaited" warning
    assert ran == []
    assert lt.close() is True  # idempotent, reports the ended thread


def test_the_loop_is_uvloop_when_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    lt = LoopThread()
    try:
        assert isinstance(lt.loop, uvloop.Loop)
    finally:
        lt.close()
