"""The controller on a CUDA device: copy streams, pinned host memory, device-side layer waits.

Skipped without CUDA (the `gpu` marker)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tiercache import DeviceKVPool, HostKVPool, KVLayout, TierCache, TierCacheConfig, TierController

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
async def test_cuda_round_trip_and_device_side_layer_waits(
    host_layout: str, dtype: torch.dtype
) -> None:
    lay = KVLayout(4, 8, 128, dtype, 64)
    dev = DeviceKVPool(lay, 8192, device="cuda")
    for buf in dev.buffers:
        for t in buf:
            t.copy_(torch.randn(t.shape, device="cuda").to(dtype))
    host = HostKVPool(lay, 16384, host_layout=host_layout)
    assert host.pinned
    async with TierController(dev, host) as c:
        src = c.device_allocator.alloc(4096)
        assert src is not None
        order = torch.randperm(64)
        src = src.view(64, 64)[order].reshape(-1)  # scattered pages
        expect = [dev.buffers[b][layer][src.cuda()].clone() for b in range(2) for layer in range(4)]
        h = await c.backup(src)
        assert h is not None
        c.free_device(src)
        dst = c.load(h)
        assert dst is not None
        handle = c.start_loading()
        assert handle is not None

        def forward() -> list[torch.Tensor]:
            out = []
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for layer in range(4):
                    handle.wait_layer_device(layer)  # the GPU waits, not the host
                    out.append(dev.buffers[0][layer][dst.cuda()].clone())
            s.synchronize()
            return out

        got = await asyncio.to_thread(forward)
        await handle
        for layer in range(4):
            assert torch.equal(got[layer], expect[layer])
        for b in range(2):
            for layer in range(4):
                assert torch.equal(dev.buffers[b][layer][dst.cuda()], expect[b * 4 + layer])


async def test_cuda_cache_end_to_end(tmp_path: object) -> None:
    cfg = TierCacheConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        dtype="float16",
        page_size=64,
        device="cuda",
        device_tokens=4096,
        storage_url=f"file://{tmp_path}",
        prefetch_policy="wait_complete",
        prefetch_threshold=64,
    )
    prompt = list(range(1000, 1512))
    async with TierCache(cfg) as cache:
        async with cache.request(prompt) as req:
            slots = await req.alloc(len(prompt))
            for b in range(2):
                for layer in range(2):
                    cache.device_pool.buffers[b][layer][slots.cuda()] = float(layer + b)
            await req.commit(prompt, slots)
        await cache.wait_idle()
        await cache.flush()
        async with cache.request(prompt + [1, 2, 3]) as req:
            await req.wait_loaded()
            assert req.cached_tokens == 512
            for b in range(2):
                for layer in range(2):
                    assert bool(
                        (
                            cache.device_pool.buffers[b][layer][req.prefix_indices.cuda()]
                            == layer + b
                        ).all()
                    )
