"""The storage fault policy: auto_reconnect and auto_detach after consecutive failures."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierCache, TierCacheConfig, TierController
from tiercache.errors import ConfigError
from tiercache.storage.faults import FaultyBackend
from tiercache.storage.memory import MemoryBackend
from tiercache.storage_tier import StorageTierConfig

PS = 16


def make(policy: str) -> TierController:
    lay = KVLayout(2, 2, 8, torch.float16, PS)
    conf = StorageTierConfig(
        prefetch_threshold=PS,
        fault_policy=policy,
        fault_threshold=3,
        reconnect_backoff_s=0.01,
        timeout_s=1.0,
    )
    return TierController(DeviceKVPool(lay, 256), HostKVPool(lay, 512), storage_config=conf)


async def failing_prefetches(c: TierController, n: int) -> None:
    for i in range(n):
        h = c.host_allocator.alloc(2 * PS)
        assert h is not None
        op = c.prefetch(i, h, list(range(i, i + 2 * PS)))
        if op is None:
            c.free_host(h)
            continue
        await op
        done, _ = await c.terminate_prefetch(op)
        assert done == 0


async def until(pred: object, limit: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not pred():  # type: ignore[operator]
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_auto_reconnect_stops_calling_a_down_backend_and_resumes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with make("auto_reconnect") as c:
        faulty = FaultyBackend(MemoryBackend())
        await c.attach_storage_backend(faulty)
        tier = c.storage
        assert tier is not None
        faulty.fail_all(True)
        with caplog.at_level(logging.WARNING, logger="tiercache"):
            await failing_prefetches(c, 3)
        assert tier.down and tier.stats.outages == 1
        assert "treating it as down" in caplog.text
        calls_before = faulty.total_injected
        h = c.host_allocator.alloc(2 * PS)
        assert h is not None
        assert c.prefetch("x", h, list(range(2 * PS))) is None  # a miss at once; the caller keeps h
        c.free_host(h)
        faulty.fail_all(False)
        await until(lambda: not tier.down)
        assert tier.stats.reconnects == 1
        assert faulty.total_injected >= calls_before
        # Backups and prefetches work again without re-attaching.
        d = c.device_allocator.alloc(2 * PS)
        assert d is not None
        host = await c.backup(d)
        assert host is not None
        b = c.write_storage(host, list(range(2 * PS)))
        assert b is not None
        await b
        assert b.succeeded
        assert c.host_allocator.available == c.host_allocator.num_slots - 2 * PS


async def test_backups_skipped_during_an_outage_do_not_each_log_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with make("auto_reconnect") as c:
        faulty = FaultyBackend(MemoryBackend())
        await c.attach_storage_backend(faulty)
        tier = c.storage
        assert tier is not None
        faulty.fail_all(True)
        await failing_prefetches(c, 3)
        assert tier.down
        d = c.device_allocator.alloc(2 * PS)
        assert d is not None
        host = await c.backup(d)
        assert host is not None
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="tiercache"):
            for i in range(20):
                b = c.write_storage(host, list(range(i, i + 2 * PS)))
                assert b is not None
                await b
                assert not b.succeeded
        assert tier.stats.skipped_while_down >= 20
        skipped = [r for r in caplog.records if "ended early" in r.getMessage()]
        assert len(skipped) == 20 and {r.levelno for r in skipped} == {logging.DEBUG}
        c.free_host(host)


async def test_auto_detach_detaches_after_consecutive_failures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with make("auto_detach") as c:
        faulty = FaultyBackend(MemoryBackend())
        await c.attach_storage_backend(faulty)
        faulty.fail_all(True)
        with caplog.at_level(logging.WARNING, logger="tiercache"):
            await failing_prefetches(c, 3)
            await until(lambda: c.storage is None)
        assert c.stats.storage_auto_detaches == 1
        assert "detaching it" in caplog.text
        assert c.host_allocator.available == c.host_allocator.num_slots
        faulty.fail_all(False)
        await c.attach_storage_backend(faulty)  # attach again by hand
        assert c.storage is not None


async def test_policy_none_keeps_calling() -> None:
    async with make("none") as c:
        faulty = FaultyBackend(MemoryBackend())
        await c.attach_storage_backend(faulty)
        faulty.fail_all(True)
        await failing_prefetches(c, 6)
        assert c.storage is not None and not c.storage.down
        assert faulty.total_injected == 6


async def test_cache_stats_show_outages() -> None:
    cfg = TierCacheConfig(
        device_tokens=256,
        page_size=PS,
        prefetch_threshold=PS,
        storage_fault_threshold=2,
        storage_reconnect_backoff_s=0.01,
    )
    async with TierCache(cfg) as cache:
        faulty = FaultyBackend(MemoryBackend())
        await cache.attach_storage(faulty)
        faulty.fail_all(True)
        for i in range(3):
            assert await cache.prefetch(list(range(i, i + 4 * PS))) == 0
        assert cache.stats().storage_outages == 1
        # The probe of the down backend keeps running; waiting for idle does not wait for it.
        async with asyncio.timeout(5):
            await cache.wait_idle()
        assert cache.controller.storage is not None and cache.controller.storage.down


def test_a_reconnect_backoff_maximum_below_its_first_delay_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="reconnect_backoff_max_s"):
        StorageTierConfig(reconnect_backoff_s=1.0, reconnect_backoff_max_s=0.5)
    StorageTierConfig(reconnect_backoff_s=1.0, reconnect_backoff_max_s=1.0)


def test_bad_fault_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        StorageTierConfig(fault_policy="retry_forever")
    with pytest.raises(ConfigError):
        TierCacheConfig(storage_fault_policy="sometimes")
    with pytest.raises(ConfigError):
        TierCacheConfig(storage_fault_threshold=0)
