"""Host room that copies in flight hold is waited for, like device room.

The host pool here holds 64 tokens. A host-only node whose storage backup is
still running is pinned: it cannot be evicted until the backup ends. A
write-through (or a ``wait_complete`` prefetch) that finds the host full only
because of such a pin waits for it, first come first served, bounded by
``alloc_timeout_s``; a best-effort prefetch does not wait (it must not stall
the request it serves); when nothing in flight holds host room nothing waits.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from tests.cache.gated_backend import GatedBackend

from tiercache import TierCache, TierCacheConfig

PS = 16


def config(**kw: Any) -> TierCacheConfig:
    base: dict[str, Any] = dict(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        page_size=PS,
        device_tokens=256,
        host_tokens=64,
        model="host-room",
        write_policy="write_through",
        alloc_timeout_s=5.0,
    )
    base.update(kw)
    return TierCacheConfig(**base)


async def put(cache: TierCache, tokens: list[int], value: float) -> torch.Tensor:
    slots = await cache.alloc_device(len(tokens))
    for bufs in cache.device_pool.buffers:
        for buf in bufs:
            buf[slots] = value
    await cache.insert(tokens, slots)
    return slots


def host_kv(cache: TierCache, tokens: list[int]) -> float | None:
    """The value the host copy of ``tokens`` holds, ``None`` when it is not on host."""
    m = cache.index.match_prefix(tokens, touch=False)
    node = m.last_node
    if node.is_root or node.host_indices is None or m.matched_length != len(tokens):
        return None
    hp, lay = cache.host_pool, cache.layout
    values = {
        float(hp.layer(b, layer)[node.host_indices].mean())
        for b in range(lay.num_buffers)
        for layer in range(lay.num_layers)
    }
    assert len(values) == 1, values
    return values.pop()


async def pinned_host(cache: TierCache, backend: GatedBackend) -> list[int]:
    """Fill the host with a host-only node whose storage backup is held at the gate."""
    a = list(range(1000, 1064))
    backend.gate.clear()
    await put(cache, a, 1.0)
    await cache.controller.wait_idle()  # A's host write (not its backup)
    await asyncio.sleep(0)  # its completion callback starts the backup
    assert not cache.index.pending_writes()
    assert await cache.evict_device(256) == 64  # A is host-only now, its backup held
    assert cache.stats().extra["host_free"] == 0
    return a


async def test_write_through_waits_for_host_room_a_backup_holds() -> None:
    backend = GatedBackend(open_gate=True)
    async with TierCache(config()) as cache:
        await cache.attach_storage(backend)
        a = await pinned_host(cache, backend)
        b = list(range(2000, 2064))
        await put(cache, b, 2.0)
        await asyncio.sleep(0.02)
        assert host_kv(cache, b) is None  # still waiting: A's pin holds the host
        backend.gate.set()
        await cache.wait_idle()
        # A's backup ended, A was evicted from host (it is in storage), B was written.
        assert host_kv(cache, b) == 2.0
        assert host_kv(cache, a) is None
        s = cache.stats().extra
        assert s["host_free"] == 0 and s["host_tokens_cached"] == 64


async def test_write_through_without_anything_in_flight_does_not_wait() -> None:
    async with TierCache(config(host_tokens=32)) as cache:
        b = list(range(2000, 2064))
        await put(cache, b, 2.0)  # larger than the host: can never be written
        await cache.wait_idle()
        assert host_kv(cache, b) is None
        assert len(cache.tasks) == 0
        # The write policy counts what it left out; the controller only what it refused.
        assert cache.stats().host_writes_skipped == 1
        assert cache.controller.stats.host_full == 0


async def test_host_waiters_are_served_first_come_first_served() -> None:
    backend = GatedBackend(open_gate=True)
    async with TierCache(config(host_tokens=64)) as cache:
        await cache.attach_storage(backend)
        await pinned_host(cache, backend)
        b, c = list(range(2000, 2032)), list(range(3000, 3032))
        await put(cache, b, 2.0)
        await put(cache, c, 3.0)
        order: list[str] = []
        real = cache.controller.submit_write

        def spy(dev: torch.Tensor, *a: Any, **kw: Any) -> Any:
            order.append("b" if int(kw.get("node_id", -1)) == node_b else "c")
            return real(dev, *a, **kw)

        node_b = cache.index.match_prefix(b, touch=False).last_node.id
        cache.controller.submit_write = spy  # type: ignore[method-assign]
        backend.gate.set()
        await cache.wait_idle()
        assert order == ["b", "c"]
        assert host_kv(cache, b) == 2.0 and host_kv(cache, c) == 3.0


async def test_a_write_waiting_for_host_room_gives_up_at_the_timeout() -> None:
    backend = GatedBackend(open_gate=True)
    async with TierCache(config(alloc_timeout_s=0.2)) as cache:
        await cache.attach_storage(backend)
        await pinned_host(cache, backend)
        b = list(range(2000, 2064))
        await put(cache, b, 2.0)
        # It gives up at its deadline (0.2 s), not when the gate opens: allow a loaded machine slack.
        async with asyncio.timeout(5):
            while cache._parts.room.host or cache._ops.deferred_writes:  # noqa: ASYNC110 (a bounded wait on private state)
                await asyncio.sleep(0.02)
        assert not backend.gate.is_set()
        assert host_kv(cache, b) is None  # it stays device-only
        backend.gate.set()
        await cache.wait_idle()
        assert host_kv(cache, b) is None
        # Nothing leaked: the host holds A's pages only until they are evicted.
        assert await cache.evict_host(64) == 64
        assert cache.stats().extra["host_free"] == 64


async def test_wait_complete_prefetch_waits_for_host_room_best_effort_does_not() -> None:
    backend = GatedBackend(open_gate=True)
    async with TierCache(config(write_policy="write_through", prefetch_threshold=PS)) as cache:
        await cache.attach_storage(backend)
        p = list(range(5000, 5064))
        await put(cache, p, 5.0)
        await cache.wait_idle()  # P is in storage now
        await cache.flush()
        await pinned_host(cache, backend)
        assert await cache.prefetch(p, policy="best_effort") == 0  # no wait: a miss
        task = asyncio.ensure_future(cache.prefetch(p, policy="wait_complete"))
        await asyncio.sleep(0.02)
        assert not task.done()  # waiting for the pinned host room
        backend.gate.set()
        assert await task == 64
        assert host_kv(cache, p) == 5.0


async def test_a_cancelled_host_waiter_takes_nothing() -> None:
    backend = GatedBackend(open_gate=True)
    async with TierCache(config(prefetch_threshold=PS)) as cache:
        await cache.attach_storage(backend)
        p = list(range(5000, 5064))
        await put(cache, p, 5.0)
        await cache.wait_idle()
        await cache.flush()
        await pinned_host(cache, backend)
        task = asyncio.ensure_future(cache.prefetch(p, policy="wait_complete"))
        await asyncio.sleep(0.02)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        assert not cache._parts.room.host
        backend.gate.set()
        await cache.wait_idle()
        assert await cache.evict_host(64) == 64
        assert cache.stats().extra["host_free"] == 64


async def test_evicting_a_node_whose_write_through_waits_for_host_room_leaks_nothing() -> None:
    """The eviction's write back and the waiting write-through race for one node.

    Whichever writes it, the node must not be dropped with its host copy in
    flight or landed (its host slots would be lost), and the accounting must
    come back exact.
    """
    backend = GatedBackend(open_gate=True)
    async with TierCache(config()) as cache:
        await cache.attach_storage(backend)
        await pinned_host(cache, backend)
        b = list(range(2000, 2064))
        await put(cache, b, 2.0)  # its write-through waits for host room
        evict = asyncio.ensure_future(cache.evict_device(256))  # writes B back first
        await asyncio.sleep(0.02)
        assert not evict.done()
        backend.gate.set()
        await evict
        await cache.wait_idle()
        await cache.evict_device(256)
        await cache.wait_idle()
        ctl = cache.controller
        assert ctl.host_allocator.used == cache.index.total_host_tokens()
        assert ctl.device_allocator.used == cache.index.total_device_tokens()
        assert host_kv(cache, b) == 2.0
