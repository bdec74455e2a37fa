"""The TierCache API in one page: configure, request, alloc, commit, flush, match from storage."""

import asyncio
import tempfile

import torch

from tiercache import TierCache, TierCacheConfig


async def main() -> None:
    with tempfile.TemporaryDirectory() as store:
        config = TierCacheConfig(
            num_layers=2,
            num_kv_heads=2,
            head_dim=16,
            page_size=16,
            device_tokens=1024,
            storage_url=f"file://{store}",  # L3: a file store
            prefetch_threshold=16,
            prefetch_policy="wait_complete",
        )
        prompt = list(range(100, 164))  # 64 tokens = 4 pages
        async with TierCache(config) as cache:
            async with cache.request(prompt) as req:
                print(f"first request: {req.cached_tokens} tokens cached")
                slots = await req.alloc(len(prompt) - req.cached_tokens)
                # ... a model writes the new tokens' KV into cache.device_pool at `slots` ...
                await req.commit(prompt, torch.cat([req.prefix_indices, slots]))
            await cache.wait_idle()  # the write-through to host and the storage backup land
            await cache.flush()  # drop the device and host tiers: only storage remains
            async with cache.request(prompt + [7, 8, 9]) as req:
                await req.wait_loaded()
                print(f"after flush: {req.cached_tokens} tokens cached (from storage)")
            print("hit rates:", {k: round(v, 2) for k, v in cache.stats().hit_rates().items()})


if __name__ == "__main__":
    asyncio.run(main())
