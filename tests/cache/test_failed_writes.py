"""A device->host copy that fails is never a raw crash and never wrong KV.

Under ``write_back`` a node is written to host when it leaves the device: by
`TierCache.evict_device`, or by an allocation that evicts to make room. When
that copy fails (a copy-temporary OOM on a GPU looks like this), the node has
no host copy, so it is dropped (its KV is recomputed later), the call goes on,
and the allocators account exactly for what the index holds.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.transfer.engine import CopyEngine

PS = 16


def config(**kw: Any) -> TierCacheConfig:
    base: dict[str, Any] = dict(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        page_size=PS,
        device_tokens=64,
        host_tokens=256,
        model="failed-writes",
        write_policy="write_back",
    )
    base.update(kw)
    return TierCacheConfig(**base)


async def put(cache: TierCache, tokens: list[int], value: float) -> None:
    slots = await cache.alloc_device(len(tokens))
    for bufs in cache.device_pool.buffers:
        for buf in bufs:
            buf[slots] = value
    await cache.insert(tokens, slots)


def fail_writes(cache: TierCache, phase: str) -> None:
    engine = cache.controller.engine

    def backup_all_layers(plan: Any) -> None:
        if phase == "after":  # every copy queued, then the job fails
            CopyEngine.backup_all_layers(engine, plan)
        raise RuntimeError("injected copy failure")

    engine.backup_all_layers = backup_all_layers  # type: ignore[method-assign]


@pytest.mark.parametrize("phase", ["before", "after"])
async def test_evict_device_whose_write_back_fails_drops_the_node(phase: str) -> None:
    async with TierCache(config()) as cache:
        a = list(range(100, 132))
        await put(cache, a, 1.0)
        fail_writes(cache, phase)
        assert await cache.evict_device(32) == 32  # no raw RuntimeError
        await cache.wait_idle()
        s = cache.stats().extra
        assert s["device_tokens_cached"] == s["host_tokens_cached"] == 0
        assert s["device_free"] == 64 and s["host_free"] == 256
        # Nothing claims A: a request for it computes it again.
        async with cache.request([*a, 0]) as req:
            assert req.cached_tokens == 0


async def test_an_alloc_that_evicts_through_a_failing_write_back_still_gets_room() -> None:
    async with TierCache(config()) as cache:
        await put(cache, list(range(100, 164)), 1.0)  # the device is full
        fail_writes(cache, "before")
        slots = await cache.alloc_device(32)  # evicts: the write back fails, A is dropped
        assert slots.numel() == 32
        del cache.controller.engine.backup_all_layers
        cache.free_device(slots)
        await cache.wait_idle()
        assert cache.stats().extra["host_free"] == 256
        # Writes work again: the next eviction lands on host, with the right bytes.
        b = list(range(200, 232))
        await put(cache, b, 2.0)
        assert await cache.evict_device(64) >= 32
        m = cache.match_prefix(b)
        assert m.host_tokens == 32
        host = m.index.last_host_node.host_indices
        assert host is not None
        lay = cache.layout
        for bi in range(lay.num_buffers):
            for layer in range(lay.num_layers):
                assert bool((cache.host_pool.layer(bi, layer)[host] == 2.0).all())
        assert torch.equal(m.device_indices, torch.empty(0, dtype=torch.int64))
