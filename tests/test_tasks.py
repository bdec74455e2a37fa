"""One task group, one failure policy: logged once, raised once, never swallowed."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tiercache._tasks import TaskGroup
from tiercache.errors import StateError


async def _boom() -> None:
    await asyncio.sleep(0)
    raise ValueError("bug")


async def test_a_failure_is_logged_once_and_raised_once_at_the_next_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    group = TaskGroup("cache")
    with caplog.at_level(logging.ERROR, logger="tiercache"):
        group.spawn(_boom(), "a deferred write")
        await group.join()
    assert [r.getMessage() for r in caplog.records] == [
        "tiercache cache: a deferred write failed: ValueError('bug')"
    ]
    with pytest.raises(StateError, match="background task of the cache failed") as info:
        group.raise_failure()
    assert isinstance(info.value.__cause__, ValueError)
    group.raise_failure()  # raised once, not again
    assert group.failures == 1
    await group.aclose()


async def test_a_failure_not_raised_before_is_raised_at_close() -> None:
    group = TaskGroup("controller")
    group.spawn(_boom(), "a detach")
    with pytest.raises(StateError, match="ValueError"):
        await group.aclose()


async def test_only_the_first_failure_is_raised_but_every_one_is_counted() -> None:
    group = TaskGroup("cache")
    for _ in range(3):
        group.spawn(_boom(), "x")
    await group.join()
    assert group.failures == 3
    with pytest.raises(StateError):
        group.raise_failure()
    group.raise_failure()
    await group.aclose()


async def test_cancelled_tasks_are_not_failures() -> None:
    group = TaskGroup("cache")
    task = group.spawn(asyncio.sleep(10), "a wait")
    await asyncio.sleep(0)
    task.cancel()
    await group.join()
    assert group.failures == 0
    group.raise_failure()
    await group.aclose()


async def test_join_waits_for_tasks_started_while_it_waits() -> None:
    group = TaskGroup("cache")
    order: list[str] = []

    async def second() -> None:
        await asyncio.sleep(0.01)
        order.append("second")

    async def first() -> None:
        await asyncio.sleep(0)
        group.spawn(second(), "second")
        order.append("first")

    group.spawn(first(), "first")
    await group.join()
    assert order == ["first", "second"] and len(group) == 0
    await group.aclose()


async def test_close_refuses_new_tasks_and_can_cancel_running_ones() -> None:
    group = TaskGroup("cache")
    task = group.spawn(asyncio.sleep(10), "a long wait")
    await group.aclose(cancel=True)
    assert task.cancelled()
    coro = asyncio.sleep(0)
    with pytest.raises(StateError, match="closed"):
        group.spawn(coro, "late")
