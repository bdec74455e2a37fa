"""Layer-by-layer overlap: the forward pass starts while the prefix is still loading from host.

A prompt's prefix is computed, evicted from the device to the host tier, then
requested again: the load back runs layer by layer while the model's prefill,
in a worker thread, waits on each layer just before using it. The per-layer
waits show the compute of layer ``i`` overlapping the copy of layers ``> i``.
"""

import asyncio
import time

import torch

from tiercache import TierCache, TierCacheConfig
from tiercache.models.tiny import TinyCausalLM, TinyConfig


async def main() -> None:
    mc = TinyConfig(num_layers=8)
    model = TinyCausalLM(mc)
    config = TierCacheConfig(
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=mc.dtype,
        page_size=16,
        device_tokens=8192,
    )
    prefix = torch.randint(0, mc.vocab_size, (2048,), generator=torch.Generator().manual_seed(0))
    prompt = prefix.tolist() + [1, 2, 3, 4]
    async with TierCache(config) as cache:
        pool = cache.device_pool
        async with cache.request(prefix) as req:
            slots = await req.alloc(prefix.numel())
            await asyncio.to_thread(model.prefill, pool, prefix, slots)
            await req.commit(prefix, torch.cat([req.prefix_indices, slots]))
        await cache.wait_idle()  # write-through: the prefix is on host too
        await cache.evict_device(8192)  # now it is on host only
        async with cache.request(prompt) as req:
            print(f"{req.cached_tokens} prefix tokens loading from host: {req.load is not None}")
            waits: list[float] = []

            def layer_ready(i: int) -> None:
                t0 = time.perf_counter()
                req.layer_ready(i)
                waits.append(time.perf_counter() - t0)

            new = await req.alloc(len(prompt) - req.cached_tokens)
            t0 = time.perf_counter()
            logits = await asyncio.to_thread(
                model.prefill,
                pool,
                prompt[req.cached_tokens :],
                new,
                req.prefix_indices,
                layer_ready,
            )
            total = time.perf_counter() - t0
        for i, w in enumerate(waits):
            print(f"layer {i}: waited {w * 1e3:6.2f} ms for its KV")
        print(f"prefill with overlapped load: {total * 1e3:.1f} ms")
        ref = model.reference_forward(prompt)[-len(new) :]
        print("logits match a full recompute:", bool(torch.allclose(logits, ref, atol=1e-5)))


if __name__ == "__main__":
    asyncio.run(main())
