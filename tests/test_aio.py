"""The two ways of awaiting work that must end before its caller regains control."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tiercache._aio import bounded, finish


async def test_finish_returns_the_result() -> None:
    loop = asyncio.get_running_loop()
    assert await finish(loop.run_in_executor(None, lambda: 7)) == 7


async def test_finish_raises_what_the_job_raised() -> None:
    def boom() -> None:
        raise ValueError("x")

    with pytest.raises(ValueError, match="x"):
        await finish(asyncio.get_running_loop().run_in_executor(None, boom))


async def test_a_cancelled_caller_regains_control_only_after_the_job_ended() -> None:
    gate = threading.Event()
    ended = threading.Event()

    def job() -> None:
        gate.wait(5)
        ended.set()

    task = asyncio.ensure_future(finish(asyncio.get_running_loop().run_in_executor(None, job)))
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done()  # still waiting for the job, in spite of the cancellation
    task.cancel()  # a second cancellation changes nothing
    await asyncio.sleep(0.01)
    assert not task.done()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended.is_set()


async def test_bounded_returns_within_the_deadline() -> None:
    async def quick() -> int:
        await asyncio.sleep(0)
        return 3

    assert await bounded(quick(), 1.0) == 3
    assert await bounded(quick(), None) == 3


async def test_bounded_times_out_only_after_the_call_settled() -> None:
    settled: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.02)  # cleanup that must finish first
            settled.append("cleaned")
            raise

    with pytest.raises(TimeoutError):
        await bounded(slow(), 0.01)
    assert settled == ["cleaned"]


async def test_bounded_cancelled_caller_cancels_and_settles_the_call() -> None:
    settled: list[str] = []
    started = asyncio.Event()

    async def slow() -> None:
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)
            settled.append("cleaned")
            raise

    outer = asyncio.ensure_future(bounded(slow(), 5.0))
    await started.wait()
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert settled == ["cleaned"]


async def test_bounded_raises_what_the_call_raised() -> None:
    async def boom() -> None:
        raise KeyError("k")

    with pytest.raises(KeyError):
        await bounded(boom(), 1.0)
