"""SGLang's HiCache end-to-end checks, translated to the library (page size 64,
wait_complete, file backend), plus device/host eviction round trips."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from tiercache import TierCache, TierCacheConfig

PS = 64


def config(root: Path, **kw: object) -> TierCacheConfig:
    base: dict[str, object] = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        dtype="float16",
        page_size=PS,
        device_tokens=4096,
        host_tokens=8192,
        storage_url=f"file://{root}",
        prefetch_policy="wait_complete",
        prefetch_threshold=PS,
        model="e2e",
    )
    base.update(kw)
    return TierCacheConfig(**base)  # type: ignore[arg-type]


def kv_for(cache: TierCache, tokens: list[int]) -> None:
    """Deterministic 'computed' KV: a function of the token and its position, so reloads can be checked."""


def expected_kv(cache: TierCache, tokens: list[int], layer: int, b: int) -> torch.Tensor:
    lay = cache.layout
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    base = (t * 0.001 + pos * 0.01 + layer + b * 0.5)[:, None, None]
    grid = torch.arange(lay.num_kv_heads * lay.head_dim, dtype=torch.float32).view(
        1, lay.num_kv_heads, lay.head_dim
    )
    return (base + grid * 1e-3).to(lay.dtype)


async def compute(cache: TierCache, tokens: list[int]) -> tuple[int, int]:
    """What an engine does for one prompt: reuse the cached prefix, compute the rest, insert.

    Returns (cached tokens, storage-fetched tokens)."""
    before = cache.stats().tokens_storage_hit
    async with cache.request(tokens) as req:
        await req.wait_loaded()
        n_new = len(tokens) - req.cached_tokens
        slots = await req.alloc(n_new)
        full = torch.cat([req.prefix_indices, slots])
        pool = cache.device_pool
        for layer in range(cache.layout.num_layers):
            for b in range(2):
                # The prefix must hold exactly the KV computed for it earlier.
                got = pool.buffers[b][layer][req.prefix_indices]
                assert torch.equal(got, expected_kv(cache, tokens, layer, b)[: req.cached_tokens])
                pool.buffers[b][layer][slots] = expected_kv(cache, tokens, layer, b)[
                    req.cached_tokens :
                ]
        await req.commit(tokens, full)
        cached = req.cached_tokens
    return cached, cache.stats().tokens_storage_hit - before


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


async def test_sglang_end_to_end_checks(tmp_path: Path) -> None:
    p768 = prompt(1, 768)
    async with TierCache(config(tmp_path)) as cache:
        assert await compute(cache, p768) == (0, 0)
        await cache.wait_idle()
        assert cache.stats().storage_backups >= 1
        await cache.flush()
        # The same prompt plus 64 new tokens matches exactly 768 from storage.
        cached, fetched = await compute(cache, p768 + prompt(2, 64))
        assert (cached, fetched) == (768, 768)
        # Four continuations of one 512-token prefix each match exactly 512.
        p512 = prompt(3, 512)
        await compute(cache, p512)
        await cache.wait_idle()
        await cache.flush()
        for i in range(4):
            cached, _ = await compute(cache, p512 + prompt(10 + i, 128))
            assert cached == 512
        contexts = [prompt(20 + i, 512) for i in range(3)]
        for c in contexts:
            await compute(cache, c)
        await cache.wait_idle()
    # A restart: a new cache on the same directory.
    async with TierCache(config(tmp_path)) as cache:
        for c in contexts:
            cached, fetched = await compute(cache, c + prompt(99, 64))
            assert (cached, fetched) == (512, 512)  # bit-identity is asserted inside compute()
        s = cache.stats()
        assert s.tokens_storage_hit == 3 * 512
        assert s.tokens_requested == 3 * 576


async def test_device_eviction_moves_to_host_and_loads_back(tmp_path: Path) -> None:
    for policy in ("write_through", "write_back", "write_through_selective"):
        cfg = config(
            tmp_path,
            device_tokens=1024,
            host_tokens=4096,
            storage_url=None,
            write_policy=policy,
            write_through_threshold=1,
        )
        async with TierCache(cfg) as cache:
            prompts = [prompt(100 + i, 512) for i in range(4)]  # 2048 tokens > 1024 device slots
            for p in prompts:
                await compute(cache, p)
                if policy == "write_through_selective":
                    cache.match_prefix(p)  # a hit triggers the host write
                await cache.wait_idle()
            s = cache.stats()
            assert s.device_evictions > 0, policy
            # The first prompt left the device but not the host: a match finds it on host.
            m = cache.match_prefix(prompts[0])
            assert m.device_tokens + m.host_tokens == 512, policy
            assert m.host_tokens > 0, policy
            cached, _ = await compute(cache, prompts[0] + prompt(7, 64))
            assert cached == 512, policy  # and compute() checked the bytes


async def test_evict_frees_that_many_more_slots_whole_nodes_at_a_time(tmp_path: Path) -> None:
    """As the README says: ``evict_device(n)`` frees at least ``n`` more slots (whole
    nodes), even when ``n`` are free already, and returns the slots it freed."""
    async with TierCache(config(tmp_path, storage_url=None)) as cache:
        for first in (0, 10_000):
            tokens = list(range(first, first + 2 * PS))
            await cache.insert(tokens, await cache.alloc_device(len(tokens)))
        await cache.wait_idle()
        free = cache.stats().extra["device_free"]
        assert free >= PS
        assert await cache.evict_device(1) == 2 * PS  # one whole node, room or not
        assert cache.stats().extra["device_free"] == free + 2 * PS
        assert await cache.evict_host(1) == 2 * PS
        assert await cache.evict_device(10**6) == 2 * PS  # all there is


async def test_restart_fetches_from_storage_from_prefetch_threshold_tokens(
    tmp_path: Path,
) -> None:
    """The default ``prefetch_threshold`` (256 tokens): a shorter stored prefix is recomputed."""
    defaults = TierCacheConfig()
    assert (defaults.prefetch_threshold, defaults.prefetch_policy) == (256, "timeout")
    short, long = list(range(3 * PS + 1)), list(range(50_000, 50_000 + 4 * PS + 1))
    cfg = config(tmp_path, prefetch_threshold=256, prefetch_policy="timeout")
    async with TierCache(cfg) as cache:
        for tokens in (short, long):
            await compute(cache, tokens)
        await cache.wait_idle()
    async with TierCache(cfg) as cache:  # a restart: only the store holds them
        assert await compute(cache, short) == (0, 0)
        assert await compute(cache, long) == (4 * PS, 4 * PS)
