"""Tasks waiting for room are woken by events, never by a timer.

Every test here waits with ``alloc_timeout_s=60``: the deadline can never be
what wakes a waiter. Each holds the room for a stretch of real time in which
a polling waiter would look again and again, then releases it through one
kind of event (a request ends, slots are freed, a copy settles, a load
settles, a storage backup ends) and counts how often the waiter tried:
once on arrival, once per wake. ``asyncio.wait_for`` is made to fail, and
any timed sleep from the cache module is recorded, so a waiter that polls
fails the test.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
from tests.cache.gated_backend import GatedBackend

from tiercache import TierCache, TierCacheConfig
from tiercache.transfer.engine import CopyEngine

PS = 16
HOLD_ROUNDS = 6  # x 0.03 s of real time holding the room: a poller would look many times
#: The facade and the objects it delegates to: none of them may sleep on a timer.
FACADE_MODULES = frozenset(
    f"tiercache.{m}"
    for m in (
        "cache",
        "room",
        "evictor",
        "write_policy",
        "operations",
        "prefetcher",
        "insertion",
        "loads",
        "request",
    )
)


def config(**kw: Any) -> TierCacheConfig:
    base: dict[str, Any] = dict(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        page_size=PS,
        device_tokens=64,
        host_tokens=128,
        model="room-events",
        write_policy="write_through",
        alloc_timeout_s=60.0,
    )
    base.update(kw)
    return TierCacheConfig(**base)


@pytest.fixture
def no_timers(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Fail on ``asyncio.wait_for``; record timed sleeps made by the cache module."""
    timed: list[float] = []
    real_sleep = asyncio.sleep

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("a room waiter must not wait with a timeout")

    async def recording_sleep(delay: float, *args: Any) -> Any:
        if delay > 0 and sys._getframe(1).f_globals.get("__name__") in FACADE_MODULES:
            timed.append(delay)
        return await real_sleep(delay, *args)

    monkeypatch.setattr(asyncio, "wait_for", refuse)
    monkeypatch.setattr(asyncio, "sleep", recording_sleep)
    return timed


def count_turns(cache: TierCache, monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count a waiter's turns at the room: ``"device"`` the device queue head's
    (`DeviceRoom.turn`), ``"host"`` the host room's attempts (`RoomBroker.make_host_room`)."""
    parts = cache._parts
    assert parts is not None
    obj, method = (parts.device, "turn") if name == "device" else (parts.room, "make_host_room")
    calls = [0]
    real: Callable[..., Any] = getattr(obj, method)

    def counted(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        return real(*args, **kw)

    monkeypatch.setattr(obj, method, counted)
    return calls


async def hold_a_while() -> None:
    for _ in range(HOLD_ROUNDS):
        await asyncio.sleep(0.03)


async def settle(task: Awaitable[Any]) -> Any:
    async with asyncio.timeout(10):  # a guard against a hang, not a measurement
        return await task


class Gate:
    """Holds every device<->host copy in its worker thread until opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cache: TierCache, method: str) -> None:
        self.open = threading.Event()
        cache.controller.inline_copy_bytes = 0  # copies go to the stream's worker thread
        real = getattr(CopyEngine, method)

        def gated(engine: CopyEngine, *args: Any) -> Any:
            self.open.wait(10)
            return real(engine, *args)

        monkeypatch.setattr(CopyEngine, method, gated)


async def fill(cache: TierCache, tokens: list[int]) -> torch.Tensor:
    slots = await cache.alloc_device(len(tokens))
    await cache.insert(tokens, slots)
    return slots


async def test_a_request_that_ends_wakes_the_device_waiter(
    monkeypatch: pytest.MonkeyPatch, no_timers: list[float]
) -> None:
    async with TierCache(config()) as cache:
        turns = count_turns(cache, monkeypatch, "device")
        async with cache.request(list(range(5))) as req:
            await req.alloc(64)  # the whole device, outside the index
            waiter = asyncio.ensure_future(cache.alloc_device(32))
            await hold_a_while()
            assert not waiter.done() and turns[0] == 1
        slots = await settle(waiter)  # the request's end freed its slots
        assert slots.numel() == 32 and turns[0] == 2
    assert no_timers == []


async def test_freed_slots_wake_the_device_waiter(
    monkeypatch: pytest.MonkeyPatch, no_timers: list[float]
) -> None:
    async with TierCache(config()) as cache:
        turns = count_turns(cache, monkeypatch, "device")
        mine = await cache.alloc_device(64)
        waiter = asyncio.ensure_future(cache.alloc_device(64))
        await hold_a_while()
        assert not waiter.done() and turns[0] == 1
        cache.free_device(mine)
        assert (await settle(waiter)).numel() == 64
        assert turns[0] == 2
    assert no_timers == []


async def test_a_settled_copy_wakes_the_device_waiter(
    monkeypatch: pytest.MonkeyPatch, no_timers: list[float]
) -> None:
    async with TierCache(config()) as cache:
        gate = Gate(monkeypatch, cache, "backup_all_layers")
        await fill(cache, list(range(64)))  # its write-through holds it on the device
        turns = count_turns(cache, monkeypatch, "device")
        waiter = asyncio.ensure_future(cache.alloc_device(64))
        await hold_a_while()
        assert not waiter.done() and turns[0] == 1
        gate.open.set()  # the copy lands: the node may leave the device now
        assert (await settle(waiter)).numel() == 64
        assert turns[0] == 2
        assert cache.stats().device_evictions == 1
    assert no_timers == []


async def test_a_settled_load_wakes_the_device_waiter(
    monkeypatch: pytest.MonkeyPatch, no_timers: list[float]
) -> None:
    async with TierCache(config()) as cache:
        tokens = list(range(64))
        await fill(cache, tokens)
        await cache.wait_idle()
        assert await cache.evict_device(64) == 64  # host-only now
        gate = Gate(monkeypatch, cache, "load_layer")
        _, handle = await cache.load_back(cache.match_prefix(tokens))
        assert handle is not None and not handle.done()  # locked until it lands
        turns = count_turns(cache, monkeypatch, "device")
        waiter = asyncio.ensure_future(cache.alloc_device(64))
        await hold_a_while()
        assert not waiter.done() and turns[0] == 1
        gate.open.set()
        assert (await settle(waiter)).numel() == 64
        assert turns[0] == 2
    assert no_timers == []


async def test_an_ended_backup_wakes_the_host_waiter(
    monkeypatch: pytest.MonkeyPatch, no_timers: list[float]
) -> None:
    backend = GatedBackend()
    async with TierCache(config(device_tokens=256, host_tokens=64)) as cache:
        await cache.attach_storage(backend)
        a = list(range(1000, 1064))
        await fill(cache, a)
        await cache.controller.wait_idle()  # A's host write; its backup waits at the gate
        await asyncio.sleep(0)
        assert await cache.evict_device(256) == 64  # A is host-only, pinned by its backup
        turns = count_turns(cache, monkeypatch, "host")
        await fill(cache, list(range(2000, 2064)))  # its write-through waits for host room
        await hold_a_while()
        waited = turns[0]
        assert 1 <= waited <= 2  # tried on arrival (and in line), not since
        backend.gate.set()  # A's backup ends, unpinning it: B's write may evict it
        await settle(cache.wait_idle())
        # Woken by events only: the backup's end, and the controller's settle callbacks for
        # the hold it releases and the copies that follow; a handful, never a poll's dozens.
        assert 1 <= turns[0] - waited <= 6
        assert cache.stats().host_evictions == 1
        assert cache.stats().extra["host_tokens_cached"] == 64
    assert no_timers == []


class _EarlyTimers:
    """The running loop, except that a ``call_at`` timer runs at once (long before its time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> asyncio.Handle:
        return self._loop.call_soon(callback, *args)


async def test_a_deadline_timer_that_fires_early_still_ends_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loop may run a ``call_at`` timer a hair before ``loop.time()`` reaches its deadline:
    the waiter must still give up, not sleep on with no timer left to wake it."""
    import types

    import tiercache.room as room_module

    loop = asyncio.get_running_loop()
    early = types.SimpleNamespace(**vars(asyncio))
    early.get_running_loop = lambda: _EarlyTimers(loop)
    monkeypatch.setattr(room_module, "asyncio", early)
    attempts: list[int] = []

    async def never() -> None:
        attempts.append(1)
        return None

    queue = room_module.RoomQueue()
    async with asyncio.timeout(2):
        assert await queue.serve(never, loop.time() + 60.0) is None
    assert attempts and len(queue) == 0


async def test_a_call_that_needs_no_device_room_does_not_queue_behind_a_waiter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing to take, nothing to wait for: no turn in the queue, no timeout, no error.

    A load back whose pages another call loaded meanwhile, and an alloc of 0
    slots, used to wait behind the head of the device queue; when the head
    was still evicting at their deadline, they failed with "no room for 0
    device slots".
    """
    async with TierCache(config(write_policy="write_back", alloc_timeout_s=0.3)) as cache:
        prompt = list(range(32))
        await fill(cache, prompt)
        assert await cache.evict_device(32) == 32  # written back, then evicted
        stale = cache.match_prefix(prompt)
        assert stale.host_tokens == 32
        prefix, handle = await cache.load_back(stale)  # another caller loads the pages
        assert handle is not None
        await handle
        node = cache.match_prefix(prompt).index.last_device_node
        cache.lock(node)  # nothing may evict them
        await fill(cache, list(range(100, 116)))  # device only: leaving needs a write back
        held = await cache.alloc_device(16)  # the device is full now
        gate = Gate(monkeypatch, cache, "backup_all_layers")
        # The head of the queue evicts for its room, and waits for that write back.
        waiting = asyncio.Event()
        real_wait = cache._parts.device.wait_write_backs

        async def wait_write_backs(writes: Any, failed: set[int]) -> None:
            waiting.set()
            await real_wait(writes, failed)

        monkeypatch.setattr(cache._parts.device, "wait_write_backs", wait_write_backs)
        waiter = asyncio.ensure_future(cache.alloc_device(16))
        await settle(waiting.wait())
        assert len(cache._parts.room.device) == 1
        loop = asyncio.get_running_loop()
        began = loop.time()
        again, none = await settle(cache.load_back(stale))
        assert none is None and torch.equal(again, prefix)
        assert (await settle(cache.alloc_device(0))).numel() == 0
        async with cache.request(prompt + [7]) as req:
            assert req.cached_tokens == 32
            assert (await settle(req.alloc(0))).numel() == 0
        assert loop.time() - began < 0.2  # none of them waited for the head
        assert not waiter.done()
        gate.open.set()
        cache.free_device(await settle(waiter))
        cache.free_device(held)
        cache.unlock(node)
