"""The controller on Redis: killing the server mid-prefetch, then restarting it."""

from __future__ import annotations

import asyncio

import torch
from tests.redis_server import RedisServer
from tests.storage.redis_fixtures import own_redis_server  # noqa: F401  (a fixture)

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierController
from tiercache.storage.faults import FaultKind, FaultPlan, FaultSpec, FaultyBackend
from tiercache.storage.redis import RedisBackend
from tiercache.storage_tier import PrefetchState, StorageTierConfig

PS = 16


def controller() -> TierController:
    lay = KVLayout(2, 2, 16, torch.float16, PS)
    dev = DeviceKVPool(lay, 512)
    gen = torch.Generator().manual_seed(3)
    for buf in dev.buffers:
        for t in buf:
            t.copy_(torch.randn(t.shape, generator=gen).half())
    conf = StorageTierConfig(
        prefetch_threshold=PS,
        io_batch_pages=2,
        io_concurrency=1,
        timeout_s=0.5,
        fault_policy="none",
    )
    return TierController(dev, HostKVPool(lay, 1024), storage_config=conf)


async def backup(c: TierController, tokens: list[int]) -> torch.Tensor:
    d = c.device_allocator.alloc(len(tokens))
    assert d is not None
    h = await c.backup(d)
    assert h is not None
    c.free_device(d)
    op = c.write_storage(h, tokens)
    assert op is not None
    await op
    assert op.succeeded, op.error
    return h


async def test_killing_redis_mid_prefetch_keeps_what_arrived_and_restart_needs_no_reattach(
    own_redis_server: RedisServer,  # noqa: F811
) -> None:
    tokens = list(range(16 * PS))
    async with controller() as c:
        redis = await RedisBackend.from_url(own_redis_server.url, timeout=0.5, max_connections=2)
        # Slow reads a little so the prefetch is still running when the server dies.
        slow = FaultyBackend(
            redis,
            FaultPlan.of(FaultSpec(FaultKind.LATENCY, ops={"get"}, delay=0.05)),
            close_inner=True,
        )
        await c.attach_storage_backend(slow)
        try:
            await outage_and_recovery(c, own_redis_server, tokens)
        finally:
            await c.detach_storage_backend()
            await slow.aclose()  # a backend passed in stays ours to close


async def outage_and_recovery(c: TierController, server: RedisServer, tokens: list[int]) -> None:
    host = await backup(c, tokens)
    expect = [p.tobytes() for p in c.host_pool.page_buffers(host)]
    c.free_host(host)
    start = c.host_allocator.available

    h = c.host_allocator.alloc(len(tokens))
    assert h is not None
    op = c.prefetch("r", h, tokens)
    assert op is not None
    while op.completed_tokens < 2 * PS:  # noqa: ASYNC110 - polls a counter
        await asyncio.sleep(0.005)
    await asyncio.to_thread(server.kill)
    await op
    n, _ = await c.terminate_prefetch(op)
    assert op.state is PrefetchState.FAILED
    assert 2 * PS <= n < len(tokens)
    assert [p.tobytes() for p in c.host_pool.page_buffers(h[:n])] == expect[: n // PS]
    c.free_host(h[:n])
    assert c.host_allocator.available == start  # nothing leaked

    # Later requests miss cleanly while the server is down.
    h = c.host_allocator.alloc(len(tokens))
    assert h is not None
    op = c.prefetch("r2", h, tokens)
    assert op is not None
    await op
    assert await c.terminate_prefetch(op) == (0, [])
    assert c.host_allocator.available == start

    # The server comes back (empty: no persistence): backups work again on the
    # same attached backend, and so do prefetches.
    await asyncio.to_thread(server.start)
    host = await backup(c, tokens)
    expect = [p.tobytes() for p in c.host_pool.page_buffers(host)]
    c.free_host(host)
    h = c.host_allocator.alloc(len(tokens))
    assert h is not None
    op = c.prefetch("r3", h, tokens)
    assert op is not None
    await op
    n, _ = await c.terminate_prefetch(op)
    assert n == len(tokens)
    assert [p.tobytes() for p in c.host_pool.page_buffers(h)] == expect
    c.free_host(h)
    assert c.host_allocator.available == start
