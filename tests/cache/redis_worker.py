"""One cache instance for test_redis_sharing.py, in its own process.

``redis_worker.py compute URL KEY_PREFIX OUT LOOP``: compute the KV of the
prefix with the tiny model, back it up to Redis, and save the prefix's KV as
it was computed to OUT.

``redis_worker.py load URL KEY_PREFIX OUT LOOP``: request the prefix plus a few
new tokens on a cold cache, wait for the prefix to load from Redis, and save
the loaded KV (and what the cache counted) to OUT.

LOOP is ``asyncio`` or ``uvloop``: the loop the cache runs on.
"""

from __future__ import annotations

import asyncio
import sys

import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.models.tiny import TinyCausalLM, TinyConfig

PREFIX_TOKENS = 512
MODEL = TinyConfig(dtype=torch.float32, seed=0)


def config(url: str, key_prefix: str) -> TierCacheConfig:
    return TierCacheConfig(
        num_layers=MODEL.num_layers,
        num_kv_heads=MODEL.num_kv_heads,
        head_dim=MODEL.head_dim,
        dtype=MODEL.dtype,
        page_size=16,
        device_tokens=2048,
        model="tiny-seed0",
        storage_url=url,
        storage_options={"prefix": key_prefix},
        prefetch_policy="wait_complete",
        prefetch_threshold=16,
    )


def prefix_tokens() -> list[int]:
    gen = torch.Generator().manual_seed(1)
    tokens: list[int] = torch.randint(0, MODEL.vocab_size, (PREFIX_TOKENS,), generator=gen).tolist()
    return tokens


def gather_kv(cache: TierCache, slots: torch.Tensor) -> dict[str, torch.Tensor]:
    """The K and V of ``slots``, every layer: ``(num_layers, len(slots), heads, head_dim)``."""
    pool = cache.device_pool
    n = cache.layout.num_layers
    return {
        "k": torch.stack([pool.k_buffer[i][slots] for i in range(n)]).clone(),
        "v": torch.stack([pool.v_buffer[i][slots] for i in range(n)]).clone(),
    }


async def compute(url: str, key_prefix: str, out: str) -> None:
    model = TinyCausalLM(MODEL)
    prefix = prefix_tokens()
    async with TierCache(config(url, key_prefix)) as cache:
        async with cache.request(prefix) as req:
            assert req.cached_tokens == 0
            slots = await req.alloc(len(prefix))
            await asyncio.to_thread(model.prefill, cache.device_pool, prefix, slots)
            await req.commit(prefix, slots)
            kv = gather_kv(cache, slots)
        await cache.wait_idle()
        stats = cache.stats()
    result = {
        **kv,
        "storage_backups": stats.storage_backups,
        "written": stats.bytes_storage_written,
    }
    await asyncio.to_thread(torch.save, result, out)


async def load(url: str, key_prefix: str, out: str) -> None:
    prompt = prefix_tokens() + [1, 2, 3, 4, 5]
    async with TierCache(config(url, key_prefix)) as cache:
        async with cache.request(prompt) as req:
            await req.wait_loaded()
            kv = gather_kv(cache, req.prefix_indices)
            cached = req.cached_tokens
        stats = cache.stats()
    result = {
        **kv,
        "cached_tokens": cached,
        "storage_hit": stats.tokens_storage_hit,
        "read": stats.bytes_storage_read,
    }
    await asyncio.to_thread(torch.save, result, out)


def main() -> None:
    role, url, key_prefix, out, loop = sys.argv[1:6]
    coro = compute(url, key_prefix, out) if role == "compute" else load(url, key_prefix, out)
    if loop == "uvloop":
        import uvloop

        uvloop.run(coro)
    else:
        asyncio.run(coro)


if __name__ == "__main__":
    main()
