"""The default configuration serves from storage after a restart.

Only the storage URL is set: every other field keeps its default (the
``timeout`` prefetch policy). A restarted cache must get the stored prompt's
pages back from the file store on the first request, not recompute them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiercache import TierCache, TierCacheConfig


def kv_of(tokens: list[int], layer: int, b: int, heads: int, dim: int) -> torch.Tensor:
    t = torch.tensor(tokens, dtype=torch.float32)
    base = (t * 0.001 + torch.arange(len(tokens)) * 0.01 + layer + b * 0.5)[:, None, None]
    return base.expand(-1, heads, dim).contiguous()


async def test_default_configuration_gets_storage_hits_after_a_restart(tmp_path: Path) -> None:
    config = TierCacheConfig(storage_url=f"file://{tmp_path / 'store'}")
    assert config.prefetch_policy == "timeout"
    lay = config.layout()
    prompt = [(13 * i + 5) % 30000 for i in range(512)]

    def write(cache: TierCache, start: int, slots: torch.Tensor) -> None:
        for b, bufs in enumerate(cache.device_pool.buffers):
            for layer, buf in enumerate(bufs):
                kv = kv_of(prompt, layer, b, lay.num_kv_heads, lay.head_dim)
                buf[slots] = kv[start : start + slots.numel()].to(buf.dtype)

    async with TierCache(config) as cache:
        async with cache.request(prompt) as req:
            slots = await req.alloc(len(prompt))
            write(cache, 0, slots)
            await req.commit(prompt, slots)
        await cache.wait_idle()
        assert cache.stats().storage_backups > 0

    for _ in range(5):  # five restarts, one request each
        async with TierCache(config) as cache:
            async with cache.request(prompt) as req:
                assert req.cached_tokens == 496, req.cached_tokens  # all but the last page
                await req.wait_loaded()
                for b, bufs in enumerate(cache.device_pool.buffers):
                    for layer, buf in enumerate(bufs):
                        kv = kv_of(prompt, layer, b, lay.num_kv_heads, lay.head_dim)
                        assert torch.equal(buf[req.prefix_indices], kv[:496].to(buf.dtype))
            assert cache.stats().tokens_storage_hit == 496
