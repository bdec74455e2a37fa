"""Many concurrent requests with random cancellations, misuse and injected faults.

Bounded in time and seeded. CI runs a small configuration;
``make stress`` sets ``TIERCACHE_STRESS_SECONDS`` for a longer run. Mixed in
with the requests: refused calls (token ids out of range, bad counts, slots
the caller does not own), commits of tokens that are not the request's
(refused, then the right commit), storage faults, and host->device loads
that fail at a random layer. No request retries by hand: allocation waits
for room others hold. After each round and at the end: allocator accounting
equals what the index holds, no lock is left, every prefix a request reused
held exactly the KV computed for its tokens (wrong KV is counted, and must
be 0), and no task or thread is left after close.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest
import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.errors import InvalidInputError, StateError
from tiercache.ledger import Owner
from tiercache.storage.faults import FaultKind, FaultPlan, FaultSpec, FaultyBackend
from tiercache.storage.memory import MemoryBackend
from tiercache.transfer.engine import CopyEngine

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
        self.wrong_kv = 0
        self.refused = 0
        self.mismatched_commits = 0
        self.failed_loads = 0
        self.injected_load_failures = 0
        self.accounting_checks = 0


async def expect_refused(cache: TierCache, call: object, c: Counters) -> None:
    """``call`` (a coroutine or a thunk) is refused with `InvalidInputError`."""
    try:
        if asyncio.iscoroutine(call):
            await call
        else:
            assert callable(call)
            call()
    except InvalidInputError:
        c.refused += 1
    else:
        raise AssertionError("a bad call was accepted")


async def misuse(cache: TierCache, rng: random.Random, c: Counters) -> None:
    """Calls that must be refused, changing nothing, between real requests."""
    bad_ids = rng.choice([[-1] * 40, [2**32] * 40, [2**40] * 40, torch.full((40,), -1)])
    kind = rng.randrange(5)
    if kind == 0:

        async def req() -> None:
            async with cache.request(bad_ids):
                pass

        await expect_refused(cache, req(), c)
    elif kind == 1:
        await expect_refused(cache, cache.prefetch(bad_ids), c)
    elif kind == 2:
        await expect_refused(cache, cache.alloc_device(rng.choice([-PS, PS + 1])), c)
    elif kind == 3:
        await expect_refused(cache, cache.evict_device(-1), c)
    else:  # slots the caller does not own
        await expect_refused(cache, cache.insert([7] * PS, torch.arange(PS)), c)


async def serve(
    cache: TierCache, tokens: list[int], c: Counters, rng: random.Random, mismatch: bool
) -> None:
    async with cache.request(tokens) as req:
        try:
            await req.wait_loaded()
        except RuntimeError:  # an injected copy failure: nothing to compute on
            c.failed_loads += 1
            c.completed += 1
            return
        pool = cache.device_pool
        for layer in range(cache.layout.num_layers):
            for b in range(2):
                got = pool.buffers[b][layer][req.prefix_indices]
                want = expected_kv(cache, tokens, layer, b)[: req.cached_tokens]
                if not torch.equal(got, want):
                    c.wrong_kv += 1
        c.verified_pages += req.cached_tokens // PS
        c.reused_tokens += req.cached_tokens
        slots = await req.alloc(len(tokens) - req.cached_tokens)
        await asyncio.sleep(0)  # let other requests interleave mid-request
        for layer in range(cache.layout.num_layers):
            for b in range(2):
                pool.buffers[b][layer][slots] = expected_kv(cache, tokens, layer, b)[
                    req.cached_tokens :
                ]
        full = torch.cat([req.prefix_indices, slots])
        if mismatch:
            other = [rng.randrange(30000) for _ in range(len(tokens))]
            await expect_refused(cache, req.commit(other, full), c)
            c.mismatched_commits += 1
        try:
            await req.commit(tokens, full)
        except StateError:  # the prefix's load failed meanwhile (a request sharing it loaded it)
            c.failed_loads += 1
            return
    c.completed += 1


def check_accounting(cache: TierCache, c: Counters) -> None:
    ctl = cache.controller
    cache.index.check_invariants()
    assert ctl.device_allocator.used == cache.index.total_device_tokens()
    assert ctl.host_allocator.used == cache.index.total_host_tokens()
    ctl.ledger.check_invariants()
    assert ctl.ledger.device.tokens_owned(Owner.INDEX) == cache.index.total_device_tokens()
    assert not any(n.lock_ref for n in cache.index.nodes())
    assert not cache._ops.loads
    assert ctl.ledger.device.tokens_owned(Owner.REQUEST) == 0
    c.accounting_checks += 1


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
    load_rng = random.Random(7)
    async with cache:
        await cache.attach_storage(faulty)
        engine = cache.controller.engine

        def load_layer(i: int, plan: object) -> None:
            if load_rng.random() < 0.05:
                c.injected_load_failures += 1
                raise RuntimeError(f"injected copy failure at layer {i}")
            CopyEngine.load_layer(engine, i, plan)  # type: ignore[arg-type]

        engine.load_layer = load_layer  # type: ignore[method-assign]
        while time.monotonic() < deadline or rounds < 2:
            rounds += 1
            tasks = []
            requests: set[asyncio.Task[None]] = set()
            for _ in range(12):
                tokens = rng.choice(systems) + [
                    rng.randrange(30000) for _ in range(rng.randrange(1, 80))
                ]
                mismatch = rng.random() < 0.1
                tasks.append(asyncio.create_task(serve(cache, tokens, c, rng, mismatch)))
                requests.add(tasks[-1])
                c.requests += 1
                if rng.random() < 0.2:
                    tasks.append(asyncio.create_task(misuse(cache, rng, c)))
            for t in tasks:
                if rng.random() < 0.2:
                    await asyncio.sleep(rng.random() * 0.002)
                    t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for t, r in zip(tasks, results, strict=True):
                if isinstance(r, asyncio.CancelledError):
                    c.cancelled += t in requests
                elif isinstance(r, BaseException):
                    raise r
            await cache.wait_idle()
            check_accounting(cache, c)
            if rounds % 5 == 0:
                await cache.flush()  # a restart: everything must come back from storage
                check_accounting(cache, c)
        del engine.load_layer
        stats = cache.stats()
    print(
        f"\nstress: {rounds} rounds, {c.requests} requests ({c.completed} completed, "
        f"{c.cancelled} cancelled), {c.refused} refused calls ({c.mismatched_commits} mismatched "
        f"commits), {stats.loads_back} loads back ({c.injected_load_failures} copy failures injected, "
        f"{c.failed_loads} requests saw one), "
        f"wrong KV {c.wrong_kv}, "
        f"{c.verified_pages} reused pages verified, {c.accounting_checks} exact accounting checks, "
        f"{faulty.total_injected} storage faults injected, storage hits "
        f"{stats.tokens_storage_hit} tokens, evictions device {stats.device_evictions} "
        f"host {stats.host_evictions}"
    )
    assert c.wrong_kv == 0
    assert c.completed > 0 and c.cancelled > 0 and c.reused_tokens > 0 and c.refused > 0
    assert faulty.total_injected > 0
