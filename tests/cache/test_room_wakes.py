"""Every way room is released wakes the tasks waiting for it, by construction.

Room is released through: the ledger (pages freed, leases ended: the
controller's settle callbacks), an index hold dropped (`RoomBroker.release`,
`RoomBroker.unpin`), a request that ends (`RoomBroker.open_request`) and the
cache closing (`RoomBroker.close`). Each test parks a waiter in a room queue,
releases through one path and checks the waiter looked again at once: a path
that forgot to wake leaves it asleep (the waits are bounded, never timed).
A last test reads the source: no module but the room broker drops an index
hold, so no new release path can forget the wake.
"""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tiercache import TierCache, TierCacheConfig
from tiercache.errors import ClosedError
from tiercache.room import RoomBroker, RoomQueue

SRC = Path(__file__).resolve().parents[2] / "src" / "tiercache"


class _Index:
    """The index calls a broker makes, recorded (nothing to lock in a test double)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def lock(self, node: object) -> None:
        self.calls.append("lock")

    def unlock(self, node: object) -> None:
        self.calls.append("unlock")

    def pin_host(self, node: object) -> None:
        self.calls.append("pin")

    def unpin_host(self, node: object) -> None:
        self.calls.append("unpin")


class _Controller:
    """Keeps the settle callback the broker adds: the ledger's releases run it."""

    def __init__(self) -> None:
        self.settle_callbacks: list[Callable[[], None]] = []

    def add_settle_callback(self, fn: Callable[[], None]) -> Callable[[], None]:
        self.settle_callbacks.append(fn)
        return lambda: self.settle_callbacks.remove(fn)

    def released(self) -> None:
        for fn in list(self.settle_callbacks):
            fn()


class _Node:
    is_root = False


def _broker() -> tuple[RoomBroker, _Controller]:
    ctl = _Controller()
    broker = RoomBroker(_Index(), ctl, None, None)  # type: ignore[arg-type]
    broker.attach()
    return broker, ctl


async def _parked(queue: RoomQueue) -> tuple[asyncio.Future[Any], list[int]]:
    """A waiter at the head of ``queue`` that found no room once, and now sleeps."""
    turns = [0]

    async def attempt() -> str | None:
        turns[0] += 1
        return "room" if turns[0] > 1 else None

    loop = asyncio.get_running_loop()
    waiter = asyncio.ensure_future(queue.serve(attempt, loop.time() + 60.0))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not waiter.done() and turns == [1]
    return waiter, turns


def _release_paths() -> dict[str, Callable[[RoomBroker, _Controller], Any]]:
    def request_end(broker: RoomBroker, _ctl: _Controller) -> None:
        with broker.open_request():
            pass

    def released_hold(broker: RoomBroker, _ctl: _Controller) -> None:
        broker.release(_Node())  # type: ignore[arg-type]

    def held_block(broker: RoomBroker, _ctl: _Controller) -> None:
        with broker.holding(_Node()):  # type: ignore[arg-type]
            pass

    return {
        "ledger release (settle callback)": lambda _b, ctl: ctl.released(),
        "index lock dropped": released_hold,
        "index lock held for a block": held_block,
        "host pin dropped": lambda b, _c: b.unpin(_Node()),  # type: ignore[arg-type]
        "request end": request_end,
        "cache closed": lambda b, _c: b.close(),
    }


@pytest.mark.parametrize("queue", ["device", "host"])
@pytest.mark.parametrize("path", list(_release_paths()))
async def test_each_release_path_wakes_a_waiter(path: str, queue: str) -> None:
    broker, ctl = _broker()
    waiter, turns = await _parked(getattr(broker, queue))
    _release_paths()[path](broker, ctl)
    async with asyncio.timeout(2):  # woken at once, or never: there is no timer but 60 s
        assert await waiter == "room"
    assert turns == [2]


async def test_a_detached_broker_is_no_longer_woken_by_the_controller() -> None:
    broker, ctl = _broker()
    broker.detach()
    assert ctl.settle_callbacks == []


def config(**kw: Any) -> TierCacheConfig:
    base: dict[str, Any] = dict(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        page_size=16,
        device_tokens=64,
        host_tokens=128,
        model="room-wakes",
        write_policy="write_through",
        alloc_timeout_s=60.0,
    )
    base.update(kw)
    return TierCacheConfig(**base)


async def test_unlock_wakes_the_device_waiter() -> None:
    """A node locked with `TierCache.lock` holds the device; its `unlock` lets a waiter evict it.

    An open request that holds nothing keeps the waiter waiting (someone might
    free room); only the unlock can wake it before that request ends.
    """
    async with TierCache(config()) as cache:
        tokens = list(range(64))
        await cache.insert(tokens, await cache.alloc_device(64))
        await cache.wait_idle()  # its host copy has landed: it may leave the device
        node = cache.match_prefix(tokens).index.last_device_node
        cache.lock(node)
        async with cache.request([9999]):
            waiter = asyncio.ensure_future(cache.alloc_device(64))
            for _ in range(10):
                await asyncio.sleep(0.01)
            assert not waiter.done()
            cache.unlock(node)
            async with asyncio.timeout(2):
                slots = await waiter
            assert slots.numel() == 64
        cache.free_device(slots)
        assert cache.stats().device_evictions == 1


async def test_closing_wakes_a_device_waiter() -> None:
    cache = TierCache(config())
    await cache.open()
    await cache.alloc_device(64)
    async with cache.request([9999]):  # someone might free room: the waiter waits
        waiter = asyncio.ensure_future(cache.alloc_device(64))
        await asyncio.sleep(0.02)
        assert not waiter.done()
        await cache.aclose()
        async with asyncio.timeout(2):
            with pytest.raises(ClosedError):
                await waiter


def _index_releases(tree: ast.Module) -> list[int]:
    """Lines calling ``<...index...>.unlock(...)`` or ``.unpin_host(...)``."""
    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("unlock", "unpin_host")
            and "index" in ast.unparse(node.func.value).lower()
        ):
            lines.append(node.lineno)
    return lines


def test_only_the_room_broker_drops_index_holds() -> None:
    """A hold dropped anywhere else would release room without waking its waiters."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "room.py" or rel.startswith("index/"):
            continue
        lines = _index_releases(ast.parse(path.read_text(encoding="utf-8")))
        if lines:
            found[rel] = lines
    assert found == {}, f"index holds dropped outside the room broker: {found}"
    assert _index_releases(ast.parse("self.index.unlock(n)\nx.room.index.unpin_host(n)\n")) == [
        1,
        2,
    ]
