"""Making device room is one loop whose passes decide on the index as it is.

Under ``write_back`` nothing is on the host until eviction writes it there.
One pass over the LRU candidates starts the write back of every device-only
leaf it can (their copies run together), the loop waits for those copies,
and the next pass, taken fresh from the index, evicts what landed: a node
that a request locked meanwhile stays.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from tiercache import TierCache, TierCacheConfig
from tiercache.transfer.engine import CopyEngine

PS = 16


def config(**kw: Any) -> TierCacheConfig:
    base: dict[str, Any] = dict(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        page_size=PS,
        device_tokens=128,
        host_tokens=256,
        model="make-room",
        write_policy="write_back",
        alloc_timeout_s=5.0,
    )
    base.update(kw)
    return TierCacheConfig(**base)


async def test_one_pass_starts_every_write_back_and_a_node_locked_meanwhile_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with TierCache(config()) as cache:
        a, b = list(range(64)), list(range(1000, 1064))
        for toks in (a, b):
            await cache.insert(toks, await cache.alloc_device(64))
        assert cache.index.total_host_tokens() == 0  # write_back: device only
        # Hold the device->host copies in their worker thread.
        gate = threading.Event()
        cache.controller.inline_copy_bytes = 0
        real_backup = CopyEngine.backup_all_layers

        def gated(engine: CopyEngine, *args: Any) -> Any:
            gate.wait(10)
            return real_backup(engine, *args)

        monkeypatch.setattr(CopyEngine, "backup_all_layers", gated)
        waits: list[int] = []
        waiting = asyncio.Event()
        real_wait = cache._parts.device.wait_write_backs

        async def counted(writes: Any, failed: set[int]) -> None:
            waits.append(len(writes))
            waiting.set()
            await real_wait(writes, failed)

        monkeypatch.setattr(cache._parts.device, "wait_write_backs", counted)
        evicting = asyncio.ensure_future(cache.evict_device(128))
        async with asyncio.timeout(10):
            await waiting.wait()
        assert waits == [2] and cache.stats().write_backs == 2  # one pass, both started
        node_a = cache.match_prefix(a).index.last_device_node
        cache.lock(node_a)  # a request takes A while its write back runs
        gate.set()
        async with asyncio.timeout(10):
            freed = await evicting
        assert freed == 64  # B only
        assert node_a.device_indices is not None and node_a.host_indices is not None
        m = cache.match_prefix(b)
        assert m.device_tokens == 0 and m.host_tokens == 64  # B was written, then evicted
        cache.unlock(node_a)
        assert waits == [2]  # the copies were waited for once, together
