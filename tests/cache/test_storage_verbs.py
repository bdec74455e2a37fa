"""What storage verbs of the cache return: backups written, prefetches that a flush met.

A storage error is a miss, never raised: a backup that fails, or that the
backend takes only in part, ends early. Such a node is not written, so it is
neither returned by `backup_to_storage` ("nodes written") nor counted in
``CacheStats.storage_backups`` (``tiercache_storage_backups_total``), and the
next call tries it again. A prefetch that a `flush` overtakes has lost its
pages to the flush: it returns 0, as any prefetch whose pages did not stay.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.errors import InvalidInputError, StateError
from tiercache.storage.faults import FaultKind, FaultPlan, FaultSpec, FaultyBackend
from tiercache.storage.memory import MemoryBackend

PS = 4


def config(**kw: Any) -> TierCacheConfig:
    base: dict[str, Any] = dict(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        page_size=PS,
        device_tokens=64,
        prefetch_threshold=PS,
        model="storage-verbs",
    )
    return TierCacheConfig(**{**base, **kw})


async def put(cache: TierCache, tokens: list[int]) -> None:
    async with cache.request([*tokens, 0]) as req:
        slots = await req.alloc(len(tokens) + 1 - req.cached_tokens)
        await req.commit([*tokens, 0], torch.cat([req.prefix_indices, slots]))


@pytest.mark.parametrize("fault", [FaultKind.ERROR, FaultKind.PARTIAL])
async def test_backups_that_fail_are_not_counted_as_written(fault: FaultKind) -> None:
    async with TierCache(config(storage_fault_policy="none")) as cache:
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


async def test_a_backup_the_controller_refuses_leaves_no_pin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node is pinned on the host while its storage backup runs; a backup
    the controller refuses at the call must not leave the pin behind (the
    node could never be evicted from the host again)."""
    async with TierCache(config()) as cache:
        await put(cache, list(range(3 * PS)))
        await cache.wait_idle()
        await cache.attach_storage(MemoryBackend())

        def refuse(*args: Any, **kw: Any) -> None:
            raise StateError("refused")

        monkeypatch.setattr(cache.controller, "write_storage", refuse)
        with pytest.raises(StateError, match="refused"):
            await cache.backup_to_storage()
        assert all(n.host_pin == 0 for n in cache.index.nodes())
        cache.index.check_invariants()
        monkeypatch.undo()
        assert await cache.backup_to_storage() == 1


@pytest.mark.parametrize("cached_prefix", [False, True])
async def test_a_flush_during_a_prefetch_drops_its_pages_and_it_returns_0(
    cached_prefix: bool,
) -> None:
    """A `prefetch` still fetching when `flush` ran raised StateError from the
    flushed index (its parent node, or the root, was from before the reset)
    instead of returning 0 like any other prefetch whose pages did not stay."""
    tokens = list(range(1, 29))
    async with TierCache(config(prefetch_policy="wait_complete")) as cache:
        backend = FaultyBackend(
            MemoryBackend(), FaultPlan.of(FaultSpec(FaultKind.LATENCY, ops=["get"], delay=0.2))
        )
        backend.disable()
        await cache.attach_storage(backend)
        await put(cache, tokens)
        await cache.wait_idle()
        await cache.flush()  # the prompt is in storage only
        if cached_prefix:
            await put(cache, tokens[: 2 * PS])  # the prefetch continues a cached node
            await cache.wait_idle()
        backend.enable()
        fetch = asyncio.create_task(cache.prefetch(tokens))
        await asyncio.sleep(0.05)
        await cache.flush()
        assert await fetch == 0
        await cache.wait_idle()
        ctl = cache.controller
        assert ctl.host_allocator.used == cache.index.total_host_tokens() == 0
        backend.disable()
        assert await cache.prefetch(tokens) == 7 * PS  # and the next one keeps its pages
        assert ctl.host_allocator.used == cache.index.total_host_tokens() == 7 * PS


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
async def test_every_cached_token_of_concurrent_requests_is_counted_as_a_hit(policy: str) -> None:
    """Requests that arrive together for a prompt in storage only each prefetch it;
    one request's pages land first and the others' are duplicates. Those others
    counted their cached prefix as no hit at all: 5 requests served 28 cached
    tokens each, and the stats (and the hit metrics) said 28 in total."""
    tokens = list(range(1, 29))
    async with TierCache(config(prefetch_policy=policy, device_tokens=256)) as cache:
        backend = FaultyBackend(
            MemoryBackend(),
            FaultPlan.of(FaultSpec(FaultKind.LATENCY, ops=["get", "exists"], delay=(0.0, 0.02))),
        )
        await cache.attach_storage(backend)
        await put(cache, tokens)
        await cache.wait_idle()
        await cache.flush()
        before = cache.stats()

        async def serve(i: int) -> int:
            async with cache.request([*tokens, i]) as req:
                await req.wait_loaded()
                return req.cached_tokens

        cached = await asyncio.gather(*(serve(i) for i in range(5)))
        assert cached == [7 * PS] * 5
        s = cache.stats()
        hits = {
            tier: getattr(s, f"tokens_{tier}_hit") - getattr(before, f"tokens_{tier}_hit")
            for tier in ("device", "host", "storage")
        }
        assert hits == {"device": 0, "host": 4 * 7 * PS, "storage": 7 * PS}
        assert sum(hits.values()) == sum(cached)


async def test_a_prefetch_with_a_match_of_other_tokens_is_refused_and_holds_nothing() -> None:
    """A match taken on a longer prompt passed with fewer tokens: the cache took
    host room for the match's storage part and pinned its node, then the
    controller refused the call (fewer tokens than slots) and both stayed held
    for good: 20 host slots gone and a node that could never leave the host."""
    tokens = list(range(1, 30))
    async with TierCache(config(prefetch_policy="wait_complete")) as cache:
        await cache.attach_storage(MemoryBackend())
        await put(cache, tokens[:8])
        await put(cache, tokens)
        await cache.wait_idle()
        await cache.flush()
        await put(cache, tokens[:8])  # a cached node, then storage only
        await cache.wait_idle()
        match = cache.match_prefix(tokens)
        assert (match.device_tokens, match.storage_candidate_tokens) == (8, 20)
        ctl = cache.controller
        before = ctl.host_allocator.used
        for other in (tokens[:13], [9, *tokens[1:]], list(range(50, 80))):
            with pytest.raises(InvalidInputError, match="not a match of these tokens"):
                await cache.prefetch(other, match)
        assert ctl.host_allocator.used == before == cache.index.total_host_tokens()
        assert not any(n.host_pin or n.lock_ref for n in cache.index.nodes())
        assert await cache.prefetch(tokens, match) == 20  # the right call still works
