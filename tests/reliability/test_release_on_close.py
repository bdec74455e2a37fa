"""Closed and dropped, a cache or a controller gives its pools back at once.

Reference counting, not the garbage collector, must free them: a cycle
through the controller or the cache would keep gigabytes of pool memory alive
until a collection, which then frees it all in one pause on whichever thread
triggers it (the event loop, mid-request: a 256 MiB pool took 160 ms). Each
test runs with the collector off and checks that the pools are gone as soon
as the last reference is dropped.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierCache, TierCacheConfig, TierController
from tiercache.storage.faults import FaultKind, FaultPlan, FaultSpec, FaultyBackend
from tiercache.storage.memory import MemoryBackend


@pytest.fixture
def no_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def config(**kw: Any) -> TierCacheConfig:
    base: dict[str, Any] = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        page_size=16,
        device_tokens=256,
        host_tokens=512,
        model="release",
    )
    return TierCacheConfig(**{**base, **kw})


async def serve(cache: TierCache, tokens: list[int]) -> None:
    async with cache.request(tokens) as r:
        await r.wait_loaded()
        slots = await r.alloc(len(tokens) - r.cached_tokens)
        await r.commit(tokens, torch.cat([r.prefix_indices, slots]))


async def use(cache: TierCache) -> None:
    """Every tier and path: commits, write-through, evictions, loads back, a flush."""
    for k in range(3):
        await serve(cache, list(range(40 + k)))
    await cache.wait_idle()
    await cache.evict_device(256)
    await serve(cache, list(range(41)))  # loaded back from host
    await cache.wait_idle()
    await cache.flush()
    await serve(cache, list(range(41)))  # from storage, when attached
    await cache.wait_idle()


@pytest.mark.parametrize("storage", [None, "memory", "file", "failing", "detached on failure"])
async def test_a_closed_cache_frees_its_pools_without_the_collector(
    no_gc: None, storage: str | None, tmp_path: Path
) -> None:
    """Every storage call failing too: the failures an operation keeps hold no frame of the tier."""
    policy = "auto_detach" if storage == "detached on failure" else "auto_reconnect"
    cache = TierCache(config(storage_fault_policy=policy, storage_fault_threshold=1))
    async with cache:
        pools = [weakref.ref(cache.device_pool), weakref.ref(cache.host_pool)]
        if storage == "memory":
            await cache.attach_storage("memory://")
        elif storage == "file":
            await cache.attach_storage(f"file://{tmp_path}")
        elif storage is not None:
            every_call = FaultSpec(FaultKind.ERROR, ops={"exists", "get", "set"}, probability=1.0)
            await cache.attach_storage(FaultyBackend(MemoryBackend(), FaultPlan.of(every_call)))
        await use(cache)
    assert all(p() is not None for p in pools)
    del cache
    assert [p() is None for p in pools] == [True, True]


@pytest.mark.parametrize("inline_copy_bytes", [0, 1 << 20], ids=["worker", "inline"])
async def test_a_closed_controller_frees_its_pools_without_the_collector(
    no_gc: None, inline_copy_bytes: int
) -> None:
    """Copies run on the stream's worker (as on a GPU, or large ones) or inline."""
    layout = KVLayout(2, 2, 8, torch.float16, 16)
    device, host = DeviceKVPool(layout, 256), HostKVPool(layout, 512)
    pools = [weakref.ref(device), weakref.ref(host)]
    c = TierController(device, host, inline_copy_bytes=inline_copy_bytes)
    del device, host
    async with c:
        await c.attach_storage_backend("memory://")
        src = c.device_allocator.alloc(64)
        assert src is not None
        back = await c.load_back(await c.backup(src))  # type: ignore[arg-type]
        assert back is not None
    del c
    assert [p() is None for p in pools] == [True, True]


async def test_a_cache_never_opened_frees_at_once(no_gc: None) -> None:
    cache = TierCache(config())
    ref = weakref.ref(cache)
    del cache
    assert ref() is None
