"""Many concurrent requests with random cancellations and injected storage faults.

Bounded in time and seeded. CI runs a small configuration;
``make stress`` sets ``TIERCACHE_STRESS_SECONDS`` for a longer run. After
each round and at the end: allocator accounting equals what the index holds,
no lock is left, every prefix a request reused held exactly the KV computed
for its tokens, and no task or thread is left after close.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest
import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.storage.faults import FaultKind, FaultPlan, FaultSpec, FaultyBackend
from tiercache.storage.memory import MemoryBackend

PS = 16
SECONDS = float(os.environ.get("TIERCACHE_STRESS_SECONDS", "3"))


def expected_kv(cache: TierCache, tokens: list[int], layer: int, b: int) -> torch.Tensor:
    lay = cache.layout
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    base = (t * 0.001 + pos * 0.01 + layer + b * 0.5)[:, None, None]
    grid = torch.arange(lay.num_kv_heads * lay.head_dim, dtype=torch.float32).view(
        1, lay.num_kv_heads, lay.head_dim
    )
    return (base + grid * 1e-3).to(lay.dtype)


class Counters:
    def __init__(self) -> None:
        self.requests = 0
        self.completed = 0
        self.cancelled = 0
        self.reused_tokens = 0
        self.verified_pages = 0


async def serve(cache: TierCache, tokens: list[int], c: Counters) -> None:
    async with cache.request(tokens) as req:
        await req.wait_loaded()
        pool = cache.device_pool
        for layer in range(cache.layout.num_layers):
            for b in range(2):
                got = pool.buffers[b][layer][req.prefix_indices]
                want = expected_kv(cache, tokens, layer, b)[: req.cached_tokens]
                assert torch.equal(got, want), "a reused prefix held the wrong KV"
        c.verified_pages += req.cached_tokens // PS
        c.reused_tokens += req.cached_tokens
        slots = await req.alloc(len(tokens) - req.cached_tokens)
        await asyncio.sleep(0)  # let other requests interleave mid-request
        for layer in range(cache.layout.num_layers):
            for b in range(2):
                pool.buffers[b][layer][slots] = expected_kv(cache, tokens, layer, b)[
                    req.cached_tokens :
                ]
        await req.commit(tokens, torch.cat([req.prefix_indices, slots]))


def check_accounting(cache: TierCache) -> None:
    ctl = cache.controller
    cache.index.check_invariants()
    assert ctl.device_allocator.used == cache.index.total_device_tokens()
    assert ctl.host_allocator.used == cache.index.total_host_tokens()
    assert not any(n.lock_ref for n in cache.index.nodes())


@pytest.mark.timeout(max(120, int(SECONDS * 2) + 60))
async def test_concurrent_requests_with_cancellations_and_storage_faults() -> None:
    rng = random.Random(1234)
    plan = FaultPlan.of(
        FaultSpec(FaultKind.ERROR, ops={"exists", "get", "set"}, probability=0.05),
        FaultSpec(FaultKind.LATENCY, ops={"get", "set"}, probability=0.3, delay=(0.0, 0.005)),
        FaultSpec(FaultKind.PARTIAL, ops={"get"}, probability=0.05),
        FaultSpec(FaultKind.TIMEOUT, ops={"get"}, probability=0.02, delay=0.3),
        seed=99,
    )
    faulty = FaultyBackend(MemoryBackend(), plan)
    cfg = TierCacheConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        dtype="float16",
        page_size=PS,
        device_tokens=1024,
        host_tokens=2048,
        prefetch_threshold=PS,
        prefetch_policy="timeout",
        prefetch_timeout_base=0.05,
        storage_timeout_s=0.1,
        model="stress",
    )
    systems = [[rng.randrange(30000) for _ in range(rng.choice([32, 64, 128]))] for _ in range(6)]
    c = Counters()
    rounds = 0
    deadline = time.monotonic() + SECONDS
    cache = TierCache(cfg)
    async with cache:
        await cache.attach_storage(faulty)
        while time.monotonic() < deadline or rounds < 2:
            rounds += 1
            tasks = []
            for _ in range(12):
                tokens = rng.choice(systems) + [
                    rng.randrange(30000) for _ in range(rng.randrange(0, 80))
                ]
                tasks.append(asyncio.create_task(serve(cache, tokens, c)))
                c.requests += 1
            for t in tasks:
                if rng.random() < 0.2:
                    await asyncio.sleep(rng.random() * 0.002)
                    t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for r in results:
                if isinstance(r, asyncio.CancelledError):
                    c.cancelled += 1
                elif isinstance(r, BaseException):
                    raise r
                else:
                    c.completed += 1
            await cache.wait_idle()
            check_accounting(cache)
            if rounds % 5 == 0:
                await cache.flush()  # a restart: everything must come back from storage
                check_accounting(cache)
        stats = cache.stats()
    assert c.completed > 0 and c.cancelled > 0 and c.reused_tokens > 0
    assert faulty.total_injected > 0
    print(
        f"\nstress: {rounds} rounds, {c.requests} requests ({c.completed} completed, {c.cancelled} cancelled), "
        f"{c.verified_pages} reused pages verified, {faulty.total_injected} storage faults injected, "
        f"storage hits {stats.tokens_storage_hit} tokens, evictions device {stats.device_evictions} "
        f"host {stats.host_evictions}"
    )
