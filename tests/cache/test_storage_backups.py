"""`TierCache.backup_to_storage` and the ``storage_backups`` count say what was written.

A storage error is a miss, never raised: a backup that fails, or that the
backend takes only in part, ends early. Such a node is not written, so it is
neither returned by `backup_to_storage` ("nodes written") nor counted in
``CacheStats.storage_backups`` (``tiercache_storage_backups_total``), and the
next call tries it again.
"""

from __future__ import annotations

import pytest
import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.storage.faults import FaultKind, FaultPlan, FaultSpec, FaultyBackend
from tiercache.storage.memory import MemoryBackend

PS = 4


async def put(cache: TierCache, tokens: list[int]) -> None:
    async with cache.request([*tokens, 0]) as req:
        slots = await req.alloc(len(tokens) + 1 - req.cached_tokens)
        await req.commit([*tokens, 0], torch.cat([req.prefix_indices, slots]))


@pytest.mark.parametrize("fault", [FaultKind.ERROR, FaultKind.PARTIAL])
async def test_backups_that_fail_are_not_counted_as_written(fault: FaultKind) -> None:
    config = TierCacheConfig(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        page_size=PS,
        device_tokens=64,
        storage_fault_policy="none",
        model="backups",
    )
    async with TierCache(config) as cache:
        for i in range(3):
            await put(cache, [100 * i + j for j in range(3 * PS)])
        await cache.wait_idle()
        inner = MemoryBackend()
        backend = FaultyBackend(inner, FaultPlan.of(FaultSpec(fault, ops=["set"])))
        await cache.attach_storage(backend)
        assert await cache.backup_to_storage() == 0
        assert cache.stats().storage_backups == 0
        backend.disable()
        assert await cache.backup_to_storage() == 3  # the three nodes, tried again
        assert cache.stats().storage_backups == 3
        assert (await inner.stats()).set_written == 9  # their pages, every one
        assert await cache.backup_to_storage() == 0  # nothing left to write
